"""Torch implementation of the KV cache ops and paged attention: the CPU serving path and the test oracle.

Layout: see kernels/__init__.py (k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]).

Paged attention gathers each sequence's blocks with one index per block (a row copy of block_size * num_kv_heads *
head_dim elements, never per token) and runs torch's scaled_dot_product_attention over the gathered K/V. GQA folds the
num_heads // num_kv_heads query heads of a KV head into the query-length axis, so K/V are never repeated.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.errors import KernelInputError


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise KernelInputError(message)


def check_store_inputs(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Validate store_kv's arguments (shapes, dtypes, devices); raises KernelInputError."""
    _require(k_cache.dim() == 4 and k_cache.shape == v_cache.shape, "k_cache/v_cache must be equal 4-D tensors")
    _require(k.shape == v.shape and k.dim() == 3, f"k and v must be equal [tokens, kv_heads, head_dim], got {k.shape}")
    _require(k.shape[1:] == k_cache.shape[2:], f"k {tuple(k.shape)} does not match cache {tuple(k_cache.shape)}")
    _require(k.dtype == k_cache.dtype == v.dtype == v_cache.dtype, "k, v and the caches must share one dtype")
    _require(slot_mapping.shape == (k.shape[0],), f"slot_mapping must be [{k.shape[0]}], got {slot_mapping.shape}")
    _require(slot_mapping.device == k_cache.device == k.device, "k, caches and slot_mapping must share a device")


def check_attention_inputs(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
) -> None:
    """Validate paged_attention's arguments (shapes, dtypes, devices; no device sync); raises KernelInputError."""
    _require(k_cache.dim() == 4 and k_cache.shape == v_cache.shape, "k_cache/v_cache must be equal 4-D tensors")
    _require(q.dim() == 3 and q.shape[2] == k_cache.shape[3], f"q must be [tokens, heads, {k_cache.shape[3]}]")
    _require(q.shape[1] % k_cache.shape[2] == 0, f"num_heads {q.shape[1]} not a multiple of {k_cache.shape[2]}")
    _require(q.dtype == k_cache.dtype == v_cache.dtype, "q and the caches must share one dtype")
    num_seqs = seq_lens.shape[0]
    _require(block_tables.dim() == 2 and block_tables.shape[0] == num_seqs, "block_tables must be [num_seqs, blocks]")
    _require(query_start_loc.shape == (num_seqs + 1,), "query_start_loc must be [num_seqs + 1]")
    devices = {t.device for t in (q, k_cache, v_cache, block_tables, seq_lens, query_start_loc)}
    _require(len(devices) == 1, f"all attention inputs must share a device, got {devices}")


