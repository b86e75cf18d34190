"""SamplingParams: how one request is decoded. Plain msgspec Struct, no torch, validated at construction.

Every field is bounded to what the code below it can represent: each int that reaches a torch tensor fits int32,
every float is finite and survives float32, and the stop conditions a request may bring are limited in number and
size, so one request can neither overflow a step's tensors nor make every stream's per-token stop check expensive.
The limits are the module constants below.
"""

from __future__ import annotations

import math

import msgspec

from runtime.structured_outputs import StructuredOutputs

INT32_MAX = 2**31 - 1  # largest max_tokens, top_k and stop token id: each fits the int32/int64 tensors it reaches
SEED_LIMIT = 2**63  # seed in [-SEED_LIMIT, SEED_LIMIT) (any int64): its two's-complement 64-bit word seeds the draw
MAX_N = 64  # completions per prompt
MAX_LOGPROBS = 20  # top alternatives returned per token
MAX_TEMPERATURE = 1e4  # finite in float32; above it a distribution whose logits span < 100 is within 1% of uniform
GREEDY_TEMPERATURE = 1e-5  # 0 <= temperature < this is greedy (vLLM's _SAMPLING_EPS): logits / t overflow float32
MAX_STOP_STRINGS = 64  # stop strings per request
MAX_STOP_CHARS = 4096  # total characters over a request's stop strings
MAX_STOP_TOKEN_IDS = 1024  # stop token ids per request
MAX_FREQUENCY_PENALTY = 2.0  # frequency_penalty and presence_penalty in [-2, 2]: the OpenAI API's range
MAX_PRESENCE_PENALTY = 2.0
MAX_REPETITION_PENALTY = 10.0  # repetition_penalty in [1/10, 10]: scales a logit by at most 10x either way
MIN_REPETITION_PENALTY = 1.0 / MAX_REPETITION_PENALTY
MIN_BEAM_WIDTH = 2  # beam search: n beams in [MIN_BEAM_WIDTH, MAX_BEAM_WIDTH]
MAX_BEAM_WIDTH = 16
MAX_LENGTH_PENALTY = 10.0  # length_penalty in [-10, 10]: length ** 10 of a 2**31-token length is finite in float64
MAX_LOGIT_BIAS = 100.0  # logit_bias values in [-100, 100] (the OpenAI API's range)
MAX_LOGIT_BIAS_TOKENS = 1024  # logit_bias entries per request: the step's bias tensor stays small


class InvalidSamplingParams(ValueError):
    """A sampling parameter is out of range; the message names the field and the allowed range."""


