"""ParallelSamples: n > 1 completions of one prompt share its KV. A prefill-only parent computes prompt[:-1] once;
then n children fork its block table (KVCacheManager.fork: shared blocks gain a reference, the partial last one is
copied on write) and each runs the last prompt token, sampling its own continuation. Pure Python (no torch)."""

from __future__ import annotations

from radix.manager import KVCacheManager
from runtime.scheduler.finish import Finisher
from runtime.scheduler.registry import SequenceRegistry
from runtime.scheduler.request import RequestState, SchedulerSeq, SeqStatus


class ParallelSamples:
    """Starts and forks the n > 1 sequences of a request (params.n > 1, a prompt of two tokens or more).

    Args:
        manager: the KV block manager (the children fork the parent's table there).
        registry: makes the sequences.
        finisher: finishes the parent ("forked": no delta of its own).
        running: the Scheduler's running list (the children join it at once).
    """

    def __init__(
        self, manager: KVCacheManager, registry: SequenceRegistry, finisher: Finisher, running: list[SchedulerSeq]
    ) -> None:
        self._manager = manager
        self._registry = registry
        self._finisher = finisher
        self._running = running

    def start(self, req: RequestState) -> SchedulerSeq:
        """req's prefill-only parent (a new WAITING sequence whose target is prompt[:-1]); the caller queues it."""
        return self._registry.new_seq(req, 0, prefill_only=True)

    def fork(self, parent: SchedulerSeq) -> list[SchedulerSeq]:
        """The parent's prompt[:-1] has KV: fork n RUNNING children sharing its blocks (admitted with it), then
        finish it "forked". Returns the children, by index. O(n * parent's blocks)."""
        children = []
        for i in range(parent.req.params.n):
            child = self._registry.new_seq(parent.req, i)
            self._manager.fork(parent.seq_id, child.seq_id)
            child.status = SeqStatus.RUNNING
            child.admitted_at = parent.admitted_at
            self._running.append(child)
            children.append(child)
        self._finisher.finish(parent, "forked")
        return children
