"""Speculative decoding (n-gram prompt lookup) through the Engine on a tiny loopy Llama in float32: every output
equals plain decoding's token for token (greedy, and seeded sampling with its filters), across block boundaries,
prefix-cache hits, preemption by recompute and by swap (these two also with multi-step decoding), and aborts; the
manager's invariants hold after every step and every block comes back."""

from __future__ import annotations

import json

import pytest

from runtime.engine import Engine
from runtime.sampling_params import SamplingParams
from tests.runtime.engine_helpers import assert_idle, greedy, record_batches
from tests.runtime.spec_helpers import NGRAM, PROMPTS, memoised_plain


@pytest.fixture(scope="module")
def plain_outputs(make_engine):
    """Plain decoding's output of (prompts, params), memoised (one token a step)."""
    return memoised_plain(make_engine(num_scheduler_steps=1))


# the settings that run more than one token of a sequence per step: n-gram drafts, and multi-step decoding (4 steps)
LOOKAHEAD = [
    pytest.param({"speculative_config": NGRAM}, id="ngram"),
    pytest.param({"num_scheduler_steps": 4}, id="multi_step"),
]


def _drafted(batches) -> int:
    return sum(s.num_draft_tokens for b in batches for s in b.seqs)


def test_greedy_equals_plain_decoding_across_blocks(make_engine, plain_outputs):
    spec = make_engine(speculative_config=NGRAM)
    batches = record_batches(spec)  # checks the manager's invariants after every step
    want = plain_outputs(PROMPTS, greedy(40))
    assert [o.token_ids for o in spec.generate(input_ids=PROMPTS, sampling_params=greedy(40))] == want
    c = spec.scheduler.speculation.counters
    assert c.num_draft_tokens == _drafted(batches) > 0
    assert 0 < c.num_accepted_tokens < c.num_draft_tokens  # drafts both accepted and rejected
    assert c.num_accepted_tokens == sum(c.accepted_per_pos)
    assert c.accepted_per_pos == sorted(c.accepted_per_pos, reverse=True)  # position i needs i - 1 before it
    s = spec.stats()
    assert (s.spec_decode_num_drafts, s.spec_decode_num_draft_tokens, s.spec_decode_num_accepted_tokens) == (
        c.num_drafts,
        c.num_draft_tokens,
        c.num_accepted_tokens,
    )
    assert s.spec_decode_num_accepted_tokens_per_pos == c.accepted_per_pos
    assert _saved_steps(batches) > 0
    assert_idle(spec)


def _saved_steps(batches) -> int:
    """Decode steps the slowest sequence saved: plain decoding runs 40 - 1 after the prefill."""
    steps_by_seq: dict[int, int] = {}
    for b in batches[1:]:
        for s in b.seqs:
            steps_by_seq[s.seq_id] = steps_by_seq.get(s.seq_id, 0) + 1
    return 40 - 1 - max(steps_by_seq.values())


def test_mixed_batch_with_penalties_and_logprobs(make_engine, plain_outputs):
    spec = make_engine(speculative_config=NGRAM)
    batches = record_batches(spec)
    params = [greedy(24), greedy(24, frequency_penalty=0.5), greedy(24, logprobs=1)]
    rids = [spec.add_request(input_ids=p, sampling_params=q) for p, q in zip(PROMPTS, params, strict=True)]
    seq_ids = [spec.scheduler.requests[r].seqs[0].seq_id for r in rids]
    while spec.scheduler.has_unfinished():
        spec.step()
    for rid, prompt, q in zip(rids, PROMPTS, params, strict=True):
        assert spec.result(rid).token_ids == plain_outputs([prompt], q)[0]
    drafted = {s.seq_id for b in batches for s in b.seqs if s.num_draft_tokens}
    assert drafted == set(seq_ids)  # penalties and logprobs run drafts too (tests/runtime/test_engine_spec_options)
    assert_idle(spec)


