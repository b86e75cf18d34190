"""HybridKVCache: the worker's KV tensors with two KV cache groups (ServerArgs.kv_groups "auto" on a model with
sliding-window layers): the full-attention layers' blocks (group 0, the scheduler's block tables) and the sliding
layers' blocks (group 1, the window tables of radix/hybrid_manager.py), each its own tensor and pool.

k_cache, v_cache [num_full_layers, num_blocks, block_size, kv_heads, head_dim] (group 0: the host tier and swaps copy
these); window_k, window_v [num_window_layers, num_window_blocks, ...] (group 1); host_window_k, host_window_v
[num_window_layers, num_host_blocks, ...] (group 1's host swap pool, radix/swa_group.py). layer_k[i] / layer_v[i]
is layer i's [num_blocks of its group, block_size, kv_heads, head_dim] view, which the model indexes as it indexes
the one tensor of a single group (runtime/model/kv_cache.py KVCache.layer_k).

Sizing from one budget (after vLLM's and SGLang's hybrid pools): with r = window_blocks_ratio window blocks per full
block, a full block and its share of window blocks cost bytes_full + r * bytes_window, so num_blocks = budget //
that and num_window_blocks = r * num_blocks, at least a window and a prefill chunk (num_blocks / num_window_blocks,
when given, override).

Under tensor parallelism each rank builds this from its ShardPlan.local_config (its KV heads) with num_blocks the
smallest count any rank's budget allows (runtime/model/parallel/load.py), so every rank holds the same block ids in
both groups and num_window_blocks, derived from num_blocks alone, agrees too.
"""

from __future__ import annotations

import logging

import torch

import kernels
from radix.blocks import cdiv
from runtime.config import InvalidConfig, ServerArgs
from runtime.model.host_kv import HostCopies, host_cache_blocks
from runtime.model.kv_cache import kv_block_bytes, kv_pool_blocks
from runtime.model.loader import ModelConfig
from runtime.speculative import parse_speculative_config

logger = logging.getLogger(__name__)


