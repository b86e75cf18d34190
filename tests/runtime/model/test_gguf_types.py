"""Each supported GGUF tensor type loads (runtime/model/gguf_convert.py): a one-layer model written with gguf-py in that
type reads back, under Hugging Face names, exactly as gguf-py dequantizes it; Llama's q/k rows come back in Hugging
Face's order; each tensor's type is recorded; a type outside the supported list fails naming the supported ones."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from runtime.model.gguf_convert import SUPPORTED_GGUF_TYPES, read_gguf
from runtime.model.loader import UnsupportedModelError, resolve_model
from tests.runtime.model.gguf_files import TINY, write_tiny_gguf

QUANT_TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "F16", "BF16"]
HF_OF_GGUF = {
    "blk.0.attn_q.weight": "model.layers.0.self_attn.q_proj.weight",
    "blk.0.attn_k.weight": "model.layers.0.self_attn.k_proj.weight",
    "blk.0.attn_v.weight": "model.layers.0.self_attn.v_proj.weight",
    "blk.0.attn_output.weight": "model.layers.0.self_attn.o_proj.weight",
    "blk.0.ffn_gate.weight": "model.layers.0.mlp.gate_proj.weight",
    "blk.0.ffn_up.weight": "model.layers.0.mlp.up_proj.weight",
    "blk.0.ffn_down.weight": "model.layers.0.mlp.down_proj.weight",
    "token_embd.weight": "model.embed_tokens.weight",
    "output.weight": "lm_head.weight",
    "blk.0.attn_norm.weight": "model.layers.0.input_layernorm.weight",
    "blk.0.ffn_norm.weight": "model.layers.0.post_attention_layernorm.weight",
    "output_norm.weight": "model.norm.weight",
}


QWEN2_BIASES = {f"blk.0.attn_{p}.bias": f"model.layers.0.self_attn.{p}_proj.bias" for p in "qkv"}


def unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's convert_hf_to_gguf permute of q/k rows (each head's rotary halves interleaved in pairs)."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("type_name", QUANT_TYPES)
def test_every_tensor_equals_gguf_py_dequantization(tmp_path, arch, type_name):
    qtype = GGMLQuantizationType[type_name]
    raw = write_tiny_gguf(tmp_path / "tiny.gguf", arch, qtype)
    checkpoint = read_gguf(tmp_path / "tiny.gguf")
    names = {**HF_OF_GGUF, **(QWEN2_BIASES if arch == "qwen2" else {})}
    assert set(checkpoint.tensors) == set(names.values())
    for gguf_name, hf_name in names.items():
        projection = gguf_name.endswith(".weight") and gguf_name.startswith(("blk.0.attn_", "blk.0.ffn_"))
        stored = qtype if projection and "norm" not in gguf_name else None
        expected = dequantize(raw[gguf_name], stored or GGMLQuantizationType.F32).astype(np.float32)
        if arch == "llama" and gguf_name == "blk.0.attn_q.weight":
            expected = unpermute(expected, TINY["heads"])
        if arch == "llama" and gguf_name == "blk.0.attn_k.weight":
            expected = unpermute(expected, TINY["kv_heads"])
        got = checkpoint.tensors[hf_name]
        assert got.dtype == torch.float32 and got.shape == expected.shape, hf_name
        assert torch.equal(got, torch.from_numpy(expected)), hf_name
        assert checkpoint.types[hf_name] == (stored or GGMLQuantizationType.F32).name, hf_name
    assert checkpoint.architecture == {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[arch]


def test_quantized_weights_are_not_trivial(tmp_path):
    """The K-quant blocks written from random bytes dequantize to spread-out values (the comparison above is not
    between two arrays of zeros)."""
    raw = write_tiny_gguf(tmp_path / "tiny.gguf", "llama", GGMLQuantizationType.Q4_K)
    values = dequantize(raw["blk.0.ffn_up.weight"], GGMLQuantizationType.Q4_K)
    assert values.std() > 0.01 and len(np.unique(values)) > 1000


def test_unsupported_type_fails_listing_the_supported_ones(tmp_path):
    path = tmp_path / "q2k.gguf"
    write_tiny_gguf(path, "llama", GGMLQuantizationType.Q2_K)
    supported = ", ".join(repr(t) for t in SUPPORTED_GGUF_TYPES)
    with pytest.raises(UnsupportedModelError, match=rf"\['Q2_K'\] are not supported; supported: \[{supported}\]"):
        read_gguf(path)
    with pytest.raises(UnsupportedModelError, match=r"\['Q2_K'\] are not supported"):
        resolve_model(str(path))
