"""CPU rows of benchmarks/attention_kernel.py: the fused decode operator against gather + SDPA and the retired C kernel.

Decode rows, SmolLM2 heads (9 q / 3 kv / 64, block 16), float32 and bfloat16, batch x context from the mode:
  fused            kernels.paged_attention with the fused operator (kernels/cpu_decode.py), as served
  gather+sdpa      the same call with the operator off: gather blocks, torch SDPA (kernels/reference.py)
  legacy_c         float32 only: the OpenMP C kernel the operator replaced (kernels/cpu_decode.c at LEGACY_COMMIT,
                   compiled here with its own flags, ctypes); rows only where git and a C compiler are at hand
  sdpa_contiguous  SDPA over contiguous K/V of the same size (the vs_contiguous baseline)
Each timing walks a stack of layers (as a model does) so K/V come from memory; the backends are interleaved round by
round so load from other processes hits them alike.

Decode step ("step" rows): per layer the F.linear calls of a SmolLM2 layer (q, k, v, o, gate, up, down) plus the
decode attention, float32, for the legacy C kernel and the fused operator: does the kernel's thread pool fight
torch's? ``openmp_runtimes`` in the result lists the OpenMP libraries mapped into the process after both ran.
"""

from __future__ import annotations

import ctypes
import logging
import os
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

import kernels
from kernels import cpu_decode
from radix.blocks import cdiv

logger = logging.getLogger(__name__)

HEADS = (9, 3, 64)  # SmolLM2-135M: query heads, kv heads, head_dim
HIDDEN, INTERMEDIATE = 576, 1536
BLOCK_SIZE = 16
LEGACY_COMMIT = "9cad5b8cd46fd3d6df028a689329de0765aedc9f"  # the last commit with kernels/cpu_decode.c
LEGACY_CFLAGS = ("-O3", "-march=native", "-fopenmp", "-std=c99", "-fPIC", "-shared")
ROOT = Path(__file__).resolve().parents[1]


def timed(fns: dict[str, Callable[[], object]], rounds: int) -> dict[str, tuple[float, float]]:
    """(wall, process CPU) median seconds of each fn, interleaved round by round, after one warm-up call each."""
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in fns}
    for fn in fns.values():
        fn()
    for _ in range(rounds):
        for name, fn in fns.items():
            w0, c0 = time.perf_counter(), time.process_time()
            fn()
            samples[name].append((time.perf_counter() - w0, time.process_time() - c0))
    return {n: (statistics.median(w for w, _ in s), statistics.median(c for _, c in s)) for n, s in samples.items()}


