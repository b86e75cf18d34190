"""TPGroup: one worker rank's view of the tensor-parallel process group (torch.distributed) and the collectives the
sharded model and the step relay use, each counted (bytes and seconds) for benchmarks/tensor_parallel.py.

Two groups: the device group runs the model's collectives (NCCL on CUDA, gloo on CPU); the CPU group (gloo; the same
group on CPU) carries the step relay's bytes from rank 0. Both have the process-group timeout, so a rank that dies or
hangs ends every other rank's wait with RankFailure instead of a wait forever (issue 27).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)


class RankFailure(BaseException):
    """A collective failed: a peer rank died, hung past the timeout, or the group broke.

    A BaseException on purpose: the step's failure isolation (runtime/model/isolation.py) and the worker loop catch
    Exception to fail one sequence or one step and go on; a broken group cannot go on, so this ends the rank process
    and the launcher handles it as a worker failure (clients told, the other processes stopped)."""


class ProcessGroupError(RuntimeError):
    """The process group did not form at start-up (a rank missing past the timeout, the master port taken)."""


@dataclass
class CommStats:
    """Per kind of collective ("all_reduce", "all_gather", "broadcast", ...): calls, payload bytes sent by this rank
    and wall seconds spent in them. Mutated by TPGroup; read (and reset) by benchmarks."""

    calls: dict[str, int] = field(default_factory=dict)
    bytes: dict[str, int] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)

    def add(self, kind: str, nbytes: int, seconds: float) -> None:
        """Count one collective of kind: nbytes of payload, seconds of wall time."""
        self.calls[kind] = self.calls.get(kind, 0) + 1
        self.bytes[kind] = self.bytes.get(kind, 0) + nbytes
        self.seconds[kind] = self.seconds.get(kind, 0.0) + seconds

    def reset(self) -> None:
        """Forget every count."""
        self.calls.clear()
        self.bytes.clear()
        self.seconds.clear()


@dataclass(frozen=True)
class RankInfo:
    """Where one rank sits: rank in [0, size), size (the tensor-parallel size), the master's TCP address (torchrun's
    MASTER_ADDR / MASTER_PORT: rank 0's host) and the timeout of every collective (seconds)."""

    rank: int
    size: int
    master_addr: str
    master_port: int
    timeout_s: float


class TPGroup:
    """The collectives of one rank (see the module docstring). Built by init_group; every method is called by every
    rank in the same order with tensors of the same shapes (the collectives' contract), else the group hangs until the
    timeout. Each method raises RankFailure when its collective fails or times out."""

    def __init__(self, info: RankInfo, device: torch.device, device_group, cpu_group) -> None:
        self.rank = info.rank
        self.size = info.size
        self.device = device
        self.device_group = device_group
        self.cpu_group = cpu_group
        self.stats = CommStats()

    def _run(self, kind: str, nbytes: int, fn) -> None:
        start = time.perf_counter()
        try:
            fn()
        except Exception as exc:  # gloo / NCCL raise RuntimeError (DistBackendError) on a dead or late peer
            raise RankFailure(f"rank {self.rank}: {kind} failed: {type(exc).__name__}: {exc}") from exc
        self.stats.add(kind, nbytes, time.perf_counter() - start)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum t over the ranks, in place; returns t (any shape and dtype, on self.device)."""
        self._run("all_reduce", t.numel() * t.element_size(), lambda: dist.all_reduce(t, group=self.device_group))
        return t

    def all_gather_last(self, t: torch.Tensor) -> torch.Tensor:
        """The ranks' t [..., n] (same shape on each) joined along the last dimension in rank order: [..., size * n]."""
        parts = [torch.empty_like(t) for _ in range(self.size)]
        t = t.contiguous()
        self._run(
            "all_gather", t.numel() * t.element_size(), lambda: dist.all_gather(parts, t, group=self.device_group)
        )
        return torch.cat(parts, dim=-1)

    def min_int(self, value: int) -> int:
        """The smallest of the ranks' values (e.g. the KV blocks each rank's memory allows)."""
        t = torch.tensor([value], dtype=torch.int64)
        self._run("all_reduce_min", 8, lambda: dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.cpu_group))
        return int(t.item())

    def union(self, ids: set[int]) -> set[int]:
        """The union of the ranks' sets of ints (a decision every rank must share, e.g. the sequences held back)."""
        gathered: list[list[int] | None] = [None] * self.size
        nbytes = 8 * len(ids)
        self._run(
            "all_gather_object", nbytes, lambda: dist.all_gather_object(gathered, sorted(ids), group=self.cpu_group)
        )
        return {i for part in gathered for i in part or []}

    def broadcast_bytes(self, payload: bytes | None) -> bytes:
        """Rank 0's payload on every rank: rank 0 passes it, the others pass None and get it. Two broadcasts on the CPU
        group: the length (int64), then the bytes (uint8); an empty payload sends the length alone."""
        size = torch.tensor([len(payload) if payload is not None else 0], dtype=torch.int64)
        self._run("broadcast", 8, lambda: dist.broadcast(size, src=0, group=self.cpu_group))
        n = int(size.item())
        if n == 0:
            return b""
        if payload is not None:
            buf = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        else:
            buf = torch.empty(n, dtype=torch.uint8)
        self._run("broadcast", n, lambda: dist.broadcast(buf, src=0, group=self.cpu_group))
        return payload if payload is not None else buf.numpy().tobytes()

    def close(self) -> None:
        """Leave the process group (best effort; never raises)."""
        try:
            dist.destroy_process_group()
        except Exception:  # already gone with a dead peer
            logger.debug("destroy_process_group failed", exc_info=True)


def init_group(info: RankInfo, device_name: str) -> TPGroup:
    """Join the process group of info on device device_name ("cpu", "cuda:1"), blocking until all info.size ranks
    joined (info.timeout_s seconds at most), and return this rank's TPGroup. NCCL for a CUDA device (with a gloo group
    beside it for the step relay), gloo on CPU.

    Raises ProcessGroupError when the group cannot form in time (a rank missing, the master port taken)."""
    device = torch.device(device_name)
    timeout = timedelta(seconds=info.timeout_s)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    try:
        dist.init_process_group(
            backend,
            init_method=f"tcp://{info.master_addr}:{info.master_port}",
            rank=info.rank,
            world_size=info.size,
            timeout=timeout,
        )
        cpu_group = dist.new_group(backend="gloo", timeout=timeout) if backend == "nccl" else dist.group.WORLD
    except Exception as exc:  # a start-up failure: reported by the worker as ProcessFailed
        raise ProcessGroupError(f"rank {info.rank} of {info.size}: the process group did not form: {exc}") from exc
    logger.info(
        "rank %d of %d joined (%s, master %s:%d)", info.rank, info.size, backend, info.master_addr, info.master_port
    )
    return TPGroup(info, device, dist.group.WORLD, cpu_group)
