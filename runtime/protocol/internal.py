"""Internal messages: tokenizer <-> scheduler, launcher <-> children."""

from __future__ import annotations

import msgspec

from runtime.protocol.public import (
    ERR_SHUTDOWN,
    AbortRequest,
    HealthRequest,
    HealthResponse,
    KvSnapshotRequest,
    KvSnapshotResponse,
    StatsRequest,
    StatsResponse,
    Usage,
)
from runtime.protocol.worker import PromptLogprobs, Ready, TokenLogprobs
from runtime.sampling_params import SamplingParams


class TokenizedRequest(msgspec.Struct, tag="tokenized", kw_only=True, forbid_unknown_fields=True):
    """A validated request for the scheduler. rid is the tokenizer's internal id (unique in the server)."""

    rid: str
    input_ids: list[int]
    sampling_params: SamplingParams
    cache_salt: str | None = None


class Stop(msgspec.Struct, tag="stop", forbid_unknown_fields=True):
    """A stop string ended completion `index` of rid: the scheduler finishes it keeping keep_tokens completion
    tokens (the fewest whose text covers everything before the stop string; runtime.text.stop_strings.StopChecker
    computes it), and caches no block past them."""

    rid: str
    index: int
    keep_tokens: int


class TokenOutput(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """New tokens of completion `index` of rid since the previous step.

    finish_reason: None while running; "stop", "length" or "abort" when it ended. usage is set with finish_reason
    (and on the first output, so the tokenizer knows prompt and cached tokens early). score: a beam search
    completion's length-penalised cumulative logprob (runtime/scheduler/beam_search.py), set on its one, final output;
    else None. prompt_logprobs: the request's prompt logprobs computed this step (SamplingParams.prompt_logprobs; on
    completion 0, each prompt position once and in order, position 0 first with None), else None.
    """

    rid: str
    index: int
    token_ids: list[int]
    finish_reason: str | None = None
    usage: Usage | None = None
    logprobs: list[TokenLogprobs | None] | None = None
    score: float | None = None
    prompt_logprobs: PromptLogprobs | None = None


class TokenOutputs(msgspec.Struct, tag="token_outputs", forbid_unknown_fields=True):
    """Every TokenOutput of one scheduler step, in one message."""

    outputs: list[TokenOutput]


class RequestFailed(msgspec.Struct, tag="request_failed", forbid_unknown_fields=True):
    """The scheduler could not serve rid (e.g. the worker failed the step); the tokenizer sends ErrorResponse."""

    rid: str
    code: str
    message: str


class SchedulerReady(msgspec.Struct, tag="scheduler_ready", forbid_unknown_fields=True):
    """The scheduler sized its KV cache from the worker's Ready and serves; forwarded to the tokenizer."""

    worker: Ready


class ProcessReady(msgspec.Struct, tag="process_ready", forbid_unknown_fields=True):
    """A child process tells the launcher it serves (role: "worker", "scheduler" or "tokenizer"). max_model_len: the
    context limit in tokens (the scheduler reports it, from the worker's Ready; the launcher shows it on the HTTP
    server's model cards)."""

    role: str
    pid: int
    endpoint: str = ""
    max_model_len: int | None = None


class ProcessFailed(msgspec.Struct, tag="process_failed", forbid_unknown_fields=True):
    """A child process tells the launcher why it could not start, or why it is about to exit (its loop raised).
    message: the cause on one line, e.g. "cannot bind events_port tcp://127.0.0.1:5599: Address already in use" or
    "InvalidConfig: ..."; the launcher logs it as "<role> process failed to start: <message>"."""

    role: str
    pid: int
    message: str


class Shutdown(msgspec.Struct, tag="shutdown", forbid_unknown_fields=True):
    """The launcher tells the tokenizer the server stops: it answers every request in flight with `code`
    (ERR_SHUTDOWN on Ctrl-C / SIGTERM, ERR_SERVER when a process died; reason as the message) and exits."""

    reason: str
    code: str = ERR_SHUTDOWN


SchedulerInput = TokenizedRequest | AbortRequest | Stop | HealthRequest | StatsRequest | KvSnapshotRequest
TokenizerInput = (
    TokenOutputs | RequestFailed | HealthResponse | StatsResponse | KvSnapshotResponse | SchedulerReady | Shutdown
)
LauncherInput = ProcessReady | ProcessFailed
