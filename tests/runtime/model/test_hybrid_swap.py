"""Preemption by swap with KV cache groups (kv_groups "auto", preemption_mode "swap") on the tiny random Gemma 3 and
Mistral models, window 32, blocks of 8: a window pool too small for three sequences at once swaps one out (both
groups' blocks to their host pools) and back, and the tokens equal the all-full path's exactly; every block of both
groups comes back."""

from __future__ import annotations

import pytest

from radix.hybrid_manager import HybridKVCacheManager
from runtime.engine import Engine
from runtime.sampling_params import SamplingParams
from tests.runtime.engine_helpers import assert_idle, greedy, record_batches
from tests.runtime.model.tiny_families import random_prompts, save_tiny_family

BLOCK = 8
NEW_TOKENS = 40  # decodes past the 32-token window


@pytest.fixture(scope="module", params=["gemma3", "mistral"])
def tiny_folder(request, tmp_path_factory, smollm2_tokenizer):
    return save_tiny_family(request.param, tmp_path_factory.mktemp(request.param), smollm2_tokenizer)


def _engine(folder, kv_groups: str, **kw) -> Engine:
    return Engine(
        model=str(folder),
        dtype="float32",
        block_size=BLOCK,
        chunked_prefill_size=40,
        kv_groups=kv_groups,
        num_blocks=256,
        **kw,
    )


def test_swap_preemption_with_window_groups_equals_the_all_full_path(tiny_folder):
    prompts = random_prompts([97, 113, 121], seed=4)
    ref = _engine(tiny_folder, "single").generate(input_ids=prompts, sampling_params=greedy(NEW_TOKENS))
    # 20 window blocks: two sequences' windows and a chunk at most, so a third is swapped out (group 0 has room)
    engine = _engine(tiny_folder, "auto", num_window_blocks=20, preemption_mode="swap", num_host_blocks=64)
    batches = record_batches(engine)  # with the manager's invariants after every step
    outs = engine.generate(input_ids=prompts, sampling_params=greedy(NEW_TOKENS))
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    stats = engine.stats()
    assert stats.num_swaps > 0 and stats.num_preemptions == stats.num_swaps  # every preemption was a swap
    window_out = [p for b in batches for p in b.window_swap_out]
    window_in = [p for b in batches for p in b.window_swap_in]
    assert window_out and sorted(h for _, h in window_out) == sorted(h for h, _ in window_in)
    manager = engine.manager
    assert isinstance(manager, HybridKVCacheManager)
    assert_idle(engine)
    manager.check_invariants()
    assert manager.window_stats().in_use_blocks == 0


@pytest.mark.slow
def test_beam_search_swapped_under_window_pressure_equals_the_all_full_path(tiny_folder):
    prompts = random_prompts([97, 113], seed=1)
    params = SamplingParams(use_beam_search=True, n=3, temperature=0.0, max_tokens=24, ignore_eos=True)
    ref = _engine(tiny_folder, "single").generate(input_ids=prompts, sampling_params=params)
    # 15 usable window blocks for six beams: beams (forks sharing their blocks) are swapped out and back
    engine = _engine(tiny_folder, "auto", num_window_blocks=16, preemption_mode="swap", num_host_blocks=64)
    record_batches(engine)
    outs = engine.generate(input_ids=prompts, sampling_params=params)
    assert [[b.token_ids for b in o.outputs] for o in outs] == [[b.token_ids for b in o.outputs] for o in ref]
    for o, r in zip(outs, ref, strict=True):  # float32 sums in another order: equal to a tolerance
        assert [b.score for b in o.outputs] == pytest.approx([b.score for b in r.outputs], abs=1e-4)
    assert engine.stats().num_swaps > 0
    assert_idle(engine)
    assert isinstance(engine.manager, HybridKVCacheManager)
    engine.manager.check_invariants()
