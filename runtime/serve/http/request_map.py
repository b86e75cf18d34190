"""OpenAI request fields -> the one GenerateRequest the HTTP server sends (runtime.protocol), with the request field
each sampling parameter came from (named by an out-of-range error).

The request is built and its SamplingParams validated here, once; AsyncClient.stream_request sends it as is. The
tokenizer process validates it again as it decodes the frame: that is another process, behind a socket any client
can write to.

Mapping (a field left out or null keeps SamplingParams' default):
    max_tokens / max_completion_tokens (chat; the latter wins) -> max_tokens; not given: 16 for completions (the
        OpenAI default), unbounded for chat (the completion ends at EOS or at the model's context).
    temperature, top_p, top_k, min_p, n, seed, stop_token_ids, ignore_eos, frequency_penalty, presence_penalty,
        repetition_penalty, use_beam_search, length_penalty (vLLM's extra fields: n beams, choices best first) -> the
        field of the same name. stop (a string or a list) -> stop (a list). use_beam_search without temperature:
        temperature 0 (beam search is deterministic; vLLM ignores temperature there).
    chat: logprobs (bool) + top_logprobs -> logprobs = top_logprobs (0 when not given) when logprobs is true;
        top_logprobs without logprobs is a 400. completions: logprobs (int) -> logprobs.
    stream_options.include_usage (+ continuous_usage_stats) -> BackendRequest.include_usage (continuous_usage).
    cache_salt -> the request's cache_salt (requests with different salts share no cached block). user: ignored.
    completions prompt: a list of prompts -> one GenerateRequest per prompt (openai_schema.completion_prompts).
    response_format, structured_outputs, guided_json / guided_regex / guided_choice / guided_grammar (chat and
        completions) -> structured_outputs (runtime.serve.http.structured).
    chat: tools, tool_choice, parallel_tool_calls -> ChatOptions.tools and the answer's ToolSetup
        (runtime.serve.http.tool_request; "required" / a named function put their grammar in structured_outputs, so
        they exclude response_format and the other constraint fields); chat_template_kwargs, add_generation_prompt
        (default: true, false when continue_final_message is true), continue_final_message -> ChatOptions (both
        true is a 400, as vLLM answers).
    logit_bias (token-id string keys), min_tokens, prompt_logprobs (vLLM's extra) -> the field of the same name.
    completions: echo with logprobs -> prompt_logprobs = max(logprobs, prompt_logprobs) (the prompt's tokens come
        first in the legacy logprobs); echo with max_tokens 0 and no logprobs -> prompt_logprobs 0 (max_tokens 0 is
        scoring: the prompt runs, nothing is generated). chat: echo is a 400 (unsupported), and so is prompt_logprobs
        with stream.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from runtime import protocol as p
from runtime.sampling_params import INT32_MAX, InvalidSamplingParams, SamplingParams
from runtime.serve.http.errors import bad_request, from_exception
from runtime.serve.http.openai_schema import ChatCompletionRequest, CompletionRequest, chat_messages, completion_prompts
from runtime.serve.http.structured import request_constraint
from runtime.serve.http.tool_request import ToolSetup, chat_tools
from runtime.text.chat_templates import reserved_kwargs
from runtime.text.tool_parsers import HermesToolParser, ToolParser

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
    "logit_bias",
    "min_tokens",
    "prompt_logprobs",
)


class BackendRequest(NamedTuple):
    """What one OpenAI request sends to the backend.

    request: the GenerateRequest (stream True: the backend always streams, so TTFT and inter-token latency are
        measured for every request), its SamplingParams validated.
    param_names: SamplingParams field -> the request field it came from, where the names differ (for errors the
        backend raises later).
    prompt_param: the request field holding the prompt ("messages" or "prompt"). include_usage: stream_options';
    continuous_usage: include_usage and stream_options.continuous_usage_stats (vLLM's rule).
    tools: how the answer's tool calls are parsed (None: they are not).
    echo: completions' echo (the answer puts the prompt first: runtime/serve/http/echo.py). prompt_logprobs: the
        top alternatives the request's own prompt_logprobs field asked for (None: no such field in the answer).
    """

    request: p.GenerateRequest
    param_names: dict[str, str]
    prompt_param: str
    include_usage: bool
    continuous_usage: bool = False
    tools: ToolSetup | None = None
    echo: bool = False
    prompt_logprobs: int | None = None

    @property
    def sampling_params(self) -> SamplingParams:
        return self.request.sampling_params


def _constraint(req: ChatCompletionRequest | CompletionRequest, fields: dict[str, Any], names: dict[str, str]) -> None:
    """Put the request's structured-output constraint, if any, in fields and the field it came from in names."""
    constraint = request_constraint(req)
    if constraint is not None:
        fields["structured_outputs"] = constraint.value
        names["structured_outputs"] = constraint.param


def _same_name_fields(req: ChatCompletionRequest | CompletionRequest) -> dict[str, Any]:
    """The SamplingParams fields whose request field has the same name (or stop, as a list), as given."""
    fields: dict[str, Any] = {}
    for name in _SAME_NAME:
        value = getattr(req, name)
        if value is not None and value != {}:  # logit_bias {} is none
            fields[name] = value
    if isinstance(req.stop, str):
        fields["stop"] = [req.stop]
    elif req.stop is not None:
        fields["stop"] = req.stop
    if req.use_beam_search and req.temperature is None:
        fields["temperature"] = 0.0  # beam search is deterministic (vLLM ignores temperature there)
    return fields


def _include_usage(req: ChatCompletionRequest | CompletionRequest) -> bool:
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options is only allowed with stream: true", "stream_options")
    return bool(req.stream_options is not None and req.stream_options.include_usage)


def _continuous_usage(req: ChatCompletionRequest | CompletionRequest) -> bool:
    return bool(_include_usage(req) and req.stream_options and req.stream_options.continuous_usage_stats)


def _sampling_params(fields: dict[str, Any], param_names: dict[str, str], prompt_param: str) -> SamplingParams:
    """SamplingParams(**fields), the one validation in this process; raises OpenAIError (400) naming the request
    field of an out-of-range value."""
    try:
        return SamplingParams(**fields)
    except InvalidSamplingParams as exc:
        raise from_exception(exc, param_names, prompt_param) from None


def chat_request(
    req: ChatCompletionRequest, rid: str, tool_parser: type[ToolParser] = HermesToolParser
) -> BackendRequest:
    """The backend request of a chat completion under rid; tool_parser: the server's (--tool-call-parser). Raises
    OpenAIError (400) for bad messages, bad tools or tool_choice, top_logprobs without logprobs, stream_options
    without stream, add_generation_prompt and continue_final_message both true, an out-of-range sampling
    parameter."""
    messages = chat_messages(req.messages)
    tools = chat_tools(req.tools, req.tool_choice, req.parallel_tool_calls, tool_parser)
    fields = _same_name_fields(req)
    names: dict[str, str] = {}
    if req.max_completion_tokens is not None:
        fields["max_tokens"] = req.max_completion_tokens
        names["max_tokens"] = "max_completion_tokens"
    elif req.max_tokens is not None:
        fields["max_tokens"] = req.max_tokens
    else:
        fields["max_tokens"] = INT32_MAX
    if req.logprobs:
        fields["logprobs"] = req.top_logprobs or 0
        names["logprobs"] = "top_logprobs"
    elif req.top_logprobs is not None:
        raise bad_request("top_logprobs requires logprobs: true", "top_logprobs")
    _constraint(req, fields, names)
    if tools.setup is not None and tools.setup.constraint is not None:
        if "structured_outputs" in fields:
            raise bad_request(
                f"tool_choice {req.tool_choice!r} cannot be combined with {names['structured_outputs']}", "tool_choice"
            )
        fields["structured_outputs"] = tools.setup.constraint
        names["structured_outputs"] = "tool_choice"
    if req.stream and req.prompt_logprobs is not None:
        raise bad_request(
            "prompt_logprobs is not supported with stream: true", "prompt_logprobs", "unsupported_parameter"
        )
    include_usage = _include_usage(req)
    request = p.GenerateRequest(
        rid=rid,
        messages=messages,
        sampling_params=_sampling_params(fields, names, "messages"),
        stream=True,
        cache_salt=req.cache_salt,
        chat_options=_chat_options(req, tools.tools),
    )
    return BackendRequest(
        request,
        names,
        "messages",
        include_usage,
        _continuous_usage(req),
        tools.setup,
        prompt_logprobs=req.prompt_logprobs,
    )


def _chat_options(req: ChatCompletionRequest, tools: list[dict[str, Any]] | None) -> p.ChatOptions | None:
    """The chat's rendering options (None: all defaults). Raises OpenAIError (400) when add_generation_prompt and
    continue_final_message are both true."""
    continue_final = bool(req.continue_final_message)
    add_prompt = not continue_final if req.add_generation_prompt is None else req.add_generation_prompt
    if add_prompt and continue_final:
        raise bad_request(
            "add_generation_prompt and continue_final_message cannot both be true", "continue_final_message"
        )
    reserved = reserved_kwargs(req.chat_template_kwargs or {})
    if reserved:
        raise bad_request(f"chat_template_kwargs may not set {reserved}", "chat_template_kwargs")
    options = p.ChatOptions(
        tools=tools,
        chat_template_kwargs=req.chat_template_kwargs or None,
        add_generation_prompt=add_prompt,
        continue_final_message=continue_final,
    )
    return None if options == p.ChatOptions() else options


def completion_requests(req: CompletionRequest, rid: str) -> list[BackendRequest]:
    """The backend requests of a (text) completion under rid, one per prompt (rid, or rid-0, rid-1, ... for a list
    of prompts), sharing one validated SamplingParams. Raises OpenAIError (400) for a bad prompt list, echo or
    prompt_logprobs with several prompts, stream_options without stream, an out-of-range sampling parameter."""
    prompts = completion_prompts(req.prompt)
    fields = _same_name_fields(req)
    if req.max_tokens is not None:
        fields["max_tokens"] = req.max_tokens
    else:
        fields["max_tokens"] = COMPLETIONS_MAX_TOKENS
    if req.logprobs is not None:
        fields["logprobs"] = req.logprobs
    names: dict[str, str] = {}
    if req.echo:
        if req.logprobs is not None:
            fields["prompt_logprobs"] = max(req.logprobs, req.prompt_logprobs or 0)
            names["prompt_logprobs"] = "prompt_logprobs" if req.prompt_logprobs is not None else "logprobs"
        elif fields["max_tokens"] == 0 and req.prompt_logprobs is None:
            fields["prompt_logprobs"] = 0  # nothing but the prompt: it runs for its token count
    _constraint(req, fields, names)
    include_usage = _include_usage(req)
    params = _sampling_params(fields, names, "prompt")
    if len(prompts) > 1 and (req.echo or params.prompt_logprobs is not None):
        raise bad_request("echo and prompt_logprobs take a single prompt per request", "prompt")
    out = []
    for i, prompt in enumerate(prompts):
        request = p.GenerateRequest(
            rid=rid if len(prompts) == 1 else f"{rid}-{i}",
            prompt=prompt.text,
            input_ids=prompt.input_ids,
            sampling_params=params,
            stream=True,
            cache_salt=req.cache_salt,
        )
        backend = BackendRequest(
            request,
            names,
            "prompt",
            include_usage,
            _continuous_usage(req),
            echo=bool(req.echo),
            prompt_logprobs=req.prompt_logprobs,
        )
        out.append(backend)
    return out
