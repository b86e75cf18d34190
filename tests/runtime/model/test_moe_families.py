"""Qwen3-MoE and Mixtral served by the Engine in float32 on tiny random models (tests/runtime/model/tiny_moe.py),
token for token against transformers' greedy generate on three prompts of 200+ tokens prefilled in 40-token chunks,
then again from the prefix cache (cold == warm); the config reader's MoE fields."""

from __future__ import annotations

import json

import pytest

from runtime.engine import Engine
from runtime.model.errors import CorruptModelError
from runtime.model.hf_config import load_config
from runtime.model.models.mlp import GatedMLP
from runtime.model.models.moe import SparseMoeBlock
from runtime.model.moe_config import MoeConfig
from tests.conftest import _assert_same_greedy
from tests.runtime.engine_helpers import assert_idle, greedy
from tests.runtime.model.tiny_families import hf_greedy_each, random_prompts
from tests.runtime.model.tiny_moe import MOE_FAMILIES, NUM_EXPERTS, TOP_K, save_tiny_moe, tiny_moe_config

NEW_TOKENS = 24
BLOCK = 8
PROMPT_LENS = [203, 229, 251]


@pytest.fixture(scope="module", params=MOE_FAMILIES)
def tiny(request, tmp_path_factory, smollm2_tokenizer):
    """(family, folder, prompts, transformers' greedy reference per prompt)."""
    folder = save_tiny_moe(request.param, tmp_path_factory.mktemp(request.param), smollm2_tokenizer)
    prompts = random_prompts(PROMPT_LENS)
    return request.param, folder, prompts, hf_greedy_each(folder, prompts, NEW_TOKENS)


@pytest.mark.slow  # 35-65 s per family on 2 shared cores (transformers' generate included)
def test_greedy_equals_transformers_cold_and_warm(tiny):
    family, folder, prompts, refs = tiny
    engine = Engine(model=str(folder), dtype="float32", block_size=BLOCK, chunked_prefill_size=40, num_blocks=256)
    kinds = [type(layer.mlp) for layer in engine.runner.model.layers]
    assert kinds == ([SparseMoeBlock, GatedMLP, SparseMoeBlock] if family == "qwen3_moe" else [SparseMoeBlock] * 2)
    cold = engine.generate(input_ids=prompts, sampling_params=greedy(NEW_TOKENS))
    for out, (ref, ref_logits) in zip(cold, refs, strict=True):
        assert len(out.token_ids) == NEW_TOKENS
        _assert_same_greedy(out.token_ids, ref, ref_logits)
    assert [o.usage.cached_tokens for o in cold] == [0, 0, 0]
    warm = engine.generate(input_ids=prompts, sampling_params=greedy(NEW_TOKENS))
    assert [o.usage.cached_tokens for o in warm] == [(n - 1) // BLOCK * BLOCK for n in PROMPT_LENS]
    assert [o.token_ids for o in warm] == [o.token_ids for o in cold]
    assert_idle(engine)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_config_reads_the_experts(tmp_path, family):
    tiny_moe_config(family).save_pretrained(tmp_path)
    cfg = load_config(tmp_path)
    assert cfg.architecture == ("Qwen3MoeForCausalLM" if family == "qwen3_moe" else "MixtralForCausalLM")
    if family == "qwen3_moe":
        assert cfg.moe == MoeConfig(NUM_EXPERTS, TOP_K, 32, True, 1, (1,))
        assert [cfg.moe.is_sparse(i) for i in range(3)] == [True, False, True]
        assert cfg.sliding_window is None  # use_sliding_window is off
    else:
        assert cfg.moe == MoeConfig(NUM_EXPERTS, TOP_K, 32, True)
        assert cfg.sliding_window == 48 and set(cfg.layer_types) == {"sliding_attention"}


def test_hub_style_qwen3_moe_config_keys(tmp_path):
    # Qwen3-30B-A3B's config.json spells num_experts (transformers 5 writes num_local_experts) and sets a step
    raw = tiny_moe_config("qwen3_moe").to_dict()
    raw.pop("num_local_experts", None)
    raw |= {"num_experts": 6, "decoder_sparse_step": 2, "mlp_only_layers": [], "norm_topk_prob": False}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    moe = load_config(tmp_path).moe
    assert moe == MoeConfig(6, TOP_K, 32, False, 2, ())
    assert [moe.is_sparse(i) for i in range(4)] == [False, True, False, True]


def test_a_top_k_above_the_experts_is_a_corrupt_config(tmp_path):
    raw = tiny_moe_config("mixtral").to_dict() | {"num_experts_per_tok": NUM_EXPERTS + 1}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CorruptModelError, match="num_experts_per_tok"):
        load_config(tmp_path)
