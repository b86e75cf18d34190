"""What a load benchmark's clients saw and how it is judged: the tally (counts, errors by type, bad outputs by kind,
TTFT and latency samples), the consistency check of one finished stream, "LO:HI" token ranges and percentiles.
Shared by benchmarks/soak.py and benchmarks/http_load.py."""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class Tally:
    """What the clients saw. errors / bad_outputs: kind -> count. ttft_s / latency_s: completed requests only."""

    requests: int = 0
    completed: int = 0
    aborted: int = 0
    errors: collections.Counter = field(default_factory=collections.Counter)
    bad_outputs: collections.Counter = field(default_factory=collections.Counter)
    ttft_s: list[float] = field(default_factory=list)
    latency_s: list[float] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        """The result keys every load benchmark reports: counts, errors, bad outputs, TTFT and latency p50 / p99."""
        return {
            "requests": self.requests,
            "completed": self.completed,
            "aborted": self.aborted,
            "errors": dict(self.errors),
            "bad_outputs": dict(self.bad_outputs),
            "ttft_p50_s": pct(self.ttft_s, 50),
            "ttft_p99_s": pct(self.ttft_s, 99),
            "latency_p50_s": pct(self.latency_s, 50),
            "latency_p99_s": pct(self.latency_s, 99),
        }


def token_range(text: str) -> tuple[int, int]:
    """ "LO:HI" (or "N") -> (LO, HI). Raises ValueError unless 1 <= LO <= HI."""
    lo, _, hi = text.partition(":")
    a = int(lo)
    b = int(hi or lo)
    if not 1 <= a <= b:
        raise ValueError(f"bad token range {text!r}: LO:HI with 1 <= LO <= HI")
    return a, b


def check_output(
    finish_reason: str | None, usage: Any, num_token_ids: int, max_tokens: int, prompt_len: int, max_model_len: int
) -> list[str]:
    """The ways a finished stream's finish reason and usage contradict its tokens ([]: consistent).

    usage: a protocol Usage or None; num_token_ids: token ids received; prompt_len: the chat template's token count.
    """
    if finish_reason not in ("stop", "length"):
        return [f"finish_reason {finish_reason!r}"]
    if usage is None:
        return ["no usage"]
    problems = []
    if usage.completion_tokens != num_token_ids:
        problems.append("completion_tokens != len(token_ids)")
    if usage.completion_tokens > max_tokens:
        problems.append("completion_tokens > max_tokens")
    full = usage.prompt_tokens + usage.completion_tokens >= max_model_len
    if finish_reason == "length" and usage.completion_tokens < max_tokens and not full:
        problems.append("length below max_tokens, context not full")
    if not 0 <= usage.cached_tokens <= usage.prompt_tokens:
        problems.append("cached_tokens outside [0, prompt_tokens]")
    if usage.prompt_tokens != prompt_len:
        problems.append("prompt_tokens != chat template length")
    return problems


def pct(values: list[float], q: float) -> float | None:
    """The q-th percentile (0..100) of values, rounded to 4 decimals; None for no values."""
    return round(float(np.percentile(values, q)), 4) if values else None
