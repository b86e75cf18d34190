"""Decode steps of a batch on a server's decode setting (one torch thread, the qgemv op's helper thread on), three ways
side by side in one process: what the bfloat16 dot products (kernels/cpu_qgemv_bf16.cpp) and the attention shared
with the helper (kernels.cpu_decode.share_helper) each buy.

Settings, alternating in blocks of `--block` steps so that all see the same machine minute by minute:
- vnni: an Engine built with the CPU's flags less avx512_bf16 (RADIXSERVE_CPU_FLAGS at construction; its dtype the
  other Engine's, as "auto" resolved it with the CPU's own flags): the op's
  integer dot products up to its avx512_vnni row limits, torch's int4 / int8 kernels above them; the attention on the
  calling thread;
- bf16: an Engine built with the CPU's own flags (on an AVX512_BF16 CPU: the op serves bfloat16 steps of up to 16
  rows), the attention on the calling thread;
- bf16+attention: the same Engine with the attention's work items shared with the helper.
Per `--batches` x `--contexts`: each Engine gets `batch` requests of `context` random prompt tokens (greedy, EOS
ignored), prefilled before the timing; step_ms is the median Engine.step (one token a sequence: num_scheduler_steps 1)
and the ratios are vnni / bf16 and bf16 / bf16+attention. machine: runtime.model.cpu_features.machine_facts(); isas:
what each Engine's Linear picked (on a CPU without AVX512_BF16 the first two are the same code).

    .venv/bin/python -m benchmarks.batch_decode   # smollm2, batches 1 8, contexts 512 1500: results/batch_decode.json
    .venv/bin/python -m benchmarks.batch_decode --smoke --model <tiny model folder>   # seconds; writes nothing
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
from pathlib import Path
from typing import Any
from unittest import mock

import torch

from benchmarks.cli import apply_preset, write_result
from benchmarks.decode_profile import timed_steps
from radix.blocks import cdiv
from runtime.sampling_params import SamplingParams

RESULTS = Path(__file__).parent / "results" / "batch_decode.json"
SMOKE = {"batches": [1, 2], "contexts": [24], "blocks": 2, "block": 2}
SETTINGS = ("vnni", "bf16", "bf16+attention")
BLOCK_SIZE = 16


def _max_tokens(ns: argparse.Namespace) -> int:
    """Each request's max_tokens: every timed step, and room for the first requests to decode while the others
    prefill (the requests are aborted at the end)."""
    return len(SETTINGS) * ns.blocks * ns.block + 256


def _engine(ns: argparse.Namespace, flags: str | None, dtype: str) -> Any:
    """An Engine (one token a step) in dtype whose Linears read these CPU flags (None: the CPU's own), its KV pool
    large enough for the largest case's requests at once (no preemption)."""
    from runtime.engine import Engine

    blocks = max(ns.batches) * cdiv(max(ns.contexts) + _max_tokens(ns), BLOCK_SIZE) + 16
    env = {} if flags is None else {"RADIXSERVE_CPU_FLAGS": flags}
    with mock.patch.dict(os.environ, env):
        return Engine(
            ns.model,
            dtype=dtype,
            quantization=ns.quantization,
            num_scheduler_steps=1,
            block_size=BLOCK_SIZE,
            num_blocks=blocks,
        )


def _fill(engine: Any, batch: int, context: int, max_tokens: int) -> list[str]:
    """batch requests of context random tokens, run up to every one's first token; returns their ids."""
    vocab = engine.runner.ready.vocab_size
    gen = torch.Generator().manual_seed(context)
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=max_tokens)
    prompts = [torch.randint(3, vocab, (context,), generator=gen).tolist() for _ in range(batch)]
    rids = [engine.add_request(input_ids=prompt, sampling_params=params) for prompt in prompts]
    started: set[str] = set()
    while len(started) < batch:
        started.update(chunk.rid for chunk in engine.step() if chunk.token_ids)
    return rids


def _link(shared: bool) -> None:
    """The attention's work items shared with the helper (share_helper's link) or kept on the caller (unlinked)."""
    from kernels import cpu_decode

    if shared:
        cpu_decode.share_helper()
    else:
        torch.ops.radixserve.link_helper(0, 0)


def _case(engines: dict[str, Any], batch: int, context: int, ns: argparse.Namespace) -> dict[str, Any]:
    rids = {name: _fill(engine, batch, context, _max_tokens(ns)) for name, engine in engines.items()}
    times: dict[str, list[float]] = {s: [] for s in SETTINGS}
    for _ in range(ns.blocks):
        for setting in SETTINGS:
            _link(setting == "bf16+attention")
            times[setting].extend(timed_steps(engines[setting.split("+")[0]], ns.block))
    for name, engine in engines.items():
        for rid in rids[name]:
            engine.abort(rid)
        engine.step()
    ms = {s: round(1e3 * statistics.median(times[s]), 3) for s in SETTINGS}
    return {
        "batch": batch,
        "context": context,
        "step_ms": ms,
        "bf16_speedup": round(ms["vnni"] / ms["bf16"], 3),
        "attention_speedup": round(ms["bf16"] / ms["bf16+attention"], 3),
        "total_speedup": round(ms["vnni"] / ms["bf16+attention"], 3),
    }


def run(ns: argparse.Namespace) -> dict[str, Any]:
    """The two Engines and every case; returns the JSON-ready result."""
    from kernels import cpu_decode, cpu_qgemv
    from runtime.model.cpu_features import cpu_flags, machine_facts

    torch.set_num_threads(1)
    without = " ".join(sorted(cpu_flags() - {cpu_qgemv.BF16_FLAG}))
    bf16 = _engine(ns, None, ns.dtype)
    dtype = str(bf16.runner.dtype).removeprefix("torch.")  # "auto" follows the flags: resolve it with the CPU's own
    engines = {"vnni": _engine(ns, without, dtype), "bf16": bf16}
    torch.set_num_threads(1)
    cpu_qgemv.set_helper(True)
    if not cpu_decode.share_helper():
        raise RuntimeError("the qgemv and decode attention ops must both build for this benchmark")
    try:
        cases = [_case(engines, b, c, ns) for b in ns.batches for c in ns.contexts]
    finally:
        cpu_qgemv.set_helper(False)
    isas = {name: engine.runner.model.layers[0].mlp.down_proj.isa for name, engine in engines.items()}
    return {
        "machine": machine_facts(),
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(ns).items() if k != "out"},
        "resolved_dtype": dtype,
        "isas": isas,
        "cases": cases,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2", help="embedded name, folder or .gguf")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--quantization", default="auto", choices=["auto", "none", "int8", "int4"])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8], help="requests decoding together")
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 1500], help="prompt tokens per request")
    parser.add_argument("--blocks", type=int, default=10, help="alternations of the settings")
    parser.add_argument("--block", type=int, default=5, help="steps per block")
    parser.add_argument("--smoke", action="store_true", help="seconds: batches 1 2, a 24-token prompt, 2 blocks")
    parser.add_argument("--out", type=Path, help=f"JSON output (default {RESULTS}; none in --smoke)")
    ns = parser.parse_args(argv)
    if ns.smoke:
        apply_preset(parser, ns, SMOKE)
    logging.basicConfig(level=logging.WARNING)
    result = run(ns)
    for case in result["cases"]:
        print(case)
    write_result(result, ns.out, ns.smoke, RESULTS)
    return result


if __name__ == "__main__":
    main()
