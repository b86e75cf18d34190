"""Paged attention and KV cache ops, with one signature on every backend.

KV cache layout (the one layout every function here reads and writes), per layer:

    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], same dtype as q.

The model runner allocates one tensor per K and V for all layers, [num_layers, num_blocks, block_size, num_kv_heads,
head_dim], and passes ``k_cache[layer]`` views. Token position p of a sequence lives at slot
``block_table[p // block_size] * block_size + p % block_size``. Block 0 is the null block: block tables are padded with
0 so a padded entry never aliases live data; padded tokens have slot -1 in slot_mapping and are never written.

Backends: ``backend=None`` or ``"auto"`` picks ``"triton"`` for CUDA tensors and ``"reference"`` (torch, kernels/
reference.py) for CPU tensors; ``"reference"`` or ``"triton"`` forces one. On CPU, decode attention over float32 or
bfloat16 caches runs the fused operator of kernels/cpu_decode.py (built on first use) when it builds. Triton on CPU
tensors works only under ``TRITON_INTERPRET=1`` (the tests use it). Triton is imported lazily, on the first Triton
call, so the CPU path never imports it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kernels import reference
from kernels.errors import KernelError, KernelInputError, UnknownBackend

if TYPE_CHECKING:
    import torch

__all__ = [
    "BACKENDS",
    "KernelError",
    "KernelInputError",
    "UnknownBackend",
    "copy_blocks",
    "paged_attention",
    "resolve_backend",
    "store_kv",
    "swap_blocks",
]

BACKENDS = ("auto", "reference", "triton")


def resolve_backend(backend: str | None, tensor: torch.Tensor) -> str:
    """Return "reference" or "triton" for ``backend`` (None/"auto" follow ``tensor``'s device).

    Raises:
        UnknownBackend: backend is not one of BACKENDS (or None).
    """
    if backend is None or backend == "auto":
        return "triton" if tensor.is_cuda else "reference"
    if backend not in BACKENDS:
        raise UnknownBackend(f"attention backend must be one of {BACKENDS} or None, got {backend!r}")
    return backend


def _triton():
    from kernels import triton_ops

    return triton_ops


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    backend: str | None = None,
) -> None:
    """Write new tokens' K/V into their slots. Mutates k_cache and v_cache in place.

    Args:
        k, v: [num_tokens, num_kv_heads, head_dim], dtype of the caches.
        k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim].
        slot_mapping: int64 [num_tokens], slot = block * block_size + offset; -1 marks padding (skipped).

    Raises:
        KernelInputError: mismatched shapes, devices or dtypes.
    """
    reference.check_store_inputs(k, v, k_cache, v_cache, slot_mapping)
    if resolve_backend(backend, k_cache) == "triton":
        _triton().store_kv(k, v, k_cache, v_cache, slot_mapping)
    else:
        reference.store_kv(k, v, k_cache, v_cache, slot_mapping)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    backend: str | None = None,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Causal attention of a flat varlen query batch over paged K/V (decode, extend and prefill mixed).

    Query i of a sequence with query_len n and seq_len L sits at position p = L - n + i and attends to the keys at
    positions k <= p of that sequence; with a sliding window W, to p - W < k <= p only (the last W positions, itself
    included). That is transformers' ``sliding_window_overlay`` (``kv_idx > q_idx - sliding_window``, and-ed with
    the causal mask), which Mistral and Gemma 3's local layers use with their config's ``sliding_window``. Every
    backend skips the blocks that lie wholly before a query's window: a decode reads at most
    cdiv(W - 1, block_size) + 1 blocks per sequence, whatever its length. The K/V of this step's tokens must already
    be stored (store_kv first).

    Args:
        q: [num_tokens, num_heads, head_dim]; num_heads % num_kv_heads == 0 (GQA/MQA).
        k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], dtype of q.
        block_tables: int32 [num_seqs, max_blocks_per_seq], padded with 0.
        seq_lens: int32 [num_seqs], context of each sequence in tokens, this step's new tokens included.
        query_start_loc: int32 [num_seqs + 1], cumulative query lengths starting at 0.
        scale: softmax scale (usually head_dim ** -0.5).
        max_query_len, max_seq_len: optional host-side hints (tokens) so the caller avoids a device sync. When given
            they must be the batch's true maxima (or upper bounds; max_query_len == 1 promises a decode-only batch):
            the Triton backend sizes its grid from them.
        backend: None/"auto", "reference" or "triton".
        sliding_window: W in tokens (a layer's window), or None / 0 for full causal attention.

    Returns:
        [num_tokens, num_heads, head_dim], dtype of q. Mutates nothing.

    Raises:
        KernelInputError: mismatched shapes, devices or dtypes; a sliding_window that is not None or an int >= 0;
            UnknownBackend.
    """
    reference.check_attention_inputs(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc)
    window = reference.check_sliding_window(sliding_window)
    if resolve_backend(backend, q) == "triton":
        fn = _triton().paged_attention
    else:
        fn = reference.paged_attention
    args = (q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, max_query_len, max_seq_len)
    return fn(*args, sliding_window=window)


def copy_blocks(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    pairs: list[tuple[int, int]] | torch.Tensor,
    backend: str | None = None,
) -> None:
    """Copy whole blocks src -> dst in both caches (copy-on-write). Mutates k_cache and v_cache.

    Args:
        k_cache, v_cache: [..., num_blocks, block_size, num_kv_heads, head_dim]; the block dim is -4, so a per-layer
            cache or the all-layer [num_layers, num_blocks, ...] tensor both work.
        pairs: list of (src, dst) block ids, or int64 [n, 2]. All reads happen before any write.

    Raises:
        KernelInputError: a block id out of range, a dst listed twice, or mismatched caches.
    """
    if resolve_backend(backend, k_cache) == "triton":
        _triton().copy_blocks(k_cache, v_cache, pairs)
    else:
        reference.copy_blocks(k_cache, v_cache, pairs)


def swap_blocks(src: torch.Tensor, dst: torch.Tensor, pairs: list[tuple[int, int]] | torch.Tensor) -> None:
    """Copy src[..., s, :, :, :] -> dst[..., d, :, :, :] for each (s, d); block dim -4. Mutates dst.

    src and dst may be on different devices (device cache <-> host cache, preemption by swapping).

    Raises:
        KernelInputError: a block id out of range, a dst listed twice, or mismatched shapes/dtypes.
    """
    reference.swap_blocks(src, dst, pairs)
