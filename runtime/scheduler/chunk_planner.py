"""ChunkPlanner: one sequence's next chunk in a step. It reserves the chunk's blocks (preempting another sequence when
none can be freed), decides the copy-on-write copies and the block table delta the worker needs, and adds the chunk
to the StepPlan. A decode is 1 token, plus a speculative draft when one is proposed (runtime/scheduler/speculation.py);
a prompt longer than chunked_prefill_size is split into chunks (chunked prefill, Agrawal et al. 2023, "SARATHI").
Pure Python (no torch)."""

from __future__ import annotations

from radix.block_pool import NoFreeBlocksError
from radix.manager import KVCacheManager
from runtime.scheduler.kv_groups import take_window_copies, window_delta
from runtime.scheduler.parallel_samples import ParallelSamples
from runtime.scheduler.preemption import Preemption
from runtime.scheduler.request import SchedulerSeq
from runtime.scheduler.speculation import Speculation
from runtime.scheduler.stats import SchedulerCounters
from runtime.scheduler.step_plan import StepPlan


class ChunkPlanner:
    """Plans sequences' chunks into a StepPlan.

    Args:
        manager: the KV block manager (allocate, prepare_write, block_table).
        chunked_prefill_size: longest prefill chunk of one sequence in one step (tokens).
        preemption: frees blocks when a chunk's cannot be allocated.
        samples: forks the children of an n > 1 parent whose prompt[:-1] is computed.
        drops: the seq ids the next ForwardBatch drops from the worker (a sequence to re-register joins them).
        counters: the Scheduler's counters (prefill_tokens_computed).
        speculation: proposes a decode's draft (runtime/scheduler/speculation.py; off: always empty).
    """

    def __init__(
        self,
        manager: KVCacheManager,
        chunked_prefill_size: int,
        preemption: Preemption,
        samples: ParallelSamples,
        drops: list[int],
        counters: SchedulerCounters,
        speculation: Speculation,
    ) -> None:
        self._manager = manager
        self._speculation = speculation
        self._chunked_prefill_size = chunked_prefill_size
        self._preemption = preemption
        self._samples = samples
        self._drops = drops
        self._counters = counters

    def plan(self, seq: SchedulerSeq, step: StepPlan, may_preempt: bool = False) -> None:
        """Reserve blocks for seq's next chunk (decode: 1 token; else up to chunked_prefill_size and the step's
        prefill budget) and add it to step. Nothing is added when seq was preempted or finished, or (may_preempt
        False) could not get its blocks this step. Preemption is only allowed in the running phase, so a step never
        swaps a sequence out after swapping one in (the worker copies swap_out before swap_in). A prefill-only
        parent whose prompt[:-1] is computed forks its children here, and they are planned in its place.
        O(chunk + its blocks), plus the preemptions'."""
        computed = self._manager.num_computed_tokens(seq.seq_id)
        if seq.prefill_only and computed == seq.target:  # its whole prompt[:-1] is cached (or loaded): fork
            for child in self._samples.fork(seq):
                self.plan(child, step, may_preempt)
            return
        remaining = seq.target - computed
        is_decode = remaining == 1 and seq.num_output > 0
        draft: list[int] = []
        if is_decode:
            draft = self._speculation.propose(seq)
            chunk = 1 + len(draft)
        else:
            chunk = min(remaining, self._chunked_prefill_size, step.prefill_budget)
        if chunk <= 0:
            return
        while True:  # allocate and prepare the chunk's blocks, preempting (if may_preempt) until they fit
            if self._manager.allocate(seq.seq_id, chunk) is not None:
                try:
                    copies = self._manager.prepare_write(seq.seq_id, computed, computed + chunk)
                    break
                except NoFreeBlocksError:
                    pass
            if draft:  # no room for the draft's slots: a plain decode (a draft never preempts anyone)
                draft = []
                chunk = 1
                continue
            if not may_preempt or not self._preemption.make_room(seq, step):
                return  # seq was the victim or finished, or may not preempt: not planned this step
        window_copies = take_window_copies(self._manager)
        if (copies or window_copies) and seq.in_worker:  # a replaced table entry: the worker re-registers seq
            self._drops.append(seq.seq_id)
            seq.in_worker = False
        step.copies.extend(copies)
        step.window_copies.extend(window_copies)
        table = self._manager.block_table(seq.seq_id)
        if seq.in_worker:
            new_blocks = table[seq.sent_blocks :]
        else:
            new_blocks = list(table)
        sample = not seq.prefill_only and computed + chunk - len(draft) == len(seq.token_ids)
        window = window_delta(self._manager, seq.seq_id, seq.sent_blocks, not seq.in_worker)
        step.add(seq, computed, chunk, new_blocks, sample, not seq.in_worker, is_decode, window, draft)
        seq.in_worker = True
        seq.sent_blocks = len(table)
        if not is_decode:
            self._counters.prefill_tokens_computed += chunk
