"""Request bodies of the OpenAI API as msgspec Structs, decoded strictly from JSON.

Which fields are accepted (the rule, documented in the README):
    - Implemented fields are honoured (see runtime.serve.http.request_map for their mapping onto one GenerateRequest).
    - Harmless OpenAI fields that change nothing about the completion are accepted and ignored: user, metadata, store,
      service_tier, safety_identifier, prompt_cache_key, prompt_cache_retention, parallel_tool_calls,
      stream_options.include_obfuscation.
    - Known OpenAI (or vLLM) fields this server does not implement are a 400 unsupported_parameter naming the field
      when they are set to anything but their neutral value (tools: [] or null, response_format: {"type": "text"},
      logit_bias: {} or null, best_of: 1, echo: false, ...): see UNSUPPORTED.
    - Any other field is a 400 unknown_parameter naming it, as the OpenAI API itself answers ("Unrecognized request
      argument"): a misspelt max_tokens or temperature is never silently ignored.
Nulls are accepted everywhere a field is optional and mean "not given".
"""

from __future__ import annotations

from typing import Any, NamedTuple

import msgspec

from runtime import protocol as p
from runtime.serve.http.errors import OpenAIError, bad_request, from_decode_error


class StreamOptions(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """stream_options: include_usage adds a last chunk with the usage and empty choices."""

    include_usage: bool | None = None
    include_obfuscation: bool | None = None  # accepted, ignored: nothing is obfuscated


class ChatMessageIn(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """One message of a chat request: content is text or a list of {"type": "text", "text": ...} parts."""

    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None  # accepted, ignored (the chat template has no place for it)
    tool_calls: Any = None
    tool_call_id: Any = None
    function_call: Any = None
    audio: Any = None
    refusal: Any = None


class _Common(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The fields chat and completions requests share."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    n: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    use_beam_search: bool | None = None  # vLLM's extra fields: beam search of width n
    length_penalty: float | None = None
    cache_salt: str | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    # harmless: accepted and ignored
    user: str | None = None
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    # not implemented: a 400 unless neutral (UNSUPPORTED)
    logit_bias: Any = None
    skip_special_tokens: Any = None
    min_tokens: Any = None
    include_stop_str_in_output: Any = None


class ChatCompletionRequest(_Common, kw_only=True, forbid_unknown_fields=True):
    """POST /v1/chat/completions. logprobs (bool) with top_logprobs (0..20) returns per-token logprobs."""

    messages: list[ChatMessageIn]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    parallel_tool_calls: bool | None = None  # harmless without tools
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    response_format: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    web_search_options: Any = None
    moderation: Any = None
    prompt_cache_options: Any = None
    add_generation_prompt: Any = None
    continue_final_message: Any = None
    chat_template: Any = None
    chat_template_kwargs: Any = None
    echo: Any = None


class CompletionRequest(_Common, kw_only=True, forbid_unknown_fields=True):
    """POST /v1/completions. prompt: a string or a list of token ids (one prompt; a list of several prompts is a
    400). logprobs (int, 0..20): the sampled token's logprob and that many alternatives."""

    prompt: str | list[Any]
    logprobs: int | None = None
    echo: Any = None
    suffix: Any = None
    best_of: Any = None


class TokenizeRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """POST /tokenize: exactly one of prompt (text; add_special_tokens as the completions route does) or messages
    (the chat template is applied, as the chat route does)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessageIn] | None = None
    add_special_tokens: bool = True


class DetokenizeRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """POST /detokenize: tokens (ids) to text."""

    tokens: list[int]
    model: str | None = None


def _none_or(*neutral: Any):
    return lambda v: v is None or any(v == n for n in neutral)


# field -> is its value neutral (as if not given)? Anything else is a 400 unsupported_parameter naming the field.
UNSUPPORTED: dict[str, Any] = {
    "logit_bias": _none_or({}),
    "skip_special_tokens": _none_or(True),
    "min_tokens": _none_or(0),
    "include_stop_str_in_output": _none_or(False),
    "tools": _none_or([]),
    "tool_choice": _none_or("none"),
    "functions": _none_or([]),
    "function_call": _none_or("none"),
    "response_format": _none_or({"type": "text"}),
    "audio": _none_or(),
    "modalities": _none_or(["text"]),
    "prediction": _none_or(),
    "reasoning_effort": _none_or(),
    "verbosity": _none_or(),
    "web_search_options": _none_or(),
    "moderation": _none_or(),
    "prompt_cache_options": _none_or(),
    "add_generation_prompt": _none_or(True),
    "continue_final_message": _none_or(False),
    "chat_template": _none_or(),
    "chat_template_kwargs": _none_or({}),
    "echo": _none_or(False),
    "suffix": _none_or(""),
    "best_of": _none_or(1),
}
_MESSAGE_UNSUPPORTED = ("tool_calls", "tool_call_id", "function_call", "audio")
CHAT_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}

_decoders = {
    cls: msgspec.json.Decoder(cls)
    for cls in (ChatCompletionRequest, CompletionRequest, TokenizeRequest, DetokenizeRequest)
}


def decode(body: bytes, cls: type[Any]) -> Any:
    """body decoded as cls (one of the request Structs), its unsupported fields checked. O(len(body)).

    Raises OpenAIError (400): invalid_json (also for JSON nested too deep for the decoder's recursion: msgspec raises
    RecursionError), invalid_type, missing_required_parameter, unknown_parameter, unsupported_parameter (each naming
    the field)."""
    try:
        req = _decoders[cls].decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise from_decode_error(exc) from None
    except RecursionError:
        raise bad_request("the body is not valid JSON: it nests too deeply", None, "invalid_json") from None
    for name in req.__struct_fields__:
        neutral = UNSUPPORTED.get(name)
        if neutral is not None and not neutral(getattr(req, name)):
            raise _unsupported(name)
    return req


def _unsupported(param: str) -> OpenAIError:
    return bad_request(f"{param!r} is not supported by this server", param, "unsupported_parameter")


def chat_messages(messages: list[ChatMessageIn], field: str = "messages") -> list[p.ChatMessage]:
    """The messages as a GenerateRequest carries them (runtime.protocol.ChatMessage: role, content), developer
    mapped to system, text parts joined. Raises OpenAIError (400) for an empty list, an unknown role, a missing
    content, a non-text part or a tool message / tool call (tools are not supported), naming the field (e.g.
    "messages[1].role")."""
    if not messages:
        raise bad_request(f"{field} must not be empty", field)
    return [_message(f"{field}[{i}]", m) for i, m in enumerate(messages)]


def _message(at: str, m: ChatMessageIn) -> p.ChatMessage:
    for name in _MESSAGE_UNSUPPORTED:
        if getattr(m, name) is not None:
            raise _unsupported(f"{at}.{name}")
    role = CHAT_ROLES.get(m.role)
    if role is None:
        if m.role in ("tool", "function"):
            raise _unsupported(f"{at}.role")
        raise bad_request(f"{at}.role must be one of {sorted(CHAT_ROLES)}, got {m.role[:40]!r}", f"{at}.role")
    if m.content is None:
        raise bad_request(f"{at}.content is required", f"{at}.content", "missing_required_parameter")
    if isinstance(m.content, str):
        return p.ChatMessage(role, m.content)
    return p.ChatMessage(role, _text_parts(at, m.content))


def _text_parts(at: str, parts: list[dict[str, Any]]) -> str:
    texts = []
    for j, part in enumerate(parts):
        text = part.get("text")
        if part.get("type") != "text":
            raise _unsupported(f"{at}.content[{j}].type")
        if not isinstance(text, str) or set(part) - {"type", "text"}:
            raise bad_request(
                f"{at}.content[{j}] must be {{'type': 'text', 'text': <string>}}", f"{at}.content[{j}]", "invalid_type"
            )
        texts.append(text)
    return "".join(texts)


class CompletionPrompt(NamedTuple):
    """A completions prompt: exactly one of text and input_ids (token ids) is set."""

    text: str | None
    input_ids: list[int] | None


def completion_prompt(prompt: str | list[Any]) -> CompletionPrompt:
    """The prompt of a completions request: a string, a list of token ids, or a list holding one string or one list
    of token ids. Raises OpenAIError (400) for several prompts or a mixed list."""
    if isinstance(prompt, str):
        return CompletionPrompt(prompt, None)
    if len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        return completion_prompt(prompt[0])
    if prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return CompletionPrompt(None, list(prompt))
    if len(prompt) > 1 and all(isinstance(t, (str, list)) for t in prompt):
        raise bad_request("a list of several prompts is not supported: send one prompt per request", "prompt")
    if not prompt:
        raise bad_request("prompt must not be empty", "prompt")
    raise bad_request(
        "prompt must be a string, a list of token ids, or a list holding one of them", "prompt", "invalid_type"
    )
