"""Paged attention decode: the cost of reading K/V through block tables, against SDPA over contiguous K/V.

CUDA: the Triton split-KV decode kernel (kernels/triton_decode.py) for batch {1, 8, 64, 256} x context {512, 4096,
32768} with Llama-3-8B heads (32 q / 8 kv / 128) and SmolLM2 heads (9 q / 3 kv / 64), bf16: time
(triton.testing.do_bench, median), achieved bandwidth (bytes of K/V read / time), the fraction of the device's
measured copy bandwidth (2 x bytes / time of a large device-to-device copy), and the time of torch's
scaled_dot_product_attention over a contiguous K/V of the same size (GQA folded the same way: the G query heads of a
KV head are its G query rows). Target on an H200 at batch 64 x 4096: >= 0.8 of copy bandwidth, no slower than SDPA.

CPU (benchmarks/attention_kernel_cpu.py): the fused decode operator (kernels/cpu_decode.py) against the torch
gather + SDPA path, the retired OpenMP C kernel (float32) and SDPA over contiguous K/V, SmolLM2 heads, float32 and
bfloat16, batch {1, 8, 32} x context {512, 2048}; and a decode step of F.linear calls plus the attention, legacy C
kernel vs the operator (do two thread pools fight?). Default 2 torch threads. Machine facts in "device".

    .venv/bin/python -m benchmarks.attention_kernel            # -> benchmarks/results/attention_kernel.json
    .venv/bin/python -m benchmarks.attention_kernel --quick    # CPU: about a minute
    .venv/bin/python -m benchmarks.attention_kernel --smoke    # seconds; writes nothing unless --out is given
    .venv/bin/python -m benchmarks.attention_kernel --sweep    # CUDA: also try decode launch configurations
"""

from __future__ import annotations

import argparse
import json
import logging
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

import kernels
from benchmarks.cli import output_path, run_mode
from radix.blocks import cdiv

logger = logging.getLogger(__name__)

RESULTS = Path(__file__).parent / "results" / "attention_kernel.json"
HEADS = {"llama3-8b": (32, 8, 128), "smollm2": (9, 3, 64)}
BLOCK_SIZE = 16


def _heads_label(name: str) -> str:
    h, kvh, d = HEADS[name]
    return f"{name} {h}q/{kvh}kv/{d}"


def _kv_bytes(batch: int, context: int, kvh: int, d: int, elem: int) -> int:
    return 2 * batch * context * kvh * d * elem


def _paged_decode_inputs(batch: int, context: int, heads: str, dtype: torch.dtype, device: str, layers: int = 1):
    """Caches [layers, num_blocks, BLOCK_SIZE, kvh, d] with each sequence's blocks at shuffled positions."""
    h, kvh, d = HEADS[heads]
    blocks_per_seq = cdiv(context, BLOCK_SIZE)
    num_blocks = batch * blocks_per_seq + 1
    shape = (layers, num_blocks, BLOCK_SIZE, kvh, d)
    k_cache = torch.empty(shape, dtype=dtype, device=device).normal_()
    v_cache = torch.empty(shape, dtype=dtype, device=device).normal_()
    perm = torch.randperm(num_blocks - 1, device=device) + 1
    tables = perm.view(batch, blocks_per_seq).to(torch.int32)
    q = torch.randn(batch, h, d, dtype=dtype, device=device)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    qsl = torch.arange(batch + 1, dtype=torch.int32, device=device)
    return q, k_cache, v_cache, tables, seq_lens, qsl


def _contiguous(batch: int, context: int, heads: str, dtype: torch.dtype, device: str, layers: int = 1):
    _, kvh, d = HEADS[heads]
    shape = (layers, batch, kvh, context, d)
    return (
        torch.empty(shape, dtype=dtype, device=device).normal_(),
        torch.empty(shape, dtype=dtype, device=device).normal_(),
    )