class SamplingParams(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Decoding parameters of one request (one prompt; n completions).

    Fields (units), with the module constants that bound them:
        max_tokens: completion tokens to generate at most, in [1, INT32_MAX] (the scheduler also stops at the
            model's context); 0 only with prompt_logprobs set (scoring: the prompt runs, its logprobs come back, no
            token is generated; the completion finishes "length").
        min_tokens: completion tokens before EOS or a stop_token_ids id may end the completion, in [0, max_tokens]:
            the sampler masks those ids to -inf until then (vLLM's semantics), and stop strings are looked for only in
            the text after the first min_tokens tokens (runtime/text/completion_stream.py).
        logit_bias: token id -> a bias added to that token's logit before sampling (after the penalties), in
            [-MAX_LOGIT_BIAS, MAX_LOGIT_BIAS] = [-100, 100] (the OpenAI API's range: -100 bans a token in practice,
            +100 forces it), at most MAX_LOGIT_BIAS_TOKENS entries, each id in [0, INT32_MAX] (checked against the
            vocabulary where it is known: vocab_problem). Logprobs stay those of the raw logits.
        prompt_logprobs: when set, return each prompt token's logprob given the tokens before it, its rank, and this
            many top alternatives per prompt position (0..MAX_LOGPROBS; vLLM's prompt_logprobs). Such a request
            computes its whole prompt (it takes nothing from the prefix cache: cached blocks have no logits).
        temperature: softmax temperature, finite, in [0, MAX_TEMPERATURE]. Below GREEDY_TEMPERATURE (1e-5, 0
            included) decoding is greedy (argmax): `greedy` is True and the sampler never divides by it.
        top_k: keep the k most likely tokens: -1 or 0 for all, else in [1, INT32_MAX] (clamped to the vocabulary).
        top_p: keep the smallest set whose probability mass reaches top_p (0 < top_p <= 1).
        min_p: drop tokens whose probability is below min_p x the top probability (0 <= min_p <= 1).
        seed: per-request seed, any int64 in [-SEED_LIMIT, SEED_LIMIT) = [-2**63, 2**63); draws depend only on
            (seed, sample index, token index). A negative seed s draws as its two's-complement 64-bit word s + 2**64
            (seed_word), so every int64 is a distinct, reproducible seed.
        stop: stop strings (the text ends before the first one): at most MAX_STOP_STRINGS, each non-empty UTF-8
            text, MAX_STOP_CHARS characters in all.
        stop_token_ids: token ids that end the completion (the id is kept in token_ids, not in the text): at most
            MAX_STOP_TOKEN_IDS, each in [0, INT32_MAX].
        ignore_eos: keep generating past EOS until max_tokens.
        n: completions per prompt, in [1, MAX_N] (parallel sampling; the prompt is prefilled once).
        logprobs: when set, return the sampled token's logprob and this many top alternatives (0..MAX_LOGPROBS).
            They are the log-softmax of the raw logits, before penalties, temperature and filters (vLLM's default
            logprobs_mode "raw_logprobs").
        frequency_penalty: subtracted from a token's logit once per time the token occurs in this completion's
            output so far, in [-MAX_FREQUENCY_PENALTY, MAX_FREQUENCY_PENALTY] (0: off; negative favours repeats).
        presence_penalty: subtracted from the logit of every token that occurs in the output so far, in
            [-MAX_PRESENCE_PENALTY, MAX_PRESENCE_PENALTY] (0: off). Both as the OpenAI API and vLLM define them.
        repetition_penalty: CTRL's penalized sampling (Keskar et al. 2019) over the prompt and the output so far: a
            positive logit of a token seen there is divided by it, a negative one multiplied, in
            [MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY] = [0.1, 10] (1: off; > 1 discourages repeats). The
            bound keeps the scaled logit finite in float32 (vLLM accepts any value > 0: 1e-40 is 0 in float32 and a
            division by it gives inf).
        The penalties apply per completion, before temperature and the filters (so greedy decoding sees them too).
        use_beam_search: beam search of width n in [MIN_BEAM_WIDTH, MAX_BEAM_WIDTH] = [2, 16]
        (runtime/scheduler/beam_search.py): the n completions come back best first by score = cumulative logprob /
        completion_length ** length_penalty, as transformers' generate(num_beams=n, num_return_sequences=n,
        do_sample=False, early_stopping=True). Needs temperature 0; stop, stop_token_ids, logprobs and the penalties are
        not supported with it, nor logit_bias, min_tokens or prompt_logprobs (InvalidSamplingParams).
        length_penalty: the exponent above, finite, in [-MAX_LENGTH_PENALTY, MAX_LENGTH_PENALTY] (1: the average
            logprob; 0: the plain sum; only read by beam search).
        structured_outputs: the constraint the completion must satisfy (runtime/structured_outputs.py: a JSON
            schema, regex, choice, grammar, json_object or structural tag), or None. Each step the worker masks the
            tokens the grammar forbids (after the penalties, greedy and sampled rows alike); the grammar allows EOS
            exactly when the completion is complete, so a completed one ends with finish_reason "stop" (or "length"
            at max_tokens first). Not supported with use_beam_search, ignore_eos or min_tokens (InvalidSamplingParams).

    Raises:
        InvalidSamplingParams: on any value of the wrong type or outside the ranges above, naming the field (msgspec
            raises msgspec.ValidationError for wrong types when decoding from the wire).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    n: int = 1
    logprobs: int | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    use_beam_search: bool = False
    length_penalty: float = 1.0
    structured_outputs: StructuredOutputs | None = None
    min_tokens: int = 0
    logit_bias: dict[int, float] | None = None
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check every field; raises InvalidSamplingParams naming the first bad one. O(len(stop) + stop chars +
        len(stop_token_ids))."""
        if self.prompt_logprobs is not None:
            _check_int("prompt_logprobs", self.prompt_logprobs, 0, MAX_LOGPROBS)
        scoring = self.prompt_logprobs is not None
        _check_int("max_tokens", self.max_tokens, 0 if scoring else 1, INT32_MAX)
        _check_int("min_tokens", self.min_tokens, 0, self.max_tokens, f"[0, max_tokens={self.max_tokens}]")
        _check_logit_bias(self.logit_bias)
        _check_float("temperature", self.temperature, 0.0, MAX_TEMPERATURE)
        _check_top_k(self.top_k)
        _check_float("top_p", self.top_p, 0.0, 1.0, low_open=True)
        _check_float("min_p", self.min_p, 0.0, 1.0)
        if self.seed is not None:
            _check_int("seed", self.seed, -SEED_LIMIT, SEED_LIMIT - 1, "[-2**63, 2**63)")
        _check_int("n", self.n, 1, MAX_N)
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, 0, MAX_LOGPROBS)
        if not isinstance(self.ignore_eos, bool):
            raise InvalidSamplingParams(f"ignore_eos must be a bool, got {type(self.ignore_eos).__name__}")
        _check_stop(self.stop)
        _check_stop_token_ids(self.stop_token_ids)
        _check_float("frequency_penalty", self.frequency_penalty, -MAX_FREQUENCY_PENALTY, MAX_FREQUENCY_PENALTY)
        _check_float("presence_penalty", self.presence_penalty, -MAX_PRESENCE_PENALTY, MAX_PRESENCE_PENALTY)
        _check_float("repetition_penalty", self.repetition_penalty, MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY)
        _check_float("length_penalty", self.length_penalty, -MAX_LENGTH_PENALTY, MAX_LENGTH_PENALTY)
        if not isinstance(self.use_beam_search, bool):
            raise InvalidSamplingParams(f"use_beam_search must be a bool, got {type(self.use_beam_search).__name__}")
        if self.use_beam_search:
            _check_beam_search(self)
        if self.structured_outputs is not None:
            _check_structured_outputs(self)

    @property
    def greedy(self) -> bool:
        """True when decoding is argmax: temperature below GREEDY_TEMPERATURE (1e-5), 0 included."""
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def seed_word(self) -> int | None:
        """The seed as the unsigned 64-bit word the draws hash: seed mod 2**64 (a negative seed's two's complement);
        None without a seed."""
        return None if self.seed is None else self.seed & (2**64 - 1)

    def vocab_problem(self, vocab_size: int) -> str | None:
        """Why these params cannot run on a vocabulary of vocab_size ids (a logit_bias id outside [0, vocab_size)),
        or None. The tokenizer process and the scheduler call it, where the vocabulary is known. O(len(logit_bias))."""
        if self.logit_bias and max(self.logit_bias) >= vocab_size:
            bad = sorted(t for t in self.logit_bias if t >= vocab_size)[:8]
            return f"logit_bias token ids outside the vocabulary [0, {vocab_size}): {bad}"
        return None

    @property
    def has_penalties(self) -> bool:
        """True when any of frequency_penalty, presence_penalty, repetition_penalty is on (the worker then keeps the
        completion's token counts)."""
        return self.frequency_penalty != 0.0 or self.presence_penalty != 0.0 or self.repetition_penalty != 1.0


def _check_beam_search(p: SamplingParams) -> None:
    """The fields beam search needs or does not support (SamplingParams' docstring)."""
    if not MIN_BEAM_WIDTH <= p.n <= MAX_BEAM_WIDTH:
        raise InvalidSamplingParams(
            f"use_beam_search needs n (the beam width) in [{MIN_BEAM_WIDTH}, {MAX_BEAM_WIDTH}], got {p.n}"
        )
    if not p.greedy:
        raise InvalidSamplingParams(f"use_beam_search needs temperature 0, got {p.temperature}")
    unsupported = [
        name
        for name, on in (
            ("stop", bool(p.stop)),
            ("stop_token_ids", bool(p.stop_token_ids)),
            ("logprobs", p.logprobs is not None),
            ("penalties", p.has_penalties),
            ("logit_bias", bool(p.logit_bias)),
            ("min_tokens", p.min_tokens != 0),
            ("prompt_logprobs", p.prompt_logprobs is not None),
        )
        if on
    ]
    if unsupported:
        raise InvalidSamplingParams(f"use_beam_search does not support {', '.join(unsupported)}")


def _check_structured_outputs(p: SamplingParams) -> None:
    """structured_outputs is a StructuredOutputs, without the options it does not support (see SamplingParams)."""
    if not isinstance(p.structured_outputs, StructuredOutputs):
        raise InvalidSamplingParams(
            f"structured_outputs must be a StructuredOutputs, got {type(p.structured_outputs).__name__}"
        )
    if p.use_beam_search:
        raise InvalidSamplingParams("structured_outputs is not supported with use_beam_search")
    if p.ignore_eos:
        raise InvalidSamplingParams("structured_outputs is not supported with ignore_eos (the grammar ends with EOS)")
    if p.min_tokens:
        raise InvalidSamplingParams(
            "structured_outputs is not supported with min_tokens (the grammar ends with EOS, which min_tokens masks)"
        )


def _show(value: object) -> str:
    """A short repr for an error message (a Python int of thousands of digits cannot even be printed)."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        return f"an int of {value.bit_length()} bits"
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _check_int(name: str, value: object, low: int, high: int, shown: str | None = None) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidSamplingParams(f"{name} must be an int, got {type(value).__name__}")
    if not low <= value <= high:
        raise InvalidSamplingParams(f"{name} must be in {shown or f'[{low}, {high}]'}, got {_show(value)}")


def _check_float(name: str, value: object, low: float, high: float, low_open: bool = False) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise InvalidSamplingParams(f"{name} must be a number, got {type(value).__name__}")
    in_range = (
        (isinstance(value, float) or value.bit_length() <= 64)
        and math.isfinite(value)
        and (low < value <= high if low_open else low <= value <= high)
    )
    if not in_range:
        shown = f"{'(' if low_open else '['}{low:g}, {high:g}]"
        raise InvalidSamplingParams(f"{name} must be finite and in {shown}, got {_show(value)}")


def _check_top_k(top_k: object) -> None:
    if not isinstance(top_k, int) or isinstance(top_k, bool):
        raise InvalidSamplingParams(f"top_k must be an int, got {type(top_k).__name__}")
    if not -1 <= top_k <= INT32_MAX:
        raise InvalidSamplingParams(f"top_k must be -1, 0 (all tokens) or in [1, {INT32_MAX}], got {_show(top_k)}")


def _check_stop(stop: object) -> None:
    if not isinstance(stop, list):
        raise InvalidSamplingParams(f"stop must be a list of strings, got {type(stop).__name__}")
    if len(stop) > MAX_STOP_STRINGS:
        raise InvalidSamplingParams(f"stop has {len(stop)} strings, at most {MAX_STOP_STRINGS} are allowed")
    total = 0
    for i, s in enumerate(stop):
        if not isinstance(s, str) or s == "":
            raise InvalidSamplingParams(f"stop strings must be non-empty strings, stop[{i}] is {_show(s)}")
        if not s.isascii():
            try:
                s.encode("utf-8")
            except UnicodeEncodeError:
                raise InvalidSamplingParams(f"stop[{i}] is not valid UTF-8 text (a lone surrogate)") from None
        total += len(s)
    if total > MAX_STOP_CHARS:
        raise InvalidSamplingParams(
            f"stop strings have {total} characters in all, at most {MAX_STOP_CHARS} are allowed"
        )


def _check_stop_token_ids(ids: object) -> None:
    if not isinstance(ids, list):
        raise InvalidSamplingParams(f"stop_token_ids must be a list of ints, got {type(ids).__name__}")
    if len(ids) > MAX_STOP_TOKEN_IDS:
        raise InvalidSamplingParams(f"stop_token_ids has {len(ids)} ids, at most {MAX_STOP_TOKEN_IDS} are allowed")
    if not ids or (set(map(type, ids)) == {int} and 0 <= min(ids) and max(ids) <= INT32_MAX):
        return  # the common case, in C: every id an int (not a bool) and in range
    for i, t in enumerate(ids):
        if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t <= INT32_MAX:
            raise InvalidSamplingParams(
                f"stop_token_ids must be ints in [0, {INT32_MAX}], stop_token_ids[{i}] is {_show(t)}"
            )


def _check_logit_bias(bias: object) -> None:
    if bias is None:
        return
    if not isinstance(bias, dict):
        raise InvalidSamplingParams(f"logit_bias must be a map of token id to bias, got {type(bias).__name__}")
    if len(bias) > MAX_LOGIT_BIAS_TOKENS:
        raise InvalidSamplingParams(f"logit_bias has {len(bias)} entries, at most {MAX_LOGIT_BIAS_TOKENS} are allowed")
    for token, value in bias.items():
        if not isinstance(token, int) or isinstance(token, bool) or not 0 <= token <= INT32_MAX:
            raise InvalidSamplingParams(f"logit_bias keys must be token ids in [0, {INT32_MAX}], got {_show(token)}")
        _check_float(f"logit_bias[{token}]", value, -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS)
