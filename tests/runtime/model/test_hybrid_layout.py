"""hybrid_layout (runtime/model/hybrid_kv.py), the choice between one KV cache group and two under kv_groups "auto"
(the default): two only for a model with sliding layers whose window is shorter than the context it serves."""

from __future__ import annotations

import dataclasses
import logging

from runtime.config import ServerArgs
from runtime.model.hf_config import FULL_ATTENTION, SLIDING_ATTENTION, ModelConfig
from runtime.model.hybrid_kv import hybrid_layout

LOCAL_GLOBAL = (SLIDING_ATTENTION, SLIDING_ATTENTION, FULL_ATTENTION)


def _config(layer_types: tuple[str, ...] = (), sliding_window: int | None = None) -> ModelConfig:
    return ModelConfig(
        architecture="Gemma3ForCausalLM",
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        rope_type="default",
        rope_scaling={},
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        layer_types=layer_types,
        sliding_window=sliding_window,
    )


def test_auto_is_the_default_and_groups_only_a_window_shorter_than_the_context(caplog) -> None:
    args = ServerArgs()
    assert args.kv_groups == "auto"
    assert hybrid_layout(args, _config(LOCAL_GLOBAL, 32)) == 32
    assert hybrid_layout(dataclasses.replace(args, kv_groups="single"), _config(LOCAL_GLOBAL, 32)) is None
    assert hybrid_layout(args, _config()) is None  # full attention only: one group, today's path
    assert hybrid_layout(args, _config((FULL_ATTENTION,) * 3)) is None
    with caplog.at_level(logging.INFO, logger="runtime.model.hybrid_kv"):
        assert hybrid_layout(args, _config(LOCAL_GLOBAL, 1024)) is None  # the window covers max_position_embeddings
        assert hybrid_layout(dataclasses.replace(args, max_model_len=32), _config(LOCAL_GLOBAL, 32)) is None
    assert [r.getMessage() for r in caplog.records] == [
        "kv_groups auto: the 1024-token window covers the 1024-token context: one group",
        "kv_groups auto: the 32-token window covers the 32-token context: one group",
    ]
    assert hybrid_layout(dataclasses.replace(args, max_model_len=33), _config(LOCAL_GLOBAL, 32)) == 32


def test_a_window_pool_from_the_ratio_is_raised_to_a_window_and_a_chunk() -> None:
    import torch

    from runtime.model.hybrid_kv import HybridKVCache

    cfg = _config(LOCAL_GLOBAL, 32)
    cpu = torch.device("cpu")
    small = ServerArgs(num_blocks=24, block_size=8, chunked_prefill_size=40)
    kv = HybridKVCache(small, cfg, 32, 8, torch.float32, cpu)
    assert (kv.num_blocks, kv.num_window_blocks) == (24, 11)  # 0.25 x 24 = 6 < cdiv(32 + 40, 8) + 2 = 11
    assert kv.window_k.shape == (2, 11, 8, 2, 16) and kv.k_cache.shape == (1, 24, 8, 2, 16)
    large = dataclasses.replace(small, num_blocks=100)
    assert HybridKVCache(large, cfg, 32, 8, torch.float32, cpu).num_window_blocks == 25  # 0.25 x 100


def test_the_budget_buys_a_full_block_and_its_share_of_window_blocks() -> None:
    import torch

    from runtime.model.hybrid_kv import HybridKVCache, hybrid_block_bytes

    cfg = _config(LOCAL_GLOBAL, 32)
    args = ServerArgs(block_size=8, chunked_prefill_size=40, kv_cache_memory=3072 * 50)
    # K and V x 8 tokens x 2 heads x 16 x 4 bytes = 2048 bytes a layer: 1 full layer + 0.25 x 2 sliding layers
    assert hybrid_block_bytes(args, cfg, 8, torch.float32) == 2048 + 1024
    kv = HybridKVCache(args, cfg, 32, 8, torch.float32, torch.device("cpu"))
    assert (kv.num_blocks, kv.num_window_blocks) == (50, 12)  # 3072 * 50 bytes; 0.25 x 50 = 12 >= 11
