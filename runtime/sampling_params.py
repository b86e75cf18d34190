"""SamplingParams: how one request is decoded. Plain msgspec Struct, no torch, validated at construction."""

from __future__ import annotations

import math

import msgspec


class InvalidSamplingParams(ValueError):
    """A sampling parameter is out of range; the message names the field and the allowed range."""


class SamplingParams(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Decoding parameters of one request (one prompt; n completions).

    Fields (units):
        max_tokens: completion tokens to generate at most (>= 1).
        temperature: softmax temperature (>= 0, finite); 0 means greedy (argmax).
        top_k: keep the k most likely tokens (-1 or 0: all; else >= 1).
        top_p: keep the smallest set whose probability mass reaches top_p (0 < top_p <= 1).
        min_p: drop tokens whose probability is below min_p x the top probability (0 <= min_p <= 1).
        seed: per-request seed; draws depend only on (seed, sample index, token index), never on the batch.
        stop: stop strings; the text ends before the first one (hold-back in the detokenizer).
        stop_token_ids: token ids that end the completion (the id is kept in token_ids, not in the text).
        ignore_eos: keep generating past EOS until max_tokens.
        n: completions per prompt (parallel sampling; the prompt is prefilled once).
        logprobs: when set, return the sampled token's logprob and this many top alternatives (0..20).

    Raises:
        InvalidSamplingParams: on any value outside the ranges above (msgspec also raises
            msgspec.ValidationError for wrong types when decoding from the wire).
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

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check every field; raises InvalidSamplingParams naming the first bad one."""
        if self.max_tokens < 1:
            raise InvalidSamplingParams(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise InvalidSamplingParams(f"temperature must be finite and >= 0, got {self.temperature}")
        if self.top_k < -1:
            raise InvalidSamplingParams(f"top_k must be -1, 0 (all tokens) or >= 1, got {self.top_k}")
        if not math.isfinite(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise InvalidSamplingParams(f"top_p must be in (0, 1], got {self.top_p}")
        if not math.isfinite(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise InvalidSamplingParams(f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise InvalidSamplingParams(f"seed must be in [0, 2**63), got {self.seed}")
        if self.n < 1 or self.n > 64:
            raise InvalidSamplingParams(f"n must be in [1, 64], got {self.n}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise InvalidSamplingParams(f"logprobs must be in [0, 20], got {self.logprobs}")
        if any((not isinstance(s, str)) or s == "" for s in self.stop):
            raise InvalidSamplingParams("stop strings must be non-empty strings")
        if any(t < 0 for t in self.stop_token_ids):
            raise InvalidSamplingParams("stop_token_ids must be >= 0")

    @property
    def greedy(self) -> bool:
        """True when decoding is argmax (temperature 0)."""
        return self.temperature == 0.0
