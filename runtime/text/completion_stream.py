"""The one text path of a completion: CompletionStream combines the Detokenizer and the StopChecker into text,
token_ids, logprobs (with the texts of their tokens), finish_reason and the keep_tokens the scheduler is told. The
Engine uses it in process; the tokenizer process wraps it around its ZeroMQ loop."""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from runtime.protocol import PromptLogprobs, TokenLogprobs, TokenOutput, TokenText, Usage
from runtime.text.detokenizer import Detokenizer
from runtime.text.stop_strings import StopChecker
from runtime.text.token_text import TokenTextCache

if TYPE_CHECKING:
    from runtime.sampling_params import SamplingParams


class CompletionDelta(NamedTuple):
    """What CompletionStream.feed releases to the client: the next StreamChunk's fields, plus an order for the
    scheduler.

    text / token_ids / logprobs: new since the previous delta (logprobs aligned with token_ids, None when the request
        asked for none). token_texts: aligned with token_ids when the request asked for logprobs and there is a
        tokenizer (each token's TokenText), else None. finish_reason: set once, on the last delta. usage: prompt and
        cached tokens as the scheduler reported them (None until it did), completion_tokens the tokens released so
        far (on the last delta: len(CompletionStream.token_ids)).
    stop_keep_tokens: set when a stop string ended the completion while the scheduler still runs it: the caller must
        tell the scheduler to finish it keeping this many completion tokens (Scheduler.stop / protocol.Stop).
    prompt_logprobs / prompt_token_texts: the prompt logprobs that came with this output (SamplingParams.
        prompt_logprobs, completion 0 only) and, with a tokenizer, the TokenText of each of their tokens.
    """

    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None] | None
    token_texts: list[TokenText] | None
    finish_reason: str | None
    usage: Usage | None
    stop_keep_tokens: int | None
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_texts: list[TokenText] | None = None

    @property
    def empty(self) -> bool:
        """True when there is nothing to send (no text, no token, no prompt logprobs, not the last delta)."""
        return not self.text and not self.token_ids and self.finish_reason is None and self.prompt_logprobs is None


