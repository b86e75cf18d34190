"""The worker's KV cache tensors: how many blocks the pool holds, the device and host tensors, and the block copies
between them (copy-on-write copies, swaps and host-tier transfers).

k_cache, v_cache [num_layers, num_blocks, block_size, num_kv_heads, head_dim] live on the device; block 0 is the null
block (never allocated, so a padded block table entry reads zeros). host_k_cache, host_v_cache hold num_host_blocks
for swapping, then num_host_cache_blocks of the prefix cache's host tier (runtime/model/host_kv.py), on the CPU.
"""

from __future__ import annotations

import torch

import kernels
from runtime.config import MIN_USABLE_BLOCKS, InvalidConfig, ServerArgs
from runtime.model.host_kv import HostCopies, host_cache_blocks
from runtime.model.loader import ModelConfig


def kv_block_bytes(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes of one KV block across all layers, K and V: 2 * layers * block_size * kv_heads * head_dim * elem."""
    return 2 * num_layers * block_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def kv_pool_blocks(args: ServerArgs, block_bytes: int, device: torch.device) -> int:
    """Blocks of the device pool (the null block included): args.num_blocks, else the budget divided by block_bytes
    (bytes per block, kv_block_bytes). The budget is args.kv_cache_memory bytes on CPU; on CUDA
    args.gpu_memory_utilization x the free device memory now (call it after loading the weights).

    Raises InvalidConfig, naming the budget and the fix in one line, when fewer than MIN_USABLE_BLOCKS would be usable.
    """
    if args.num_blocks is not None:
        num_blocks = args.num_blocks
        source = f"num_blocks {args.num_blocks}"
        fix = ""
    elif device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        num_blocks = int(free * args.gpu_memory_utilization) // block_bytes
        source = f"gpu_memory_utilization {args.gpu_memory_utilization} of {free} free bytes"
        source += f", {block_bytes} bytes per block"
        fix = ": raise gpu_memory_utilization, free GPU memory or set num_blocks"
    else:
        num_blocks = args.kv_cache_memory // block_bytes
        source = f"kv_cache_memory {args.kv_cache_memory} bytes, {block_bytes} bytes per block"
        fix = f": raise kv_cache_memory to >= {(MIN_USABLE_BLOCKS + 1) * block_bytes} bytes or set num_blocks"
    usable = max(0, num_blocks - 1)
    if usable < MIN_USABLE_BLOCKS:
        plural = "" if usable == 1 else "s"
        raise InvalidConfig(f"KV pool of {usable} usable block{plural} ({source}); needs >= {MIN_USABLE_BLOCKS}{fix}")
    return num_blocks


class KVCache:
    """The device and host KV tensors of one model (see the module docstring) and the copies between their blocks.

    num_blocks comes from kv_pool_blocks (so construct it after the weights are on the device); num_host_cache_blocks
    from host_cache_blocks. The tensors are allocated once, zeroed, and never replaced: a reference to k_cache stays
    valid for the runner's lifetime. Raises InvalidConfig as kv_pool_blocks does.
    extra_block_bytes: bytes per block of a parallel pool indexed by the same block ids (a draft model's KV,
    runtime/model/draft_runner.py): the budget is split by both, so num_blocks covers the two pools (0: none).
    """

    def __init__(
        self,
        args: ServerArgs,
        cfg: ModelConfig,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        extra_block_bytes: int = 0,
    ) -> None:
        block_bytes = kv_block_bytes(cfg.num_hidden_layers, block_size, cfg.num_key_value_heads, cfg.head_dim, dtype)
        block_bytes += extra_block_bytes
        self.num_blocks = kv_pool_blocks(args, block_bytes, device)
        self.num_host_cache_blocks = host_cache_blocks(args, block_bytes)
        shape = (cfg.num_hidden_layers, self.num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim)
        self.k_cache = torch.zeros(shape, dtype=dtype, device=device)
        self.v_cache = torch.zeros(shape, dtype=dtype, device=device)
        host_shape = (shape[0], args.num_host_blocks + self.num_host_cache_blocks, *shape[2:])
        pin = device.type == "cuda"
        self.host_k_cache = torch.zeros(host_shape, dtype=dtype, pin_memory=pin)
        self.host_v_cache = torch.zeros(host_shape, dtype=dtype, pin_memory=pin)
        self.host_copies = HostCopies(device)
        self.num_window_blocks = 0  # one KV cache group (runtime/model/hybrid_kv.py has two)
        self.window = 0

    @property
    def layer_k(self) -> torch.Tensor:
        """What the model indexes by layer for its K cache: k_cache itself (layer i's blocks are k_cache[i])."""
        return self.k_cache

    @property
    def layer_v(self) -> torch.Tensor:
        """What the model indexes by layer for its V cache: v_cache itself."""
        return self.v_cache

    def copy_window(self, pairs: list[tuple[int, int]]) -> None:
        """A sliding-window group's copies: none with one group (ForwardBatch.window_copies is empty)."""

    def swap_window(self, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]]) -> None:
        """A sliding-window group's swaps: none with one group (ForwardBatch.window_swap_out / _in are empty)."""

    def copy(self, pairs: list[tuple[int, int]]) -> None:
        """Copy device block src to dst for each (src, dst) of pairs, K and V (copy-on-write; nothing when empty).
        Raises what kernels.copy_blocks raises (e.g. for a block id outside the pool)."""
        if pairs:
            kernels.copy_blocks(self.k_cache, self.v_cache, pairs)

    def swap(self, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]]) -> None:
        """Copy each (device, host) pair of swap_out device -> host, then each (host, device) pair of swap_in
        host -> device, K and V (runtime.model.host_kv.HostCopies.apply; it raises the same errors)."""
        self.host_copies.apply((self.k_cache, self.v_cache), (self.host_k_cache, self.host_v_cache), swap_out, swap_in)
