"""ZeroMQ client library for the public endpoint: one sans-IO core (core.py: routing by rid, finish tracking,
timeout and liveness judgements, the frames to send) with two faces that only do I/O and waiting, the synchronous
Client (client.py) and the asyncio AsyncClient (async_client.py); the Completion they return (folded by
runtime.results.CompletionFold, as the Engine's and the HTTP server's results are), and one exception class per
ErrorResponse code (errors.py)."""

from runtime.client.async_client import AsyncClient
from runtime.client.client import Client
from runtime.client.core import LIVENESS_S
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
from runtime.client.wire import build_request, encode_request
from runtime.results import Choice, Completion

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
