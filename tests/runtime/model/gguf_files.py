"""Test helper: small GGUF files written with gguf-py's GGUFWriter, their tensors in a chosen GGML type.

Types gguf-py can quantize (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, F16, BF16) are quantized from random float32 weights with
gguf.quants.quantize; the K-quants (no Python quantizer in gguf-py: Q4_K, Q5_K, Q6_K, and Q2_K) are random bytes with
their float16 super-block scales set to sane values (d = 0.01, dmin = 0.005), so every bit pattern of the quants and
sub-scales occurs.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize

# Byte offsets of the float16 scales d and dmin inside one block (ggml-common.h, block_q2_K ... block_q6_K); Q2_K
# serves as a type the loader refuses.
_K_SCALE_OFFSETS = {
    GGMLQuantizationType.Q2_K: {"d": 80, "dmin": 82},
    GGMLQuantizationType.Q4_K: {"d": 0, "dmin": 2},
    GGMLQuantizationType.Q5_K: {"d": 0, "dmin": 2},
    GGMLQuantizationType.Q6_K: {"d": 208},
}
_K_SCALES = {"d": 0.01, "dmin": 0.005}
TINY = {"hidden": 256, "intermediate": 512, "heads": 4, "kv_heads": 2, "vocab": 64, "layers": 1}


def encode(weight: np.ndarray, qtype: GGMLQuantizationType, rng: np.random.Generator) -> np.ndarray:
    """weight float32 [N, K] in GGML type qtype (uint8 bytes [N, K / block * type_size], or a float array)."""
    if qtype not in _K_SCALE_OFFSETS:
        return quantize(weight, qtype)
    block, size = GGML_QUANT_SIZES[qtype]
    rows, k = weight.shape
    blocks = rng.integers(0, 256, size=(rows, k // block, size), dtype=np.uint8)
    for field, offset in _K_SCALE_OFFSETS[qtype].items():
        blocks[..., offset : offset + 2] = np.frombuffer(np.float16(_K_SCALES[field]).tobytes(), dtype=np.uint8)
    return blocks.reshape(rows, -1)


def write_tiny_gguf(path: Path, arch: str, qtype: GGMLQuantizationType, seed: int = 0) -> dict[str, np.ndarray]:
    """Write a one-layer model of architecture arch ("llama", "qwen2") with every projection in qtype (embeddings,
    head, norms and Qwen2's q/k/v biases float32). Returns the raw array written per GGUF tensor name (what
    gguf.quants.dequantize reads).
    """
    rng = np.random.default_rng(seed)
    h, f, heads, kv, vocab = (TINY[k] for k in ("hidden", "intermediate", "heads", "kv_heads", "vocab"))
    head_dim = h // heads
    writer = GGUFWriter(str(path), arch)
    writer.add_context_length(256)
    writer.add_embedding_length(h)
    writer.add_block_count(TINY["layers"])
    writer.add_feed_forward_length(f)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(10000.0)
    writer.add_vocab_size(vocab)
    shapes = {
        "blk.0.attn_q.weight": (heads * head_dim, h),
        "blk.0.attn_k.weight": (kv * head_dim, h),
        "blk.0.attn_v.weight": (kv * head_dim, h),
        "blk.0.attn_output.weight": (h, heads * head_dim),
        "blk.0.ffn_gate.weight": (f, h),
        "blk.0.ffn_up.weight": (f, h),
        "blk.0.ffn_down.weight": (h, f),
    }
    raw: dict[str, np.ndarray] = {}
    for name, shape in shapes.items():
        raw[name] = encode(rng.standard_normal(shape, dtype=np.float32) * 0.05, qtype, rng)
    raw["token_embd.weight"] = rng.standard_normal((vocab, h), dtype=np.float32)
    raw["output.weight"] = rng.standard_normal((vocab, h), dtype=np.float32) * 0.05
    for name in ("blk.0.attn_norm.weight", "blk.0.ffn_norm.weight", "output_norm.weight"):
        raw[name] = 1.0 + 0.1 * rng.standard_normal(h, dtype=np.float32)
    if arch == "qwen2":  # Qwen2's q/k/v projections have biases
        for p in "qkv":
            raw[f"blk.0.attn_{p}.bias"] = 0.1 * rng.standard_normal(
                shapes[f"blk.0.attn_{p}.weight"][0], dtype=np.float32
            )
    for name, array in raw.items():
        quantized = name in shapes
        writer.add_tensor(name, array, raw_dtype=qtype if quantized else None)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return raw
