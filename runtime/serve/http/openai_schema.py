"""Request bodies of the OpenAI API as msgspec Structs, decoded strictly from JSON.

Which fields are accepted (the rule, documented in the README):
    - Implemented fields are honoured (see runtime.serve.http.request_map for their mapping onto one GenerateRequest).
    - Harmless OpenAI fields that change nothing about the completion are accepted and ignored: user, metadata, store,
      service_tier, safety_identifier, prompt_cache_key, prompt_cache_retention, stream_options.include_obfuscation.
    - Known OpenAI (or vLLM) fields this server does not implement are a 400 unsupported_parameter naming the field
      when they are set to anything but their neutral value (best_of: 1, chat's echo: false, ...): see UNSUPPORTED.
    - Any other field (at the top level, in a message, in a text content part, in stream_options) is ignored with a
      warning logged once per name, as vLLM does (runtime.serve.http.extra_fields): clients send other servers'
      extras and newer OpenAI fields.
Nulls are accepted everywhere a field is optional and mean "not given".
"""

from __future__ import annotations

from typing import Any, NamedTuple

import msgspec

from runtime import protocol as p
from runtime.serve.http.errors import OpenAIError, bad_request, from_decode_error
from runtime.serve.http.extra_fields import drop_unknown_in_body
from runtime.serve.http.tool_request import history_tool_calls


class StreamOptions(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """stream_options: include_usage adds a last chunk with the usage and empty choices; with it, vLLM's
    continuous_usage_stats puts the choice's usage so far on every chunk too."""

    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None
    include_obfuscation: bool | None = None  # accepted, ignored: nothing is obfuscated


class ChatMessageIn(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """One message of a chat request: content is text or a list of {"type": "text", "text": ...} parts (null in an
    assistant message with tool_calls); tool_calls: an assistant's calls; tool_call_id: the call a tool message
    answers (runtime.serve.http.tool_request)."""

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
    logit_bias: dict[int, float] | None = None  # JSON keys are token-id strings ("50256"), as OpenAI sends them
    min_tokens: int | None = None
    prompt_logprobs: int | None = None  # vLLM's extra field
    use_beam_search: bool | None = None  # vLLM's extra fields: beam search of width n
    length_penalty: float | None = None
    response_format: Any = None  # structured outputs (runtime.serve.http.structured): OpenAI's and vLLM's fields
    structured_outputs: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
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
    skip_special_tokens: Any = None
    include_stop_str_in_output: Any = None


class ChatCompletionRequest(_Common, kw_only=True, forbid_unknown_fields=True):
    """POST /v1/chat/completions. logprobs (bool) with top_logprobs (0..20) returns per-token logprobs."""

    messages: list[ChatMessageIn]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    parallel_tool_calls: bool | None = None
    tools: Any = None  # checked by runtime.serve.http.tool_request
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    web_search_options: Any = None
    moderation: Any = None
    prompt_cache_options: Any = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    chat_template: Any = None
    chat_template_kwargs: dict[str, Any] | None = None
    echo: Any = None


class CompletionRequest(_Common, kw_only=True, forbid_unknown_fields=True):
    """POST /v1/completions. prompt: a string, a list of token ids, or a list of several such prompts (one choice
    per prompt and sample: completion_prompts). logprobs (int, 0..20): the sampled token's logprob and that many
    alternatives."""

    prompt: str | list[Any]
    logprobs: int | None = None
    echo: bool | None = None  # the prompt before each choice's text (and its logprobs first, with logprobs)
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
    "skip_special_tokens": _none_or(True),
    "include_stop_str_in_output": _none_or(False),
    "functions": _none_or([]),
    "function_call": _none_or("none"),
    "audio": _none_or(),
    "modalities": _none_or(["text"]),
    "prediction": _none_or(),
    "reasoning_effort": _none_or(),
    "verbosity": _none_or(),
    "web_search_options": _none_or(),
    "moderation": _none_or(),
    "prompt_cache_options": _none_or(),
    "chat_template": _none_or(),
    "echo": _none_or(False),  # chat only: completions implement it (CompletionRequest.echo is a bool)
    "suffix": _none_or(""),
    "best_of": _none_or(1),
}
_MESSAGE_UNSUPPORTED = ("function_call", "audio")
CHAT_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}

_typed_decoders = {
    cls: msgspec.json.Decoder(cls)
    for cls in (ChatCompletionRequest, CompletionRequest, TokenizeRequest, DetokenizeRequest)
}
_json_decoder = msgspec.json.Decoder()
_MESSAGE_FIELDS = ChatMessageIn.__struct_fields__
_STREAM_OPTIONS_FIELDS = StreamOptions.__struct_fields__


def decode(body: bytes, cls: type[Any]) -> Any:
    """body decoded as cls (one of the request Structs), its undeclared fields dropped (extra_fields: each name
    logged once), its unsupported fields checked. O(len(body)).

    Raises OpenAIError (400): invalid_json (also for JSON nested too deep for the decoder's recursion: msgspec raises
    RecursionError), invalid_type, missing_required_parameter, unsupported_parameter (each naming the field)."""
    try:
        req = _typed_decoders[cls].decode(body)
    except msgspec.ValidationError as exc:
        if "unknown field" not in str(exc):
            raise from_decode_error(exc) from None
        req = _decode_dropping_unknown(body, cls)
    except msgspec.DecodeError as exc:
        raise from_decode_error(exc) from None
    except RecursionError:
        raise _too_deep() from None
    for name in req.__struct_fields__:
        neutral = None if cls is CompletionRequest and name == "echo" else UNSUPPORTED.get(name)
        if neutral is not None and not neutral(getattr(req, name)):
            raise _unsupported(name)
    return req


