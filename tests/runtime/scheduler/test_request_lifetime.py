"""A finished request's state is freed by reference counting, the moment it leaves the Scheduler.

Left in a reference cycle (RequestState.seqs -> SchedulerSeq -> .req -> RequestState) each finished request, with its
prompt and token-id lists, waits for a full collection of Python's cycle collector. In the scheduler process that
comes only after the long-lived heap grew by a quarter, so the soak saw RSS climb for minutes (benchmarks/soak.py,
issue 12 "State that grows forever") before it plateaued at that garbage's high-water mark. The tests run with the
cycle collector off: an object still alive then is one that only the collector could have freed.
"""

from __future__ import annotations

import gc
import weakref

import pytest

from tests.runtime.scheduler.harness import Harness, reference


@pytest.fixture
def no_cycle_collector():
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _track(h: Harness, rid: str, refs: list) -> None:
    """Weak references to rid's RequestState and each of its SchedulerSeqs so far."""
    req = h.sched.requests[rid]
    refs.extend(weakref.ref(o) for o in (req, *req.seqs))


def _alive(refs: list) -> list[str]:
    return [f"{type(o).__name__} {getattr(o, 'rid', None) or o.req.rid}" for o in (r() for r in refs) if o is not None]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_every_way_a_request_ends_frees_its_state_without_the_cycle_collector(no_cycle_collector, mode):
    h = Harness(num_blocks=13, block_size=4, num_host_blocks=64 if mode == "swap" else 0, preemption_mode=mode)
    refs: list = []
    for i in range(6):  # more than the pool holds: preemption (recompute or swap) happens
        h.add(f"long{i}", [i * 50 + j for j in range(1, 10)], max_tokens=10)
        _track(h, f"long{i}", refs)
    h.add("n3", [300 + j for j in range(1, 10)], max_tokens=3, n=3, temperature=1.0, seed=1)  # forks after prefill
    h.add("stop_token", [400, 401, 402], max_tokens=40, stop_token_ids=[reference([400, 401, 402], 2)[1]])
    h.add("abort_waiting", [500 + j for j in range(1, 30)], max_tokens=5)
    h.add("abort_running", [600, 601, 602], max_tokens=40)
    h.add("stopped", [700, 701, 702], max_tokens=40)
    for rid in ("n3", "stop_token", "abort_waiting", "abort_running", "stopped"):
        _track(h, rid, refs)
    h.sched.abort("abort_waiting")
    h.step()
    h.step()
    _track(h, "n3", refs)  # its children, forked by now
    h.sched.abort("abort_running")
    h.sched.stop("stopped", keep_tokens=1)
    h.run()
    assert h.sched.counters.num_preemptions > 0
    assert h.finish[("abort_running", 0)] == "abort" and h.finish[("stopped", 0)] == "stop"
    assert [h.finish[("n3", i)] for i in range(3)] == ["length"] * 3
    assert h.finish[("stop_token", 0)] == "stop" and len(h.tokens[("stop_token", 0)]) == 2
    h.assert_idle()
    assert _alive(refs) == []


def test_a_failed_request_frees_its_state_without_the_cycle_collector(no_cycle_collector):
    h = Harness()
    h.add("bad", [1, 2, 3], max_tokens=5)
    h.add("good", [4, 5, 6], max_tokens=2)
    refs: list = []
    _track(h, "bad", refs)
    _track(h, "good", refs)
    batch = h.sched.schedule()
    result = h.runner.execute(batch)
    bad_seq = refs[1]().seq_id
    result.failed_seq_ids = [bad_seq]
    result.failed_errors = ["RuntimeError: injected"]
    h.collect(h.sched.process_result(result))
    assert [f.rid for f in h.sched.drain_failures()] == ["bad"]
    h.run()
    h.assert_idle()
    del batch, result
    assert _alive(refs) == []
