"""Request and sequence state the Scheduler owns: plain data classes, the typed errors of admission, and per-request
metrics. Pure Python (no torch)."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from runtime.sampling_params import SamplingParams


class RequestRejected(ValueError):
    """A request can never be served: empty prompt, prompt longer than max_model_len, or more KV blocks than the
    whole pool. Raised by add_request at once; code is a runtime.protocol ERR_* value."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class UnknownRequestError(KeyError):
    """No live request has this rid (finished, aborted or never added)."""


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED = "finished"


@dataclass(eq=False)
class RequestState:
    """One request: a prompt and n completions. cached_tokens is fixed at the first admission (counted once)."""

    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    cache_salt: str | None
    arrival_time: float
    arrival_step: int
    block_keys: list[int]
    cached_tokens: int | None = None
    first_token_time: float | None = None
    seqs: list[SeqState] = field(default_factory=list)
    live: int = 0


@dataclass(eq=False)
class SeqState:
    """One sequence (one completion, or the prompt-only parent of n > 1 samples). token_ids = prompt + output."""

    seq_id: int
    req: RequestState
    index: int
    token_ids: list[int]
    prefill_only: bool = False
    status: SeqStatus = SeqStatus.WAITING
    admitted_at: int = -1
    sent_blocks: int = 0
    in_worker: bool = False
    preempted: bool = False
    finish_reason: str | None = None
    usage_sent: bool = False

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - len(self.req.prompt_ids)

    @property
    def target(self) -> int:
        """Tokens that must have KV before this sequence samples (the parent of n > 1 stops one short)."""
        return len(self.req.prompt_ids) - 1 if self.prefill_only else len(self.token_ids)


class RequestMetrics(NamedTuple):
    """Per-request figures: tokens, time to first token (seconds, None before it), finish reason per index."""

    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    ttft_s: float | None
    finish_reasons: dict[int, str | None]


def prompt_block_keys(prompt: Sequence[int], block_size: int, cache_salt: str | None) -> list[int]:
    """In-process chained keys of the prompt's full blocks (for in-flight prefix dedup only, never cache lookup).

    O(len(prompt)). key_i = hash((key_{i-1}, tokens of block i)); the salt enters block 0 like the cache hash does.
    """
    keys: list[int] = []
    parent: Any = ("salt", cache_salt)
    for i in range(len(prompt) // block_size):
        parent = hash((parent, tuple(prompt[i * block_size : (i + 1) * block_size])))
        keys.append(parent)
    return keys
