"""KV cache groups (ServerArgs.kv_groups "auto": radix/hybrid_manager.py, runtime/model/hybrid_kv.py) on the tiny
random Gemma 3 (local and global layers) and Mistral (a window on every layer) models, window 32, blocks of 8: the
Engine's tokens equal the all-full path's (kv_groups "single") exactly, and transformers' greedy reference, for long
prompts prefilled in chunks across the window, decodes past it, cold == warm, a chat's turn 2 hitting turn 1's prompt
and output, preemption by recompute, and beam search; every block of both groups comes back."""

from __future__ import annotations

import pytest

from radix.hybrid_manager import HybridKVCacheManager
from runtime.config import InvalidConfig
from runtime.engine import Engine
from runtime.sampling_params import SamplingParams
from tests.conftest import _assert_same_greedy
from tests.runtime.engine_helpers import assert_idle, greedy
from tests.runtime.model.tiny_families import WINDOW, hf_beams, hf_greedy_each, random_prompts, save_tiny_family

BLOCK = 8
NEW_TOKENS = 40  # decodes past the 32-token window
PROMPT_LENS = [203, 229, 251]


@pytest.fixture(scope="module", params=["gemma3", "mistral"])
def tiny_folder(request, tmp_path_factory, smollm2_tokenizer):
    return save_tiny_family(request.param, tmp_path_factory.mktemp(request.param), smollm2_tokenizer)


def _engine(folder, kv_groups: str = "auto", **kw) -> Engine:
    kw.setdefault("num_blocks", 256)
    kw.setdefault("num_window_blocks", 48)
    return Engine(
        model=str(folder), dtype="float32", block_size=BLOCK, chunked_prefill_size=40, kv_groups=kv_groups, **kw
    )


def _assert_window_idle(engine: Engine) -> None:
    assert_idle(engine)
    manager = engine.manager
    assert isinstance(manager, HybridKVCacheManager)
    manager.check_invariants()
    window = manager.window_stats()
    assert window.in_use_blocks == 0 and window.evictable_blocks == window.cached_blocks
    stats = engine.stats()  # the same counters in ServerStats (and /metrics)
    assert stats.num_window_blocks == window.total_blocks + 1 and stats.num_window_used_blocks == 0
    assert stats.num_window_cached_blocks == window.cached_blocks > 0
    assert stats.num_window_evicted_blocks == window.evicted_blocks


def test_one_prompt_past_the_window_equals_the_all_full_path(tiny_folder):
    prompt = random_prompts([97], seed=6)[0]  # 3 chunks of 40, then decodes to 113: past three windows of 32
    outs = [
        _engine(tiny_folder, g).generate(input_ids=[prompt], sampling_params=greedy(16)) for g in ("auto", "single")
    ]
    assert outs[0][0].token_ids == outs[1][0].token_ids and len(outs[0][0].token_ids) == 16


@pytest.mark.slow
def test_hybrid_equals_the_all_full_path_and_transformers(tiny_folder):
    prompts = random_prompts(PROMPT_LENS)
    hybrid = _engine(tiny_folder)
    assert isinstance(hybrid.manager, HybridKVCacheManager) and hybrid.manager.window == WINDOW
    full = _engine(tiny_folder, kv_groups="single")
    assert not isinstance(full.manager, HybridKVCacheManager)
    cold = hybrid.generate(input_ids=prompts, sampling_params=greedy(NEW_TOKENS))
    ref = full.generate(input_ids=prompts, sampling_params=greedy(NEW_TOKENS))
    assert [o.token_ids for o in cold] == [o.token_ids for o in ref]
    (hf, hf_logits) = hf_greedy_each(tiny_folder, prompts[:1], NEW_TOKENS)[0]
    _assert_same_greedy(cold[0].token_ids, hf, hf_logits)
    warm = hybrid.generate(input_ids=prompts, sampling_params=greedy(NEW_TOKENS))
    assert [o.usage.cached_tokens for o in warm] == [(n - 1) // BLOCK * BLOCK for n in PROMPT_LENS]
    assert [o.token_ids for o in warm] == [o.token_ids for o in cold]
    # turn 2: turn 1's prompt and answer and a new message hit everything turn 1 computed
    turn2 = prompts[0] + cold[0].token_ids + prompts[1][:37]
    more = hybrid.generate(input_ids=[turn2], sampling_params=greedy(8))[0]
    assert more.usage.cached_tokens == (len(prompts[0]) + NEW_TOKENS - 1) // BLOCK * BLOCK
    assert more.token_ids == full.generate(input_ids=[turn2], sampling_params=greedy(8))[0].token_ids
    _assert_window_idle(hybrid)


@pytest.mark.slow
def test_preemption_under_window_pressure_keeps_the_tokens(tiny_folder):
    prompts = random_prompts(PROMPT_LENS, seed=4)
    full = _engine(tiny_folder, kv_groups="single")
    ref = full.generate(input_ids=prompts, sampling_params=greedy(NEW_TOKENS))
    # 20 window blocks: two sequences' windows and a chunk at most, so the third is preempted by recompute and
    # recomputed from its cached prefix (by swap: tests/runtime/model/test_hybrid_swap.py)
    engine = _engine(tiny_folder, num_window_blocks=20)
    outs = engine.generate(input_ids=prompts, sampling_params=greedy(NEW_TOKENS))
    assert engine.stats().num_preemptions > 0 and engine.stats().num_swaps == 0
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    _assert_window_idle(engine)


@pytest.mark.slow
@pytest.mark.parametrize("k", [2, 3])
def test_beam_search_with_window_groups_equals_transformers(tiny_folder, k):
    prompt = random_prompts([211], seed=1)[0]
    ref_beams, ref_scores = hf_beams(tiny_folder, prompt, k, 12)
    engine = _engine(tiny_folder)
    params = SamplingParams(use_beam_search=True, n=k, temperature=0.0, max_tokens=12, ignore_eos=True)
    out = engine.generate(input_ids=[prompt], sampling_params=params)[0]
    assert [o.token_ids for o in out.outputs] == ref_beams
    assert [o.score for o in out.outputs] == pytest.approx(ref_scores, abs=1e-4)
    _assert_window_idle(engine)


def test_a_window_pool_too_small_for_a_chunk_is_refused(tiny_folder):
    with pytest.raises(InvalidConfig, match="num_window_blocks"):
        _engine(tiny_folder, num_window_blocks=8)  # cdiv(32 + 40, 8) + 2 = 11 needed
