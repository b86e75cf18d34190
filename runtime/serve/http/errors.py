"""Errors in the OpenAI shape: `{"error": {"message", "type", "param", "code"}}` with the HTTP status that fits.

Statuses and types (the `code` tells the cases apart):
    400 invalid_request_error: invalid_json (not JSON, not UTF-8), invalid_type (a field of the wrong type),
        missing_required_parameter, unknown_parameter (a field this server does not know), unsupported_parameter (a
        known OpenAI field it does not implement, e.g. tools), invalid_value (out of range), and every ERR_* code of
        runtime.protocol the backend or the client library raises for bad input (invalid_request,
        context_length_exceeded, ...).
    401 authentication_error: invalid_api_key (missing or wrong Authorization header).
    404 not_found_error: model_not_found, not_found (unknown route). 405 invalid_request_error: method_not_allowed.
    413 invalid_request_error: request_too_large (over max_body_bytes), message_too_large (over the backend's
        max_message_bytes).
    500 server_error: server_error (a backend process failed while serving the request).
    503 service_unavailable_error: backend_unavailable (not ready yet, shutting down, or gone).
"""

from __future__ import annotations

import re

import msgspec
import orjson
from starlette.responses import Response

from runtime import protocol as p
from runtime.client.errors import (
    ClientError,
    InvalidInputError,
    InvalidRequestError,
    MalformedRequestError,
    RequestTimeout,
    ServerError,
    ServerFailedError,
    ServerGoneError,
    ServerShutdownError,
)
from runtime.sampling_params import InvalidSamplingParams

INVALID = "invalid_request_error"


class OpenAIError(Exception):
    """An HTTP error answer: status (int), type, message, param (the request field at fault, or None), code."""

    def __init__(self, status: int, type: str, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.type = type
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict:
        """The JSON object of the answer (also the `data:` of an error event in a stream)."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> Response:
        """The HTTP response carrying this error."""
        return Response(orjson.dumps(self.body()), status_code=self.status, media_type="application/json")


def bad_request(message: str, param: str | None = None, code: str = "invalid_value") -> OpenAIError:
    """A 400 invalid_request_error."""
    return OpenAIError(400, INVALID, message, param, code)


def unavailable(message: str) -> OpenAIError:
    """A 503: the backend is not ready, shutting down or gone."""
    return OpenAIError(503, "service_unavailable_error", message, None, "backend_unavailable")


def not_found(message: str, code: str = "not_found", param: str | None = None) -> OpenAIError:
    """A 404 not_found_error (model_not_found for an unknown model, not_found for an unknown route)."""
    return OpenAIError(404, "not_found_error", message, param, code)


def too_large(size: int | None, limit: int) -> OpenAIError:
    """A 413: the body has size bytes (None: more than limit, still being read), over limit."""
    shown = f"{size} bytes" if size is not None else f"more than {limit} bytes"
    return OpenAIError(
        413, INVALID, f"request body of {shown} exceeds the limit of {limit} bytes", None, "request_too_large"
    )


_PATH = re.compile(r" - at (?:`key` in )?`\$\.?(.*)`$")  # "at `key` in `$.logit_bias`": a map's key
_FIELD = re.compile(r"(?:unknown|missing required) field `([^`]*)`")


def from_decode_error(exc: Exception) -> OpenAIError:
    """The 400 for a body msgspec could not decode into a request Struct: invalid_json (not JSON or not UTF-8),
    unknown_parameter / missing_required_parameter naming the field, or invalid_type naming the field's path (e.g.
    "messages[0].content")."""
    text = str(exc)
    if not isinstance(exc, msgspec.ValidationError):
        return bad_request(f"the body is not valid JSON: {text}", None, "invalid_json")
    at = _PATH.search(text)
    path = at.group(1) if at else ""
    field = _FIELD.search(text)
    if field is not None:
        param = f"{path}.{field.group(1)}" if path else field.group(1)
        if "unknown field" in text:
            return bad_request(
                f"unknown parameter {param!r}: this server does not implement it", param, "unknown_parameter"
            )
        return bad_request(f"missing required parameter {param!r}", param, "missing_required_parameter")
    if not path:
        return bad_request(f"the body must be a JSON object: {text}", None, "invalid_type")
    return bad_request(f"invalid type for {path!r}: {_PATH.sub('', text)}", path, "invalid_type")


def from_exception(exc: BaseException, params: dict[str, str], prompt_param: str) -> OpenAIError:
    """The OpenAIError for what runtime.client raised for a request.

    params: SamplingParams field -> the request field it came from (names the param of an out-of-range value);
    prompt_param: the request field of the prompt ("messages" or "prompt"), named by prompt errors."""
    if isinstance(exc, OpenAIError):
        return exc
    if isinstance(exc, InvalidSamplingParams):
        name = str(exc).split(" ", 1)[0]
        return bad_request(_rename(str(exc), name, params.get(name, name)), params.get(name, name))
    if isinstance(exc, InvalidInputError):
        return bad_request(str(exc), prompt_param)
    if isinstance(exc, MalformedRequestError) and exc.code == p.ERR_TOO_LARGE:
        return OpenAIError(413, INVALID, exc.message, prompt_param, exc.code)
    if isinstance(exc, (InvalidRequestError, MalformedRequestError)):
        param = prompt_param if exc.code in (p.ERR_CONTEXT, p.ERR_INVALID) else None
        if exc.message.startswith("structured_outputs") and "structured_outputs" in params:  # it did not compile
            param = params["structured_outputs"]
            return bad_request(param + exc.message[exc.message.find(" ") :], param, exc.code)
        if exc.message.startswith("logit_bias"):  # SamplingParams.vocab_problem: checked where the vocabulary is
            param = "logit_bias"
        return bad_request(exc.message, param, exc.code)
    if isinstance(exc, (ServerShutdownError, ServerGoneError)):
        return unavailable(f"the backend is unavailable: {exc.message}")
    if isinstance(exc, (ServerFailedError, ServerError)):
        return OpenAIError(500, "server_error", f"the backend failed: {exc}", None, "server_error")
    if isinstance(exc, RequestTimeout):
        return unavailable(f"the backend did not answer in time: {exc}")
    if isinstance(exc, ClientError):
        return OpenAIError(500, "server_error", str(exc), None, "server_error")
    raise exc


def _rename(message: str, name: str, param: str) -> str:
    return message if name == param else param + message[len(name) :]
