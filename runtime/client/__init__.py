"""ZeroMQ client library for the public endpoint: a synchronous Client and an asyncio AsyncClient, the Completion
they return, and one exception class per ErrorResponse code."""

from runtime.client.client import LIVENESS_S, AsyncClient, Client
from runtime.client.errors import (
    ClientError,
    ContextLengthError,
    InvalidInputError,
    InvalidRequestError,
    MalformedRequestError,
    RequestTimeout,
    ServerError,
    ServerFailedError,
    ServerGoneError,
    ServerShutdownError,
    error_from_response,
)
from runtime.client.results import Choice, Completion
from runtime.client.wire import build_request, encode_request

__all__ = [
    "LIVENESS_S",
    "AsyncClient",
    "Choice",
    "Client",
    "ClientError",
    "Completion",
    "ContextLengthError",
    "InvalidInputError",
    "InvalidRequestError",
    "MalformedRequestError",
    "RequestTimeout",
    "ServerError",
    "ServerFailedError",
    "ServerGoneError",
    "ServerShutdownError",
    "build_request",
    "encode_request",
    "error_from_response",
]
