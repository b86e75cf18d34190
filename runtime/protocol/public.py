"""Public messages: client (DEALER) <-> tokenizer process (ROUTER). One msgpack frame per message.

runtime.protocol.client_frame.decode_client_frame is the server's one strict, typed reader of a client frame.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

from radix.events import KvSnapshot
from runtime.protocol.server_stats import ServerStats
from runtime.protocol.worker import PromptLogprobs, TokenLogprobs
from runtime.sampling_params import SamplingParams

MAX_RID_CHARS = 256
"""The longest rid (in characters, i.e. code points) a client message may carry. The server echoes the rid in every
reply (every StreamChunk of every completion) and keeps it for the request's lifetime, so an unbounded rid multiplies
into unbounded traffic and memory; 256 leaves room for a client's own prefixes around a uuid (runtime.client sends a
32-character uuid4 hex). decode_client_frame rejects a longer rid with ERR_MALFORMED and answers with rid ""."""

Rid = Annotated[str, msgspec.Meta(max_length=MAX_RID_CHARS)]  # a client message's rid: at most MAX_RID_CHARS characters


class ChatToolCall(msgspec.Struct, forbid_unknown_fields=True):
    """A tool call of an earlier assistant turn: its id (OpenAI's tool_calls[].id), the function's name and its
    arguments as JSON text (as the model wrote them, or as the HTTP answer returned them)."""

    id: str
    name: str
    arguments: str


class ChatMessage(msgspec.Struct, forbid_unknown_fields=True):
    """One chat turn: role is "system", "user", "assistant" or "tool"; content is its text (None only for an
    assistant turn that is all tool calls). tool_calls: an assistant turn's calls; tool_call_id: the call a "tool"
    turn answers."""

    role: str
    content: str | None
    tool_calls: list[ChatToolCall] | None = None
    tool_call_id: str | None = None


class ChatOptions(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """How a chat's messages are rendered (transformers' apply_chat_template arguments, vLLM's request fields).

    tools: OpenAI function tools ({"type": "function", "function": {"name", "description", "parameters"}}) given
        to the template (runtime.text.prompt picks a tool-capable template).
    chat_template_kwargs: extra template variables (e.g. {"enable_thinking": false}); apply_chat_template's own
        argument names are refused.
    add_generation_prompt: append the assistant turn's header (default); continue_final_message: leave the last
        (assistant) message open so the model continues it; at most one of the two is true.
    """

    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False

    def check(self) -> str | None:
        """The reason these options are invalid (None when they are fine)."""
        if self.add_generation_prompt and self.continue_final_message:
            return "add_generation_prompt and continue_final_message cannot both be true"
        return None


class GenerateRequest(msgspec.Struct, tag="generate", kw_only=True, forbid_unknown_fields=True):
    """A completion request. Exactly one of prompt (text), messages (chat, the model's template is applied) or
    input_ids (token ids) is set.

    rid: the client's id of the request, echoed in every reply (unique among the client's requests in flight; at
        most MAX_RID_CHARS characters).
    stream: True sends a StreamChunk per step; False one StreamChunk per completion when it ends.
    chat_options: how messages are rendered (tools, template variables, generation prompt); None: the defaults.
    cache_salt: tenant key; requests with different salts never share cached blocks (it enters the first block hash).
    """

    rid: Rid
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    input_ids: list[int] | None = None
    sampling_params: SamplingParams = msgspec.field(default_factory=SamplingParams)
    stream: bool = False
    cache_salt: str | None = None
    chat_options: ChatOptions | None = None

    def check(self) -> str | None:
        """The reason this request is invalid regardless of the model (None when it is well formed)."""
        problem = input_problem(self.prompt, self.messages, self.input_ids)
        if problem is None and not self.rid:
            return "rid is empty"
        if problem is None and self.chat_options is not None:
            if self.messages is None:
                return "chat_options need messages"
            return self.chat_options.check()
        return problem


def input_problem(prompt: str | None, messages: list | None, input_ids: list[int] | None) -> str | None:
    """Why a request's inputs are malformed, whatever the model (None when exactly one of prompt, messages,
    input_ids is set and it is not empty). GenerateRequest.check (the server, the router) and the Engine use it."""
    inputs = (("prompt", prompt), ("messages", messages), ("input_ids", input_ids))
    given = [name for name, value in inputs if value is not None]
    if len(given) != 1:
        return f"exactly one of prompt, messages, input_ids must be set, got {given or 'none'}"
    if prompt is not None and prompt == "":
        return "prompt is empty"
    if messages is not None and not messages:
        return "messages is empty"
    if input_ids is not None and not input_ids:
        return "input_ids is empty"
    return None


class AbortRequest(msgspec.Struct, tag="abort", forbid_unknown_fields=True):
    """Cancel request rid; its blocks are freed at the scheduler's next step. No reply."""

    rid: Rid


