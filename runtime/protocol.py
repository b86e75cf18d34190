"""Every message that crosses a socket, as tagged msgspec Structs encoded as msgpack. The wire format lives here only.

Worker-facing messages (scheduler <-> worker) use the delta format of ARCHITECTURE.md: a new sequence is sent once in
full (its whole block table and SamplingParams); afterwards each step carries only that step's input token ids, its
start position and the block ids appended since the previous step, so a step's message grows with the batch, not with
the context length. Decoding is strict and typed (msgspec); nothing here is ever pickled.
"""

from __future__ import annotations

import msgspec

from radix.events import KvSnapshot
from runtime.sampling_params import SamplingParams


class ScheduledSeq(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """One sequence's work in one step.

    seq_id: scheduler-assigned id, unique while the sequence is live in the worker.
    token_ids: this step's input tokens (a prefill chunk, or the one token sampled last step).
    start_pos: position (tokens) of token_ids[0]; the tokens before it already have KV in the block table.
    new_block_ids: block ids appended to the sequence's block table since its previous step (a new sequence: its
        whole table, cached prefix included).
    sample: True when this step reaches the end of the known tokens, so the worker samples the next token.
    sampling_params: sent once, when the sequence is new to the worker (first step, or resumed after recompute).
    prompt_len: with sampling_params: the request's original prompt length (tokens), so the worker knows the
        completion-token index (start_pos + len(token_ids) - prompt_len) that seeds each draw.
    sample_index: with sampling_params: which of the request's n samples this sequence is (seeds differ per sample).
    """

    seq_id: int
    token_ids: list[int]
    start_pos: int
    new_block_ids: list[int]
    sample: bool
    sampling_params: SamplingParams | None = None
    prompt_len: int = 0
    sample_index: int = 0


class ForwardBatch(msgspec.Struct, tag="forward_batch", forbid_unknown_fields=True):
    """One step for the worker. Applied in this order: drop, swap_out, swap_in, copies, then the forward.

    drop_seq_ids: sequences the worker forgets (finished, aborted, preempted by recompute).
    swap_out: (device block, host block) pairs to copy device -> host (preemption by swapping).
    swap_in: (host block, device block) pairs to copy host -> device.
    copies: copy-on-write (src device block, dst device block) pairs.
    """

    step_id: int
    seqs: list[ScheduledSeq]
    drop_seq_ids: list[int] = []
    swap_out: list[tuple[int, int]] = []
    swap_in: list[tuple[int, int]] = []
    copies: list[tuple[int, int]] = []


class TokenLogprobs(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """Logprob (natural log) of the sampled token and the top alternatives, best first."""

    logprob: float
    top_token_ids: list[int]
    top_logprobs: list[float]


class ForwardResult(msgspec.Struct, tag="forward_result", forbid_unknown_fields=True):
    """The worker's answer to one ForwardBatch.

    seq_ids / token_ids: one sampled token per sequence that had sample=True, in batch order.
    logprobs: aligned with seq_ids when any of them asked for logprobs (else None).
    num_forward_tokens: tokens run through the model this step (prompt tokens actually computed + decode tokens).
    error: set (and nothing sampled) when the step failed; the scheduler fails the batch's requests.
    """

    step_id: int
    seq_ids: list[int]
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None] | None = None
    num_forward_tokens: int = 0
    error: str | None = None


class Ready(msgspec.Struct, tag="ready", forbid_unknown_fields=True):
    """Worker start-up handshake: the KV cache is allocated and the model loaded.

    num_blocks includes the reserved null block 0; block_size and max_model_len are in tokens.
    """

    num_blocks: int
    block_size: int
    max_model_len: int
    num_host_blocks: int
    vocab_size: int
    eos_token_ids: list[int]


WorkerMessage = ForwardBatch | ForwardResult | Ready


# ----------------------------------------------------------------------------------------------------------------------
# Public messages: client (DEALER) <-> tokenizer process (ROUTER). One msgpack frame per message.
# ----------------------------------------------------------------------------------------------------------------------


class ChatMessage(msgspec.Struct, forbid_unknown_fields=True):
    """One chat turn: role is "system", "user", "assistant" (or "tool"); content is its text."""

    role: str
    content: str


class GenerateRequest(msgspec.Struct, tag="generate", kw_only=True, forbid_unknown_fields=True):
    """A completion request. Exactly one of prompt (text), messages (chat, the model's template is applied) or
    input_ids (token ids) is set.

    rid: the client's id of the request, echoed in every reply (unique among the client's requests in flight).
    stream: True sends a StreamChunk per step; False one StreamChunk per completion when it ends.
    cache_salt: tenant key; requests with different salts never share cached blocks (it enters the first block hash).
    """

    rid: str
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    input_ids: list[int] | None = None
    sampling_params: SamplingParams = msgspec.field(default_factory=SamplingParams)
    stream: bool = False
    cache_salt: str | None = None

    def check(self) -> str | None:
        """The reason this request is invalid regardless of the model (None when it is well formed)."""
        given = [name for name in ("prompt", "messages", "input_ids") if getattr(self, name) is not None]
        if len(given) != 1:
            return f"exactly one of prompt, messages, input_ids must be set, got {given or 'none'}"
        if self.prompt is not None and self.prompt == "":
            return "prompt is empty"
        if self.messages is not None and not self.messages:
            return "messages is empty"
        if self.input_ids is not None and not self.input_ids:
            return "input_ids is empty"
        if not self.rid:
            return "rid is empty"
        return None


class AbortRequest(msgspec.Struct, tag="abort", forbid_unknown_fields=True):
    """Cancel request rid; its blocks are freed at the scheduler's next step. No reply."""

    rid: str


class HealthRequest(msgspec.Struct, tag="health", forbid_unknown_fields=True):
    """Liveness probe; answered by HealthResponse once the scheduler has answered too."""

    rid: str


class StatsRequest(msgspec.Struct, tag="stats", forbid_unknown_fields=True):
    """Asks for the scheduler's ServerStats; answered by StatsResponse."""

    rid: str


class KvSnapshotRequest(msgspec.Struct, tag="kv_snapshot_request", forbid_unknown_fields=True):
    """Asks for the scheduler's resident block hashes (a router's resync); answered by KvSnapshotResponse."""

    rid: str


class Usage(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """Token counts of one completion: prompt_tokens, cached_tokens (prompt tokens whose KV came from the radix
    cache), completion_tokens."""

    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int


class StreamChunk(msgspec.Struct, tag="chunk", kw_only=True, forbid_unknown_fields=True):
    """Part of completion `index` (0..n-1) of request rid.

    text: new text since the previous chunk (never a partial UTF-8 character, never a stop string or part of one).
    token_ids: new token ids since the previous chunk.
    logprobs: aligned with token_ids when the request asked for logprobs.
    finish_reason: None while running; "stop" (EOS, stop token or stop string), "length" (max_tokens or context),
        "abort" on the last chunk.
    usage: set on the last chunk.
    """

    rid: str
    index: int = 0
    text: str = ""
    token_ids: list[int] = []
    logprobs: list[TokenLogprobs | None] | None = None
    finish_reason: str | None = None
    usage: Usage | None = None


# ErrorResponse codes. The client maps each to an exception class (runtime/client.py).
ERR_MALFORMED = "malformed"  # not msgpack, wrong field types, several frames
ERR_UNKNOWN_MESSAGE = "unknown_message"  # a tag this server does not know
ERR_TOO_LARGE = "message_too_large"  # over ServerArgs.max_message_bytes
ERR_INVALID = "invalid_request"  # well typed but out of range (sampling params, prompt fields, token ids)
ERR_CONTEXT = "context_length_exceeded"  # prompt (+1) longer than max_model_len
ERR_DUPLICATE = "duplicate_rid"  # a request with this rid is already in flight for this client
ERR_SERVER = "server_error"  # a process failed while serving the request
ERR_SHUTDOWN = "shutdown"  # the server is shutting down
ERROR_CODES = (ERR_MALFORMED, ERR_UNKNOWN_MESSAGE, ERR_TOO_LARGE, ERR_INVALID, ERR_CONTEXT, ERR_DUPLICATE,
               ERR_SERVER, ERR_SHUTDOWN)


class ErrorResponse(msgspec.Struct, tag="error", forbid_unknown_fields=True):
    """The request rid failed (rid is "" when the frame could not be read far enough to find one). Ends the request."""

    rid: str
    code: str
    message: str


class HealthResponse(msgspec.Struct, tag="health_response", forbid_unknown_fields=True):
    """Answer to HealthRequest: status "ok" when every process is serving."""

    rid: str
    status: str


class ServerStats(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A snapshot of the scheduler.

    num_running / num_waiting: sequences (a request with n > 1 counts n). num_blocks: KV blocks incl. the null
    block; num_free_blocks: on the free list; num_cached_blocks: held by the radix tree only (evictable);
    num_used_blocks: referenced by a running sequence (locked). kv_usage = num_used_blocks / (num_blocks - 1).
    prompt_tokens / cached_tokens / generated_tokens: totals since start; hit_rate = cached_tokens / prompt_tokens.
    tokens_per_s: tokens run through the model per second over the last stats interval. num_steps: forward steps.
    num_preemptions / num_swaps: sequences preempted (either mode) / swapped out; recomputed_tokens: prompt + output
    tokens computed again after a recompute preemption (never counted as cache hits).
    """

    num_running: int = 0
    num_waiting: int = 0
    num_blocks: int = 0
    num_free_blocks: int = 0
    num_cached_blocks: int = 0
    num_used_blocks: int = 0
    kv_usage: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generated_tokens: int = 0
    hit_rate: float = 0.0
    tokens_per_s: float = 0.0
    num_steps: int = 0
    num_preemptions: int = 0
    num_swaps: int = 0
    recomputed_tokens: int = 0


class StatsResponse(msgspec.Struct, tag="stats_response", forbid_unknown_fields=True):
    """Answer to StatsRequest."""

    rid: str
    stats: ServerStats


class KvSnapshotResponse(msgspec.Struct, tag="kv_snapshot_response", forbid_unknown_fields=True):
    """Answer to KvSnapshotRequest: every resident block hash and the last KV event seq it reflects; block_size
    (tokens) the hashes are over; events_port: the TCP port of the KV events PUB socket (0: not on TCP)."""

    rid: str
    block_size: int
    events_port: int
    snapshot: KvSnapshot


class Heartbeat(msgspec.Struct, tag="heartbeat", forbid_unknown_fields=True):
    """Sent by the tokenizer to a client with requests in flight and nothing sent for a while, so a vanished client
    is noticed (ROUTER_MANDATORY send fails) and its requests aborted. Clients ignore it."""


ClientMessage = GenerateRequest | AbortRequest | HealthRequest | StatsRequest | KvSnapshotRequest
ServerMessage = StreamChunk | ErrorResponse | HealthResponse | StatsResponse | KvSnapshotResponse | Heartbeat
CLIENT_TAGS = frozenset({"generate", "abort", "health", "stats", "kv_snapshot_request"})


# ----------------------------------------------------------------------------------------------------------------------
# Internal messages: tokenizer <-> scheduler, launcher <-> children.
# ----------------------------------------------------------------------------------------------------------------------


class TokenizedRequest(msgspec.Struct, tag="tokenized", kw_only=True, forbid_unknown_fields=True):
    """A validated request for the scheduler. rid is the tokenizer's internal id (unique in the server)."""

    rid: str
    input_ids: list[int]
    sampling_params: SamplingParams
    cache_salt: str | None = None


class Stop(msgspec.Struct, tag="stop", forbid_unknown_fields=True):
    """A stop string ended completion `index` of rid: the scheduler finishes it keeping keep_tokens completion
    tokens (the fewest whose text covers everything before the stop string; runtime.tokenizer.StopChecker computes
    it), and caches no block past them."""

    rid: str
    index: int
    keep_tokens: int


class TokenOutput(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """New tokens of completion `index` of rid since the previous step.

    finish_reason: None while running; "stop", "length" or "abort" when it ended. usage is set with finish_reason
    (and on the first output, so the tokenizer knows prompt and cached tokens early).
    """

    rid: str
    index: int
    token_ids: list[int]
    finish_reason: str | None = None
    usage: Usage | None = None
    logprobs: list[TokenLogprobs | None] | None = None


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
    """A child process tells the launcher it serves (role: "worker", "scheduler" or "tokenizer")."""

    role: str
    pid: int
    endpoint: str = ""


class ProcessFailed(msgspec.Struct, tag="process_failed", forbid_unknown_fields=True):
    """A child process tells the launcher it could not start (e.g. the model failed to load)."""

    role: str
    pid: int
    message: str


class Shutdown(msgspec.Struct, tag="shutdown", forbid_unknown_fields=True):
    """The launcher tells the tokenizer the server stops: it answers every request in flight with `code`
    (ERR_SHUTDOWN on Ctrl-C / SIGTERM, ERR_SERVER when a process died; reason as the message) and exits."""

    reason: str
    code: str = ERR_SHUTDOWN


SchedulerInput = TokenizedRequest | AbortRequest | Stop | HealthRequest | StatsRequest | KvSnapshotRequest
TokenizerInput = (TokenOutputs | RequestFailed | HealthResponse | StatsResponse | KvSnapshotResponse | SchedulerReady
                  | Shutdown)
LauncherInput = ProcessReady | ProcessFailed

_client_decoder = msgspec.msgpack.Decoder(ClientMessage)
_any_decoder = msgspec.msgpack.Decoder()


def decode_client_frame(frame: bytes, max_message_bytes: int) -> ClientMessage | ErrorResponse:
    """Decode one public frame strictly; a frame that cannot be served becomes the ErrorResponse to send back.

    Never raises and never unpickles: the frame is msgpack decoded into the ClientMessage union (typed, unknown
    fields rejected, SamplingParams validated). The rid of a rejected frame is recovered when the frame is a msgpack
    map with a string "rid", so a client with many requests in flight can route the error.
    """
    if len(frame) > max_message_bytes:
        return ErrorResponse("", ERR_TOO_LARGE, f"message of {len(frame)} bytes exceeds {max_message_bytes} bytes")
    try:
        return _client_decoder.decode(frame)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as exc:  # deep nesting: RecursionError
        error = exc
    try:
        raw = _any_decoder.decode(frame)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        return ErrorResponse("", ERR_MALFORMED, f"not a msgpack message: {error}")
    if not isinstance(raw, dict):
        return ErrorResponse("", ERR_MALFORMED, f"a message is a msgpack map, got {type(raw).__name__}")
    rid = raw.get("rid") if isinstance(raw.get("rid"), str) else ""
    tag = raw.get("type")
    if tag not in CLIENT_TAGS:
        return ErrorResponse(rid, ERR_UNKNOWN_MESSAGE, f"unknown message type {tag!r}; known: {sorted(CLIENT_TAGS)}")
    code = ERR_INVALID if "sampling_params" in str(error) and _is_range_error(error) else ERR_MALFORMED
    return ErrorResponse(rid, code, str(error))


def _is_range_error(error: Exception) -> bool:
    """SamplingParams.validate() failures surface as ValidationErrors whose message has no 'Expected'."""
    return "Expected" not in str(error)
