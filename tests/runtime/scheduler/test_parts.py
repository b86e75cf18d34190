"""The Scheduler's parts on their own, each built from its constructor arguments only (no Scheduler): the
SequenceRegistry's ids and lifetimes, and Preemption's recompute, swap, swap-in and lone-sequence cases with exact
queues, drops and counters."""

from __future__ import annotations

from collections import deque
from typing import Literal

import pytest

from radix.manager import KVCacheManager
from runtime.sampling_params import SamplingParams
from runtime.scheduler.finish import Finisher
from runtime.scheduler.preemption import Preemption
from runtime.scheduler.registry import SequenceRegistry
from runtime.scheduler.request import RequestState, SchedulerSeq, SeqStatus, UnknownRequestError
from runtime.scheduler.stats import SchedulerCounters
from runtime.scheduler.step_plan import StepPlan
from runtime.scheduler.waiting_queue import WaitingQueue


def _request(manager: KVCacheManager, rid: str, prompt: list[int], n: int = 1) -> RequestState:
    params = SamplingParams(max_tokens=4, n=n, temperature=1.0 if n > 1 else 0.0)
    return RequestState(rid, prompt, params, None, 0.0, 0, manager.block_keys(prompt))


def test_registry_numbers_sequences_once_and_forgets_requests():
    manager = KVCacheManager(8, 4)
    registry = SequenceRegistry()
    req = _request(manager, "a", [1, 2, 3], n=2)
    registry.add(req)
    parent = registry.new_seq(req, 0, prefill_only=True)
    child = registry.new_seq(req, 1)
    assert (parent.seq_id, child.seq_id, req.live, req.seqs) == (1, 2, 2, [parent, child])
    assert parent.target == 2 and child.token_ids == [1, 2, 3] and child.token_ids is not req.prompt_ids
    assert registry.get("a") is req
    registry.forget(req)
    assert registry.requests == {} and req.seqs == []
    with pytest.raises(UnknownRequestError):
        registry.get("a")
    assert registry.new_seq(req, 0).seq_id == 3  # ids are never reused


class Parts:
    """A manager of 8 usable blocks of 4 tokens, the queues, and the Finisher and Preemption sharing them."""

    def __init__(self, mode: Literal["recompute", "swap"] = "recompute", num_host_blocks: int = 0) -> None:
        self.manager = KVCacheManager(9, 4, True, num_host_blocks)
        self.registry = SequenceRegistry()
        self.running: list[SchedulerSeq] = []
        self.waiting = WaitingQueue()
        self.swapped: deque[SchedulerSeq] = deque()
        self.drops: list[int] = []
        self.counters = SchedulerCounters()
        self.finisher = Finisher(
            self.manager,
            self.registry,
            self.running,
            self.waiting,
            self.swapped,
            self.drops,
            self.counters,
            frozenset(),
            64,
            lambda: 0.0,
        )
        self.preemption = Preemption(
            self.manager,
            mode,
            self.running,
            self.waiting,
            self.swapped,
            self.drops,
            self.counters,
            self.finisher,
        )

    def run(self, rid: str, prompt: list[int], admitted_at: int) -> SchedulerSeq:
        """A running sequence whose prompt is computed and held by the worker."""
        req = _request(self.manager, rid, prompt)
        self.registry.add(req)
        seq = self.registry.new_seq(req, 0)
        match = self.manager.match_prefix(req.block_keys.extended(seq.token_ids))
        assert self.manager.add_sequence(seq.seq_id, match) == 0
        self.manager.commit_computed(seq.seq_id, len(prompt))
        seq.status = SeqStatus.RUNNING
        seq.admitted_at = admitted_at
        seq.in_worker = True
        seq.sent_blocks = len(self.manager.block_table(seq.seq_id))
        self.running.append(seq)
        return seq


def test_recompute_preempts_the_latest_admitted_onto_the_front_of_waiting():
    parts = Parts()
    old = parts.run("old", list(range(10, 20)), admitted_at=0)
    new = parts.run("new", list(range(30, 40)), admitted_at=1)
    queued = parts.run("queued", [50, 51], admitted_at=2)
    parts.running.remove(queued)
    parts.manager.free(queued.seq_id)
    queued.status = SeqStatus.WAITING
    parts.waiting.append(queued)
    step = StepPlan(7, 100)
    assert parts.preemption.make_room(old, step)
    assert parts.running == [old] and list(parts.waiting) == [new, queued]
    assert parts.waiting.waiting_since(new) == 7 and parts.drops == [new.seq_id]
    assert (new.status, new.preempted, new.in_worker, new.sent_blocks) == (SeqStatus.WAITING, True, False, 0)
    assert parts.counters.num_preemptions == 1 and parts.counters.num_swaps == 0
    assert parts.manager.stats().num_sequences == 1 and step.swap_out == []


def test_swap_out_then_swap_in_the_oldest_swapped():
    parts = Parts("swap", num_host_blocks=8)
    old = parts.run("old", list(range(10, 20)), admitted_at=0)
    new = parts.run("new", list(range(30, 40)), admitted_at=1)
    step = StepPlan(3, 100)
    parts.preemption.preempt(new, step)
    assert list(parts.swapped) == [new] and new.status == SeqStatus.SWAPPED and parts.drops == [new.seq_id]
    assert len(step.swap_out) == 3 and parts.counters.num_swaps == 1  # 10 computed tokens: 3 blocks of 4
    other = parts.run("other", list(range(60, 70)), admitted_at=2)  # 3 of the 5 blocks to be had (3 free, 2 cached)
    assert parts.preemption.swap_in_next(StepPlan(4, 100)) is None  # 2 left: no room for 3 + 1 to grow into
    assert list(parts.swapped) == [new] and new.status == SeqStatus.SWAPPED
    parts.finisher.finish(other, "abort")
    back = StepPlan(5, 100)
    assert parts.preemption.swap_in_next(back) is new
    assert sorted(host for host, _ in back.swap_in) == sorted(host for _, host in step.swap_out)
    assert parts.running == [old, new] and not parts.swapped
    assert (new.status, new.in_worker) == (SeqStatus.RUNNING, False)
    assert parts.preemption.swap_in_next(StepPlan(6, 100)) is None  # nothing swapped out


def test_a_sequence_alone_that_fills_the_pool_finishes_length():
    parts = Parts()
    alone = parts.run("alone", list(range(10, 20)), admitted_at=0)
    assert not parts.preemption.make_room(alone, StepPlan(1, 100))
    [out] = parts.finisher.drain_outputs()
    assert (out.rid, out.index, out.token_ids, out.finish_reason) == ("alone", 0, [], "length")
    assert parts.running == [] and parts.drops == [alone.seq_id] and parts.registry.requests == {}
    assert parts.counters.num_preemptions == 0 and parts.manager.stats().num_sequences == 0
