"""Quantized matrix-vector speed on cold weights: the qgemv op (kernels/cpu_qgemv.py) vs torch's int4pack / int8pack
kernels vs dense F.linear, on SmolLM2-135M's layer shapes and its lm_head, side by side in one run, on both ISAs.

For each shape [N, K], activation dtype (float32, bfloat16) and row count M, each method multiplies x [M, K] by
`copies` distinct copies of the weight in turn (as many as make ~COLD_BYTES of dense float32 weights, at most 30, the
model's layer count), so caches hold none of them, as in a decode step that reads each layer once:
- qgemv_int4 / qgemv_int8: the op on runtime.model.quant_groups.quantize_q4 / quantize_q8 copies, ISA of the leg;
- torch_int4 / torch_int8: runtime.model.quant_int4.int4_linear / runtime.model.quant.int8_linear (x converted to
  bfloat16 and back for float32, as Linear's torch path does);
- dense: F.linear on the weight in x's dtype.
us: microseconds per call, the fastest of `repeats` passes, on `--threads` torch threads (default 1: a call
split over 2 threads waits for both, and on a shared machine one of them is often descheduled); gb_s: the method's
weight bytes (codes, scales, mins) read per call / time. crossing["dense"][dtype][method]: the largest M up to which the
method beats dense on every shape it ran; crossing["torch"]: the largest M up to which the op beats torch's kernel of
the same bits on every shape (the row limit runtime.model.quant_groups.QGEMV_MAX_ROWS records: above it Linear runs
torch's kernel). The head runs int8 in every model: no int4 rows.

Legs: "native" runs in this process with the qgemv ISA this CPU's flags pick; "avx2" in a subprocess with
ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 (torch's kernels and oneDNN held to AVX2) and the op's AVX2 code.
machine: runtime.model.cpu_features.machine_facts() (its load average: the machine is shared; compare rows of one run).

    .venv/bin/python -m benchmarks.qgemv            # rows 1 2 4 8 12 16, both legs -> results/qgemv.json
    .venv/bin/python -m benchmarks.qgemv --smoke    # seconds: two tiny shapes, rows 1 and 2, native leg only
    .venv/bin/python -m benchmarks.qgemv --legs native --rows 1 --decode   # + decode tok/s, torch kernels vs op

--decode adds single-stream decode tok/s of the embedded SmolLM2 with the defaults (dtype auto, quantization auto),
Linear on torch's kernels and on the op, two runners side by side in this process (measure_decode).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.cli import write_result
from benchmarks.decode_throughput import make_prompts, run_runner
from kernels import cpu_qgemv
from radix.blocks import cdiv
from runtime.config import MIN_USABLE_BLOCKS, ServerArgs
from runtime.model import quant, quant_groups, quant_int4
from runtime.model.cpu_features import cpu_flags, machine_facts
from runtime.model.runner import ModelRunner

RESULTS = Path(__file__).parent / "results" / "qgemv.json"
SHAPES = {"qkv_proj": (960, 576), "o_proj": (576, 576), "gate_up_proj": (3072, 576), "down_proj": (576, 1536)}
HEAD = {"lm_head": (49152, 576)}
SMOKE_SHAPES = {"small": (64, 64), "wide": (96, 128)}
COLD_BYTES = 128 << 20
DTYPES = (torch.float32, torch.bfloat16)
METHODS = ("qgemv_int4", "qgemv_int8", "torch_int4", "torch_int8", "dense")
AVX2_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}


def weight_bytes(method: str, n: int, k: int, dtype: torch.dtype) -> int:
    """Bytes of weight data one call of `method` reads for an [N, K] weight."""
    groups = n * (k // 32)
    return {
        "qgemv_int4": n * k // 2 + groups * 8,
        "qgemv_int8": n * k + groups * 4,
        "torch_int4": n * k // 2 + groups * 4,
        "torch_int8": n * k + n * 2,
        "dense": n * k * dtype.itemsize,
    }[method]


def make_calls(method: str, weights: list[torch.Tensor], isa: str) -> dict[torch.dtype, list[Callable]]:
    """{x dtype: one callable x -> y per weight copy} for `method` (quantized copies shared by both dtypes)."""
    if method == "dense":
        dense = {dtype: [w.to(dtype) for w in weights] for dtype in DTYPES}
        return {dtype: [lambda x, w=w: F.linear(x, w) for w in dense[dtype]] for dtype in DTYPES}
    calls: list[Callable]
    if method == "qgemv_int4":
        q4 = [quant_groups.quantize_q4(w) for w in weights]
        calls = [lambda x, w=w: cpu_qgemv.qgemv(x, w, isa) for w in q4]
    elif method == "qgemv_int8":
        q8 = [quant_groups.quantize_q8(w) for w in weights]
        calls = [lambda x, w=w: cpu_qgemv.qgemv(x, w, isa) for w in q8]
    elif method == "torch_int4":
        p4 = [quant_int4.pack_int4(quant_int4.quantize_int4(w)) for w in weights]
        calls = [lambda x, w=w: quant_int4.int4_linear(x, w) for w in p4]
    else:
        p8 = [quant.quantize_int8(w, quant.KERNEL_DTYPE) for w in weights]
        calls = [lambda x, w=w: quant.int8_linear(x, w) for w in p8]
    return dict.fromkeys(DTYPES, calls)


def time_calls(calls: list[Callable], x: torch.Tensor, repeats: int) -> float:
    """Microseconds per call of the fastest of `repeats` passes through all calls (after one warm-up pass): on a
    shared machine the fastest pass is the one least disturbed by other processes."""
    for call in calls:
        call(x)
    passes = []
    for _ in range(repeats):
        start = time.perf_counter()
        for call in calls:
            call(x)
        passes.append((time.perf_counter() - start) / len(calls) * 1e6)
    return min(passes)


def measure_leg(shapes: dict[str, tuple[int, int]], rows: list[int], repeats: int, isa: str) -> list[dict]:
    """Rows of {shape, n, k, dtype, rows, method, us, gb_s} for every shape, method, dtype and row count (the head,
    int8 in every model, without the int4 methods)."""
    out = []
    for name, (n, k) in shapes.items():
        copies = max(2, min(30, COLD_BYTES // (n * k * 4)))
        gen = torch.Generator().manual_seed(0)
        weights = [torch.randn(n, k, generator=gen) * 0.02 for _ in range(copies)]
        methods = [m for m in METHODS if not (name in HEAD and m.endswith("int4"))]
        for method in methods:
            calls = make_calls(method, weights, isa)
            for dtype in DTYPES:
                for m in rows:
                    x = torch.randn(m, k, generator=gen).to(dtype)
                    us = time_calls(calls[dtype], x, repeats)
                    gb_s = weight_bytes(method, n, k, dtype) / us / 1e3
                    row = {"shape": name, "n": n, "k": k, "dtype": str(dtype).removeprefix("torch."), "rows": m}
                    out.append({**row, "method": method, "us": round(us, 1), "gb_s": float(f"{gb_s:.3g}")})
            del calls
    return out


def crossings(rows: list[dict]) -> dict[str, dict[str, int]]:
    """{dtype: {method: largest M at which the method is faster than dense on every shape}} (0: never)."""
    table: dict[tuple, float] = {(r["shape"], r["dtype"], r["rows"], r["method"]): r["us"] for r in rows}
    result: dict[str, dict[str, int]] = {}
    for dtype in sorted({r["dtype"] for r in rows}):
        result[dtype] = {}
        for method in METHODS[:-1]:
            best = 0
            for m in sorted({r["rows"] for r in rows}):
                shapes = {r["shape"] for r in rows if r["dtype"] == dtype and r["method"] == method}
                if all(table[(s, dtype, m, method)] < table[(s, dtype, m, "dense")] for s in shapes):
                    best = m
                else:
                    break
            result[dtype][method] = best
    return result


def crossings_torch(rows: list[dict]) -> dict[str, dict[str, int]]:
    """{dtype: {qgemv_int4 / qgemv_int8: largest M up to which the op beats torch's kernel of the same bits on every
    shape}} (0: never): the row limit runtime.model.quant_groups.QGEMV_MAX_ROWS records."""
    table: dict[tuple, float] = {(r["shape"], r["dtype"], r["rows"], r["method"]): r["us"] for r in rows}
    result: dict[str, dict[str, int]] = {}
    for dtype in sorted({r["dtype"] for r in rows}):
        result[dtype] = {}
        for method in ("qgemv_int4", "qgemv_int8"):
            rival = method.replace("qgemv", "torch")
            shapes = {r["shape"] for r in rows if r["dtype"] == dtype and r["method"] == method}
            best = 0
            for m in sorted({r["rows"] for r in rows}):
                if all(table[(s, dtype, m, method)] < table[(s, dtype, m, rival)] for s in shapes):
                    best = m
                else:
                    break
            result[dtype][method] = best
    return result


def measure_decode(model: str, context: int, steps: int, repeats: int) -> dict:
    """Single-stream decode tok/s of `model` with the defaults (ServerArgs: dtype auto, quantization auto), two
    runners side by side in this process: Linear on torch's kernels (the op turned off while it was built) and on
    the qgemv op; greedy steps after a `context`-token prompt, best of `repeats` interleaved runs."""
    max_prefill = ServerArgs().max_prefill_tokens
    blocks = MIN_USABLE_BLOCKS + 1 + cdiv(context + steps, 16)
    runners = {}
    enabled = cpu_qgemv.ENABLED
    for label, on in (("torch_kernels", False), ("qgemv", True)):
        cpu_qgemv.ENABLED = on
        runners[label] = ModelRunner(ServerArgs(model=model, num_blocks=blocks))
    cpu_qgemv.ENABLED = enabled
    vocab = runners["qgemv"].model.lm_head.weight.shape[0]
    prompts = make_prompts(1, context, vocab)
    tok_s: dict[str, list[float]] = {label: [] for label in runners}
    for r in range(repeats):
        for i, (label, runner) in enumerate(runners.items()):
            _, (wall, _) = run_runner(runner, prompts, steps, max_prefill, first_seq_id=1 + 2 * r + i)
            tok_s[label].append(round(steps / wall, 2))
    best = {label: max(v) for label, v in tok_s.items()}
    return {
        "model": model,
        "context": context,
        "steps": steps,
        "tok_s": tok_s,
        "best_tok_s": best,
        "speedup": round(best["qgemv"] / best["torch_kernels"], 3),
    }


def run_leg(args: argparse.Namespace, isa: str) -> dict:
    """One leg measured in this process."""
    shapes = SMOKE_SHAPES if args.smoke else {**SHAPES, **HEAD}
    rows = measure_leg(shapes, args.rows, args.repeats, isa)
    crossing = {"dense": crossings(rows), "torch": crossings_torch(rows)}
    return {"isa": isa, "machine": machine_facts(), "crossing": crossing, "rows": rows}


def main(argv: list[str] | None = None) -> dict:
    """Measure (see the module docstring), print and write the JSON; returns it."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--rows", type=int, nargs="+")
    parser.add_argument("--repeats", type=int)
    parser.add_argument("--legs", nargs="+", choices=["native", "avx2"])
    parser.add_argument("--leg-json", action="store_true", help=argparse.SUPPRESS)  # a subprocess leg: print one leg
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the kernel legs (default 1)")
    parser.add_argument("--decode", action="store_true", help="also single-stream decode tok/s, op off vs on")
    parser.add_argument("--model", default="smollm2", help="the --decode model (default: the embedded SmolLM2)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    args.rows = args.rows or ([1, 2] if args.smoke else [1, 2, 4, 8, 12, 16])
    args.repeats = args.repeats or (1 if args.smoke else 5)
    legs = args.legs or (["native"] if args.smoke else ["native", "avx2"])
    cpu_qgemv.ENABLED = True  # the default, unless RADIXSERVE_CPU_QGEMV=0; measure_decode turns it off for one runner
    if cpu_qgemv.load_op() is None:
        raise SystemExit("the qgemv op could not be built (see the warning above)")
    torch.set_num_threads(args.threads)
    if args.leg_json:
        print(json.dumps(run_leg(args, cpu_qgemv.isa_for(cpu_flags()))))
        return {}
    result: dict = {"legs": {}}
    for leg in legs:
        if leg == "native":
            result["legs"][leg] = run_leg(args, cpu_qgemv.isa_for(cpu_flags()))
            continue
        flags = " ".join(f for f in cpu_flags() if not f.startswith(("avx512", "amx")))
        env = {**os.environ, **AVX2_ENV, "RADIXSERVE_CPU_FLAGS": flags}
        cmd = [sys.executable, "-m", "benchmarks.qgemv", "--leg-json", "--rows", *map(str, args.rows)]
        cmd += ["--repeats", str(args.repeats), "--threads", str(args.threads), *(["--smoke"] if args.smoke else [])]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
        result["legs"][leg] = json.loads(proc.stdout.strip().splitlines()[-1])
    if args.decode:
        context, steps = (16, 4) if args.smoke else (512, 32)
        result["decode"] = measure_decode(args.model, context, steps, args.repeats)
        result["decode"]["machine"] = machine_facts()
    write_result(result, args.out, args.smoke, RESULTS)
    print(json.dumps({leg: r["crossing"] for leg, r in result["legs"].items()}, indent=2))
    if args.decode:
        print(json.dumps(result["decode"], indent=2))
    return result


if __name__ == "__main__":
    main()
