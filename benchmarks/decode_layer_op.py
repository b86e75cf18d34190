"""Decode with and without the C++ decode layer (kernels/cpu_decode_layer.cpp), side by side in one process: one
Engine, one request (or `--batch` requests decoding together), blocks of `--block` steps alternating between the op
and the Python layer (each layer's fused_decode switched off), so that both settings see the same machine minute by
minute (on a shared VM the speed of a whole process moves by 2x between minutes; only a ratio measured this way means
anything).

Per setting: the median step (ms, the scheduler and sampling included: Engine.step), tok/s, and the torch ops per step
(torch.profiler over `--profile-steps` more steps: how many dispatches the Python around the kernels costs).

Writes benchmarks/results/decode_layer_op_<model>.json (machine facts, config, per setting, the ratio).

    .venv/bin/python -m benchmarks.decode_layer_op --model smollm2            # 1 thread, 512-token prompt, 12 blocks
    .venv/bin/python -m benchmarks.decode_layer_op --model smollm2 --batch 8  # 8 requests: results/..._b8.json
    .venv/bin/python -m benchmarks.decode_layer_op --smoke --model <tiny model folder>     # seconds; writes nothing
"""

from __future__ import annotations

import argparse
import logging
import statistics
from pathlib import Path
from typing import Any

import torch

from benchmarks.cli import apply_preset, write_result
from benchmarks.decode_profile import results_path as profile_path
from benchmarks.decode_profile import timed_steps
from runtime.sampling_params import SamplingParams

RESULTS = Path(__file__).parent / "results"
SMOKE = {"prompt_tokens": 16, "blocks": 2, "block": 2, "profile_steps": 2}
SETTINGS = ("op", "python")


def _switch(engine: Any, setting: str, saved: list[Any]) -> None:
    """Every layer's fused_decode: its own ("op") or one that always declines ("python")."""
    for layer, fused in zip(engine.runner.model.layers, saved, strict=True):
        layer.fused_decode = fused if setting == "op" else _declines


def _declines(*args: Any) -> None:
    return None


def _ops_per_step(engine: Any, steps: int) -> float:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        timed_steps(engine, steps)
    return sum(e.count for e in prof.key_averages()) / steps


def run(ns: argparse.Namespace) -> dict[str, Any]:
    """The engine, its request, the alternating blocks and the profiles; returns the JSON-ready result."""
    from runtime.engine import Engine
    from runtime.model.cpu_features import machine_facts

    torch.set_num_threads(ns.threads)
    # one token a step (num_scheduler_steps 1): the figures are per decode step
    engine = Engine(ns.model, dtype=ns.dtype, quantization=ns.quantization, num_scheduler_steps=1)
    vocab = engine.runner.ready.vocab_size
    gen = torch.Generator().manual_seed(0)
    steps = 2 * ns.blocks * ns.block + 2 * ns.profile_steps + 8
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=steps)
    rids = []
    for _ in range(ns.batch):
        prompt = torch.randint(3, vocab, (ns.prompt_tokens,), generator=gen).tolist()
        rids.append(engine.add_request(input_ids=prompt, sampling_params=params))
    started: set[str] = set()
    while len(started) < ns.batch:  # the prefills' steps, up to every request's first token
        started.update(chunk.rid for chunk in engine.step() if chunk.token_ids)
    saved = [layer.fused_decode for layer in engine.runner.model.layers]
    timed_steps(engine, 4)
    times: dict[str, list[float]] = {s: [] for s in SETTINGS}
    for _ in range(ns.blocks):
        for setting in SETTINGS:
            _switch(engine, setting, saved)
            times[setting].extend(timed_steps(engine, ns.block))
    per_setting = {}
    for setting in SETTINGS:
        _switch(engine, setting, saved)
        median = statistics.median(times[setting])
        per_setting[setting] = {
            "step_ms": round(1e3 * median, 3),
            "decode_tok_s": round(ns.batch / median, 2),
            "ops_per_step": round(_ops_per_step(engine, ns.profile_steps), 1),
        }
    for rid in rids:
        engine.abort(rid)
    return {
        "machine": machine_facts(),
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(ns).items() if k != "out"},
        "resolved_dtype": str(engine.runner.dtype).removeprefix("torch."),
        "settings": per_setting,
        "op_speedup": round(per_setting["python"]["step_ms"] / per_setting["op"]["step_ms"], 3),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2", help="embedded name, folder or .gguf")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--quantization", default="auto", choices=["auto", "none", "int8", "int4"])
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--batch", type=int, default=1, help="requests decoding together (rows per step)")
    parser.add_argument("--blocks", type=int, default=12, help="alternations of the two settings")
    parser.add_argument("--block", type=int, default=8, help="steps per block")
    parser.add_argument("--profile-steps", type=int, default=8)
    parser.add_argument("--smoke", action="store_true", help="seconds: a short prompt, 2 blocks of 2 steps")
    parser.add_argument("--out", type=Path, help="JSON output (default results/decode_layer_op_<model>.json)")
    ns = parser.parse_args(argv)
    if ns.smoke:
        apply_preset(parser, ns, SMOKE)
    logging.basicConfig(level=logging.WARNING)
    result = run(ns)
    for setting, row in result["settings"].items():
        figures = f"{row['step_ms']:8.2f} ms/step {row['decode_tok_s']:8.1f} tok/s {row['ops_per_step']:8.1f} ops"
        print(f"{setting:<8} {figures}")
    print(f"op speedup {result['op_speedup']:.2f}x")
    name = profile_path(ns.model).name.replace("decode_profile_", "decode_layer_op_")
    if ns.batch > 1:
        name = name.replace(".json", f"_b{ns.batch}.json")
    default = RESULTS / name
    write_result(result, ns.out, ns.smoke, default)
    return result


if __name__ == "__main__":
    main()