def _decode_dropping_unknown(body: bytes, cls: type[Any]) -> Any:
    """The slow path of decode, for a body with an undeclared field (the typed decoder refused it): decoded to
    Python objects, undeclared fields dropped (extra_fields), then converted to cls (about 7x the typed decode)."""
    try:
        obj = _json_decoder.decode(body)
        if isinstance(obj, dict):
            drop_unknown_in_body(obj, cls.__struct_fields__, _MESSAGE_FIELDS, _STREAM_OPTIONS_FIELDS)
        return msgspec.convert(obj, cls)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise from_decode_error(exc) from None
    except RecursionError:
        raise _too_deep() from None


def _too_deep() -> OpenAIError:
    return bad_request("the body is not valid JSON: it nests too deeply", None, "invalid_json")


def _unsupported(param: str) -> OpenAIError:
    return bad_request(f"{param!r} is not supported by this server", param, "unsupported_parameter")


def chat_messages(messages: list[ChatMessageIn], field: str = "messages") -> list[p.ChatMessage]:
    """The messages as a GenerateRequest carries them (runtime.protocol.ChatMessage: role, content, tool_calls,
    tool_call_id), developer mapped to system, text parts joined. Raises OpenAIError (400) for an empty list, an
    unknown role, a missing content (null is allowed in an assistant message with tool_calls), a non-text part, a
    tool message without tool_call_id, tool_calls outside an assistant message, naming the field (e.g.
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
        if m.role == "function":
            raise _unsupported(f"{at}.role")
        raise bad_request(f"{at}.role must be one of {sorted(CHAT_ROLES)}, got {m.role[:40]!r}", f"{at}.role")
    calls = None
    if m.tool_calls is not None:
        if role != "assistant":
            raise bad_request(f"{at}.tool_calls is only allowed in an assistant message", f"{at}.tool_calls")
        calls = history_tool_calls(f"{at}.tool_calls", m.tool_calls) or None
    if role == "tool" and not isinstance(m.tool_call_id, str):
        raise bad_request(f"{at}.tool_call_id is required", f"{at}.tool_call_id", "missing_required_parameter")
    if role != "tool" and m.tool_call_id is not None:
        raise bad_request(f"{at}.tool_call_id is only allowed in a tool message", f"{at}.tool_call_id")
    if m.content is None and calls is None:
        raise bad_request(f"{at}.content is required", f"{at}.content", "missing_required_parameter")
    content = m.content if m.content is None or isinstance(m.content, str) else _text_parts(at, m.content)
    return p.ChatMessage(role, content, calls, m.tool_call_id)


def _text_parts(at: str, parts: list[dict[str, Any]]) -> str:
    texts = []
    for j, part in enumerate(parts):
        text = part.get("text")
        if part.get("type") != "text":
            raise _unsupported(f"{at}.content[{j}].type")
        if not isinstance(text, str):
            raise bad_request(
                f"{at}.content[{j}] must be {{'type': 'text', 'text': <string>}}", f"{at}.content[{j}]", "invalid_type"
            )
        texts.append(text)
    return "".join(texts)


class CompletionPrompt(NamedTuple):
    """A completions prompt: exactly one of text and input_ids (token ids) is set."""

    text: str | None
    input_ids: list[int] | None


MAX_PROMPTS = 1024  # prompts in one completions request (each is a backend request of its own)


def completion_prompts(prompt: str | list[Any]) -> list[CompletionPrompt]:
    """The prompts of a completions request, in order: a string, a list of token ids, or a list of strings and
    lists of token ids (one prompt each; OpenAI's batch form). Raises OpenAIError (400, param "prompt") for an empty
    list, a list mixing ids with prompts, a prompt that is neither, or more than MAX_PROMPTS prompts."""
    if isinstance(prompt, str):
        return [CompletionPrompt(prompt, None)]
    if not prompt:
        raise bad_request("prompt must not be empty", "prompt")
    if _token_ids(prompt):
        return [CompletionPrompt(None, list(prompt))]
    if len(prompt) > MAX_PROMPTS:
        raise bad_request(f"a request may hold at most {MAX_PROMPTS} prompts, got {len(prompt)}", "prompt")
    out = []
    for one in prompt:
        if isinstance(one, str):
            out.append(CompletionPrompt(one, None))
        elif isinstance(one, list) and one and _token_ids(one):
            out.append(CompletionPrompt(None, list(one)))
        else:
            raise bad_request(
                "prompt must be a string, a list of token ids, or a list of strings and lists of token ids",
                "prompt",
                "invalid_type",
            )
    return out


def _token_ids(values: list[Any]) -> bool:
    return all(isinstance(t, int) and not isinstance(t, bool) for t in values)
