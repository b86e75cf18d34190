"""Request and sequence state the Scheduler owns: plain data classes and the typed errors of admission. Pure Python
(no torch)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import NamedTuple

from radix.keys import BlockKeys
from runtime.protocol import ERR_SERVER, TokenLogprobs, Usage
from runtime.sampling_params import SamplingParams


class RequestRejected(ValueError):
    """A request can never be served: malformed inputs, empty prompt, prompt longer than max_model_len, more KV
    blocks than the whole pool (or, in the tokenizer process, a duplicate rid). Raised at once, nothing queued; code
    is a runtime.protocol ERR_* value."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class UnknownRequestError(KeyError):
    """No live request has this rid (finished, aborted or never added)."""


class RequestFailure(NamedTuple):
    """The worker could not run one of rid's sequences (Scheduler.drain_failures): every completion of rid ended
    with "abort"; message says why ("the worker failed step N: ExceptionType: ...")."""

    rid: str
    message: str
    code: str = ERR_SERVER  # ERR_INVALID: the request's own constraint allows no token (a client error)


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED = "finished"


@dataclass(eq=False)
class RequestState:
    """One request: a prompt and n completions. cached_tokens (both tiers) and host_cached_tokens (those loaded back
    from the host tier) are fixed at the first admission (counted once), and so is admitted_time (the scheduler's
    clock, seconds, like arrival_time).

    Each SchedulerSeq points back here (seq.req), so the Scheduler empties ``seqs`` when the last completion finishes:
    left as a reference cycle, every finished request (prompt, token lists, BlockKeys) would wait for a full pass of
    the cycle collector, and the scheduler process's RSS would climb to that garbage's high-water mark.
    """

    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    cache_salt: str | None
    arrival_time: float
    arrival_step: int
    block_keys: BlockKeys  # the prompt's per-block keys (radix/keys.py), made once at add_request
    cached_tokens: int | None = None
    host_cached_tokens: int = 0
    admitted_time: float | None = None
    first_token_time: float | None = None
    seqs: list[SchedulerSeq] = field(default_factory=list)  # emptied when the last one finishes (docstring)
    live: int = 0
    beam: BeamState | None = None  # use_beam_search: the beams and their scores (runtime/scheduler/beam_search.py)
    prompt_logprobs_sent: int = 0  # prompt positions whose logprobs went out (a recompute runs them again)


@dataclass(eq=False)
class SchedulerSeq:
    """The scheduler's state of one sequence (one completion, or the prompt-only parent of n > 1 samples).

    token_ids = prompt + output. admitted_at: admission order (preemption picks the latest). sent_blocks: how many
    entries of its block table the worker has. in_worker: the worker holds its copy of this sequence (sent since
    its last drop). preempted: it was preempted by recompute at least once (its recomputed tokens are counted).
    """

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

    def penalty_token_ids(self) -> list[int] | None:
        """What ScheduledSeq.penalty_token_ids carries when this sequence (re)enters the worker: None without
        penalties or structured_outputs; prompt + output with repetition_penalty on; else the output alone (the
        worker's grammar matcher replays it). O(len(token_ids))."""
        params = self.req.params
        if not params.has_penalties and params.structured_outputs is None:
            return None
        return list(self.token_ids if params.repetition_penalty != 1.0 else self.token_ids[len(self.req.prompt_ids) :])

    def usage(self) -> Usage:
        """This completion's token counts (cached_tokens is 0 and queue_time_s None until the request's first
        admission; queue_time_s: seconds from arrival to that admission; host_cached_tokens: the cached tokens
        loaded back from the host tier)."""
        req = self.req
        queue_s = None if req.admitted_time is None else max(0.0, req.admitted_time - req.arrival_time)
        return Usage(
            len(req.prompt_ids), req.cached_tokens or 0, max(0, self.num_output), queue_s, req.host_cached_tokens
        )


class Hypothesis(NamedTuple):
    """A finished beam: score (length-penalised), its completion token ids, finish reason ("stop": EOS, "length")."""

    score: float
    token_ids: list[int]
    reason: str


@dataclass(eq=False)
class BeamState:
    """One beam search request's beams (runtime/scheduler/beam_search.py): running (best first), their cumulative
    logprobs (seq_id -> float32 sum), the candidates offered this step (seq_id -> TokenLogprobs), the finished
    hypotheses (best first, at most width), and done once its outputs went out."""

    width: int
    running: list[SchedulerSeq]
    scores: dict[int, float]
    offers: dict[int, TokenLogprobs] = field(default_factory=dict)
    finished: list[Hypothesis] = field(default_factory=list)
    done: bool = False
