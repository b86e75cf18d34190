"""The prompt in an answer: completions' echo (the prompt text before each choice's text and, with logprobs, the
prompt's tokens first in the legacy logprobs: the first with null, as OpenAI's echo gives them) and vLLM's
prompt_logprobs field (a list with None first, then per prompt position a dict token id -> {logprob, rank,
decoded_token}: the prompt token and the top alternatives). Both read the request's folded PromptLogprobs
(runtime.results.CompletionFold), whose tokens are named by the texts the backend sent (StreamChunk.
prompt_token_texts), so the HTTP process needs no tokenizer.

This is what lm-evaluation-harness's loglikelihood requests read: completions.create(prompt=context + continuation,
echo=True, max_tokens=0, logprobs=1), then the token_logprobs of the continuation's tokens.
"""

from __future__ import annotations

from typing import Any

from runtime import protocol as p
from runtime.client import AsyncClient
from runtime.results import CompletionFold
from runtime.serve.http.request_map import BackendRequest
from runtime.serve.http.responses import _logprob


def _names(prompt: p.PromptLogprobs, texts: list[p.TokenText] | None, i: int) -> p.TokenText:
    """Position i's TokenText (its token and alternatives), or vLLM's "token_id:<id>" spelling without texts."""
    if texts is not None:
        return texts[i]
    lp = prompt.logprobs[i]
    top = [] if lp is None else [f"token_id:{t}" for t in lp.top_token_ids]
    return p.TokenText(f"token_id:{prompt.token_ids[i]}", top)


def prompt_logprobs_body(
    prompt: p.PromptLogprobs, texts: list[p.TokenText] | None, top: int
) -> list[dict[str, Any] | None]:
    """vLLM's prompt_logprobs: None for position 0, then per position {str(token id): {"logprob", "rank",
    "decoded_token"}} for the prompt token and the first `top` alternatives (ranks 1..top), the prompt token first.
    O(positions x top)."""
    out: list[dict[str, Any] | None] = [None]
    for i in range(1, len(prompt.token_ids)):
        lp = prompt.logprobs[i]
        assert lp is not None  # only position 0 has none
        named = _names(prompt, texts, i)
        entry = {
            str(prompt.token_ids[i]): {
                "logprob": _logprob(lp.logprob),
                "rank": prompt.ranks[i],
                "decoded_token": named.text,
            }
        }
        alternatives = zip(lp.top_token_ids[:top], lp.top_logprobs[:top], named.top_texts, strict=False)
        for rank, (token, value, text) in enumerate(alternatives, start=1):
            entry.setdefault(str(token), {"logprob": _logprob(value), "rank": rank, "decoded_token": text})
        out.append(entry)
    return out


def echo_logprobs(prompt: p.PromptLogprobs, texts: list[p.TokenText] | None, top: int) -> dict[str, Any]:
    """The prompt part of echo's legacy logprobs: {"tokens", "token_logprobs", "top_logprobs", "text_offset"}, one
    entry per prompt token, the first with null logprob and null top_logprobs; top_logprobs {text: logprob} holds the
    prompt token and the first `top` alternatives; text_offset counts the prompt tokens' texts from 0."""
    tokens: list[str] = []
    values: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    offsets: list[int] = []
    offset = 0
    for i in range(len(prompt.token_ids)):
        named = _names(prompt, texts, i)
        tokens.append(named.text)
        offsets.append(offset)
        offset += len(named.text)
        lp = prompt.logprobs[i]
        if lp is None:
            values.append(None)
            tops.append(None)
            continue
        values.append(_logprob(lp.logprob))
        alternatives = zip(named.top_texts, lp.top_logprobs[:top], strict=False)
        tops.append({named.text: _logprob(lp.logprob)} | {t: _logprob(v) for t, v in alternatives})
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


