"""What a request returns, whoever serves it: Choice (one completion) and Completion (the request), and the one fold
of a request's StreamChunks into them, CompletionFold. The client (generate / result), the Engine (generate / result
/ abort) and the HTTP server (non-streamed answers, usage) all fold with CompletionFold, so text, token_ids, logprobs,
token_texts, finish_reason, score and usage cannot drift between them. No sockets and no clock: the Engine imports
it without zmq, and each caller passes the time a chunk arrived."""

from __future__ import annotations

from typing import TypeVar

import msgspec

from runtime import protocol as p

T = TypeVar("T")


class Choice(msgspec.Struct, kw_only=True):
    """One completion: text, token_ids, finish_reason ("stop", "length", "abort"), logprobs (aligned with token_ids,
    one entry per token, None for a token that came without one; None when no chunk carried logprobs), token_texts
    (each token's TokenText, aligned the same way, from the chunks' token_texts), usage (this completion's, from its
    last chunk), score: a beam search completion's length-penalised cumulative logprob (use_beam_search: choices come
    best first), else None."""

    index: int
    text: str = ""
    token_ids: list[int] = msgspec.field(default_factory=list)
    finish_reason: str | None = None
    logprobs: list[p.TokenLogprobs | None] | None = None
    token_texts: list[p.TokenText | None] | None = None
    usage: p.Usage | None = None
    score: float | None = None


