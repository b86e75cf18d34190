"""Speculative decoding (n-gram prompt lookup) with KV cache groups (kv_groups "auto") on a tiny loopy Gemma 3
(window 16, blocks of 4) in float32: every output equals plain decoding's, with groups and without (the all-full
path), token for token, while drafts are both accepted and rejected far past the window, and under preemption by
recompute and by swap in a small window pool; the rollback of rejected slots cuts both groups' tables
(radix/hybrid_manager.py release_uncomputed, the worker's copy alike), the manager's invariants hold after every
step, and every block of both groups comes back. A draft model (runtime/model/draft_model.py) on such a target keeps
one group under the auto default (its pool mirrors one group only) and equals plain decoding."""

from __future__ import annotations

import json

import pytest

from radix.hybrid_manager import HybridKVCacheManager
from runtime.engine import Engine
from runtime.sampling_params import SamplingParams
from tests.runtime.engine_helpers import assert_idle, greedy, record_batches
from tests.runtime.hybrid_helpers import LOOPY_WINDOW, save_loopy_gemma3
from tests.runtime.spec_helpers import NGRAM, PROMPTS

NEW_TOKENS = 48  # prompts of 7-25 tokens decode to 55-73: past the 16-token window several times


@pytest.fixture(scope="module")
def loopy_gemma3(tmp_path_factory, smollm2_tokenizer):
    return save_loopy_gemma3(tmp_path_factory.mktemp("loopy_gemma3"), smollm2_tokenizer)


def _engine(folder, kv_groups: str = "auto", **kw) -> Engine:
    kw.setdefault("num_window_blocks", 40)
    return Engine(
        model=str(folder),
        dtype="float32",
        block_size=4,
        num_blocks=128,
        chunked_prefill_size=16,
        kv_groups=kv_groups,
        **kw,
    )


@pytest.fixture(scope="module")
def plain(loopy_gemma3) -> list[list[int]]:
    """Plain decoding's greedy tokens of PROMPTS with groups."""
    outs = _engine(loopy_gemma3).generate(input_ids=PROMPTS, sampling_params=greedy(NEW_TOKENS))
    return [o.token_ids for o in outs]


def _assert_both_groups_idle(engine: Engine) -> None:
    assert_idle(engine)
    manager = engine.manager
    assert isinstance(manager, HybridKVCacheManager)
    manager.check_invariants()
    window = manager.window_stats()
    assert window.in_use_blocks == 0 and window.free_blocks + window.evictable_blocks == window.total_blocks


def test_greedy_speculation_with_groups_equals_plain_decoding(loopy_gemma3, plain):
    full = _engine(loopy_gemma3, "single").generate(input_ids=PROMPTS, sampling_params=greedy(NEW_TOKENS))
    assert plain == [o.token_ids for o in full]
    spec = _engine(loopy_gemma3, speculative_config=NGRAM)
    assert spec.manager.window == LOOPY_WINDOW
    batches = record_batches(spec)  # checks both groups' invariants after every step
    assert [o.token_ids for o in spec.generate(input_ids=PROMPTS, sampling_params=greedy(NEW_TOKENS))] == plain
    c = spec.scheduler.speculation.counters
    assert c.num_draft_tokens == sum(s.num_draft_tokens for b in batches for s in b.seqs)
    assert 0 < c.num_accepted_tokens < c.num_draft_tokens  # drafts both accepted and rejected
    # a draft ran from a position past the window, so its rollback cut window tables whose heads were released
    assert max(s.start_pos for b in batches for s in b.seqs if s.num_draft_tokens) > 2 * LOOPY_WINDOW
    _assert_both_groups_idle(spec)


def test_seeded_sampling_and_a_prefix_hit_with_groups(loopy_gemma3):
    params = SamplingParams(max_tokens=32, temperature=0.8, top_k=20, seed=11, ignore_eos=True)
    plain_engine = _engine(loopy_gemma3)
    plain = [o.token_ids for o in plain_engine.generate(input_ids=PROMPTS, sampling_params=params)]
    spec = _engine(loopy_gemma3, speculative_config=NGRAM)
    record_batches(spec)
    assert [o.token_ids for o in spec.generate(input_ids=PROMPTS, sampling_params=params)] == plain
    assert spec.scheduler.speculation.counters.num_accepted_tokens > 0
    # turn 2 of a chat: turn 1's prompt and answer are a hit (window resident), then speculation on top of it
    first = spec.generate(input_ids=[PROMPTS[2]], sampling_params=greedy(20))[0]
    turn2 = PROMPTS[2] + first.token_ids + [3, 4, 3]
    out = spec.generate(input_ids=[turn2], sampling_params=greedy(20))[0]
    assert out.usage.cached_tokens == (len(PROMPTS[2]) + 20 - 1) // 4 * 4
    assert out.token_ids == plain_engine.generate(input_ids=[turn2], sampling_params=greedy(20))[0].token_ids
    _assert_both_groups_idle(spec)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_under_window_pressure_with_speculation(loopy_gemma3, plain, mode):
    # 12 window blocks: the three sequences' windows (5 blocks each at most) and their draft slots do not fit, so
    # sequences are preempted, drafts or not, and resume (from their cached prefix, or swapped back in both groups)
    host = 64 if mode == "swap" else 0
    spec = _engine(
        loopy_gemma3, num_window_blocks=12, speculative_config=NGRAM, preemption_mode=mode, num_host_blocks=host
    )
    record_batches(spec)
    assert [o.token_ids for o in spec.generate(input_ids=PROMPTS, sampling_params=greedy(NEW_TOKENS))] == plain
    stats = spec.stats()
    assert stats.num_preemptions > 0 and (stats.num_swaps > 0) == (mode == "swap")
    assert spec.scheduler.speculation.counters.num_accepted_tokens > 0
    _assert_both_groups_idle(spec)


def test_a_draft_model_keeps_one_group_and_equals_plain_decoding(loopy_gemma3):
    """Under the auto default a draft model keeps the target in one group (its pool mirrors one): the runner has no
    window group, and the self draft's tokens equal plain decoding's with every draft accepted."""
    draft = json.dumps({"method": "draft_model", "model": str(loopy_gemma3), "num_speculative_tokens": 2})
    spec = Engine(model=str(loopy_gemma3), dtype="float32", num_blocks=64, speculative_config=draft)
    plain = Engine(model=str(loopy_gemma3), dtype="float32", num_blocks=64, kv_groups="single")
    params = greedy(NEW_TOKENS)
    got = [o.token_ids for o in spec.generate(input_ids=PROMPTS, sampling_params=params)]
    assert got == [o.token_ids for o in plain.generate(input_ids=PROMPTS, sampling_params=params)]
    assert spec.stats().num_window_blocks == 0  # one group
    c = spec.scheduler.speculation.counters
    assert c.num_accepted_tokens == c.num_draft_tokens > 0