def add_echo(choice: dict[str, Any], prompt_text: str, prompt_part: dict[str, Any] | None) -> None:
    """Put the prompt first in one text_completion choice (mutated): its text after prompt_text; its logprobs (when
    the choice has them) after prompt_part (echo_logprobs), the completion's text offsets moved past the prompt."""
    choice["text"] = prompt_text + choice["text"]
    lp = choice.get("logprobs")
    if lp is None or prompt_part is None:
        return
    shift = len(prompt_text)
    choice["logprobs"] = {
        "tokens": prompt_part["tokens"] + lp["tokens"],
        "token_logprobs": prompt_part["token_logprobs"] + lp["token_logprobs"],
        "top_logprobs": prompt_part["top_logprobs"] + lp["top_logprobs"],
        "text_offset": prompt_part["text_offset"] + [o + shift for o in lp["text_offset"]],
    }


async def echo_text(request: BackendRequest, client: AsyncClient) -> str:
    """The prompt text echo puts first: the request's prompt string, or the text of its token ids (one
    DetokenizeRequest: raises what AsyncClient.detokenize raises)."""
    text = request.request.prompt
    if text is None:
        text = await client.detokenize(request.request.input_ids or [])
    return text


class StreamEcho:
    """The prompt in a streamed text completion: a backend chunk that carries nothing but prompt logprobs sends no
    event (choice returns None; the fold keeps them); each choice's first event gets the prompt (echo: its text first
    and, with logprobs, its tokens first; prompt_logprobs: vLLM's field), and with echo every later event of the
    choice has its text_offset moved past the prompt text. The prompt's logprobs all come before any completion
    token (the scheduler sends them in the step before), so the fold holds them whole by then."""

    def __init__(self, request: BackendRequest, fold: CompletionFold, prompt_text: str) -> None:
        self.request = request
        self.fold = fold
        self.prompt_text = prompt_text
        self._started: set[int] = set()

    def choice(self, chunk: p.StreamChunk, body: dict[str, Any]) -> dict[str, Any] | None:
        """body (the event's choice, mutated) with the prompt added as above, or None for no event."""
        if not chunk.text and not chunk.token_ids and chunk.finish_reason is None:
            return None
        if chunk.index in self._started:
            lp = body.get("logprobs")
            if self.request.echo and lp is not None:
                lp["text_offset"] = [o + len(self.prompt_text) for o in lp["text_offset"]]
            return body
        self._started.add(chunk.index)
        prompt = self.fold.prompt_logprobs
        texts = self.fold.prompt_token_texts
        if self.request.prompt_logprobs is not None and prompt is not None:
            body["prompt_logprobs"] = prompt_logprobs_body(prompt, texts, self.request.prompt_logprobs)
        if self.request.echo:
            top = self.request.sampling_params.logprobs or 0
            add_echo(body, self.prompt_text, None if prompt is None else echo_logprobs(prompt, texts, top))
        return body


async def answer_prompt(
    body: dict[str, Any], request: BackendRequest, fold: CompletionFold, client: AsyncClient
) -> None:
    """Add what request asked of its prompt to a non-streamed answer body (chat.completion or text_completion,
    mutated): vLLM's prompt_logprobs (top-level for chat, in every choice for completions, as vLLM places them) and
    completions' echo. A prompt given as token ids is echoed as their text (one DetokenizeRequest: raises what
    AsyncClient.detokenize raises)."""
    prompt = fold.prompt_logprobs
    texts = fold.prompt_token_texts
    if request.prompt_logprobs is not None and prompt is not None:
        field = prompt_logprobs_body(prompt, texts, request.prompt_logprobs)
        if body["object"] == "chat.completion":
            body["prompt_logprobs"] = field
        else:
            for choice in body["choices"]:
                choice["prompt_logprobs"] = field
    if not request.echo:
        return
    text = await echo_text(request, client)
    part = None if prompt is None else echo_logprobs(prompt, texts, request.sampling_params.logprobs or 0)
    for choice in body["choices"]:
        add_echo(choice, text, part)