class CompletionStream:
    """One completion's text path, fed the scheduler's TokenOutputs; the Engine and the tokenizer process both use it.

    The rule for EOS, stop token ids and stop strings:
        - EOS (any of eos_token_ids, unless params.ignore_eos) and params.stop_token_ids: the scheduler ends the
          completion on the id with finish_reason "stop". The id stays in token_ids (it was generated and counts as a
          completion token) and adds no text, special token or not. Nothing is told to the scheduler.
        - A stop string (params.stop): finish_reason "stop"; text ends right before the stop string's first
          occurrence after the text of the first params.min_tokens tokens, even when it begins inside a token;
          token_ids (and logprobs) keep the fewest tokens whose text covers that text (StopChecker: the token in
          which the stop string begins is kept; an EOS / stop id after it is dropped); while the scheduler still
          runs the completion, the delta's stop_keep_tokens says how many tokens it must keep (it caches no block
          past them). A stop string found in the step the scheduler finished
          the completion ("length", EOS) still wins: "stop", truncated.
        - Otherwise ("length", "abort"): text and token_ids are everything generated; held-back text is released.
        - Special tokens are skipped in text. Without a tokenizer text is "" and stop strings are not applied.
        - Logprobs (params.logprobs set): each token keeps its TokenLogprobs (None for one that came without) and,
          with a tokenizer, its TokenText (texts: the shared TokenTextCache; None: one of its own); a stop string
          drops both with the token.
        - Streaming: a delta releases the text that can no longer begin a stop string and the token ids a later stop
          string can no longer drop, so streamed token_ids never pass the final ones; the deltas concatenated equal
          the final text, token_ids, logprobs and token_texts.

    State: token_ids, logprobs, token_texts (appended, O(1 + alternatives) per token), text (property),
    finish_reason, usage (the latest usage the scheduler reported). Mutated only by feed (texts too: its cache).
    """

    def __init__(
        self,
        tokenizer: Any,
        params: SamplingParams,
        eos_token_ids: Sequence[int] = (),
        texts: TokenTextCache | None = None,
    ) -> None:
        self._hidden = frozenset(params.stop_token_ids) | (
            frozenset() if params.ignore_eos else frozenset(eos_token_ids)
        )
        self._detok = Detokenizer(tokenizer) if tokenizer is not None else None
        self._stop = StopChecker(params.stop) if params.stop and tokenizer is not None else None
        self._min_tokens = params.min_tokens  # stop strings only in the text after this many tokens (vLLM's rule)
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprobs | None] | None = [] if params.logprobs is not None else None
        self._texts: TokenTextCache | None = None
        self.token_texts: list[TokenText] | None = None
        wants_texts = params.logprobs is not None or params.prompt_logprobs is not None
        if wants_texts and tokenizer is not None:
            self._texts = texts if texts is not None else TokenTextCache(tokenizer)
            self.token_texts = [] if params.logprobs is not None else None
        self.prompt_logprobs: PromptLogprobs | None = None  # every position so far (start 0), once some came
        self.prompt_token_texts: list[TokenText] | None = None
        self.finish_reason: str | None = None
        self.usage: Usage | None = None
        self._end = 0  # characters of the decoded text released (a stop string's start once stopped)
        self._sent = 0  # token ids released

    @property
    def text(self) -> str:
        """The completion text released so far (the final text once finish_reason is set)."""
        return self._detok.text[: self._end] if self._detok is not None else ""

    def feed(self, out: TokenOutput) -> CompletionDelta:
        """Apply one scheduler delta of this completion (O(new tokens + new characters)); returns what may be sent.

        After the completion finished (finish_reason set), later deltas (the scheduler's own end after a stop string)
        are ignored: an empty delta. Mutates token_ids, logprobs, token_texts, text, finish_reason, usage.
        """
        if self.finish_reason is not None:
            return CompletionDelta("", [], None, None, None, None, None)
        if out.usage is not None:
            self.usage = out.usage
        prompt_texts = self._add_prompt_logprobs(out.prompt_logprobs)
        ids = out.token_ids
        self.token_ids.extend(ids)
        if self.logprobs is not None:
            new_logprobs = out.logprobs if out.logprobs is not None else [None] * len(ids)
            self.logprobs.extend(new_logprobs)
            if self._texts is not None and self.token_texts is not None:
                self.token_texts.extend(map(self._texts.token_text, ids, new_logprobs))
        finish = out.finish_reason
        keep = None
        start = self._end
        detok = self._detok
        if detok is not None:
            if ids:
                detok.step(ids, self._hidden)
            if self._stop is not None and self._min_tokens:
                self._skip_min_tokens(detok.token_ends)
            if self._stop is None or len(self.token_ids) <= self._min_tokens:
                self._end = len(detok.text)
            else:
                check = self._stop.update(detok.text, detok.token_ends)
                self._end += len(check.new_text)
                if check.stopped:
                    del self.token_ids[check.keep_tokens :]
                    if self.logprobs is not None:
                        del self.logprobs[check.keep_tokens :]
                    if self.token_texts is not None:
                        del self.token_texts[check.keep_tokens :]
                    keep = check.keep_tokens if finish is None else None
                    finish = "stop"
                elif finish is not None:
                    self._end += len(self._stop.flush(detok.text))
        release = len(self.token_ids) if finish is not None else self._releasable()
        sent = self._sent
        self._sent = max(sent, release)
        usage = None
        if finish is not None:
            self.finish_reason = finish
            u = self.usage or Usage(0, 0, 0)
            usage = Usage(u.prompt_tokens, u.cached_tokens, len(self.token_ids), u.queue_time_s, u.host_cached_tokens)
        elif self.usage is not None:  # the running usage (vLLM's continuous_usage_stats reads it)
            u = self.usage
            usage = Usage(u.prompt_tokens, u.cached_tokens, self._sent, u.queue_time_s, u.host_cached_tokens)
        text = detok.text[start : self._end] if detok is not None else ""
        logprobs = self.logprobs[sent : self._sent] if self.logprobs is not None else None
        token_texts = self.token_texts[sent : self._sent] if self.token_texts is not None else None
        new_ids = self.token_ids[sent : self._sent]
        prompt = out.prompt_logprobs
        return CompletionDelta(text, new_ids, logprobs, token_texts, finish, usage, keep, prompt, prompt_texts)

    def _add_prompt_logprobs(self, new: PromptLogprobs | None) -> list[TokenText] | None:
        """Append new (the next prompt positions) to prompt_logprobs and their texts to prompt_token_texts; returns
        the new texts (None without a tokenizer or without new). O(len(new.token_ids) x (1 + alternatives))."""
        if new is None:
            return None
        if self.prompt_logprobs is None:
            self.prompt_logprobs = PromptLogprobs(0, [], [], [])
            self.prompt_token_texts = [] if self._texts is not None else None
        self.prompt_logprobs.token_ids.extend(new.token_ids)
        self.prompt_logprobs.logprobs.extend(new.logprobs)
        self.prompt_logprobs.ranks.extend(new.ranks)
        if self._texts is None or self.prompt_token_texts is None:
            return None
        texts = list(map(self._texts.token_text, new.token_ids, new.logprobs))
        self.prompt_token_texts.extend(texts)
        return texts

    def _skip_min_tokens(self, token_ends: Sequence[int]) -> None:
        """Once more than min_tokens tokens exist, start the stop check after the text of the first min_tokens of
        them (before that, feed releases all text and checks nothing). vLLM checks its stop strings only once
        min_tokens is passed, too; it also finds one that begins before that point and ends after it, which this
        check does not."""
        if len(self.token_ids) > self._min_tokens and self._stop is not None:
            base = token_ends[self._min_tokens - 1]
            self._stop.skip_to(base)
            self._end = max(self._end, base)
            self._min_tokens = 0

    def _releasable(self) -> int:
        """How many token ids no later stop string can drop: all without stop strings; with them, the tokens whose
        text is released, but none a stop string at the released end would not keep (StopChecker's keep rule)."""
        if self._stop is None or self._detok is None:
            return len(self.token_ids)
        if self._end == 0:
            return 0
        ends = self._detok.token_ends
        return min(bisect.bisect_right(ends, self._end), bisect.bisect_left(ends, self._end) + 1)
