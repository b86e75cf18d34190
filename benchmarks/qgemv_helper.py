"""The qgemv op's helper thread (kernels/cpu_share.h) off and on, side by side in one run.

Legs:
- shapes: microseconds per call of the op on SmolLM2-135M's layer shapes and its int8 lm_head, 1 row of bfloat16 x,
  one torch thread, on `copies` distinct copies of each weight in turn (cold caches, as in a decode step), helper off
  and on alternating in `--blocks` blocks; the outputs of both must be the same bits (same_bits).
- http (not in --smoke): two servers of --model with the defaults, one started with RADIXSERVE_QGEMV_HELPER=0,
  single-stream decode over HTTP alternating between them (benchmarks/chat/single_stream.py: `--decode-runs` runs of
  `--decode-tokens` tokens each, median tok/s); quiet, then again beside a process that keeps one core busy
  (benchmarks.vs_llama_busy.busy_core, started before the servers).
ratio: helper on / off (tok/s), or off / on (us). machine: runtime.model.cpu_features.machine_facts() (this VM's speed
drifts: compare the two sides of one run, not runs).

    .venv/bin/python -m benchmarks.qgemv_helper              # both legs -> results/qgemv_helper.json
    .venv/bin/python -m benchmarks.qgemv_helper --smoke      # seconds: two small shapes, 2 blocks, no http leg
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import torch

from benchmarks.chat.single_stream import interleaved
from benchmarks.cli import write_result
from benchmarks.vs_llama_busy import busy_core
from kernels import cpu_qgemv
from runtime.model import quant_groups
from runtime.model.cpu_features import cpu_flags, machine_facts
from runtime.model.threads import HELPER_ENV

RESULTS = Path(__file__).parent / "results" / "qgemv_helper.json"
SHAPES = {  # name: (N, K, bits), SmolLM2-135M int4 layers and its int8 head
    "qkv_proj": (960, 576, 4),
    "o_proj": (576, 576, 4),
    "gate_up_proj": (3072, 576, 4),
    "down_proj": (576, 1536, 4),
    "lm_head": (49152, 576, 8),
}
SMOKE_SHAPES = {"small_q4": (256, 256, 4), "small_q8": (256, 128, 8)}
COLD_BYTES = 64 << 20  # weight bytes cycled through per shape (several times the L3 cache)
PROMPT = "Tell me a long story about a dragon who learns to cook. " * 40


def copies_for(n: int, k: int, bits: int, cold_bytes: int) -> list[cpu_qgemv.Q4Weight | cpu_qgemv.Q8Weight]:
    """Distinct quantized copies of a random [n, k] weight, as many as make ~cold_bytes (at least 2, at most 60)."""
    gen = torch.Generator().manual_seed(n * 7 + k)
    per_copy = n * k * bits // 8
    count = max(2, min(60, cold_bytes // per_copy))
    quantize = quant_groups.quantize_q4 if bits == 4 else quant_groups.quantize_q8
    return [quantize(torch.randn(n, k, generator=gen) * 0.05) for _ in range(count)]


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        cpu_qgemv.set_helper(False)
        torch.set_num_threads(before)


def time_shape(weights: list[Any], k: int, isa: str, blocks: int, passes: int) -> dict[str, Any]:
    """Per call us with the helper off and on, alternating blocks (off first in even blocks), medians of blocks."""
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(k)).bfloat16()
    outputs = {}
    us: dict[bool, list[float]] = {False: [], True: []}
    for block in range(blocks):
        for on in (False, True) if block % 2 == 0 else (True, False):
            cpu_qgemv.set_helper(on)
            outputs[on] = [cpu_qgemv.qgemv(x, w, isa) for w in weights[:2]]
            start = time.perf_counter()
            for _ in range(passes):
                for w in weights:
                    cpu_qgemv.qgemv(x, w, isa)
            us[on].append((time.perf_counter() - start) / (passes * len(weights)) * 1e6)
    off = statistics.median(us[False])
    on = statistics.median(us[True])
    same = all(torch.equal(a, b) for a, b in zip(outputs[False], outputs[True], strict=True))
    return {
        "copies": len(weights),
        "off_us": round(off, 2),
        "on_us": round(on, 2),
        "ratio": round(off / on, 3),
        "same_bits": same,
    }


def shapes_leg(shapes: dict[str, tuple[int, int, int]], cold_bytes: int, blocks: int, passes: int) -> dict[str, Any]:
    isa = cpu_qgemv.isa_for(cpu_flags())
    rows = {}
    with one_thread():
        for name, (n, k, bits) in shapes.items():
            rows[name] = {
                "n": n,
                "k": k,
                "bits": bits,
                **time_shape(copies_for(n, k, bits, cold_bytes), k, isa, blocks, passes),
            }
            print(name, rows[name])
    return {"isa": isa, "rows": rows}


@contextlib.contextmanager
def server(model: str) -> Iterator[str]:
    """A radixserve server of model with the defaults and its HTTP API, for the with block; yields its base URL.
    Raises runtime.serve.launch.LaunchError when it does not start."""
    from runtime.config import ServerArgs
    from runtime.serve.launch import Launcher

    launcher = Launcher(ServerArgs(model=model, port=0, http_port=0, log_interval_s=3600.0))
    try:
        launcher.start()
        yield launcher.http_url
    finally:
        launcher.shutdown("benchmark finished")


def http_leg(model: str, busy: bool, tokens: int, runs: int) -> dict[str, Any]:
    """Single-stream tok/s of two servers (RADIXSERVE_QGEMV_HELPER=1: on, the default; 0: off), alternating."""
    with busy_core(busy), contextlib.ExitStack() as stack:
        with mock.patch.dict(os.environ, {HELPER_ENV: "1"}):  # the servers started here inherit it
            on = stack.enter_context(server(model))
        with mock.patch.dict(os.environ, {HELPER_ENV: "0"}):
            off = stack.enter_context(server(model))
        urls = {"helper_on": on, "helper_off": off}
        interleaved(urls, model, PROMPT, 16, 1)  # warm both
        done = interleaved(urls, model, PROMPT, tokens, runs)
    on_tok_s = done["helper_on"]["decode_tok_s"]
    off_tok_s = done["helper_off"]["decode_tok_s"]
    return {
        "busy_core": busy,
        "helper_on": done["helper_on"],
        "helper_off": done["helper_off"],
        "ratio": round(on_tok_s / off_tok_s, 3),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="seconds: two small shapes, 2 blocks, no http leg")
    parser.add_argument("--model", default="smollm2", help="the http leg's model (default smollm2)")
    parser.add_argument("--blocks", type=int, default=8, help="alternating blocks per shape (default 8)")
    parser.add_argument("--passes", type=int, default=3, help="passes over the copies per block (default 3)")
    parser.add_argument("--decode-tokens", type=int, default=256, help="tokens per single-stream run (default 256)")
    parser.add_argument("--decode-runs", type=int, default=8, help="runs per server (default 8)")
    parser.add_argument("--out", type=Path, help="JSON output (default results/qgemv_helper.json)")
    ns = parser.parse_args(argv)
    assert cpu_qgemv.load_op() is not None, "the qgemv op does not build here"
    result: dict[str, Any] = {"machine": machine_facts()}
    if ns.smoke:
        result["shapes"] = shapes_leg(SMOKE_SHAPES, 1 << 20, 2, 1)
    else:
        result["shapes"] = shapes_leg(SHAPES, COLD_BYTES, ns.blocks, ns.passes)
        result["http"] = [http_leg(ns.model, busy, ns.decode_tokens, ns.decode_runs) for busy in (False, True)]
        for leg in result["http"]:
            print(
                "busy" if leg["busy_core"] else "quiet",
                "on",
                leg["helper_on"]["decode_tok_s"],
                "off",
                leg["helper_off"]["decode_tok_s"],
                "ratio",
                leg["ratio"],
            )
    result["machine_after"] = machine_facts()
    write_result(result, ns.out, ns.smoke, RESULTS)
    return result


if __name__ == "__main__":
    main()