def _row(backend, batch, context, heads, phase, seconds, nbytes, copy_gbps, baseline_s, cpu=None) -> dict:
    """One result row; cpu = (cpu_seconds, baseline cpu_seconds) adds the process-CPU-time figures (CPU runs)."""
    gbps = nbytes / seconds / 1e9
    extra = {} if cpu is None else {"cpu_seconds": cpu[0], "vs_contiguous_cpu": round(cpu[0] / cpu[1], 3)}
    return {
        "backend": backend,
        "phase": phase,
        "batch": batch,
        "context": context,
        "heads": _heads_label(heads),
        "seconds": seconds,
        "gbps": round(gbps, 2),
        "fraction_of_copy_bw": round(gbps / copy_gbps, 3),
        "vs_contiguous": round(seconds / baseline_s, 3),
        **extra,
    }


def run_cpu(mode: str) -> tuple[dict, dict]:
    """CPU rows (benchmarks/attention_kernel_cpu.py) and the machine they ran on."""
    from benchmarks import attention_kernel_cpu
    from runtime.model.cpu_features import machine_facts

    extra = attention_kernel_cpu.run(mode)
    device = {"type": "cpu", **machine_facts(), "copy_gbps": extra.pop("copy_gbps"), "dtype": "float32+bfloat16"}
    return device, extra


# ---------------------------------------------------------------- CUDA


def _cuda_time(fn: Callable[[], object]) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median") / 1e3


def _cuda_copy_gbps() -> float:
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() / _cuda_time(lambda: dst.copy_(src)) / 1e9