def store_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write k, v [num_tokens, kv_heads, head_dim] into slots slot_mapping (int64, -1 skipped). Mutates the caches."""
    block_size = k_cache.shape[1]
    slots = slot_mapping.long()
    valid = slots >= 0
    if not bool(valid.all()):
        slots, k, v = slots[valid], k[valid], v[valid]
    if slots.numel() == 0:
        return
    blocks, offsets = slots // block_size, slots % block_size
    _require(int(blocks.max()) < k_cache.shape[0], f"slot {int(slots.max())} beyond {k_cache.shape[0]} blocks")
    k_cache.index_put_((blocks, offsets), k)
    v_cache.index_put_((blocks, offsets), v)


def _pairs_tensor(pairs: list[tuple[int, int]] | torch.Tensor, src_blocks: int, dst_blocks: int) -> torch.Tensor:
    t = torch.as_tensor(pairs, dtype=torch.long, device="cpu").reshape(-1, 2)
    if t.numel():
        _require(int(t.min()) >= 0, "block ids must be >= 0")
        _require(int(t[:, 0].max()) < src_blocks, f"src block out of range (num_blocks {src_blocks})")
        _require(int(t[:, 1].max()) < dst_blocks, f"dst block out of range (num_blocks {dst_blocks})")
        _require(t[:, 1].unique().numel() == t.shape[0], "a dst block is listed twice")
    return t


def copy_blocks(k_cache: torch.Tensor, v_cache: torch.Tensor, pairs: list[tuple[int, int]] | torch.Tensor) -> None:
    """Copy blocks (src, dst) within each cache along dim -4 (all reads before writes). Mutates the caches."""
    _require(k_cache.shape == v_cache.shape and k_cache.dim() >= 4, "k_cache/v_cache must be equal, >= 4-D")
    t = _pairs_tensor(pairs, k_cache.shape[-4], k_cache.shape[-4]).to(k_cache.device)
    if t.numel() == 0:
        return
    dim = k_cache.dim() - 4
    for cache in (k_cache, v_cache):
        cache.index_copy_(dim, t[:, 1], cache.index_select(dim, t[:, 0]))


def swap_blocks(src: torch.Tensor, dst: torch.Tensor, pairs: list[tuple[int, int]] | torch.Tensor) -> None:
    """Copy src[..., s, :, :, :] -> dst[..., d, :, :, :] for each (s, d); devices may differ. Mutates dst."""
    _require(src.dim() >= 4 and src.dim() == dst.dim(), "src and dst must have the same rank, >= 4")
    _require(src.shape[:-4] == dst.shape[:-4] and src.shape[-3:] == dst.shape[-3:], "src/dst shapes differ")
    _require(src.dtype == dst.dtype, f"src dtype {src.dtype} != dst dtype {dst.dtype}")
    t = _pairs_tensor(pairs, src.shape[-4], dst.shape[-4])
    if t.numel() == 0:
        return
    dim = src.dim() - 4
    blocks = src.index_select(dim, t[:, 0].to(src.device)).to(dst.device, non_blocking=False)
    dst.index_copy_(dim, t[:, 1].to(dst.device), blocks)


def _gather(cache: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    """cache [num_blocks, bs, kvh, d], tables long [S, n] -> [S, kvh, n * bs, d] (a strided view of one copy)."""
    blocks = cache.index_select(0, tables.reshape(-1))
    s, n = tables.shape
    return blocks.view(s, n * cache.shape[1], cache.shape[2], cache.shape[3]).transpose(1, 2)


def _decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    lens: torch.Tensor,
    max_len: int,
    scale: float,
) -> torch.Tensor:
    """One query token per sequence. q [S, H, d], tables long [S, >=blocks], lens [S] -> [S, H, d]."""
    num_seqs, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    n_blocks = -(-max_len // block_size)
    k = _gather(k_cache, tables[:, :n_blocks])
    v = _gather(v_cache, tables[:, :n_blocks])
    mask = None
    if bool((lens != n_blocks * block_size).any()):
        mask = (torch.arange(n_blocks * block_size, device=q.device) < lens[:, None]).view(num_seqs, 1, 1, -1)
    qg = q.view(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
    out = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=scale)
    return out.reshape(num_seqs, num_heads, head_dim)


def _extend(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor, seq_len: int, scale: float
) -> torch.Tensor:
    """One sequence with q [n, H, d] new tokens at positions seq_len - n .. seq_len - 1 -> [n, H, d]."""
    n, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    n_blocks = -(-seq_len // block_size)
    k = _gather(k_cache, table[None, :n_blocks])[:, :, :seq_len]
    v = _gather(v_cache, table[None, :n_blocks])[:, :, :seq_len]
    # [n, kvh, G, d] -> [1, kvh, G * n, d]: the G query heads of a KV head share its K/V without repeating it.
    qg = q.view(n, num_kv_heads, group, head_dim).permute(1, 2, 0, 3).reshape(1, num_kv_heads, group * n, head_dim)
    q_pos = torch.arange(seq_len - n, seq_len, device=q.device)
    mask = torch.arange(seq_len, device=q.device)[None, :] <= q_pos[:, None]
    mask = mask.repeat(group, 1)
    out = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=scale)
    return out.view(num_kv_heads, group, n, head_dim).permute(2, 0, 1, 3).reshape(n, num_heads, head_dim)


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
) -> torch.Tensor:
    """Paged causal attention; the contract is kernels.paged_attention's. Returns [num_tokens, num_heads, head_dim].

    Decode sequences (one query token) run as one batched SDPA over their gathered blocks with a key-length mask;
    extend/prefill sequences run one SDPA each with the bottom-right causal mask key_pos <= seq_len - n + i.
    """
    out = torch.empty_like(q)
    if q.shape[0] == 0:
        return out
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    tables = block_tables.long()
    decode = [i for i in range(len(lens)) if starts[i + 1] - starts[i] == 1]
    if decode:
        idx = torch.tensor(decode, device=q.device)
        tok = query_start_loc.long()[idx]
        max_len = max(lens[i] for i in decode)
        out[tok] = _decode(q[tok], k_cache, v_cache, tables[idx], seq_lens[idx].long(), max_len, scale)
    for i in range(len(lens)):
        s, e = starts[i], starts[i + 1]
        if e - s > 1:
            out[s:e] = _extend(q[s:e], k_cache, v_cache, tables[i], lens[i], scale)
    return out