class HealthRequest(msgspec.Struct, tag="health", forbid_unknown_fields=True):
    """Liveness probe; answered by HealthResponse once the scheduler has answered too."""

    rid: Rid


class StatsRequest(msgspec.Struct, tag="stats", forbid_unknown_fields=True):
    """Asks for the scheduler's ServerStats; answered by StatsResponse."""

    rid: Rid


class KvSnapshotRequest(msgspec.Struct, tag="kv_snapshot_request", forbid_unknown_fields=True):
    """Asks for the scheduler's resident block hashes (a router's resync); answered by KvSnapshotResponse."""

    rid: Rid


class TokenizeRequest(msgspec.Struct, tag="tokenize", kw_only=True, forbid_unknown_fields=True):
    """Asks for the prompt token ids of a text or a chat, as a GenerateRequest with the same prompt or messages
    would get them (the chat template applied to messages; the same character limit); answered by TokenizeResponse.
    Exactly one of prompt and messages is set (an empty prompt is allowed: its ids may be []).
    add_special_tokens: for prompt only, whether the tokenizer adds its special tokens (BOS) as a GenerateRequest's
    prompt gets them (True); a chat's ids are the template's own."""

    rid: Rid
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True

    def check(self) -> str | None:
        """The reason this request is invalid regardless of the model (None when it is well formed)."""
        if (self.prompt is None) == (self.messages is None):
            given = [name for name in ("prompt", "messages") if getattr(self, name) is not None]
            return f"exactly one of prompt, messages must be set, got {given or 'none'}"
        if self.messages is not None and not self.messages:
            return "messages is empty"
        return None


class DetokenizeRequest(msgspec.Struct, tag="detokenize", forbid_unknown_fields=True):
    """Asks for the text of token_ids (special tokens kept: the text of every id); answered by DetokenizeResponse.
    Each id must lie in the tokenizer's vocabulary, and a request carries at most as many ids as a prompt may have
    characters (the server's max_prompt_chars limit)."""

    rid: Rid
    token_ids: list[int]


