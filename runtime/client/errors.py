"""The exceptions of runtime.client: one ServerError subclass per ErrorResponse code (runtime.protocol.ERROR_CODES),
plus the client-side input, timeout and liveness errors."""

from __future__ import annotations

from runtime import protocol as p


class ClientError(Exception):
    """Base of every error runtime.client raises."""


class InvalidInputError(ClientError, ValueError):
    """The request cannot be sent as given; raised before anything is sent. The message names the field: a chat
    message that is neither a ChatMessage nor a dict with "role" and "content", text msgpack cannot carry (a lone
    surrogate such as "\\ud800" is not UTF-8), an int outside msgpack's range [-2**63, 2**64 - 1] (token ids are
    bounded by the server's vocabulary anyway), or a value of a type msgpack cannot encode. Out-of-range sampling
    parameters raise runtime.sampling_params.InvalidSamplingParams (also a ValueError) instead."""


class RequestTimeout(ClientError, TimeoutError):
    """No complete answer within the timeout (seconds); the request was aborted on the server."""


class ServerError(ClientError):
    """The server answered rid with an ErrorResponse; code is one of runtime.protocol.ERROR_CODES."""

    def __init__(self, rid: str, code: str, message: str) -> None:
        super().__init__(f"[{code}] {message}")
        self.rid = rid
        self.code = code
        self.message = message


class MalformedRequestError(ServerError):
    """The frame could not be decoded: not msgpack, wrong field types, unknown message type, or too large."""


class InvalidRequestError(ServerError):
    """The request is well typed but cannot be served as asked (out-of-range values, bad token ids, ...)."""


class ContextLengthError(InvalidRequestError):
    """The prompt does not fit in the model's context (max_model_len tokens)."""


class ServerFailedError(ServerError):
    """A server process failed while serving the request (e.g. the worker died)."""


class ServerShutdownError(ServerFailedError):
    """The server is shutting down."""


class ServerGoneError(ServerFailedError):
    """Nothing came from the server, not even a heartbeat, for liveness_s seconds while a request waited: the server
    process died without a word (SIGKILL, machine loss). The server heartbeats every waiting client every 0.25 s."""


_ERRORS: dict[str, type[ServerError]] = {
    p.ERR_MALFORMED: MalformedRequestError,
    p.ERR_UNKNOWN_MESSAGE: MalformedRequestError,
    p.ERR_TOO_LARGE: MalformedRequestError,
    p.ERR_INVALID: InvalidRequestError,
    p.ERR_DUPLICATE: InvalidRequestError,
    p.ERR_CONTEXT: ContextLengthError,
    p.ERR_SERVER: ServerFailedError,
    p.ERR_SHUTDOWN: ServerShutdownError,
}


def error_from_response(err: p.ErrorResponse) -> ServerError:
    """The exception for an ErrorResponse (ServerError for a code this client does not know)."""
    return _ERRORS.get(err.code, ServerError)(err.rid, err.code, err.message)