def hybrid_layout(args: ServerArgs, cfg: ModelConfig) -> int | None:
    """The sliding window (tokens) of the model's sliding layers when args asks for KV cache groups (kv_groups
    "auto") and the model has sliding layers of one window shorter than its context, else None (one group: a model
    with full attention only; several windows, logged as a warning; a window that covers every position the model
    takes, logged, as a second pool would save nothing; a draft model, logged, as its pool mirrors one group).
    O(layers)."""
    if args.kv_groups != "auto":
        return None
    if _has_draft_model(args):  # the draft's KV pool mirrors one group (runtime/model/draft_runner.py)
        logger.info("kv_groups auto: a draft model keeps one KV cache group (every layer keeps its whole KV)")
        return None
    windows = {cfg.layer_window(i) for i in range(cfg.num_hidden_layers)} - {None}
    if not windows:
        return None
    if len(windows) > 1:  # one window group is built; several would each need their own pool
        logger.warning(
            "kv_groups auto: sliding windows %s differ; every layer keeps its whole KV", sorted(w or 0 for w in windows)
        )
        return None
    window = windows.pop()
    context = min(args.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
    if window is not None and window >= context:
        logger.info("kv_groups auto: the %d-token window covers the %d-token context: one group", window, context)
        return None
    return window


def _has_draft_model(args: ServerArgs) -> bool:
    """Whether args speculate with a draft model (ServerArgs validated the JSON already)."""
    config = parse_speculative_config(args.speculative_config)
    return config is not None and config.method == "draft_model"


def hybrid_block_bytes(args: ServerArgs, cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes a full block and its share of window blocks cost (the module docstring's sizing): bytes_full +
    int(window_blocks_ratio * bytes_window), each kv_block_bytes of its layers, K and V. O(layers)."""
    num_sliding = sum(cfg.layer_window(i) is not None for i in range(cfg.num_hidden_layers))
    heads = cfg.num_key_value_heads
    full_bytes = kv_block_bytes(cfg.num_hidden_layers - num_sliding, block_size, heads, cfg.head_dim, dtype)
    window_bytes = kv_block_bytes(num_sliding, block_size, heads, cfg.head_dim, dtype)
    return full_bytes + int(args.window_blocks_ratio * window_bytes)


class HybridKVCache:
    """The device KV tensors of the two groups and the copies between their blocks (see the module docstring); the
    interface of runtime/model/kv_cache.py KVCache plus the window group's.

    Raises InvalidConfig: a pool too small (as kv_pool_blocks), or a num_window_blocks (given) that cannot hold one
    sequence's window and a prefill chunk (cdiv(window + chunked_prefill_size, block_size) + 1 blocks and the null
    block); a window pool derived from window_blocks_ratio is raised to that floor instead (beyond the budget by
    at most that many window blocks: a small pool only).
    """

    def __init__(
        self,
        args: ServerArgs,
        cfg: ModelConfig,
        window: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.window = window
        layers = range(cfg.num_hidden_layers)
        full = [i for i in layers if cfg.layer_window(i) is None]
        sliding = [i for i in layers if cfg.layer_window(i) is not None]
        heads = cfg.num_key_value_heads
        full_bytes = kv_block_bytes(len(full), block_size, heads, cfg.head_dim, dtype)
        self.num_blocks = kv_pool_blocks(args, hybrid_block_bytes(args, cfg, block_size, dtype), device)
        least = cdiv(window + args.chunked_prefill_size, block_size) + 2
        if args.num_window_blocks is not None:
            self.num_window_blocks = args.num_window_blocks
        else:  # a small pool (num_blocks given, as tests do) still gets room for a window and a chunk
            self.num_window_blocks = max(int(args.window_blocks_ratio * self.num_blocks), least)
        if self.num_window_blocks < least:
            raise InvalidConfig(
                f"sliding-window KV pool of {self.num_window_blocks} blocks cannot hold a {window}-token window and a "
                f"{args.chunked_prefill_size}-token chunk; needs >= {least}: raise window_blocks_ratio or "
                "num_window_blocks, or lower chunked_prefill_size"
            )
        self.num_host_cache_blocks = host_cache_blocks(args, max(1, full_bytes))
        shape = (len(full), self.num_blocks, block_size, heads, cfg.head_dim)
        self.k_cache = torch.zeros(shape, dtype=dtype, device=device)
        self.v_cache = torch.zeros(shape, dtype=dtype, device=device)
        window_shape = (len(sliding), self.num_window_blocks, *shape[2:])
        self.window_k = torch.zeros(window_shape, dtype=dtype, device=device)
        self.window_v = torch.zeros(window_shape, dtype=dtype, device=device)
        # group 1's host swap pool: as many blocks as group 0's (radix/swa_group.py); no host tier
        window_host_shape = (len(sliding), args.num_host_blocks, *shape[2:])
        host_shape = (len(full), args.num_host_blocks + self.num_host_cache_blocks, *shape[2:])
        pin = device.type == "cuda"
        self.host_k_cache = torch.zeros(host_shape, dtype=dtype, pin_memory=pin)
        self.host_v_cache = torch.zeros(host_shape, dtype=dtype, pin_memory=pin)
        self.host_window_k = torch.zeros(window_host_shape, dtype=dtype, pin_memory=pin)
        self.host_window_v = torch.zeros(window_host_shape, dtype=dtype, pin_memory=pin)
        self.host_copies = HostCopies(device)
        self.layer_k: list[torch.Tensor] = [torch.empty(0)] * cfg.num_hidden_layers
        self.layer_v: list[torch.Tensor] = [torch.empty(0)] * cfg.num_hidden_layers
        for j, i in enumerate(full):
            self.layer_k[i] = self.k_cache[j]
            self.layer_v[i] = self.v_cache[j]
        for j, i in enumerate(sliding):
            self.layer_k[i] = self.window_k[j]
            self.layer_v[i] = self.window_v[j]

    def copy(self, pairs: list[tuple[int, int]]) -> None:
        """Copy group 0 block src to dst for each (src, dst), K and V (nothing when empty or no full layer)."""
        if pairs and self.k_cache.shape[0]:
            kernels.copy_blocks(self.k_cache, self.v_cache, pairs)

    def copy_window(self, pairs: list[tuple[int, int]]) -> None:
        """Copy group 1 block src to dst for each (src, dst), K and V (nothing when empty)."""
        if pairs:
            kernels.copy_blocks(self.window_k, self.window_v, pairs)

    def swap_window(self, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]]) -> None:
        """Group 1's device <-> host swap copies (its own host swap pool), K and V: every (device, host) pair of
        swap_out, then every (host, device) pair of swap_in (HostCopies.apply; it raises the same errors)."""
        caches = (self.window_k, self.window_v)
        self.host_copies.apply(caches, (self.host_window_k, self.host_window_v), swap_out, swap_in)

    def swap(self, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]]) -> None:
        """Group 0's device <-> host copies (swaps and the host tier's write-backs / load-backs)."""
        if self.k_cache.shape[0]:
            caches = (self.k_cache, self.v_cache)
            self.host_copies.apply(caches, (self.host_k_cache, self.host_v_cache), swap_out, swap_in)
