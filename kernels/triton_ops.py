"""The Triton backend of kernels/: argument preparation and kernel choice; the kernels live in triton_*.py.

Importing this module imports triton. On CPU tensors the kernels run only under TRITON_INTERPRET=1 (set before
triton is imported), which the tests use.
"""

from __future__ import annotations

import torch

from kernels import reference
from kernels.errors import KernelInputError
from kernels.triton_cache import copy_blocks as _copy_blocks
from kernels.triton_cache import store_kv as _store_kv
from kernels.triton_decode import decode_attention
from kernels.triton_extend import extend_attention


def _last_dim_contiguous(name: str, t: torch.Tensor) -> None:
    if t.stride(-1) != 1:
        raise KernelInputError(f"{name} must have a contiguous last dim for the Triton backend, strides {t.stride()}")


def store_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """kernels.store_kv on Triton. Mutates k_cache, v_cache."""
    for name, t in (("k", k), ("v", v), ("k_cache", k_cache), ("v_cache", v_cache)):
        _last_dim_contiguous(name, t)
    _store_kv(k, v, k_cache, v_cache, slot_mapping.contiguous())


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
    sliding_window: int | None = None,
) -> torch.Tensor:
    """kernels.paged_attention on Triton: the split-KV decode kernel when every query_len is 1, else the extend
    kernel. Without the max_query_len / max_seq_len hints this reads them from the device (a sync).
    sliding_window: W tokens or None (kernels.paged_attention's rule)."""
    _last_dim_contiguous("k_cache", k_cache)
    _last_dim_contiguous("v_cache", v_cache)
    q = q if q.stride(-1) == 1 else q.contiguous()
    block_tables = block_tables.contiguous()
    seq_lens, query_start_loc = seq_lens.contiguous(), query_start_loc.contiguous()
    if q.shape[0] == 0:
        return q.new_empty(q.shape)
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
    if max_query_len == 1:
        if max_seq_len is None:
            max_seq_len = int(seq_lens.max())
        args = (q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, max_seq_len)
        return decode_attention(*args, sliding_window=sliding_window)
    args = (q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, max_query_len)
    return extend_attention(*args, sliding_window=sliding_window)


def copy_blocks(k_cache: torch.Tensor, v_cache: torch.Tensor, pairs: list[tuple[int, int]] | torch.Tensor) -> None:
    """kernels.copy_blocks on Triton for contiguous caches whose dst blocks are not also src blocks; otherwise the
    torch path (which reads every src before writing). Mutates k_cache, v_cache."""
    t = reference.check_pairs(pairs, k_cache.shape[-4], k_cache.shape[-4])
    if t.numel() == 0:
        return
    chained = bool(set(t[:, 0].tolist()) & set(t[:, 1].tolist()))
    if chained or not (k_cache.is_contiguous() and v_cache.is_contiguous()) or k_cache.shape != v_cache.shape:
        reference.copy_blocks(k_cache, v_cache, t)
        return
    _copy_blocks(k_cache, v_cache, t.to(k_cache.device).contiguous())
