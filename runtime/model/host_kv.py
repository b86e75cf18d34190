"""The worker's host KV memory: how many host-tier blocks it holds, and the copies between it and the device cache.

One host KV tensor per K and V, [num_layers, num_host_blocks + num_host_cache_blocks, block_size, kv_heads,
head_dim]: the swap pool's blocks first, then the prefix cache's host tier (radix/block_supply.py numbers them the
same way), so a ForwardBatch's swap_out / swap_in (preemption swaps and the tier's write-backs / load-backs together)
are one batched kernels.swap_blocks call per direction and per K / V.

On CUDA the host tensor is pinned and the copies run on a side stream that first waits for the compute stream (the
device blocks a write-back reads were written by earlier steps); the compute stream then waits for the side stream
before the step's copy-on-write copies and forward, so attention never reads a block whose load is pending and no
write-back source is overwritten first. Overlapping the copies with compute further needs non_blocking copies through
pinned staging in kernels.swap_blocks (today's reference implementation copies synchronously); untested here (no
CUDA device on the machine this was written on). On CPU both tiers live in RAM and a copy is a memcpy.
"""

from __future__ import annotations

import torch

import kernels
from runtime.config import ServerArgs


def host_cache_blocks(args: ServerArgs, block_bytes: int) -> int:
    """Host-tier blocks: args.num_host_cache_blocks, else args.host_cache_memory // block_bytes (bytes per KV block,
    all layers, K and V); 0 when prefix caching is off (the tier caches prefixes)."""
    if not args.enable_prefix_caching:
        return 0
    if args.num_host_cache_blocks is not None:
        return args.num_host_cache_blocks
    return args.host_cache_memory // block_bytes


class HostCopies:
    """Applies a step's device <-> host block copies (see the module docstring). Mutates the destination caches.

    Args:
        device: the device of the KV cache (cuda: copies on a side stream; else in line).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def apply(
        self,
        caches: tuple[torch.Tensor, torch.Tensor],
        host: tuple[torch.Tensor, torch.Tensor],
        swap_out: list[tuple[int, int]],
        swap_in: list[tuple[int, int]],
    ) -> None:
        """Copy every (device, host) pair of swap_out device -> host, then every (host, device) pair of swap_in
        host -> device, for K and V ((k_cache, v_cache), (host_k, host_v)). Returns once the compute stream is
        ordered after the copies. Raises kernels.KernelInputError for a bad block id or a destination listed twice."""
        if not swap_out and not swap_in:
            return
        if self.stream is None:
            self._copy(caches, host, swap_out, swap_in)
            return
        compute = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(compute)
        with torch.cuda.stream(self.stream):
            self._copy(caches, host, swap_out, swap_in)
        compute.wait_stream(self.stream)

    @staticmethod
    def _copy(
        caches: tuple[torch.Tensor, torch.Tensor],
        host: tuple[torch.Tensor, torch.Tensor],
        swap_out: list[tuple[int, int]],
        swap_in: list[tuple[int, int]],
    ) -> None:
        for cache, host_cache in zip(caches, host, strict=True):
            if swap_out:
                kernels.swap_blocks(cache, host_cache, swap_out)
        for cache, host_cache in zip(caches, host, strict=True):
            if swap_in:
                kernels.swap_blocks(host_cache, cache, swap_in)
