"""Every message that crosses a socket, as tagged msgspec Structs encoded as msgpack. The wire format lives here only.

Decoding is strict and typed (msgspec); nothing here is ever pickled. One module per link:
  worker.py    scheduler <-> worker (ScheduledSeq, ForwardBatch, ForwardResult, Ready, WorkerProbe): the delta
               format
  public.py    client <-> tokenizer process (GenerateRequest ... StreamChunk, ErrorResponse, ServerStats),
               the error codes
  client_frame.py  decode_client_frame: the server's strict reader of a public frame (validates what a client sent)
  internal.py  tokenizer <-> scheduler (TokenizedRequest, Stop, TokenOutputs, ...), launcher <-> children
Import from here (`from runtime import protocol as p`, `from runtime.protocol import X`); every name is re-exported.
"""

from __future__ import annotations

from radix.events import KvSnapshot
from runtime.protocol.client_frame import decode_client_frame
from runtime.protocol.internal import (
    LauncherInput,
    ProcessFailed,
    ProcessReady,
    RequestFailed,
    SchedulerInput,
    SchedulerReady,
    Shutdown,
    Stop,
    TokenizedRequest,
    TokenizerInput,
    TokenOutput,
    TokenOutputs,
)
from runtime.protocol.public import (
    CLIENT_TAGS,
    ERR_CONTEXT,
    ERR_DUPLICATE,
    ERR_INVALID,
    ERR_MALFORMED,
    ERR_SERVER,
    ERR_SHUTDOWN,
    ERR_TOO_LARGE,
    ERR_UNKNOWN_MESSAGE,
    ERROR_CODES,
    MAX_RID_CHARS,
    AbortRequest,
    ChatMessage,
    ClientMessage,
    ErrorResponse,
    GenerateRequest,
    HealthRequest,
    HealthResponse,
    Heartbeat,
    KvSnapshotRequest,
    KvSnapshotResponse,
    ServerMessage,
    ServerStats,
    StatsRequest,
    StatsResponse,
    StreamChunk,
    TokenText,
    Usage,
    input_problem,
)
from runtime.protocol.worker import (
    ForwardBatch,
    ForwardResult,
    Ready,
    ScheduledSeq,
    TokenLogprobs,
    WorkerInput,
    WorkerMessage,
    WorkerOutput,
    WorkerProbe,
    WorkerProbeReply,
)
from runtime.sampling_params import SamplingParams

__all__ = [
    "KvSnapshot",  # message fields defined elsewhere, part of the wire format too
    "SamplingParams",
    "ScheduledSeq",
    "ForwardBatch",
    "TokenLogprobs",
    "ForwardResult",
    "Ready",
    "WorkerMessage",
    "WorkerProbe",
    "WorkerProbeReply",
    "WorkerInput",
    "WorkerOutput",
    "ChatMessage",
    "GenerateRequest",
    "AbortRequest",
    "HealthRequest",
    "StatsRequest",
    "KvSnapshotRequest",
    "Usage",
    "TokenText",
    "StreamChunk",
    "ERR_MALFORMED",
    "ERR_UNKNOWN_MESSAGE",
    "ERR_TOO_LARGE",
    "ERR_INVALID",
    "ERR_CONTEXT",
    "ERR_DUPLICATE",
    "ERR_SERVER",
    "ERR_SHUTDOWN",
    "MAX_RID_CHARS",
    "ERROR_CODES",
    "ErrorResponse",
    "HealthResponse",
    "ServerStats",
    "StatsResponse",
    "KvSnapshotResponse",
    "Heartbeat",
    "ClientMessage",
    "ServerMessage",
    "CLIENT_TAGS",
    "decode_client_frame",
    "input_problem",
    "TokenizedRequest",
    "Stop",
    "TokenOutput",
    "TokenOutputs",
    "RequestFailed",
    "SchedulerReady",
    "ProcessReady",
    "ProcessFailed",
    "Shutdown",
    "SchedulerInput",
    "TokenizerInput",
    "LauncherInput",
]
