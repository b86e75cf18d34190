"""Answer bodies in the OpenAI shape (plain dicts, serialized with orjson): chat.completion, text_completion, their
stream chunks, usage (always with prompt_tokens_details.cached_tokens) and both logprobs formats, which name each
token by the text the backend sent with it (StreamChunk.token_texts: the HTTP process has no tokenizer)."""

from __future__ import annotations

import math
from typing import Any

from runtime import protocol as p
from runtime.serve.http.tool_answer import chat_message
from runtime.serve.http.tool_request import ToolSetup

MIN_LOGPROB = -9999.0  # stands for -inf (and a missing value): JSON has no infinity


def _named(token_id: int, lp: p.TokenLogprobs | None, texts: p.TokenText | None) -> p.TokenText:
    """The text of a token and of its top alternatives, as the backend sent them (StreamChunk.token_texts); a token
    that came without them (a backend without a tokenizer) reads "token_id:<id>" (vLLM's spelling)."""
    if texts is not None:
        return texts
    top = [] if lp is None else [f"token_id:{t}" for t in lp.top_token_ids]
    return p.TokenText(f"token_id:{token_id}", top)


def _texts(token_texts: list[p.TokenText | None] | list[p.TokenText] | None, n: int) -> list[p.TokenText | None]:
    """token_texts, or n Nones when the backend sent none."""
    return [None] * n if token_texts is None else list(token_texts)


def _logprob(value: float | None) -> float:
    return MIN_LOGPROB if value is None or math.isnan(value) or value < MIN_LOGPROB else value


def usage_body(usage: p.Usage) -> dict[str, Any]:
    """OpenAI usage: prompt_tokens, completion_tokens, total_tokens, prompt_tokens_details.cached_tokens. The OpenAI
    usage object has no field for Usage.queue_time_s or host_cached_tokens (queue time reaches /metrics as
    request_queue_time_seconds instead), so the body leaves them out."""
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


def chat_logprobs(
    token_ids: list[int],
    logprobs: list[p.TokenLogprobs | None],
    token_texts: list[p.TokenText | None] | list[p.TokenText] | None,
) -> dict[str, Any]:
    """Chat logprobs: {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]},
    one entry per token id; token_texts: aligned with token_ids (None: none sent). bytes: the token's text as UTF-8."""
    content = []
    for tid, lp, texts in zip(token_ids, logprobs, _texts(token_texts, len(token_ids)), strict=True):
        named = _named(tid, lp, texts)
        token = named.text
        top = [] if lp is None else [_chat_top(t, v) for t, v in zip(named.top_texts, lp.top_logprobs, strict=True)]
        content.append(
            {
                "token": token,
                "logprob": _logprob(None if lp is None else lp.logprob),
                "bytes": list(token.encode("utf-8", "replace")),
                "top_logprobs": top,
            }
        )
    return {"content": content}


def _chat_top(token: str, value: float) -> dict[str, Any]:
    return {"token": token, "logprob": _logprob(value), "bytes": list(token.encode("utf-8", "replace"))}


def completion_logprobs(
    token_ids: list[int],
    logprobs: list[p.TokenLogprobs | None],
    token_texts: list[p.TokenText | None] | list[p.TokenText] | None,
    offset: int = 0,
) -> dict[str, Any]:
    """Completions logprobs: {"tokens", "token_logprobs", "top_logprobs": [{token: logprob}], "text_offset"};
    token_texts: aligned with token_ids (None: none sent); offset: characters of completion text before the first
    token (for a stream chunk)."""
    tokens, values, tops, offsets = [], [], [], []
    for tid, lp, texts in zip(token_ids, logprobs, _texts(token_texts, len(token_ids)), strict=True):
        named = _named(tid, lp, texts)
        token = named.text
        tokens.append(token)
        values.append(_logprob(None if lp is None else lp.logprob))
        tops.append(
            {} if lp is None else {t: _logprob(v) for t, v in zip(named.top_texts, lp.top_logprobs, strict=True)}
        )
        offsets.append(offset)
        offset += len(token)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


def chat_response(
    rid: str, created: int, model: str, choices: list[Any], usage: p.Usage, tools: ToolSetup | None = None
) -> dict[str, Any]:
    """A chat.completion object; choices: runtime.results.Choice values (Generation.collect); tools: how tool calls
    are read (runtime.serve.http.tool_answer.chat_message; None: the text is the content)."""
    out = []
    for c in choices:
        logprobs = None if c.logprobs is None else chat_logprobs(c.token_ids, c.logprobs, c.token_texts)
        message, finish_reason = chat_message(c.text, c.finish_reason, tools)
        out.append({"index": c.index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason})
    return {
        "id": f"chatcmpl-{rid}",
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": out,
        "usage": usage_body(usage),
        "system_fingerprint": None,
    }


def completion_response(rid: str, created: int, model: str, choices: list[Any], usage: p.Usage) -> dict[str, Any]:
    """A text_completion object; choices: runtime.results.Choice values (Generation.collect)."""
    out = []
    for c in choices:
        logprobs = None if c.logprobs is None else completion_logprobs(c.token_ids, c.logprobs, c.token_texts)
        out.append({"index": c.index, "text": c.text, "logprobs": logprobs, "finish_reason": c.finish_reason})
    return {
        "id": f"cmpl-{rid}",
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": out,
        "usage": usage_body(usage),
        "system_fingerprint": None,
    }
