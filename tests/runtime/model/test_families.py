"""The dense families (Qwen3, Phi-3, Mistral with its sliding window, Gemma 3's local and global layers) served by
the Engine in float32 on tiny random models, token for token against transformers' greedy generate: prompts of
200+ tokens prefilled in chunks that cross the 32-token window, prefix-cache hits (cold == warm), preemption by
recompute and by swap, and beam search on a sliding-window model. One short check per family runs in test-fast;
the rest are marked slow."""

from __future__ import annotations

import pytest

from runtime.engine import Engine
from runtime.sampling_params import SamplingParams
from tests.conftest import _assert_same_greedy
from tests.runtime.engine_helpers import assert_idle, greedy
from tests.runtime.model.tiny_families import hf_beams, hf_greedy_each, random_prompts, save_tiny_family

NEW_TOKENS = 24
BLOCK = 8
PROMPT_LENS = [203, 229, 251]
FAMILIES = ["qwen3", "phi3", "mistral", "gemma3"]


@pytest.fixture(scope="module", params=FAMILIES)
def tiny_folder(request, tmp_path_factory, smollm2_tokenizer):
    """(family, the folder of its tiny model)."""
    return request.param, save_tiny_family(request.param, tmp_path_factory.mktemp(request.param), smollm2_tokenizer)


@pytest.fixture(scope="module")
def tiny(tiny_folder):
    """(family, folder, prompts, transformers' greedy reference per prompt)."""
    family, folder = tiny_folder
    prompts = random_prompts(PROMPT_LENS)
    return family, folder, prompts, hf_greedy_each(folder, prompts, NEW_TOKENS)


def _engine(folder, **kw) -> Engine:
    kw.setdefault("num_blocks", 256)
    return Engine(model=str(folder), dtype="float32", block_size=BLOCK, chunked_prefill_size=40, **kw)


def _assert_matches(outs, refs) -> None:
    for out, (ref, ref_logits) in zip(outs, refs, strict=True):
        assert len(out.token_ids) == NEW_TOKENS
        _assert_same_greedy(out.token_ids, ref, ref_logits)


def test_one_chunked_prompt_across_the_window_equals_transformers(tiny_folder):
    _, folder = tiny_folder
    prompt = random_prompts([203], seed=3)[0]
    (ref, ref_logits) = hf_greedy_each(folder, [prompt], 4)[0]
    out = _engine(folder).generate(input_ids=[prompt], sampling_params=greedy(4))[0]
    assert len(out.token_ids) == 4
    _assert_same_greedy(out.token_ids, ref, ref_logits)


@pytest.mark.slow
def test_greedy_equals_transformers_cold_and_warm(tiny):
    _, folder, prompts, refs = tiny
    engine = _engine(folder)
    cold = engine.generate(input_ids=prompts, sampling_params=greedy(NEW_TOKENS))
    _assert_matches(cold, refs)
    assert [o.usage.cached_tokens for o in cold] == [0, 0, 0]
    warm = engine.generate(input_ids=prompts, sampling_params=greedy(NEW_TOKENS))
    # the match stops short of the last prompt token, so it covers the full blocks of prompt[:-1]
    assert [o.usage.cached_tokens for o in warm] == [(n - 1) // BLOCK * BLOCK for n in PROMPT_LENS]
    assert [o.token_ids for o in warm] == [o.token_ids for o in cold]
    # a prompt that continues a cached one (its prompt and answer) extends the cached KV past the window
    longer = prompts[0] + cold[0].token_ids + prompts[1][:37]
    more = engine.generate(input_ids=[longer], sampling_params=greedy(8))[0]
    # cached: the full blocks of the first run's computed tokens (its prompt and every sampled token but the last)
    assert more.usage.cached_tokens == (len(prompts[0]) + NEW_TOKENS - 1) // BLOCK * BLOCK
    cold_engine = _engine(folder, enable_prefix_caching=False)
    assert more.token_ids == cold_engine.generate(input_ids=[longer], sampling_params=greedy(8))[0].token_ids
    assert_idle(engine)


def test_phi3_short_rope_factors_when_the_context_stays_within_the_original(tmp_path, smollm2_tokenizer):
    # max_model_len 64 = original_max_position_embeddings: the short factors, as transformers uses up to 64 tokens
    folder = save_tiny_family("phi3", tmp_path, smollm2_tokenizer)
    prompt = random_prompts([58], seed=2)[0]
    (ref, ref_logits) = hf_greedy_each(folder, [prompt], 6)[0]
    out = _engine(folder, max_model_len=64).generate(input_ids=[prompt], sampling_params=greedy(6))[0]
    assert len(out.token_ids) == 6
    _assert_same_greedy(out.token_ids, ref, ref_logits)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_keeps_the_tokens(tiny, mode):
    _, folder, prompts, refs = tiny
    # the three sequences need 3 x 35 blocks of 8 tokens at the end; 64 blocks force preemptions
    engine = _engine(folder, num_blocks=64, preemption_mode=mode, num_host_blocks=128 if mode == "swap" else 0)
    outs = engine.generate(input_ids=prompts, sampling_params=greedy(NEW_TOKENS))
    stats = engine.stats()
    assert stats.num_preemptions > 0 and (mode == "recompute" or stats.num_swaps > 0)
    _assert_matches(outs, refs)
    assert_idle(engine)


@pytest.mark.slow
@pytest.mark.parametrize("k", [2, 3])
def test_beam_search_on_a_sliding_window_model_equals_transformers(tmp_path, smollm2_tokenizer, k):
    folder = save_tiny_family("mistral", tmp_path, smollm2_tokenizer)
    prompt = random_prompts([211], seed=1)[0]
    ref_beams, ref_scores = hf_beams(folder, prompt, k, 12)
    engine = _engine(folder)
    params = SamplingParams(use_beam_search=True, n=k, temperature=0.0, max_tokens=12, ignore_eos=True)
    out = engine.generate(input_ids=[prompt], sampling_params=params)[0]
    assert [o.token_ids for o in out.outputs] == ref_beams
    assert [o.score for o in out.outputs] == pytest.approx(ref_scores, abs=1e-4)
    assert_idle(engine)
