"""Quantized matrix times few vectors for CPU decode (kernels/cpu_qgemv.cpp): weight layout, build on first use, ISA.

``torch.ops.radixserve_qgemv.qgemv`` computes y [M, N] = x [M, K] @ W.T for M <= MAX_ROWS rows of float32 or
bfloat16 x (read as they are: no conversion around the call), W stored in groups of GROUP values along K:
- 4 bits: ``Q4Weight``: q 0..15 packed two to a byte, w = q * scale + min per group (float32 scale and min);
- 8 bits: ``Q8Weight``: int8 q in -127..127, w = q * scale per group.
x is rounded to int16 per row per group on the fly and each group's dot product is an integer sum (the C++ file's
header gives the scheme; rounding_bound, the error bound). Except on isa "avx512_bf16" (AVX-512 VNNI with
AVX512_BF16) for bfloat16 x of 2 or more rows: there each group is dequantized once per call to bfloat16 and each row
costs one vdpbf16ps per 32 weights (kernels/cpu_qgemv_bf16.cpp): y = x @ bf16(W).T up to float32 summation order
(runtime.model.quant_groups.dequantize_bf16 gives bf16(W)); one row and float32 x run the avx512_vnni code.

The instruction set is an argument (``isa_for`` picks it from the CPU's flags), not a compile flag: one library
carries the scalar, AVX2, AVX-512 VNNI and AVX512_BF16 code, each function compiled for its own target, so a test can
run the AVX2 code on an AVX-512 machine and an AVX2-only CPU never meets an AVX-512 instruction.

Build: kernels.cpp_build compiles it on first use into ``$RADIXSERVE_CACHE/kernels`` as
``radixserve_cpu_qgemv-<key>.so``. A build or load failure logs one warning and ``load_op`` returns None: the caller
keeps torch's kernels. ``RADIXSERVE_CPU_QGEMV=0`` (read at import) or ``ENABLED = False`` turns it off.
``python -m kernels.cpu_qgemv`` builds it (if needed) and prints where and how long.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Set
from pathlib import Path
from typing import NamedTuple

import torch

from kernels import cpp_build
from kernels.errors import KernelInputError

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_qgemv.cpp")
BF16_SOURCE = Path(__file__).with_name("cpu_qgemv_bf16.cpp")  # isa "avx512_bf16": bfloat16 dot products
SHARE_SOURCE = Path(__file__).with_name("cpu_share.cpp")  # the helper thread (set_helper)
HEADERS = (Path(__file__).with_name("cpu_qgemv.h"), Path(__file__).with_name("cpu_share.h"))
NAME = "radixserve_cpu_qgemv"
# No -march: each ISA's functions carry their own target attribute. -fopenmp: at::parallel_for's OpenMP backend.
# -ffp-contract=off: x's rounding (v * inv + 1.5 * 2^23) must not fuse into an fma (one rounding instead of two).
CFLAGS = ("-O3", "-fopenmp", "-ffp-contract=off")
OP = cpp_build.OpSource(NAME, (SOURCE, BF16_SOURCE, SHARE_SOURCE), CFLAGS, HEADERS)
# On by default; RADIXSERVE_CPU_QGEMV=0 turns it off (Linear then keeps torch's kernels for every row count).
ENABLED = os.environ.get("RADIXSERVE_CPU_QGEMV", "1") != "0"
GROUP = 32  # values of K per scale (and min): GGUF's Q4_0 / Q4_1 / Q8_0 block, a Q4_K sub-block
MAX_ROWS = 16  # the most rows of x one call takes
XQ_MAX = 32767  # x is rounded per group to int16: xq = round(x / a), a = max |x| / XQ_MAX
ISAS = {"scalar": 0, "avx2": 1, "avx512_vnni": 2, "avx512_bf16": 3}
AVX512_FLAGS = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512_vnni"})
BF16_FLAG = "avx512_bf16"  # vdpbf16ps: "avx512_bf16" takes bfloat16 x of 2 to 16 rows to cpu_qgemv_bf16.cpp
AVX2_FLAGS = frozenset({"avx2", "fma"})

_op: Callable[..., torch.Tensor] | None = None
_failed = False
_helper = False  # set_helper's last word, applied when the op loads


class Q4Weight(NamedTuple):
    """4-bit groups: qweight uint8 [N, K / 2] (pack_q4's layout), scales and mins float32 [N, K / GROUP];
    w[n, g * 32 + j] = q * scales[n, g] + mins[n, g]."""

    qweight: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor


class Q8Weight(NamedTuple):
    """8-bit groups: qweight int8 [N, K] (-127..127), scales float32 [N, K / GROUP]; w = q * scales[n, k // 32]."""

    qweight: torch.Tensor
    scales: torch.Tensor


def isa_for(flags: Set[str]) -> str:
    """The fastest ISA of ISAS these CPU flags (/proc/cpuinfo names) allow: avx512_bf16, avx512_vnni, avx2 or
    scalar."""
    if AVX512_FLAGS <= flags and BF16_FLAG in flags:
        return "avx512_bf16"
    if AVX512_FLAGS <= flags:
        return "avx512_vnni"
    if AVX2_FLAGS <= flags:
        return "avx2"
    return "scalar"


def pack_q4(q: torch.Tensor) -> torch.Tensor:
    """q (any integer dtype) [N, K], values 0..15, K % GROUP == 0 -> uint8 [N, K / 2]: per group of 32, byte j holds
    q[j] in its low nibble and q[j + 16] in its high one (ggml's Q4 block order). Raises ValueError on a bad shape."""
    if q.dim() != 2 or q.shape[1] % GROUP:
        raise ValueError(f"pack_q4 takes [N, K] with K % {GROUP} == 0, got {tuple(q.shape)}")
    n, k = q.shape
    g = q.to(torch.uint8).reshape(n, k // GROUP, 2, GROUP // 2)
    return (g[:, :, 0] | (g[:, :, 1] << 4)).reshape(n, k // 2).contiguous()


def unpack_q4(packed: torch.Tensor) -> torch.Tensor:
    """pack_q4's inverse: uint8 [N, K / 2] -> uint8 [N, K] (0..15)."""
    n, half = packed.shape
    g = packed.reshape(n, half // (GROUP // 2), 1, GROUP // 2)
    return torch.cat([g & 15, g >> 4], dim=2).reshape(n, half * 2)


def rounding_bound(x: torch.Tensor, dequantized: torch.Tensor) -> torch.Tensor:
    """The bound on |qgemv(x, w) - x @ dequantized.T| that x's int16 rounding allows, float64 [M, N], before float32
    rounding: sum over groups g of a_g / 2 * sum_j |w[n, g * 32 + j]|, a_g = max |x[m, group g]| / XQ_MAX (each x
    moves by at most a_g / 2; kernels/cpu_qgemv.cpp's header). x [M, K] float32 or bfloat16; dequantized float
    [N, K] (runtime.model.quant_groups.dequantize)."""
    m, k = x.shape
    n = dequantized.shape[0]
    a = x.double().reshape(m, k // GROUP, GROUP).abs().amax(-1) / XQ_MAX
    wabs = dequantized.double().abs().reshape(n, k // GROUP, GROUP).sum(-1)
    return a @ wabs.T / 2


def load_op() -> Callable[..., torch.Tensor] | None:
    """torch.ops.radixserve_qgemv.qgemv, building it on first use; None when ENABLED is False or (one warning per
    process) when it cannot be built or loaded."""
    global _op, _failed
    if not ENABLED:
        return None
    if _op is not None or _failed:
        return _op
    try:
        if not hasattr(torch.ops.radixserve_qgemv, "qgemv"):
            OP.load()
        _op = torch.ops.radixserve_qgemv.qgemv
        torch.ops.radixserve_qgemv.set_helper(_helper)
    except Exception as exc:  # any build or load failure (compiler, linker, loader) keeps torch's kernels
        detail = "\n".join(str(exc).strip().splitlines()[-6:])
        logger.warning("CPU qgemv kernel unavailable (%s); using torch's kernels: %s", cpp_build.compiler(), detail)
        _failed = True
    return _op


def set_helper(on: bool) -> None:
    """Turns the op's helper thread on or off for this process (kernels/cpu_share.h), now if the op is loaded, else
    when load_op loads it (this builds nothing): on, a call on one torch thread whose weights span more than one
    16 KB block shares its rows with one more thread (SCHED_IDLE: it takes only a core nothing else wants; it spins up
    to 200 us between calls, then sleeps); the result is the same bits. Mutates process-wide state."""
    global _helper
    _helper = on
    if _op is not None:
        torch.ops.radixserve_qgemv.set_helper(on)


def helper_on() -> bool:
    """Whether the loaded op's helper thread is on (False when the op is not loaded)."""
    return _op is not None and bool(torch.ops.radixserve_qgemv.helper_on())


def qgemv(x: torch.Tensor, w: Q4Weight | Q8Weight, isa: str) -> torch.Tensor:
    """x [M, K] @ W.T -> [M, N] in x.dtype, W the group-quantized weight w (Q4Weight: 4 bits, Q8Weight: 8 bits).

    x: float32 or bfloat16, contiguous, 1 <= M <= MAX_ROWS; isa: a key of ISAS the CPU supports (isa_for). Builds the
    op on first use. Accumulates in float32; the error against x @ dequantized(W).T is x's int16 rounding per group
    (rounding_bound) and float32 rounding. Mutates nothing.
    Raises: KernelInputError for shapes, dtypes or an isa the op does not take; RuntimeError when the op is
    unavailable (load_op() is None: check it first).
    """
    op = _op if _op is not None else load_op()
    if op is None:
        raise RuntimeError("the qgemv op is unavailable (disabled or failed to build); check load_op() first")
    if isa not in ISAS:
        raise KernelInputError(f"isa {isa!r}; supported: {list(ISAS)}")
    try:
        if isinstance(w, Q4Weight):
            return op(x, w.qweight, w.scales, w.mins, 4, ISAS[isa])
        return op(x, w.qweight, w.scales, w.scales, 8, ISAS[isa])
    except ValueError as exc:  # c10::ValueError from the operator's input checks
        raise KernelInputError(str(exc).split("\n", 1)[0]) from exc


if __name__ == "__main__":
    OP.main()
