"""What the client returns: a Completion and its Choices, and the collector that folds a request's StreamChunks into
a Completion."""

from __future__ import annotations

import time

import msgspec

from runtime import protocol as p


class Choice(msgspec.Struct, kw_only=True):
    """One completion: text, token_ids, finish_reason, logprobs (aligned with token_ids when asked for); score: a
    beam search completion's length-penalised cumulative logprob (use_beam_search: choices come best first)."""

    index: int
    text: str = ""
    token_ids: list[int] = msgspec.field(default_factory=list)
    finish_reason: str | None = None
    logprobs: list[p.TokenLogprobs | None] | None = None
    usage: p.Usage | None = None
    score: float | None = None


class Completion(msgspec.Struct, kw_only=True):
    """The result of generate(): choices (n of them, by index); text / token_ids / finish_reason are choice 0's.

    usage: prompt_tokens and cached_tokens of the prompt, completion_tokens summed over the choices.
    ttft_s: seconds from sending the request to the first chunk with tokens.
    """

    rid: str
    choices: list[Choice]
    usage: p.Usage
    ttft_s: float

    @property
    def text(self) -> str:
        return self.choices[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.choices[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.choices[0].finish_reason


class _Collector:
    """Folds the StreamChunks of one request into a Completion."""

    def __init__(self, rid: str, n: int, start: float) -> None:
        self.rid, self.start = rid, start
        self.choices = [Choice(index=i) for i in range(n)]
        self.ttft_s = -1.0

    def add(self, chunk: p.StreamChunk) -> bool:
        """Folds chunk in; True when every choice has finished."""
        if self.ttft_s < 0 and chunk.token_ids:
            self.ttft_s = time.perf_counter() - self.start
        c = self.choices[chunk.index]
        c.text += chunk.text
        c.token_ids.extend(chunk.token_ids)
        if chunk.logprobs is not None:  # appended: O(1) per token over many chunks
            if c.logprobs is None:
                c.logprobs = []
            c.logprobs.extend(chunk.logprobs)
        if chunk.finish_reason is not None:
            c.finish_reason, c.usage, c.score = chunk.finish_reason, chunk.usage, chunk.score
        return all(c.finish_reason is not None for c in self.choices)

    def result(self) -> Completion:
        usages = [c.usage for c in self.choices if c.usage is not None]
        first = usages[0] if usages else p.Usage(0, 0, 0)
        usage = p.Usage(
            first.prompt_tokens,
            first.cached_tokens,
            sum(u.completion_tokens for u in usages),
            first.queue_time_s,
            first.host_cached_tokens,
        )
        return Completion(rid=self.rid, choices=self.choices, usage=usage, ttft_s=max(self.ttft_s, 0.0))
