"""Preemption: when no block can be freed for a running sequence, the most recently admitted one gives its blocks
up (vLLM, Kwon et al. 2023, section 4.5), by recompute (its blocks are freed, full computed ones stay cached, and it
waits again at the front of the queue) or by swap (its blocks are copied to the host pool, and it comes back by
swap-in once blocks are free; with KV cache groups, both groups' blocks, each to its own host pool). Pure Python (no
torch)."""

from __future__ import annotations

import logging
from collections import deque
from operator import attrgetter
from typing import Literal

from radix.blocks import cdiv
from radix.manager import KVCacheManager
from runtime.scheduler.finish import Finisher
from runtime.scheduler.kv_groups import take_window_swaps
from runtime.scheduler.request import SchedulerSeq, SeqStatus
from runtime.scheduler.stats import SchedulerCounters
from runtime.scheduler.step_plan import StepPlan
from runtime.scheduler.waiting_queue import WaitingQueue

logger = logging.getLogger(__name__)


class Preemption:
    """Preempts running sequences and swaps swapped-out ones back in, for the Scheduler's step.

    Args:
        manager: the KV block manager (free, swap_out, swap_in).
        mode: ServerArgs.preemption_mode; "swap" falls back to recompute when the host pool is full.
        running, waiting, swapped: the Scheduler's queues (a victim moves from running to waiting or swapped).
        drops: the seq ids the next ForwardBatch drops from the worker (a victim it holds joins them).
        counters: the Scheduler's counters (num_preemptions, num_swaps).
        finisher: finishes a sequence that fills the pool alone ("length").
    """

    def __init__(
        self,
        manager: KVCacheManager,
        mode: Literal["recompute", "swap"],
        running: list[SchedulerSeq],
        waiting: WaitingQueue,
        swapped: deque[SchedulerSeq],
        drops: list[int],
        counters: SchedulerCounters,
        finisher: Finisher,
    ) -> None:
        self._manager = manager
        self._mode = mode
        self._running = running
        self._waiting = waiting
        self._swapped = swapped
        self._drops = drops
        self._counters = counters
        self._finisher = finisher

    def make_room(self, seq: SchedulerSeq, step: StepPlan) -> bool:
        """Free blocks for seq by preempting the most recently admitted running sequence not yet planned in step
        (seq itself wins ties). Returns False when seq was the victim, or when seq alone holds blocks and so
        finished "length" (it can never grow further). O(running + the victim's blocks)."""
        planned = {id(c.seq) for c in step.inflight}
        others = [s for s in self._running if s is not seq and id(s) not in planned]
        if len(self._running) == 1:
            usable = self._manager.num_blocks - 1
            block_size = self._manager.block_size
            logger.warning(
                'request %s finishes "length" at %d of max_tokens %d completion tokens: alone, it fills '
                "the KV pool (%d usable blocks of %d = %d tokens)",
                seq.req.rid,
                max(0, seq.num_output),
                seq.req.params.max_tokens,
                usable,
                block_size,
                usable * block_size,
            )
            self._finisher.finish(seq, "length")
            return False
        victim = max([seq, *others], key=attrgetter("admitted_at"))
        self.preempt(victim, step)
        return victim is not seq

    def preempt(self, seq: SchedulerSeq, step: StepPlan) -> None:
        """Take running seq out. Swap: its blocks move to the host pool (the (device, host) pairs join
        step.swap_out) and it joins swapped; recompute (or a full host pool): it is freed (full computed blocks stay
        cached) and requeued at the front of waiting. The worker drops it either way."""
        self._counters.num_preemptions += 1
        self._running.remove(seq)
        if seq.in_worker:
            self._drops.append(seq.seq_id)
        seq.in_worker = False
        seq.sent_blocks = 0
        if self._mode == "swap":
            pairs = self._manager.swap_out(seq.seq_id)
            if pairs is not None:
                step.swap_out.extend(pairs)
                step.window_swap_out.extend(take_window_swaps(self._manager).swap_out)
                seq.status = SeqStatus.SWAPPED
                self._swapped.append(seq)
                self._counters.num_swaps += 1
                return
        self._manager.free(seq.seq_id)
        seq.status = SeqStatus.WAITING
        seq.preempted = True
        self._waiting.requeue_front(seq, step.step_id)
        logger.debug("preempted seq %d of %s (recompute)", seq.seq_id, seq.req.rid)

    def requeue(self, seq: SchedulerSeq, step_id: int) -> None:
        """Put running seq back at the front of waiting, as a recompute preemption does, for a sequence the worker
        has already forgotten (it did not run: its grammar still compiles); its full computed blocks stay cached.
        Not counted as a preemption."""
        self._running.remove(seq)
        seq.in_worker = False
        seq.sent_blocks = 0
        self._manager.free(seq.seq_id)
        seq.status = SeqStatus.WAITING
        seq.preempted = True
        self._waiting.requeue_front(seq, step_id)

    def swap_in_next(self, step: StepPlan) -> SchedulerSeq | None:
        """Swap the oldest swapped-out sequence back in (the (host, device) pairs join step.swap_in) and return it,
        RUNNING and new to the worker, for the caller to plan; None when none is swapped out or its blocks (plus one
        to grow into) cannot be allocated. O(its blocks)."""
        if not self._swapped:
            return None
        seq = self._swapped[0]
        computed_blocks = cdiv(self._manager.num_computed_tokens(seq.seq_id), self._manager.block_size)
        if not self._manager.can_allocate(computed_blocks + 1):  # +1, else it is swapped straight out again
            return None
        pairs = self._manager.swap_in(seq.seq_id)
        if pairs is None:
            return None
        self._swapped.popleft()
        step.swap_in.extend(pairs)
        step.window_swap_in.extend(take_window_swaps(self._manager).swap_in)
        seq.status = SeqStatus.RUNNING
        seq.in_worker = False
        self._running.append(seq)
        return seq
