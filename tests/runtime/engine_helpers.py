"""Engine test helpers: greedy sampling params, recording the batches an Engine's runner executes (with the
manager's invariants checked after each), and asserting that an Engine is idle with every block back."""

from __future__ import annotations

from runtime.engine import Engine
from runtime.protocol import ForwardBatch
from runtime.sampling_params import SamplingParams


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **kw)


def record_batches(engine: Engine) -> list[ForwardBatch]:
    batches: list[ForwardBatch] = []
    execute = engine.runner.execute

    def spy(batch: ForwardBatch):
        batches.append(batch)
        out = execute(batch)
        engine.manager.check_invariants()
        return out

    engine.runner.execute = spy
    return batches


def assert_idle(engine: Engine) -> None:
    s = engine.stats()
    assert s.num_used_blocks == 0 and s.num_free_blocks + s.num_evictable_blocks == s.num_blocks - 1
    assert s.num_running == s.num_waiting == engine.manager.stats().num_sequences == 0
