"""OpenAI request fields -> one radixserve request: the prompt (messages, text or token ids), the SamplingParams
keyword arguments, and the request field each of them came from (named by an out-of-range error).

Mapping (a field left out or null keeps SamplingParams' default):
    max_tokens / max_completion_tokens (chat; the latter wins) -> max_tokens; not given: 16 for completions (the
        OpenAI default), unbounded for chat (the completion ends at EOS or at the model's context).
    temperature, top_p, top_k, min_p, n, seed, stop_token_ids, ignore_eos, frequency_penalty, presence_penalty,
        repetition_penalty, use_beam_search, length_penalty (vLLM's extra fields: n beams, choices best first) -> the
        field of the same name. stop (a string or a list) -> stop (a list).
    chat: logprobs (bool) + top_logprobs -> logprobs = top_logprobs (0 when not given) when logprobs is true;
        top_logprobs without logprobs is a 400. completions: logprobs (int) -> logprobs.
    cache_salt -> the request's cache_salt (requests with different salts share no cached block). user: ignored.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from runtime.sampling_params import INT32_MAX
from runtime.serve.http.errors import bad_request
from runtime.serve.http.openai_schema import ChatCompletionRequest, CompletionRequest, chat_messages, completion_prompt

COMPLETIONS_MAX_TOKENS = 16  # the OpenAI completions default
_SAME_NAME = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "n",
    "seed",
    "stop_token_ids",
    "ignore_eos",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "use_beam_search",
    "length_penalty",
)


class BackendRequest(NamedTuple):
    """What the app sends through AsyncClient.stream: exactly one of prompt / messages / input_ids, cache_salt,
    params (SamplingParams keyword arguments), and param_names (SamplingParams field -> request field, for errors);
    prompt_param: the request field holding the prompt ("messages" or "prompt"); include_usage: stream_options."""

    prompt: str | None
    messages: list[dict[str, str]] | None
    input_ids: list[int] | None
    cache_salt: str | None
    params: dict[str, Any]
    param_names: dict[str, str]
    prompt_param: str
    include_usage: bool


def _sampling(req: ChatCompletionRequest | CompletionRequest) -> tuple[dict[str, Any], dict[str, str]]:
    params: dict[str, Any] = {}
    for name in _SAME_NAME:
        value = getattr(req, name)
        if value is not None:
            params[name] = value
    if req.stop is not None:
        params["stop"] = [req.stop] if isinstance(req.stop, str) else req.stop
    if req.use_beam_search and req.temperature is None:
        params["temperature"] = 0.0  # beam search is deterministic (vLLM ignores temperature there)
    return params, {}


def _include_usage(req: ChatCompletionRequest | CompletionRequest) -> bool:
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options is only allowed with stream: true", "stream_options")
    return bool(req.stream_options is not None and req.stream_options.include_usage)


def chat_request(req: ChatCompletionRequest) -> BackendRequest:
    """The backend request of a chat completion. Raises OpenAIError (400) for bad messages, top_logprobs without
    logprobs, stream_options without stream."""
    messages = chat_messages(req.messages)
    params, names = _sampling(req)
    if req.max_completion_tokens is not None:
        params["max_tokens"], names["max_tokens"] = req.max_completion_tokens, "max_completion_tokens"
    elif req.max_tokens is not None:
        params["max_tokens"] = req.max_tokens
    else:
        params["max_tokens"] = INT32_MAX
    if req.logprobs:
        params["logprobs"], names["logprobs"] = (req.top_logprobs or 0), "top_logprobs"
    elif req.top_logprobs is not None:
        raise bad_request("top_logprobs requires logprobs: true", "top_logprobs")
    return BackendRequest(None, messages, None, req.cache_salt, params, names, "messages", _include_usage(req))


def completion_request(req: CompletionRequest) -> BackendRequest:
    """The backend request of a (text) completion. Raises OpenAIError (400) for a list of several prompts,
    stream_options without stream."""
    prompt, input_ids = completion_prompt(req.prompt)
    params, names = _sampling(req)
    params["max_tokens"] = req.max_tokens if req.max_tokens is not None else COMPLETIONS_MAX_TOKENS
    if req.logprobs is not None:
        params["logprobs"] = req.logprobs
    return BackendRequest(prompt, None, input_ids, req.cache_salt, params, names, "prompt", _include_usage(req))
