"""StepPlan: the ForwardBatch that one scheduler step is building; InflightChunk: what one planned sequence computes
in that step, kept until the worker's ForwardResult comes back. Pure Python (no torch)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from radix.host_tier import TierCopies
from runtime.protocol import ForwardBatch, ScheduledSeq
from runtime.scheduler.draft_slots import is_slots
from runtime.scheduler.request import SchedulerSeq


class ForkDeltas(NamedTuple):
    """The beam forks made since the last step: ForwardBatch.forks and their fork_copies."""

    forks: list[tuple[int, int, int]]
    copies: list[tuple[int, int]]


class InflightChunk(NamedTuple):
    """Tokens [start, start + num_tokens) of seq, computed by the step in flight. sample: the chunk reaches the end
    of seq's known tokens, so the step samples its next token. draft: a decode's speculative draft (its last
    len(draft) tokens, not yet seq's: runtime/scheduler/speculation.py), else empty."""

    seq: SchedulerSeq
    start: int
    num_tokens: int
    sample: bool
    draft: list[int]


@dataclass(eq=False)
class StepPlan:
    """One step being planned. step_id: the step's number (ForwardBatch.step_id). prefill_budget: prompt tokens
    (prefill and extend chunks) the step may still run; it starts at max_prefill_tokens and decodes do not spend it.
    seqs / copies / swap_out / swap_in: the ForwardBatch's lists (ForwardBatch documents their order of
    application). inflight: one InflightChunk per entry of seqs, in the same order."""

    step_id: int
    prefill_budget: int
    seqs: list[ScheduledSeq] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    window_copies: list[tuple[int, int]] = field(default_factory=list)  # the sliding-window group's copy-on-write
    window_swap_out: list[tuple[int, int]] = field(default_factory=list)  # the sliding-window group's swaps
    window_swap_in: list[tuple[int, int]] = field(default_factory=list)
    inflight: list[InflightChunk] = field(default_factory=list)

    def add(
        self,
        seq: SchedulerSeq,
        start: int,
        num_tokens: int,
        new_block_ids: list[int],
        sample: bool,
        first: bool,
        is_decode: bool,
        new_window_block_ids: list[int] | None = None,
        draft: list[int] | None = None,
    ) -> None:
        """Schedule tokens [start, start + num_tokens) of seq. first: seq is new to the worker, so the entry carries
        its SamplingParams, prompt length, sample index, (with penalties) penalty_token_ids and (with
        prompt_logprobs) the prompt. A chunk that is not a
        decode spends prefill_budget. draft: a decode's speculative draft, run after its one token (num_tokens
        counts it; DRAFT_SLOT placeholders go as num_draft_slots). Mutates seqs, inflight and prefill_budget only;
        O(num_tokens + len(new_block_ids)), plus O(prompt + output) for a first entry with penalties."""
        req = seq.req
        draft = draft or []
        slots = len(draft) if is_slots(draft) else 0  # a draft model's: the worker drafts them (draft_slots.py)
        self.seqs.append(
            ScheduledSeq(
                seq.seq_id,
                seq.token_ids[start : start + num_tokens - len(draft)] + (draft if not slots else []),
                start,
                new_block_ids,
                sample,
                req.params if first else None,
                len(req.prompt_ids) if first else 0,
                seq.index if first else 0,
                seq.penalty_token_ids() if first else None,
                req.prompt_ids if first and req.params.prompt_logprobs is not None else None,
                new_window_block_ids,
                len(draft) - slots,
                slots,
            )
        )
        self.inflight.append(InflightChunk(seq, start, num_tokens, sample, draft))
        if not is_decode:
            self.prefill_budget -= num_tokens

    def add_tier_copies(self, copies: TierCopies) -> None:
        """The host tier's copies of the step: write-backs join swap_out (applied first, so an evicted device block
        is read before anything of the step overwrites it), load-backs join swap_in (before the forward). O(copies)."""
        self.swap_out.extend(copies.write_back)
        self.swap_in.extend(copies.load_back)

    def batch(self, drop_seq_ids: list[int], forks: ForkDeltas | None = None) -> ForwardBatch:
        """The planned step as a ForwardBatch (shares this plan's lists); forks: the beam forks since the last step
        (ForwardBatch.forks and fork_copies)."""
        forks = forks or ForkDeltas([], [])
        return ForwardBatch(
            self.step_id,
            self.seqs,
            drop_seq_ids,
            self.swap_out,
            self.swap_in,
            self.copies,
            forks.forks,
            forks.copies,
            self.window_copies,
            self.window_swap_out,
            self.window_swap_in,
        )