def _cuda_sdpa_seconds(batch: int, context: int, heads: str) -> float:
    h, kvh, d = HEADS[heads]
    k_cont, v_cont = _contiguous(batch, context, heads, torch.bfloat16, "cuda")
    qg = torch.randn(batch, kvh, h // kvh, d, dtype=torch.bfloat16, device="cuda")
    return _cuda_time(lambda: F.scaled_dot_product_attention(qg, k_cont[0], v_cont[0], scale=d**-0.5))


def cuda_decode_rows(batch: int, context: int, heads: str, copy_gbps: float, sweep: bool) -> list[dict]:
    _, kvh, d = HEADS[heads]
    nbytes = _kv_bytes(batch, context, kvh, d, 2)
    t_sdpa = _cuda_sdpa_seconds(batch, context, heads)  # its contiguous K/V are freed on return
    q, k_cache, v_cache, tables, seq_lens, qsl = _paged_decode_inputs(batch, context, heads, torch.bfloat16, "cuda")
    args = (q, k_cache[0], v_cache[0], tables, seq_lens, qsl, d**-0.5)
    t_triton = _cuda_time(lambda: kernels.paged_attention(*args, 1, context, backend="triton"))
    rows = [
        _row("triton", batch, context, heads, "decode", t_triton, nbytes, copy_gbps, t_sdpa),
        _row("sdpa_contiguous", batch, context, heads, "decode", t_sdpa, nbytes, copy_gbps, t_sdpa),
    ]
    if sweep:
        rows += _sweep(args, context, nbytes, copy_gbps, t_sdpa, heads)
    return rows


def _cuda_device_info(copy_gbps: float) -> dict:
    props = torch.cuda.get_device_properties(0)
    return {
        "type": "cuda",
        "name": props.name,
        "sm_count": props.multi_processor_count,
        "copy_gbps": round(copy_gbps, 1),
        "dtype": "bfloat16",
    }


def run_cuda(mode: str, sweep: bool, save: Callable[[dict, list[dict]], None]) -> tuple[dict, list[dict]]:
    """All CUDA rows; save(device, rows) is called after each shape so a run cut short keeps what it measured."""
    batches, contexts = ((1, 8, 64, 256), (512, 4096, 32768)) if mode == "full" else ((1, 64), (512, 4096))
    if mode == "smoke":
        batches, contexts = (8,), (512,)
    copy_gbps = _cuda_copy_gbps()
    rows = []
    for heads in HEADS:
        _, kvh, d = HEADS[heads]
        for batch in batches:
            for context in contexts:
                nbytes = _kv_bytes(batch, context, kvh, d, 2)
                if 2.3 * nbytes > torch.cuda.mem_get_info()[0]:
                    logger.warning("skip %s batch %d context %d: %.1f GB of K/V", heads, batch, context, nbytes / 1e9)
                    continue
                rows += cuda_decode_rows(batch, context, heads, copy_gbps, sweep and batch == 64 and context == 4096)
                logger.info("cuda %s", rows[-2:])
                save(_cuda_device_info(copy_gbps), rows)
                torch.cuda.empty_cache()
    return _cuda_device_info(copy_gbps), rows


def _sweep(args: tuple, context: int, nbytes: int, copy_gbps: float, t_sdpa: float, heads: str) -> list[dict]:
    """Launch configurations of the decode kernel at one shape (rows named triton[block_n=..,warps=..,...])."""
    import triton

    from kernels.triton_decode import decode_attention

    configs = [(block_n, warps, stages, None) for block_n in (32, 64, 128) for warps in (4, 8) for stages in (2, 3)]
    configs += [(64, 4, 2, splits) for splits in (1, 8, 16)]
    rows = []
    for block_n, warps, stages, splits in configs:
        config = dict(num_splits=splits, block_n=block_n, num_warps=warps, num_stages=stages)
        try:
            t = _cuda_time(lambda c=config: decode_attention(*args, max_seq_len=context, **c))
        except triton.runtime.errors.OutOfResources as e:  # e.g. shared memory of a large tile x many stages
            logger.warning("sweep config %s does not fit: %s", config, e)
            continue
        name = f"triton[block_n={block_n},warps={warps},stages={stages},splits={splits or 'auto'}]"
        rows.append(_row(name, args[0].shape[0], context, heads, "decode", t, nbytes, copy_gbps, t_sdpa))
    return rows


def _other_runs(out: Path | None, device_type: str) -> dict:
    """The latest run of each other device type found in `out` (CPU figures survive a GPU run and the reverse)."""
    if out is None or not out.exists():
        return {}
    old = json.loads(out.read_text())
    kept = {t: r for t, r in old.get("other_runs", {}).items() if t != device_type}
    if old.get("device", {}).get("type") not in (None, device_type):
        kept[old["device"]["type"]] = {k: old[k] for k in ("device", "mode", "rows")}
    return kept


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark; returns the result dict and writes it to --out (default results/ unless --smoke)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer shapes (CPU: under a minute)")
    parser.add_argument("--smoke", action="store_true", help="seconds-long run; writes only with --out")
    parser.add_argument("--sweep", action="store_true", help="CUDA: also time decode launch configurations")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--threads", type=int, default=2, help="CPU: torch threads (1: CPU time immune to load)")
    parser.add_argument("--out", type=Path, default=None, help=f"JSON path (default {RESULTS})")
    args = parser.parse_args(argv)
    mode = run_mode(args.smoke, args.quick)
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    if device == "cpu":
        torch.set_num_threads(args.threads)
    out = output_path(args.out, args.smoke, RESULTS)
    kept = _other_runs(out, device)

    def save(info: dict, rows: list[dict], extra: dict | None = None) -> dict:
        result = {"device": info, "mode": mode, "block_size": BLOCK_SIZE, "rows": rows, **(extra or {})}
        if kept:
            result["other_runs"] = kept
        if out is not None:
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(result, indent=1) + "\n")
        return result

    if device == "cuda":
        return save(*run_cuda(mode, args.sweep, save))
    info, extra = run_cpu(mode)
    return save(info, extra.pop("rows"), extra)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    res = main()
    for r in res["rows"]:
        logger.info(
            "%-24s %-34s %-9s batch %4d ctx %6d  %10.3f ms  %8.2f GB/s  %5.3f of copy  %5.2fx contiguous",
            r["backend"],
            r["heads"] + " " + r["phase"],
            r.get("dtype", ""),
            r["batch"],
            r["context"],
            r["seconds"] * 1e3,
            r["gbps"],
            r["fraction_of_copy_bw"],
            r["vs_contiguous"],
        )
    for r in res.get("step_rows", []):
        logger.info(
            "%-24s %-20s batch %4d ctx %6d  %10.3f ms  %5.3fx fused",
            r["backend"],
            r["phase"],
            r["batch"],
            r["context"],
            r["seconds"] * 1e3,
            r["vs_fused"],
        )
    for r in res.get("summary", []):
        logger.info("%s", r)