def test_seeded_sampling_equals_plain_decoding(make_engine, plain_outputs):
    spec = make_engine(speculative_config=NGRAM)
    params = SamplingParams(max_tokens=20, temperature=0.7, top_p=0.9, top_k=20, min_p=0.05, seed=7, ignore_eos=True)
    assert [o.token_ids for o in spec.generate(input_ids=PROMPTS, sampling_params=params)] == plain_outputs(
        PROMPTS, params
    )
    assert spec.scheduler.speculation.counters.num_accepted_tokens > 0
    assert_idle(spec)


@pytest.mark.parametrize("lookahead", LOOKAHEAD)
def test_prefix_cache_hit_then_speculation(make_engine, plain_outputs, lookahead):
    spec = make_engine(**lookahead)
    first = spec.generate(input_ids=[PROMPTS[1]], sampling_params=greedy(20))[0]
    turn2 = PROMPTS[1] + first.token_ids + [3, 4, 3]
    out = spec.generate(input_ids=[turn2], sampling_params=greedy(20))[0]
    assert out.usage.cached_tokens == 24  # the whole blocks of turn 1 (prompt + reply: 27 tokens, 6 blocks of 4)
    assert out.token_ids == plain_outputs([turn2], greedy(20))[0]
    assert_idle(spec)


@pytest.mark.parametrize("lookahead", LOOKAHEAD)
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_under_speculation(make_engine, plain_outputs, mode, lookahead):
    spec = make_engine(**lookahead, num_blocks=24, preemption_mode=mode, num_host_blocks=64)
    record_batches(spec)
    outs = spec.generate(input_ids=PROMPTS, sampling_params=greedy(40))
    assert [o.token_ids for o in outs] == plain_outputs(PROMPTS, greedy(40))
    stats = spec.stats()
    assert stats.num_preemptions > 0
    assert (stats.num_swaps > 0) == (mode == "swap")
    assert_idle(spec)


def test_abort_mid_run_returns_every_block(make_engine):
    spec = make_engine(speculative_config=NGRAM)
    record_batches(spec)
    rids = [spec.add_request(input_ids=p, sampling_params=greedy(40)) for p in PROMPTS]
    for _ in range(6):
        spec.step()
    assert spec.scheduler.speculation.counters.num_drafts > 0
    aborted = [spec.abort(rids[0]), spec.abort(rids[2])]
    assert [o.finish_reason for o in aborted] == ["abort", "abort"]
    while spec.scheduler.has_unfinished():
        spec.step()
    assert spec.result(rids[1]).finish_reason == "length"
    spec.step()  # delivers the drops
    assert_idle(spec)
    assert spec.runner.seqs == {}


def test_disable_by_batch_size(make_engine):
    config = json.loads(NGRAM) | {"disable_by_batch_size": 3}
    spec = make_engine(speculative_config=json.dumps(config))
    batches = record_batches(spec)
    spec.generate(input_ids=PROMPTS, sampling_params=greedy(8))
    assert _drafted(batches) == 0  # three running: off every step
    spec.generate(input_ids=PROMPTS[:2], sampling_params=greedy(8))
    assert _drafted(batches) > 0


COPY_TEXT = (
    "def area(width, height):\n    return width * height\n\n\ndef perimeter(width, height):\n"
    "    return 2 * (width + height)\n"
)


@pytest.mark.slow
def test_smollm2_copy_task_greedy_equals_plain_decoding():
    messages = [{"role": "user", "content": "Repeat this code exactly:\n" + COPY_TEXT}]
    params = SamplingParams(max_tokens=40, temperature=0.0)
    want = Engine(dtype="float32").generate(messages=[messages], sampling_params=params)[0]
    spec = Engine(dtype="float32", speculative_config=NGRAM)
    got = spec.generate(messages=[messages], sampling_params=params)[0]
    assert got.token_ids == want.token_ids
    c = spec.scheduler.speculation.counters
    assert c.num_accepted_tokens > len(got.token_ids) // 3  # the copy is mostly proposed right