def copy_gbps(nbytes: int) -> float:
    """Read + write bandwidth of a large tensor copy (GB/s), the ceiling a memory-bound kernel is measured against."""
    src = torch.empty(nbytes // 4).normal_()
    dst = torch.empty_like(src)
    wall, _ = timed({"copy": lambda: dst.copy_(src)}, 5)["copy"]
    return 2 * nbytes / wall / 1e9


class LegacyKernel:
    """The retired OpenMP C kernel (float32 only), built from git history into a temporary folder."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.fn = lib.radixserve_paged_decode_f32
        self.fn.restype = ctypes.c_int
        self.fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p]
        self.fn.argtypes += [ctypes.c_int64] * 4 + [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p]
        self.fn.argtypes += [ctypes.c_int64] * 7 + [ctypes.c_float, ctypes.c_int]

    @classmethod
    def build(cls) -> LegacyKernel | None:
        """Compile kernels/cpu_decode.c of LEGACY_COMMIT with cc; None (logged) without git, the commit or cc."""
        try:
            source = subprocess.run(
                ["git", "show", f"{LEGACY_COMMIT}:kernels/cpu_decode.c"], cwd=ROOT, check=True, capture_output=True
            ).stdout
            folder = Path(tempfile.mkdtemp(prefix="legacy_cpu_decode-"))
            (folder / "cpu_decode.c").write_bytes(source)
            lib = folder / "cpu_decode.so"
            cc = os.environ.get("CC", "cc")
            subprocess.run(
                [cc, *LEGACY_CFLAGS, "-o", str(lib), str(folder / "cpu_decode.c"), "-lm"],
                check=True,
                capture_output=True,
            )
            return cls(ctypes.CDLL(str(lib)))
        except (OSError, subprocess.CalledProcessError) as exc:
            logger.warning("legacy C kernel not built, its rows are left out: %s", exc)
            return None

    def __call__(self, q, k_cache, v_cache, tables, lens, scale) -> torch.Tensor:
        """As the old kernels/cpu_decode.paged_decode: tables and lens int64, torch.get_num_threads() threads."""
        out = torch.empty(q.shape, dtype=q.dtype)
        num_blocks, block_size, kvh = k_cache.shape[:3]
        bad = self.fn(
            q.data_ptr(),
            q.stride(0),
            q.stride(1),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            num_blocks,
            k_cache.stride(0),
            k_cache.stride(1),
            k_cache.stride(2),
            tables.data_ptr(),
            tables.stride(0),
            lens.data_ptr(),
            out.data_ptr(),
            out.stride(0),
            out.stride(1),
            q.shape[0],
            kvh,
            q.shape[1] // kvh,
            q.shape[2],
            block_size,
            scale,
            torch.get_num_threads(),
        )
        assert bad == 0
        return out


class Stack:
    """Paged caches [layers, blocks, BLOCK_SIZE, kvh, d] with each sequence's blocks at shuffled positions, and the
    decode batch over them (every sequence `context` tokens long)."""

    def __init__(self, batch: int, context: int, dtype: torch.dtype, layers: int) -> None:
        h, kvh, d = HEADS
        per_seq = cdiv(context, BLOCK_SIZE)
        num_blocks = batch * per_seq + 1
        shape = (layers, num_blocks, BLOCK_SIZE, kvh, d)
        self.k = torch.empty(shape, dtype=dtype).normal_()
        self.v = torch.empty(shape, dtype=dtype).normal_()
        self.tables = (torch.randperm(num_blocks - 1) + 1).view(batch, per_seq).to(torch.int32)
        self.lens = torch.full((batch,), context, dtype=torch.int32)
        self.qsl = torch.arange(batch + 1, dtype=torch.int32)
        self.q = torch.randn(batch, h, d, dtype=dtype)
        self.tables64 = self.tables.long()
        self.lens64 = self.lens.long()
        self.layers = layers
        self.context = context
        self.scale = d**-0.5

    def attend(self, layer: int, q: torch.Tensor | None = None) -> torch.Tensor:
        """kernels.paged_attention on one layer, as the model calls it (decode-only batch)."""
        q = self.q if q is None else q
        return kernels.paged_attention(
            q, self.k[layer], self.v[layer], self.tables, self.lens, self.qsl, self.scale, 1, self.context
        )

    def legacy(self, kernel: LegacyKernel, layer: int, q: torch.Tensor | None = None) -> torch.Tensor:
        q = self.q if q is None else q
        return kernel(q, self.k[layer], self.v[layer], self.tables64, self.lens64, self.scale)


def without_fused(fn: Callable[[], object]) -> Callable[[], None]:
    """fn run with the fused operator off (kernels/reference.py takes its gather + SDPA path)."""

    def run() -> None:
        saved = cpu_decode.ENABLED
        cpu_decode.ENABLED = False
        try:
            fn()
        finally:
            cpu_decode.ENABLED = saved

    return run


def decode_rows(
    batch: int, context: int, dtype: torch.dtype, rounds: int, budget: int, copy: float, legacy: LegacyKernel | None
) -> list[dict]:
    """One shape's rows (see the module docstring); seconds are per layer."""
    h, kvh, d = HEADS
    nbytes = 2 * batch * context * kvh * d * torch.finfo(dtype).bits // 8
    layers = max(2, min(30, budget // nbytes))
    stack = Stack(batch, context, dtype, layers)
    k_cont = torch.empty(layers, batch, kvh, context, d, dtype=dtype).normal_()
    v_cont = torch.empty_like(k_cont).normal_()
    qg = stack.q.view(batch, kvh, h // kvh, d)

    def every_layer(fn: Callable[[int], object]) -> Callable[[], None]:
        def run() -> None:
            for layer in range(layers):
                fn(layer)

        return run

    fns = {"fused": every_layer(stack.attend), "gather+sdpa": without_fused(every_layer(stack.attend))}
    if legacy is not None and dtype == torch.float32:
        fns["legacy_c"] = every_layer(lambda layer: stack.legacy(legacy, layer))
    fns["sdpa_contiguous"] = every_layer(
        lambda layer: F.scaled_dot_product_attention(qg, k_cont[layer], v_cont[layer], scale=stack.scale)
    )
    t = timed(fns, rounds)
    base_wall, base_cpu = (x / layers for x in t["sdpa_contiguous"])
    rows = []
    for name, (wall, cpu) in t.items():
        wall, cpu = wall / layers, cpu / layers
        gbps = nbytes / wall / 1e9
        rows.append(
            {
                "backend": name,
                "phase": "decode",
                "batch": batch,
                "context": context,
                "heads": "smollm2 9q/3kv/64",
                "dtype": str(dtype).removeprefix("torch."),
                "seconds": wall,
                "gbps": round(gbps, 2),
                "fraction_of_copy_bw": round(gbps / copy, 3),
                "vs_contiguous": round(wall / base_wall, 3),
                "cpu_seconds": cpu,
                "vs_contiguous_cpu": round(cpu / base_cpu, 3),
            }
        )
    return rows


def step_rows(batch: int, context: int, layers: int, rounds: int, legacy: LegacyKernel | None) -> list[dict]:
    """A float32 decode step of `layers` SmolLM2 layers: seven F.linear and the attention per layer, with the fused
    operator, the legacy kernel (when built) and no attention at all. Seconds per step."""
    h, kvh, d = HEADS
    stack = Stack(batch, context, torch.float32, layers)
    shapes = [
        (h * d, HIDDEN),
        (kvh * d, HIDDEN),
        (kvh * d, HIDDEN),
        (HIDDEN, h * d),
        (INTERMEDIATE, HIDDEN),
        (INTERMEDIATE, HIDDEN),
        (HIDDEN, INTERMEDIATE),
    ]
    weights = [[torch.randn(shape) * 0.02 for shape in shapes] for _ in range(layers)]
    x = torch.randn(batch, HIDDEN)

    def step(attend: Callable[[int, torch.Tensor], torch.Tensor] | None) -> Callable[[], None]:
        def run() -> None:
            y = x
            for layer, (wq, wk, wv, wo, wg, wu, wd) in enumerate(weights):
                q = F.linear(y, wq).view(batch, h, d)
                F.linear(y, wk), F.linear(y, wv)
                a = attend(layer, q) if attend is not None else q
                y = y + F.linear(a.reshape(batch, h * d), wo)
                y = y + F.linear(F.silu(F.linear(y, wg)) * F.linear(y, wu), wd)

        return run

    fns = {"linears_only": step(None), "fused": step(stack.attend)}
    if legacy is not None:
        fns["legacy_c"] = step(lambda i, q: stack.legacy(legacy, i, q))
    t = timed(fns, rounds)
    return [
        {
            "backend": name,
            "phase": f"step {layers} layers",
            "batch": batch,
            "context": context,
            "dtype": "float32",
            "seconds": wall,
            "cpu_seconds": cpu,
            "vs_fused": round(wall / t["fused"][0], 3),
        }
        for name, (wall, cpu) in t.items()
    ]


def openmp_runtimes() -> list[str]:
    """OpenMP runtime libraries mapped into this process (Linux; empty elsewhere)."""
    try:
        with open("/proc/self/maps", encoding="utf-8") as f:
            return sorted({line.split()[-1] for line in f if any(n in line for n in ("libgomp", "libiomp", "libomp"))})
    except OSError:
        return []


def summary(rows: list[dict]) -> list[dict]:
    """Per decode shape: gather+sdpa / fused and legacy_c / fused wall-time ratios (> 1: the fused operator wins)."""
    by_shape: dict[tuple, dict[str, float]] = {}
    for r in rows:
        if r["phase"] == "decode":
            by_shape.setdefault((r["dtype"], r["batch"], r["context"]), {})[r["backend"]] = r["seconds"]
    out = []
    for (dtype, batch, context), t in by_shape.items():
        entry = {"dtype": dtype, "batch": batch, "context": context}
        for other in ("gather+sdpa", "legacy_c"):
            if other in t:
                entry[f"{other}_over_fused"] = round(t[other] / t["fused"], 3)
        out.append(entry)
    return out


def run(mode: str) -> dict:
    """All CPU rows of a mode ("smoke", "quick", "full"); returns rows, step rows, summary and the copy bandwidth.
    The smoke mode leaves the legacy kernel out (it needs git history and cc)."""
    if mode == "smoke":
        shapes, rounds, budget, steps = [(2, 64)], 1, 1 << 20, [(2, 64, 2)]
    elif mode == "quick":
        shapes, rounds, budget, steps = [(8, 512), (32, 512)], 5, 256 << 20, [(8, 512, 8)]
    else:
        shapes = [(b, c) for b in (1, 8, 32) for c in (512, 2048)]
        rounds, budget, steps = 9, 512 << 20, [(8, 512, 30), (32, 512, 30)]
    legacy = LegacyKernel.build() if mode != "smoke" else None
    copy = copy_gbps(min(budget, 256 << 20))
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        for batch, context in shapes:
            rows += decode_rows(batch, context, dtype, rounds, budget, copy, legacy)
            logger.info("cpu decode %s batch %d context %d: %s", dtype, batch, context, rows[-1])
    step = [r for b, c, n in steps for r in step_rows(b, c, n, rounds, legacy)]
    return {
        "rows": rows,
        "step_rows": step,
        "summary": summary(rows),
        "copy_gbps": round(copy, 2),
        "openmp_runtimes": openmp_runtimes(),
        "legacy_commit": LEGACY_COMMIT if legacy else None,
    }