class Usage(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """Token counts of one completion: prompt_tokens, cached_tokens (prompt tokens whose KV came from the radix
    cache, either tier), completion_tokens; queue_time_s: seconds from the request's arrival at the scheduler to its
    first admission (the scheduler fills it; None where unknown, e.g. the Engine's summed Usage); host_cached_tokens:
    the part of cached_tokens loaded back from the host tier (the rest was on the device). Trailing and optional: a
    3-element array from an older peer still decodes."""

    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    queue_time_s: float | None = None
    host_cached_tokens: int = 0


class TokenText(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """The text of one generated token and of its top alternatives, for answers that name tokens (the OpenAI
    logprobs formats): text is tokenizer.decode([token_id], skip_special_tokens=False) of the sampled id (special
    tokens named; a partial UTF-8 character reads U+FFFD), top_texts the same for each of its TokenLogprobs'
    top_token_ids, aligned with them ([] for a token that came without logprobs)."""

    text: str
    top_texts: list[str] = []


class PromptChunk(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """Prompt logprobs in a StreamChunk: logprobs (PromptLogprobs: the positions, their tokens, logprobs, ranks and
    top alternatives) and token_texts, aligned with logprobs.token_ids when the server has a tokenizer (each prompt
    token's and its alternatives' TokenText), else None."""

    logprobs: PromptLogprobs
    token_texts: list[TokenText] | None = None


class StreamChunk(msgspec.Struct, tag="chunk", kw_only=True, forbid_unknown_fields=True):
    """Part of completion `index` (0..n-1) of request rid.

    text: new text since the previous chunk (never a partial UTF-8 character, never a stop string or part of one).
    token_ids: new token ids since the previous chunk.
    logprobs: aligned with token_ids when the request asked for logprobs.
    token_texts: aligned with token_ids (and logprobs) when the request asked for logprobs and the server has a
        tokenizer: each token's and its alternatives' text (TokenText), so a client names tokens without one.
    finish_reason: None while running; "stop" (EOS, stop token or stop string), "length" (max_tokens or context),
        "abort" on the last chunk.
    usage: the completion's usage so far (completion_tokens: its tokens sent up to this chunk), on every chunk once
        the scheduler reported the prompt's; final on the last chunk (the one clients fold).
    score: a beam search completion's length-penalised cumulative logprob (SamplingParams.use_beam_search), on its
        last chunk; else None. Beam search completions come in one chunk each, best first by index.
    prompt_logprobs: the request's prompt logprobs (SamplingParams.prompt_logprobs) and their texts (PromptChunk), on
        completion 0's chunks only: streamed, the positions new since the previous chunk (a chunk may carry nothing
        else); not streamed, all of them (PromptLogprobs.start 0, position 0's entry None). One field, so a chunk of
        a request without them pays one key and a nil.
    """

    rid: str
    index: int = 0
    text: str = ""
    token_ids: list[int] = []
    logprobs: list[TokenLogprobs | None] | None = None
    token_texts: list[TokenText] | None = None
    finish_reason: str | None = None
    usage: Usage | None = None
    score: float | None = None
    prompt_logprobs: PromptChunk | None = None


# ErrorResponse codes. The client maps each to an exception class (runtime/client.py).
ERR_MALFORMED = "malformed"  # not msgpack, not a map with string keys, wrong field types or shape, several frames,
#                              a rid over MAX_RID_CHARS
ERR_UNKNOWN_MESSAGE = "unknown_message"  # a tag this server does not know
ERR_TOO_LARGE = "message_too_large"  # over ServerArgs.max_message_bytes
ERR_INVALID = "invalid_request"  # well typed but out of range (sampling params, prompt fields, token ids)
ERR_CONTEXT = "context_length_exceeded"  # prompt (+1) longer than max_model_len
ERR_DUPLICATE = "duplicate_rid"  # a request with this rid is already in flight for this client
ERR_SERVER = "server_error"  # a process failed while serving the request
ERR_SHUTDOWN = "shutdown"  # the server is shutting down
ERROR_CODES = (
    ERR_MALFORMED,
    ERR_UNKNOWN_MESSAGE,
    ERR_TOO_LARGE,
    ERR_INVALID,
    ERR_CONTEXT,
    ERR_DUPLICATE,
    ERR_SERVER,
    ERR_SHUTDOWN,
)


class ErrorResponse(msgspec.Struct, tag="error", forbid_unknown_fields=True):
    """The request rid failed; ends the request. rid is "" only when the frame is not a msgpack map with a string
    "rid" of at most MAX_RID_CHARS characters (decode_client_frame recovers it otherwise, also from a frame over the
    size limit); runtime.client logs and drops such an error, since no request of its own can be told apart by it."""

    rid: str
    code: str
    message: str


class HealthResponse(msgspec.Struct, tag="health_response", forbid_unknown_fields=True):
    """Answer to HealthRequest: status "ok" when every process is serving."""

    rid: str
    status: str


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


class TokenizeResponse(msgspec.Struct, tag="tokenize_response", forbid_unknown_fields=True):
    """Answer to TokenizeRequest: the prompt token ids."""

    rid: str
    token_ids: list[int]


class DetokenizeResponse(msgspec.Struct, tag="detokenize_response", forbid_unknown_fields=True):
    """Answer to DetokenizeRequest: the text of the token ids."""

    rid: str
    text: str


class Heartbeat(msgspec.Struct, tag="heartbeat", forbid_unknown_fields=True):
    """Sent by the tokenizer to a client with requests in flight and nothing sent for a while, so a vanished client
    is noticed (ROUTER_MANDATORY send fails) and its requests aborted. Clients ignore it."""


ClientMessage = (
    GenerateRequest
    | AbortRequest
    | HealthRequest
    | StatsRequest
    | KvSnapshotRequest
    | TokenizeRequest
    | DetokenizeRequest
)
ServerMessage = (
    StreamChunk
    | ErrorResponse
    | HealthResponse
    | StatsResponse
    | KvSnapshotResponse
    | TokenizeResponse
    | DetokenizeResponse
    | Heartbeat
)
CLIENT_TAGS = frozenset({"generate", "abort", "health", "stats", "kv_snapshot_request", "tokenize", "detokenize"})
