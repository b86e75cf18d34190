"""Text side of serving: incremental detokenization, stop strings with hold-back, the one CompletionStream, and
chat-template application.

Detokenizer and StopChecker (runtime.stop_strings) are plain per-completion classes with no torch and no sockets.
CompletionStream combines them into the one text path of a completion (text, token_ids, logprobs, finish_reason, the
keep_tokens the scheduler is told): the Engine uses it in process, the tokenizer process wraps it around its ZeroMQ
loop.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from runtime.prompt_check import check_prompt_chars
from runtime.protocol import TokenLogprobs, TokenOutput, Usage
from runtime.stop_strings import StopChecker

if TYPE_CHECKING:
    from runtime.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

REPLACEMENT_CHAR = "\ufffd"


class PromptError(ValueError):
    """A prompt the server will not tokenize (maps to ERR_INVALID; the message says why): text over the character
    limit, text that is not valid Unicode, token ids that are not integers, or a failed chat template."""


class ChatTemplateError(PromptError):
    """The tokenizer has no chat template, or the messages are malformed (the message says which)."""


class Detokenizer:
    """Incremental detokenization of one completion, safe across multi-byte characters split over tokens.

    With a fast tokenizer (one exposing `backend_tokenizer`) this uses tokenizers' `DecodeStream`, which buffers
    tokens until they decode to valid UTF-8. Otherwise it decodes a sliding window (the prefix/read offset scheme of
    Hugging Face's TextStreamer): text is emitted only when the window's decoding does not end in U+FFFD.
    Either way `text` always equals `tokenizer.decode(token_ids, skip_special_tokens=...)` once every pending
    multi-byte sequence is complete, and never contains a replacement character that a later token would fix.

    State (mutated by step):
        text: the completion text emitted so far (str).
        token_ends: token_ends[i] = len(text) after token i was fed (characters); tokens that complete nothing
            (a partial multi-byte character, a skipped special token) repeat the previous value.
    """

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self.text = ""
        self.token_ends: list[int] = []
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._backend = backend
        if backend is not None:
            from tokenizers.decoders import DecodeStream

            self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        else:
            self._ids: list[int] = []
            self._prefix_offset = 0
            self._read_offset = 0

    def step(self, token_ids: Sequence[int], hidden: frozenset[int] = frozenset()) -> str:
        """Feed new token ids (O(1) amortized per token); returns the newly decodable text ("" if none yet).

        hidden: ids that add no text (EOS, stop token ids): they get a token_ends entry but are never decoded.
        Mutates text and token_ends (one entry per token fed, hidden ones included).
        """
        out: list[str] = []
        for tid in token_ids:
            chunk = "" if tid in hidden else self._step_one(int(tid))
            if chunk:
                out.append(chunk)
                self.text += chunk
            self.token_ends.append(len(self.text))
        return "".join(out)

    def _step_one(self, tid: int) -> str:
        if self._backend is not None:
            return self._stream.step(self._backend, tid) or ""
        self._ids.append(tid)
        decode = self._tokenizer.decode
        prefix = decode(self._ids[self._prefix_offset : self._read_offset], skip_special_tokens=self._skip)
        window = decode(self._ids[self._prefix_offset :], skip_special_tokens=self._skip)
        if len(window) > len(prefix) and not window.endswith(REPLACEMENT_CHAR):
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
            return window[len(prefix) :]
        return ""


class CompletionDelta(NamedTuple):
    """What CompletionStream.feed releases to the client: the next StreamChunk's fields, plus an order for the
    scheduler.

    text / token_ids / logprobs: new since the previous delta (logprobs aligned with token_ids, None when the request
        asked for none). finish_reason: set once, on the last delta. usage: set with finish_reason (prompt and cached
        tokens as the scheduler reported them; completion_tokens = len(CompletionStream.token_ids)).
    stop_keep_tokens: set when a stop string ended the completion while the scheduler still runs it: the caller must
        tell the scheduler to finish it keeping this many completion tokens (Scheduler.stop / protocol.Stop).
    """

    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None] | None
    finish_reason: str | None
    usage: Usage | None
    stop_keep_tokens: int | None

    @property
    def empty(self) -> bool:
        """True when there is nothing to send (no text, no token, not the last delta)."""
        return not self.text and not self.token_ids and self.finish_reason is None


class CompletionStream:
    """One completion's text path, fed the scheduler's TokenOutputs; the Engine and the tokenizer process both use it.

    The rule for EOS, stop token ids and stop strings:
        - EOS (any of eos_token_ids, unless params.ignore_eos) and params.stop_token_ids: the scheduler ends the
          completion on the id with finish_reason "stop". The id stays in token_ids (it was generated and counts as a
          completion token) and adds no text, special token or not. Nothing is told to the scheduler.
        - A stop string (params.stop): finish_reason "stop"; text ends right before the stop string's first
          occurrence, even when it begins inside a token; token_ids (and logprobs) keep the fewest tokens whose text
          covers that text (StopChecker: the token in which the stop string begins is kept; an EOS / stop id after it
          is dropped); while the scheduler still runs the completion, the delta's stop_keep_tokens says how many
          tokens it must keep (it caches no block past them). A stop string found in the step the scheduler finished
          the completion ("length", EOS) still wins: "stop", truncated.
        - Otherwise ("length", "abort"): text and token_ids are everything generated; held-back text is released.
        - Special tokens are skipped in text. Without a tokenizer text is "" and stop strings are not applied.
        - Streaming: a delta releases the text that can no longer begin a stop string and the token ids a later stop
          string can no longer drop, so streamed token_ids never pass the final ones; the deltas concatenated equal
          the final text, token_ids and logprobs.

    State: token_ids, logprobs (appended, O(1) per token), text (property), finish_reason, usage (the latest usage the
    scheduler reported). Mutated only by feed.
    """

    def __init__(self, tokenizer: Any, params: SamplingParams, eos_token_ids: Sequence[int] = ()) -> None:
        self._hidden = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else
                                                           frozenset(eos_token_ids))  # fmt: skip
        self._detok = Detokenizer(tokenizer) if tokenizer is not None else None
        self._stop = StopChecker(params.stop) if params.stop and tokenizer is not None else None
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprobs | None] | None = [] if params.logprobs is not None else None
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
        are ignored: an empty delta. Mutates token_ids, logprobs, text, finish_reason, usage.
        """
        if self.finish_reason is not None:
            return CompletionDelta("", [], None, None, None, None)
        if out.usage is not None:
            self.usage = out.usage
        ids = out.token_ids
        self.token_ids.extend(ids)
        if self.logprobs is not None:
            self.logprobs.extend(out.logprobs if out.logprobs is not None else [None] * len(ids))
        finish, keep, start = out.finish_reason, None, self._end
        detok = self._detok
        if detok is not None:
            if ids:
                detok.step(ids, self._hidden)
            if self._stop is None:
                self._end = len(detok.text)
            else:
                check = self._stop.update(detok.text, detok.token_ends)
                self._end += len(check.new_text)
                if check.stopped:
                    del self.token_ids[check.keep_tokens :]
                    if self.logprobs is not None:
                        del self.logprobs[check.keep_tokens :]
                    keep = check.keep_tokens if finish is None else None
                    finish = "stop"
                elif finish is not None:
                    self._end += len(self._stop.flush(detok.text))
        release = len(self.token_ids) if finish is not None else self._releasable()
        sent, self._sent = self._sent, max(self._sent, release)
        usage = None
        if finish is not None:
            self.finish_reason = finish
            u = self.usage or Usage(0, 0, 0)
            usage = Usage(u.prompt_tokens, u.cached_tokens, len(self.token_ids), u.queue_time_s, u.host_cached_tokens)
        text = detok.text[start : self._end] if detok is not None else ""
        logprobs = self.logprobs[sent : self._sent] if self.logprobs is not None else None
        return CompletionDelta(text, self.token_ids[sent : self._sent], logprobs, finish, usage, keep)

    def _releasable(self) -> int:
        """How many token ids no later stop string can drop: all without stop strings; with them, the tokens whose
        text is released, but none a stop string at the released end would not keep (StopChecker's keep rule)."""
        if self._stop is None or self._detok is None:
            return len(self.token_ids)
        if self._end == 0:
            return 0
        ends = self._detok.token_ends
        return min(bisect.bisect_right(ends, self._end), bisect.bisect_left(ends, self._end) + 1)


def apply_chat_template(
    tokenizer: Any, messages: list[dict[str, Any]], add_generation_prompt: bool = True
) -> list[int]:
    """Render `messages` with the tokenizer's chat template and tokenize the result.

    Args:
        tokenizer: a transformers tokenizer with a chat template (runtime.model.loader.load_tokenizer).
        messages: [{"role": "system" | "user" | "assistant", "content": str}, ...].
        add_generation_prompt: append the assistant turn header so the model answers.
    Returns:
        the prompt token ids (list[int]); the template's own special tokens are kept, none are added twice.
    Raises:
        ChatTemplateError: no chat template, or a message without role/content.
    """
    if getattr(tokenizer, "chat_template", None) is None:
        raise ChatTemplateError("the tokenizer has no chat template; pass prompts or input_ids instead")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise ChatTemplateError(f"message {i} must be a dict with 'role' and 'content', got {m!r}")
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    return encode_text(tokenizer, text, add_special_tokens=False)


def encode_text(tokenizer: Any, text: Any, add_special_tokens: bool = True) -> list[int]:
    """tokenizer.encode(text, add_special_tokens=...) as a list, holding the GIL for ~20 ms at most per call.

    A fast tokenizer in its plain state (no truncation, no padding, special tokens as transformers would treat them)
    goes through the Rust encoder's encode_batch_fast: the same ids, and no offsets, so that neither the encoding nor
    freeing it holds the GIL for long (with transformers' encode, freeing a 260k-character prompt's Encoding held it
    ~100-200 ms; the tokenizer process encodes on a worker thread and its loop must keep running). Anything else goes
    through tokenizer.encode. Raises what the tokenizer raises (TypeError / ValueError for text it cannot encode).
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    fast = getattr(backend, "encode_batch_fast", None)
    plain = backend is not None and backend.truncation is None and backend.padding is None and (
        backend.encode_special_tokens == bool(getattr(tokenizer, "split_special_tokens", False)))  # fmt: skip
    if fast is None or not plain or not isinstance(text, str):
        return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))
    return list(fast([text], add_special_tokens=add_special_tokens)[0].ids)


def encode_prompt(tokenizer: Any, prompt: str | None = None, messages: Sequence[Any] | None = None,
                  input_ids: Sequence[int] | None = None, *, max_chars: int | None = None) -> list[int]:  # fmt: skip
    """A request's prompt token ids, the one way the tokenizer process, the router and the Engine compute them.

    Args:
        tokenizer: a transformers tokenizer (unused for input_ids; may then be None).
        prompt / messages / input_ids: exactly one is set (runtime.protocol.input_problem checks that first).
            messages: dicts or ChatMessage structs with role and content; the chat template is applied.
        max_chars: the most characters of prompt text (all messages' roles and contents together) to tokenize
            (runtime.prompt_check.prompt_char_limit); checked before any tokenizing or rendering. None: no limit.
    Returns:
        the token ids (list[int]): input_ids as given, the template's ids, or the prompt text encoded.
    Raises:
        PromptError (maps to ERR_INVALID): text over max_chars ("prompt too long: ..." / "messages too long: ..."),
            text that is not valid Unicode (a lone surrogate), input_ids that are not integers, text the tokenizer
            rejects; its subclass ChatTemplateError: "chat template failed: ..." (no template, a bad message, the
            template raised).
    Cost: O(characters) for the checks, then the tokenizer's own cost (which max_chars bounds).
    """
    if input_ids is not None:
        try:
            return [int(t) for t in input_ids]
        except (TypeError, ValueError) as exc:
            raise PromptError(f"input_ids must be integers: {exc}") from None
    problem = check_prompt_chars(prompt, messages, max_chars)
    if problem is not None:
        raise PromptError(problem.message)
    if messages is not None:
        turns = [_turn(i, m) for i, m in enumerate(messages)]
        try:
            return apply_chat_template(tokenizer, turns)
        except (ChatTemplateError, ValueError, TypeError) as exc:
            raise ChatTemplateError(f"chat template failed: {exc}") from None
    _check_text("prompt", prompt)
    try:
        return encode_text(tokenizer, prompt)
    except (TypeError, ValueError) as exc:  # e.g. a prompt that is not a str (the Engine is called in process)
        raise PromptError(f"the tokenizer cannot encode the prompt: {exc}") from None


def _turn(i: int, m: Any) -> Any:
    """One message as the chat template takes it (a dict), its text checked; anything else is passed on for
    apply_chat_template to reject."""
    if not isinstance(m, dict):
        if not (hasattr(m, "role") and hasattr(m, "content")):
            return m
        m = {"role": m.role, "content": m.content}
    for field in ("role", "content"):
        _check_text(f"message {i} {field}", m.get(field))
    return m


def _check_text(what: str, text: Any) -> None:
    """Raises PromptError when text (a str) cannot be encoded as UTF-8 (a lone surrogate). O(len(text))."""
    if isinstance(text, str) and not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise PromptError(f"{what} is not valid Unicode text: {exc.reason} (character {exc.start})") from None
