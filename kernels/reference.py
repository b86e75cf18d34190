"""Torch implementation of the KV cache ops and paged attention: the CPU serving path and the test oracle.

Layout: see kernels/__init__.py (k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]).

Paged attention gathers each sequence's blocks with one index per block (a row copy of block_size * num_kv_heads *
head_dim elements, never per token) and runs torch's scaled_dot_product_attention over the gathered K/V. GQA folds the
num_heads // num_kv_heads query heads of a KV head into the query-length axis, so K/V are never repeated.

Sliding window (see kernels.paged_attention): blocks wholly before a sequence's window are never gathered; the keys
of the first gathered block that fall outside it are masked.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.errors import KernelInputError


def _cdiv(n: int, d: int) -> int:
    """ceil(n / d) for ints, d > 0 (kernels/ imports nothing of the project, so not radix.blocks.cdiv)."""
    return -(-n // d)


def _cpu_decode():
    # Imported on first use, not with the package: `python -m kernels.cpu_decode` (the build command) must find the
    # module not yet imported, or runpy warns that it runs a second copy.
    from kernels import cpu_decode

    return cpu_decode


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


def check_sliding_window(sliding_window: int | None) -> int | None:
    """The window as the backends take it: None for full causal attention (None or 0), else the int W >= 1.

    Raises:
        KernelInputError: sliding_window is not None or an int >= 0 (a bool, a float or a negative number)."""
    ok = sliding_window is None or (isinstance(sliding_window, int) and not isinstance(sliding_window, bool))
    _require(ok and (sliding_window or 0) >= 0, f"sliding_window must be None or an int >= 0, got {sliding_window!r}")
    return sliding_window or None


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


def check_pairs(pairs: list[tuple[int, int]] | torch.Tensor, src_blocks: int, dst_blocks: int) -> torch.Tensor:
    """Pairs as int64 [n, 2] on the CPU; raises KernelInputError for an id out of range or a dst listed twice."""
    t = torch.as_tensor(pairs, dtype=torch.long).cpu().reshape(-1, 2)
    if t.numel():
        _require(int(t.min()) >= 0, "block ids must be >= 0")
        _require(int(t[:, 0].max()) < src_blocks, f"src block out of range (num_blocks {src_blocks})")
        _require(int(t[:, 1].max()) < dst_blocks, f"dst block out of range (num_blocks {dst_blocks})")
        _require(t[:, 1].unique().numel() == t.shape[0], "a dst block is listed twice")
    return t


def copy_blocks(k_cache: torch.Tensor, v_cache: torch.Tensor, pairs: list[tuple[int, int]] | torch.Tensor) -> None:
    """Copy blocks (src, dst) within each cache along dim -4 (all reads before writes). Mutates the caches."""
    _require(k_cache.shape == v_cache.shape and k_cache.dim() >= 4, "k_cache/v_cache must be equal, >= 4-D")
    t = check_pairs(pairs, k_cache.shape[-4], k_cache.shape[-4]).to(k_cache.device)
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
    t = check_pairs(pairs, src.shape[-4], dst.shape[-4])
    if t.numel() == 0:
        return
    dim = src.dim() - 4
    blocks = src.index_select(dim, t[:, 0].to(src.device)).to(dst.device, non_blocking=False)
    dst.index_copy_(dim, t[:, 1].to(dst.device), blocks)


# Gathered K/V are written into one reused buffer per (device, dtype): a fresh multi-MB allocation per call costs
# page faults that, measured on CPU, took longer than the gather itself. The buffer is never shared between calls,
# so the reference path must not run concurrently from two threads.
_workspaces: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}

# Decode sequences are gathered a few at a time so that the gathered K/V (about this many bytes) are still in the
# CPU's L2 cache when attention reads them; benchmarks/attention_kernel.py measured group sizes on CPU.
DECODE_GROUP_BYTES = 2 << 20


def _workspace(like: torch.Tensor, numel: int) -> torch.Tensor:
    key = (like.device, like.dtype)
    buf = _workspaces.get(key)
    if buf is None or buf.numel() < numel:
        # A normal tensor (not an inference tensor) so callers inside and outside torch.inference_mode can both
        # write into it; an inference tensor would refuse in-place writes outside inference mode.
        with torch.inference_mode(False):
            buf = torch.empty(max(numel, 1 << 16), dtype=like.dtype, device=like.device)
        _workspaces[key] = buf
    return buf


def _gather(k_cache: torch.Tensor, v_cache: torch.Tensor, blocks: torch.Tensor, num_seqs: int):
    """Gather blocks (long [num_seqs * n]) of both caches into the workspace -> K, V [num_seqs, kvh, n * bs, d].

    The results are strided views (token stride kvh * d) valid until the next gather."""
    size = blocks.numel() * k_cache[0].numel()
    buf = _workspace(k_cache, 2 * size)
    shape = (blocks.numel(),) + tuple(k_cache.shape[1:])
    k = torch.index_select(k_cache, 0, blocks, out=buf[:size].view(shape))
    v = torch.index_select(v_cache, 0, blocks, out=buf[size : 2 * size].view(shape))
    tokens = blocks.numel() // num_seqs * k_cache.shape[1]
    view = (num_seqs, tokens, k_cache.shape[2], k_cache.shape[3])
    return k.view(view).transpose(1, 2), v.view(view).transpose(1, 2)


def window_start(seq_len: int, num_new: int, sliding_window: int | None) -> int:
    """First key position any of the last ``num_new`` queries of a ``seq_len``-token sequence may see (tokens).

    0 without a window; else max(0, seq_len - num_new - sliding_window + 1): the first of those queries sits at
    seq_len - num_new and sees keys k > position - sliding_window."""
    if not sliding_window:
        return 0
    return max(0, seq_len - num_new - sliding_window + 1)


def _decode_tables(tables: torch.Tensor, first: torch.Tensor, n_blocks: int) -> torch.Tensor:
    """Block ids long [S * n_blocks]: row i's entries first[i] .. first[i] + n_blocks - 1, clamped to the table's
    width (a clamped entry lies past the sequence's end and is masked)."""
    cols = (first[:, None] + torch.arange(n_blocks, device=tables.device)).clamp_(max=tables.shape[1] - 1)
    return tables.gather(1, cols).reshape(-1)


def _decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    lens: list[int],
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """One query token per sequence, sequences sorted by decreasing length.

    q [S, H, d], tables long [S, >= blocks], lens: S ints (tokens) -> [S, H, d]. Sequences are taken in groups whose
    gathered K/V stay under DECODE_GROUP_BYTES (at least one sequence per group); a group pads to its longest
    sequence and masks the padding. GQA: the G = H / kvh query heads of a KV head are its G query rows. With a
    sliding window each sequence gathers only the blocks its window touches (at most cdiv(window - 1, block_size) + 1)
    and masks the keys before the window. Contiguous float32 / bfloat16 CPU caches take the fused kernel instead
    (kernels/cpu_decode.py: no gather), when it builds.
    """
    lens_t = torch.tensor(lens, device=q.device)
    cpu_decode = _cpu_decode()
    if cpu_decode.supports(q, k_cache, v_cache):
        fused = cpu_decode.paged_decode(q, k_cache, v_cache, tables, lens_t, scale, sliding_window)
        if fused is not None:
            return fused
    num_seqs, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    token_bytes = 2 * num_kv_heads * head_dim * q.element_size()
    qg = q.view(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
    out = qg.new_empty(qg.shape)
    starts = [window_start(n, 1, sliding_window) for n in lens]
    first_t = torch.tensor([s // block_size for s in starts], device=q.device)
    start = 0
    while start < num_seqs:
        n_blocks = _cdiv(lens[start], block_size)
        if sliding_window:
            n_blocks = min(n_blocks, _cdiv(sliding_window - 1, block_size) + 1)
        group = max(1, min(num_seqs - start, DECODE_GROUP_BYTES // (n_blocks * block_size * token_bytes)))
        end = start + group
        windowed = any(starts[start:end])
        if windowed:
            blocks = _decode_tables(tables[start:end], first_t[start:end], n_blocks)
        else:
            blocks = tables[start:end, :n_blocks].reshape(-1)
        k, v = _gather(k_cache, v_cache, blocks, group)
        mask = None
        if windowed or lens[end - 1] != n_blocks * block_size:
            key_pos = first_t[start:end, None] * block_size + torch.arange(n_blocks * block_size, device=q.device)
            visible = key_pos < lens_t[start:end, None]
            if windowed:
                visible &= key_pos >= torch.tensor(starts[start:end], device=q.device)[:, None]
            mask = visible.view(group, 1, 1, -1)
        out[start:end] = F.scaled_dot_product_attention(qg[start:end], k, v, attn_mask=mask, scale=scale)
        start = end
    return out.view(num_seqs, num_heads, head_dim)


def _attend_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float):
    """Attention with its log-sum-exp: q [B, h, n, d], k/v [B, h, m, d] (any strides, last dim contiguous) ->
    (out [B, h, n, d] dtype of q, lse float32 [B, h, n]). causal is top-left aligned (query i sees keys <= i)."""
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
        return out, lse
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if causal:
        n, m = scores.shape[-2:]
        scores = scores.masked_fill(torch.ones(n, m, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    return torch.matmul(torch.exp(scores - lse[..., None]), v.float()).to(q.dtype), lse


def _extend(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    table: torch.Tensor,
    seq_len: int,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """One sequence with q [n, H, d] new tokens at positions seq_len - n .. seq_len - 1 -> [n, H, d].

    Split in two: all n queries over the cached prefix (no mask) and the n queries over the new keys (a square causal
    mask), merged with the log-sum-exp rescaling of online softmax (Milakov & Gimelshein 2018; FlashAttention-2,
    Dao 2023, sec. 3.1). K/V are broadcast to the G query heads of their KV head with a stride-0 expand, not copied.
    A sliding window that cuts some query's keys (window < seq_len) goes to _extend_windowed instead.
    """
    if sliding_window and sliding_window < seq_len:
        return _extend_windowed(q, k_cache, v_cache, table, seq_len, scale, sliding_window or 0)
    n, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    n_blocks = _cdiv(seq_len, block_size)
    k, v = _gather(k_cache, v_cache, table[:n_blocks], 1)
    shape = (num_kv_heads, group, n_blocks * block_size, head_dim)
    k, v = k[0, :, None].expand(shape), v[0, :, None].expand(shape)
    qh = q.view(n, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)  # [kvh, G, n, d]
    prefix = seq_len - n
    out, lse = _attend_lse(qh, k[:, :, prefix:seq_len], v[:, :, prefix:seq_len], True, scale)
    if prefix > 0:
        out_p, lse_p = _attend_lse(qh, k[:, :, :prefix], v[:, :, :prefix], False, scale)
        total = torch.logaddexp(lse, lse_p)
        out = out * torch.exp(lse - total)[..., None] + out_p * torch.exp(lse_p - total)[..., None]
    return out.permute(2, 0, 1, 3).reshape(n, num_heads, head_dim)


# Queries of a windowed extend are taken this many at a time (at least the window): each chunk attends over its own
# keys only, chunk + window - 1 of them, so a long prefill costs O(n * window), not O(n^2).
WINDOW_QUERY_CHUNK = 256


def _extend_windowed(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    table: torch.Tensor,
    seq_len: int,
    scale: float,
    sliding_window: int,
) -> torch.Tensor:
    """_extend under a sliding window: query p sees keys k with p - sliding_window < k <= p.

    Gathers only the blocks from the first query's window onwards, then runs the queries in chunks of
    max(WINDOW_QUERY_CHUNK, sliding_window), each one SDPA with an explicit boolean mask over the keys its window
    spans. q [n, H, d] -> [n, H, d]."""
    n, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    prefix = seq_len - n
    first_block = window_start(seq_len, n, sliding_window) // block_size
    base = first_block * block_size  # position of gathered key 0
    k, v = _gather(k_cache, v_cache, table[first_block : _cdiv(seq_len, block_size)], 1)
    qh = q.view(n, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)  # [kvh, G, n, d]
    out = qh.new_empty(qh.shape)
    chunk = max(WINDOW_QUERY_CHUNK, sliding_window)
    for c0 in range(0, n, chunk):
        c1 = min(n, c0 + chunk)
        lo = max(base, prefix + c0 - sliding_window + 1)  # first key of the chunk's first query
        hi = prefix + c1  # one past the chunk's last query
        q_pos = torch.arange(prefix + c0, prefix + c1, device=q.device)[:, None]
        key_pos = torch.arange(lo, hi, device=q.device)[None, :]
        mask = (key_pos <= q_pos) & (key_pos > q_pos - sliding_window)
        shape = (num_kv_heads, group, hi - lo, head_dim)
        kc = k[0, :, None, lo - base : hi - base].expand(shape)
        vc = v[0, :, None, lo - base : hi - base].expand(shape)
        out[:, :, c0:c1] = F.scaled_dot_product_attention(qh[:, :, c0:c1], kc, vc, attn_mask=mask, scale=scale)
    return out.permute(2, 0, 1, 3).reshape(n, num_heads, head_dim)


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
    """Paged causal attention; the contract is kernels.paged_attention's. Returns [num_tokens, num_heads, head_dim].

    A decode-only batch (max_query_len == 1, or every query length 1) on float32 / bfloat16 CPU caches goes to the
    fused kernel in one call (kernels/cpu_decode.py). Otherwise decode sequences (one query token) run in groups,
    longest first, one SDPA per group over the group's gathered blocks (or the fused kernel when it builds);
    extend/prefill sequences run one at a time (see _extend). Python loops run per group, per sequence or per query
    chunk, never per token. sliding_window: kernels.paged_attention's (None or 0: full causal).
    """
    if q.shape[0] == 0:
        return q.new_empty(q.shape)
    starts = query_start_loc.tolist() if max_query_len != 1 else None
    decode_only = starts is None or all(starts[i + 1] - starts[i] == 1 for i in range(len(starts) - 1))
    cpu_decode = _cpu_decode()
    if decode_only and cpu_decode.supports(q, k_cache, v_cache):
        # The fused kernel takes a decode batch in any order and int32 tables as they are: no sorting, no copies.
        fused = cpu_decode.paged_decode(q, k_cache, v_cache, block_tables, seq_lens, scale, sliding_window)
        if fused is not None:
            return fused
    out = q.new_empty(q.shape)
    starts = query_start_loc.tolist() if starts is None else starts
    lens = seq_lens.tolist()
    tables = block_tables.long()
    decode = [i for i in range(len(lens)) if starts[i + 1] - starts[i] == 1]
    decode.sort(key=lambda i: -lens[i])
    if len(decode) == len(lens) == q.shape[0] and decode == sorted(decode):
        # A decode-only batch already longest first (e.g. all one length): no reordering copies.
        return _decode(q, k_cache, v_cache, tables, lens, scale, sliding_window)
    if decode:
        idx = torch.tensor(decode, device=q.device)
        tok = query_start_loc.long()[idx]
        decode_lens = [lens[i] for i in decode]
        out[tok] = _decode(q[tok], k_cache, v_cache, tables[idx], decode_lens, scale, sliding_window)
    for i in range(len(lens)):
        s, e = starts[i], starts[i + 1]
        if e - s > 1:
            out[s:e] = _extend(q[s:e], k_cache, v_cache, tables[i], lens[i], scale, sliding_window)
    return out