class Completion(msgspec.Struct, kw_only=True):
    """The result of a client's generate(): choices (n of them, by index); text / token_ids / finish_reason are
    choice 0's.

    usage: CompletionFold.usage() (every field of the prompt's usage, completion_tokens summed over the choices).
    ttft_s: seconds from sending the request to the first chunk with tokens (0.0 when no chunk had any).
    prompt_logprobs / prompt_token_texts: the prompt's logprobs from position 0 (SamplingParams.prompt_logprobs;
    CompletionFold.prompt_logprobs), None when not asked.
    """

    rid: str
    choices: list[Choice]
    usage: p.Usage
    ttft_s: float
    prompt_logprobs: p.PromptLogprobs | None = None
    prompt_token_texts: list[p.TokenText] | None = None

    @property
    def text(self) -> str:
        return self.choices[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.choices[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.choices[0].finish_reason


class _Parts:
    """One completion as it accumulates: its text as pieces (joined once: O(total length), not O(n^2) over many
    chunks), token ids, logprobs and token texts appended."""

    def __init__(self) -> None:
        self.texts: list[str] = []
        self.num_chars = 0
        self.token_ids: list[int] = []
        self.logprobs: list[p.TokenLogprobs | None] | None = None
        self.token_texts: list[p.TokenText | None] | None = None
        self.finish_reason: str | None = None
        self.usage: p.Usage | None = None
        self.score: float | None = None


class CompletionFold:
    """Folds the StreamChunks of one request (n completions, their chunks interleaved in any order) into its Choices,
    its Usage and its time to first token.

    The rules, per completion (StreamChunk.index): text is the chunks' texts concatenated, token_ids their token ids;
    logprobs stay None until a chunk carries some, and from then on are kept aligned with token_ids (a chunk without
    logprobs adds one None per token id, and the tokens before the first chunk with logprobs get None each); so are
    token_texts (the same rule, on the chunks' token_texts);
    finish_reason, usage and score are those of the completion's last chunk (the one with finish_reason). The
    request's usage: see usage(). prompt_logprobs (and prompt_token_texts): the request's prompt positions from 0,
    folded from whichever chunks carry them (None while none did). Time to first token: from start to the `now` of
    the first chunk with token ids.
    Mutated only by add(); O(1) per token (amortised) and O(total text) for choices().
    """

    def __init__(self, n: int, start: float) -> None:
        """n: the request's completions (SamplingParams.n); start: when the request was sent, on the clock the
        caller passes to add() (seconds)."""
        self.start = start
        self.first_token_at: float | None = None
        self._parts = [_Parts() for _ in range(n)]
        self._left = n  # completions not finished yet
        self.prompt_logprobs: p.PromptLogprobs | None = None
        self.prompt_token_texts: list[p.TokenText] | None = None

    @property
    def done(self) -> bool:
        """True once every completion has had its last chunk."""
        return self._left == 0

    @property
    def ttft_s(self) -> float | None:
        """Seconds from start to the first chunk with token ids; None while (or if) no chunk had any."""
        if self.first_token_at is None:
            return None
        return self.first_token_at - self.start

    def add(self, chunk: p.StreamChunk, now: float) -> bool:
        """Folds chunk in (now: when it arrived); returns done. O(len(chunk)). Raises IndexError for an index
        outside [0, n)."""
        parts = self._parts[chunk.index]
        if chunk.prompt_logprobs is not None:
            self._add_prompt(chunk.prompt_logprobs.logprobs, chunk.prompt_logprobs.token_texts)
        if chunk.token_ids and self.first_token_at is None:
            self.first_token_at = now
        if chunk.text:
            parts.texts.append(chunk.text)
            parts.num_chars += len(chunk.text)
        parts.logprobs = _aligned(parts.logprobs, chunk.logprobs, len(parts.token_ids), len(chunk.token_ids))
        parts.token_texts = _aligned(parts.token_texts, chunk.token_texts, len(parts.token_ids), len(chunk.token_ids))
        parts.token_ids.extend(chunk.token_ids)
        if chunk.finish_reason is not None:
            if parts.finish_reason is None:
                self._left -= 1
            parts.finish_reason = chunk.finish_reason
            parts.usage = chunk.usage
            parts.score = chunk.score
        return self.done

    def _add_prompt(self, new: p.PromptLogprobs, texts: list[p.TokenText] | None) -> None:
        """Append the positions of new past those folded already (a streamed chunk brings the next ones, a
        non-streamed one all of them), and their texts when they came with them. O(len(new.token_ids))."""
        if self.prompt_logprobs is None:
            self.prompt_logprobs = p.PromptLogprobs(0, [], [], [])
            self.prompt_token_texts = [] if texts is not None else None
        folded = self.prompt_logprobs
        skip = len(folded.token_ids) - new.start
        if skip < 0:
            raise ValueError(f"prompt logprobs from position {new.start}, {len(folded.token_ids)} folded so far")
        folded.token_ids.extend(new.token_ids[skip:])
        folded.logprobs.extend(new.logprobs[skip:])
        folded.ranks.extend(new.ranks[skip:])
        if self.prompt_token_texts is not None and texts is not None:
            self.prompt_token_texts.extend(texts[skip:])

    def num_chars(self, index: int) -> int:
        """Characters of completion index's text so far (the offset of the next chunk's text)."""
        return self._parts[index].num_chars

    def choices(self) -> list[Choice]:
        """Every completion so far as a Choice, by index (the token_ids, logprobs and token_texts lists are the fold's
        own: take them once the fold is done)."""
        return [
            Choice(
                index=i,
                text="".join(parts.texts),
                token_ids=parts.token_ids,
                finish_reason=parts.finish_reason,
                logprobs=parts.logprobs,
                token_texts=parts.token_texts,
                usage=parts.usage,
                score=parts.score,
            )
            for i, parts in enumerate(self._parts)
        ]

    def usage(self) -> p.Usage:
        """The request's usage: prompt_tokens, cached_tokens, queue_time_s and host_cached_tokens of the prompt (from
        the first completion, by index, that has finished with a usage: the prompt is shared by every completion),
        completion_tokens summed over the finished completions. Usage(0, 0, 0) before any completion finished."""
        usages = [parts.usage for parts in self._parts if parts.usage is not None]
        if not usages:
            return p.Usage(0, 0, 0)
        first = usages[0]
        return p.Usage(
            first.prompt_tokens,
            first.cached_tokens,
            sum(u.completion_tokens for u in usages),
            first.queue_time_s,
            first.host_cached_tokens,
        )

    def completion(self, rid: str) -> Completion:
        """The client's Completion of request rid (ttft_s 0.0 when no chunk had token ids)."""
        ttft = self.ttft_s
        return Completion(
            rid=rid,
            choices=self.choices(),
            usage=self.usage(),
            ttft_s=0.0 if ttft is None else ttft,
            prompt_logprobs=self.prompt_logprobs,
            prompt_token_texts=self.prompt_token_texts,
        )


def _aligned(
    folded: list[T | None] | None, new: list[T] | list[T | None] | None, before: int, count: int
) -> list[T | None] | None:
    """A per-token list of the fold (logprobs, token_texts) after a chunk of count tokens whose own list is new:
    None while no chunk carried one; once one did, one entry per token id (None for the `before` tokens folded
    earlier without one, and for each token of a chunk without one). Extends folded in place. O(count)."""
    if new is None and folded is None:
        return None
    if folded is None:
        folded = [None] * before  # the tokens before came without one
    if new is None:
        folded.extend([None] * count)
    else:
        folded.extend(new)
    return folded
