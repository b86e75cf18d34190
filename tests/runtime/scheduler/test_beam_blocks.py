"""Beam search's block accounting (runtime/scheduler/beam_search.py) on the tiny Llama: forks reach the worker as
deltas, beams share full blocks and copy only the partial last one, and after every step of a seeded stress run
(preemption by recompute and by swap, an abort mid-decode) every ref count is exact, the worker's tables are the
manager's, and nothing leaks."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from runtime.engine import Engine
from runtime.protocol import ForwardBatch
from runtime.sampling_params import SamplingParams

pytestmark = pytest.mark.slow  # seconds per test: make test-fast leaves it out


def _record(engine: Engine) -> list[ForwardBatch]:
    batches: list[ForwardBatch] = []
    execute = engine.runner.execute

    def wrapped(batch: ForwardBatch):
        batches.append(batch)
        return execute(batch)

    engine.runner.execute = wrapped  # type: ignore[method-assign]
    return batches


def _check(engine: Engine) -> None:
    """Exact ref counts (tables + shadows + tree: check_invariants), the manager holds exactly the scheduler's live
    sequences, and the worker's copy of each table is the manager's."""
    s = engine.scheduler
    m = engine.manager
    r = engine.runner
    m.check_invariants()
    assert m.stats().num_sequences == len(s.running) + len(s.swapped)
    pending = {child for _, child, _ in s.beam.forks}
    in_worker = {q.seq_id for q in s.running if q.in_worker and q.seq_id not in pending}
    assert set(r.seqs) - set(s._drops) == in_worker
    for q in s.running:
        if q.seq_id in in_worker:
            assert r.seqs[q.seq_id].block_table == m.block_table(q.seq_id)[: q.sent_blocks]


def _beam(k: int, n: int, **kw) -> SamplingParams:
    return SamplingParams(use_beam_search=True, n=k, temperature=0.0, max_tokens=n, **kw)


def test_forks_are_deltas_and_beams_share_full_blocks(tiny_llama_dir):
    engine = Engine(str(tiny_llama_dir), dtype="float32", num_blocks=256, block_size=4)
    batches = _record(engine)
    rid = engine.add_request(input_ids=list(range(10, 23)), sampling_params=_beam(4, 24, ignore_eos=True))
    max_shared = 0
    while rid not in engine._done:
        engine.step()
        _check(engine)
        beams = engine.scheduler.requests[rid].beam.running if rid in engine.scheduler.requests else []
        tables = [engine.manager.block_table(b.seq_id) for b in beams]
        held = Counter(b for t in tables for b in t)
        max_shared = max([max_shared, *held.values()])
        nexts = [
            t[(b.num_output + 12) // 4] for b, t in zip(beams, tables, strict=True) if len(t) > (b.num_output + 12) // 4
        ]
        assert len(nexts) == len(set(nexts))  # the block each beam writes next is its own (the partial one copied)
    out = engine.result(rid)
    assert [len(o.token_ids) for o in out.outputs] == [24] * 4
    assert max_shared == 4  # the prompt's full blocks are in every beam's table, once each
    registrations = [s for b in batches for s in b.seqs if s.sampling_params is not None]
    assert len(registrations) == 1  # only the prompt: every beam after it came as a fork
    forks = [f for b in batches for f in b.forks]
    assert len(forks) >= 3
    assert sum(len(b.fork_copies) for b in batches) >= 1 and not any(b.copies for b in batches)  # children copy
    fork_children = {child for _, child, _ in forks}
    first_entries = {}
    for b in batches:
        for s in b.seqs:
            first_entries.setdefault(s.seq_id, s)
    assert all(len(first_entries[c].new_block_ids) <= 1 for c in fork_children if c in first_entries)
    assert all(len(s.new_block_ids) <= 1 for b in batches[1:] for s in b.seqs)  # the message never holds a table
    engine.step()  # delivers the last drops
    assert engine.runner.seqs == {} and engine.manager.stats().in_use_blocks == 0


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_stress_accounting_preemption_and_abort(tiny_llama_dir, mode):
    rng = random.Random(16)
    extra = {"num_host_blocks": 96} if mode == "swap" else {}
    engine = Engine(str(tiny_llama_dir), dtype="float32", num_blocks=40, block_size=4, preemption_mode=mode, **extra)
    rids = []
    params = []
    prompts = []
    for i in range(7):
        prompt = [rng.randrange(3, 200) for _ in range(rng.randrange(5, 18))]
        p = (
            _beam(rng.choice([2, 3, 4]), rng.randrange(10, 28), ignore_eos=bool(i % 2))
            if i % 3 != 2
            else SamplingParams(temperature=0.0, max_tokens=rng.randrange(10, 28), n=1 + i % 2, ignore_eos=True)
        )
        rids.append(engine.add_request(input_ids=prompt, sampling_params=p))
        params.append(p)
        prompts.append(prompt)
    steps = 0
    while any(r not in engine._done for r in rids[1:]):
        engine.step()
        steps += 1
        _check(engine)
        if steps == 6:  # mid-decode: its beams are forked by now
            assert len(engine.scheduler.requests[rids[0]].beam.running) == params[0].n
            aborted = engine.abort(rids[0])
            assert [o.finish_reason for o in aborted.outputs] == ["abort"] * params[0].n
            _check(engine)
    counters = engine.scheduler.counters
    assert counters.num_preemptions > 0
    if mode == "swap":
        assert counters.num_swaps > 0
    roomy = Engine(str(tiny_llama_dir), dtype="float32", num_blocks=512, block_size=4)  # no preemption there
    alone = roomy.generate(input_ids=prompts[1:], sampling_params=params[1:])
    for rid, p, ref in zip(rids[1:], params[1:], alone, strict=True):
        out = engine.result(rid)
        assert len(out.outputs) == p.n and all(o.finish_reason in ("stop", "length") for o in out.outputs)
        assert [o.token_ids for o in out.outputs] == [o.token_ids for o in ref.outputs]  # preemption changes nothing
        if p.use_beam_search:
            scores = [o.score for o in out.outputs]
            assert scores == sorted(scores, reverse=True)
    engine.step()  # delivers the last drops
    _check(engine)
    stats = engine.manager.stats()
    assert (stats.in_use_blocks, stats.num_sequences, engine.runner.seqs) == (0, 0, {})
    assert stats.free_blocks + stats.evictable_blocks == 39
    assert engine.manager.tree.clear() and engine.manager.stats().free_blocks == 39


def test_the_winners_full_blocks_are_cached_and_pruned_beams_leave_none(tiny_llama_dir):
    engine = Engine(str(tiny_llama_dir), dtype="float32", num_blocks=256, block_size=4)
    prompt = list(range(40, 53))
    out = engine.generate(input_ids=[prompt], sampling_params=_beam(3, 17, ignore_eos=True))[0]
    engine.step()
    winners = [prompt + o.token_ids[:-1] for o in out.outputs]  # the last token of each has no KV
    prefixes = {tuple(w[: (i + 1) * 4]) for w in winners for i in range(len(w) // 4)}
    stats = engine.manager.stats()
    assert stats.cached_blocks == len(prefixes) and stats.evictable_blocks == len(prefixes)  # held by the tree only
    assert stats.in_use_blocks == 0
    again = engine.generate(input_ids=[winners[1] + [7]], sampling_params=SamplingParams(max_tokens=1))[0]
    assert again.usage.cached_tokens == len(winners[1]) // 4 * 4  # a runner-up's blocks are cached too
