"""config.json reading per family (runtime/model/hf_config.py): attention layout, rope sections, the features refused,
on configs as the Hub writes them (older keys) and as transformers 5 writes them."""

from __future__ import annotations

import json

import pytest

from runtime.model.hf_config import FULL_ATTENTION, SLIDING_ATTENTION, load_config
from runtime.model.loader import CorruptModelError, UnsupportedModelError

BASE = {
    "vocab_size": 100,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
F, S = FULL_ATTENTION, SLIDING_ATTENTION


def _load(tmp_path, arch: str, **fields):
    (tmp_path / "config.json").write_text(json.dumps({**BASE, "architectures": [arch], **fields}))
    return load_config(tmp_path)


def test_qwen_windows_only_with_use_sliding_window(tmp_path):
    hub = _load(tmp_path, "Qwen2ForCausalLM", sliding_window=32768, max_window_layers=28, use_sliding_window=False)
    assert (hub.layer_types, hub.sliding_window, hub.layer_window(3)) == ((F,) * 4, None, None)
    on = _load(tmp_path, "Qwen3ForCausalLM", sliding_window=64, max_window_layers=2, use_sliding_window=True)
    assert (on.layer_types, on.sliding_window, on.layer_window(1), on.layer_window(2)) == ((F, F, S, S), 64, None, 64)


def test_mistral_and_phi3_slide_on_every_layer_with_no_context_cap(tmp_path):
    mistral = _load(tmp_path, "MistralForCausalLM", sliding_window=4096, max_position_embeddings=32768)
    assert (mistral.layer_types, mistral.sliding_window, mistral.max_position_embeddings) == ((S,) * 4, 4096, 32768)
    assert _load(tmp_path, "MistralForCausalLM", sliding_window=None).layer_types == (F,) * 4
    assert _load(tmp_path, "LlamaForCausalLM", sliding_window=16).sliding_window is None


def test_phi3_su_rope_is_longrope_with_its_lengths(tmp_path):
    rope = {"type": "su", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}
    cfg = _load(
        tmp_path,
        "Phi3ForCausalLM",
        rope_scaling=rope,
        max_position_embeddings=131072,
        original_max_position_embeddings=4096,
        partial_rotary_factor=0.75,
    )
    assert cfg.rope_type == "longrope" and cfg.partial_rotary_factor == 0.75
    assert (cfg.rope_scaling["original_max_position_embeddings"], cfg.rope_scaling["max_position_embeddings"]) == (
        4096,
        131072,
    )
    with pytest.raises(CorruptModelError, match="longrope needs"):
        _load(tmp_path, "Phi3ForCausalLM", rope_scaling={"type": "longrope", "short_factor": [1.0]})
    with pytest.raises(UnsupportedModelError, match="rope type 'yarn'"):
        _load(tmp_path, "Qwen3ForCausalLM", rope_scaling={"rope_type": "yarn", "factor": 4.0})


def test_gemma3_hub_config_pattern_and_rope_bases(tmp_path):
    cfg = _load(
        tmp_path,
        "Gemma3ForCausalLM",
        num_hidden_layers=7,
        head_dim=256,
        sliding_window=512,
        sliding_window_pattern=6,
        rope_theta=1_000_000.0,
        rope_local_base_freq=10_000.0,
        rope_scaling={"rope_type": "linear", "factor": 8.0},
        query_pre_attn_scalar=256,
        hidden_activation="gelu_pytorch_tanh",
        final_logit_softcapping=None,
    )
    assert cfg.layer_types == (S, S, S, S, S, F, S)
    assert (cfg.rope_theta, cfg.rope_type, cfg.rope_scaling["factor"]) == (1e6, "linear", 8.0)
    assert cfg.local_rope_theta == 1e4
    assert (cfg.query_pre_attn_scalar, cfg.hidden_act, cfg.tie_word_embeddings) == (256.0, "gelu_pytorch_tanh", True)
    assert cfg.final_logit_softcapping is None and cfg.head_dim == 256


def test_gemma3_transformers5_rope_per_layer_type(tmp_path):
    rope = {F: {"rope_type": "default", "rope_theta": 5e5}, S: {"rope_type": "default", "rope_theta": 2e4}}
    cfg = _load(tmp_path, "Gemma3ForCausalLM", rope_parameters=rope, sliding_window=16, layer_types=[S, F, S, F])
    assert (cfg.rope_theta, cfg.local_rope_theta, cfg.layer_types) == (5e5, 2e4, (S, F, S, F))
    assert [cfg.layer_window(i) for i in range(4)] == [16, None, 16, None]


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"attn_logit_softcapping": 50.0}, "attention logit softcapping"),
        ({"use_bidirectional_attention": True}, "bidirectional attention"),
        ({"hidden_activation": "relu"}, "activation 'relu'"),
    ],
)
def test_features_the_kernels_lack_are_refused(tmp_path, fields, message):
    with pytest.raises(UnsupportedModelError, match=message):
        _load(tmp_path, "Gemma3ForCausalLM", **fields)
