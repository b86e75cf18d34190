"""Where a single-stream decode step's CPU time goes: torch's profiler over in-process Engine steps, top ops.

One request (`--prompt-tokens` random token ids, greedy, EOS ignored) runs through an in-process Engine with the
server's defaults (`--dtype auto --quantization auto`, prefix caching on). After its prefill and `--warm-steps`
decode steps, `--steps` decode steps are timed without the profiler (step_ms: median wall clock per Engine.step,
the scheduler and sampling included), then `--steps` more under torch.profiler (CPU activity). The ops are ranked by
self CPU time (time in the op itself, not in the ops it calls): per step, the share of all ops' self time, calls per
step. The profiler adds its own cost per op (tens of microseconds a call on a loaded machine), so profiled steps are
slower than step_ms; the ranking, not the sum, is what to read.

Writes benchmarks/results/decode_profile_<model>.json (an embedded name, else the folder's or file's name): machine
(runtime.model.cpu_features.machine_facts()), config, step_ms, profiled_step_ms, the top ops.

    .venv/bin/python -m benchmarks.decode_profile --model gemma3-270m     # 32 profiled steps after a 512-token prompt
    .venv/bin/python -m benchmarks.decode_profile --smoke --model <tiny model folder>   # seconds; writes nothing
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.cli import apply_preset, write_result
from runtime.sampling_params import SamplingParams

RESULTS = Path(__file__).parent / "results"
SMOKE = {"prompt_tokens": 16, "warm_steps": 1, "steps": 3, "top": 5}


def results_path(model: str) -> Path:
    """results/decode_profile_<name>.json: the embedded name, else the folder's or file's stem."""
    from runtime.model.loader import EMBEDDED_MODELS

    name = model if model in EMBEDDED_MODELS else Path(model).stem
    return RESULTS / f"decode_profile_{name}.json"


def timed_steps(engine: Any, steps: int) -> list[float]:
    """Wall-clock seconds of each of `steps` Engine.step calls."""
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    return times


def top_ops(prof: torch.profiler.profile, steps: int, top: int, shapes: bool = False) -> list[dict[str, Any]]:
    """The `top` ops by self CPU time: name, self_ms_per_step, total_ms_per_step (with the ops it calls),
    calls_per_step, share (of the self CPU time of all ops); shapes: one row per op and input shapes (the profile
    must have recorded them), with its input_shapes."""
    events = list(prof.key_averages(group_by_input_shape=shapes))
    total_us = sum(e.self_cpu_time_total for e in events) or 1.0
    ranked = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    return [
        {
            "op": e.key,
            "self_ms_per_step": round(e.self_cpu_time_total / 1e3 / steps, 3),
            "total_ms_per_step": round(e.cpu_time_total / 1e3 / steps, 3),
            "calls_per_step": round(e.count / steps, 2),
            "share": round(e.self_cpu_time_total / total_us, 4),
            **({"input_shapes": str(e.input_shapes)} if shapes else {}),
        }
        for e in ranked
    ]


def run(ns: argparse.Namespace) -> dict[str, Any]:
    """The engine, its request, the timed and the profiled steps; returns the JSON-ready result."""
    from runtime.engine import Engine
    from runtime.model.cpu_features import machine_facts

    # one token a step (num_scheduler_steps 1): the figures are per decode step
    engine = Engine(ns.model, dtype=ns.dtype, quantization=ns.quantization, num_scheduler_steps=1)
    vocab = engine.runner.ready.vocab_size
    prompt = torch.randint(3, vocab, (ns.prompt_tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    # room for every step below even when the detokenizer holds back the first tokens' chunks; aborted at the end
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=2 * (ns.warm_steps + 2 * ns.steps) + 64)
    rid = engine.add_request(input_ids=prompt, sampling_params=params)
    while not any(chunk.token_ids for chunk in engine.step()):  # the prefill's steps, up to the first token
        if not engine.scheduler.has_unfinished():
            raise RuntimeError("the request finished before its first token was streamed")
    timed_steps(engine, ns.warm_steps)
    plain = timed_steps(engine, ns.steps)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=ns.shapes) as prof:
        profiled = timed_steps(engine, ns.steps)
    engine.abort(rid)
    return {
        "machine": machine_facts(),
        "config": {
            "model": ns.model,
            "dtype": ns.dtype,
            "resolved_dtype": str(engine.runner.dtype).removeprefix("torch."),
            "quantization": ns.quantization,
            "prompt_tokens": ns.prompt_tokens,
            "warm_steps": ns.warm_steps,
            "steps": ns.steps,
            "threads": torch.get_num_threads(),
        },
        "step_ms": round(1e3 * statistics.median(plain), 3),
        "decode_tok_s": round(1.0 / statistics.median(plain), 2),
        "profiled_step_ms": round(1e3 * statistics.median(profiled), 3),
        "top_ops": top_ops(prof, ns.steps, ns.top, ns.shapes),
    }


def print_top(result: dict[str, Any]) -> None:
    """step_ms and the top ops, one line each, on stdout."""
    step = f"step {result['step_ms']:.2f} ms ({result['decode_tok_s']:.1f} tok/s)"
    print(f"{step}; profiled {result['profiled_step_ms']:.2f} ms")
    for row in result["top_ops"]:
        figures = f"{row['self_ms_per_step']:>9.3f} ms{row['calls_per_step']:>8.1f} calls{row['share']:>8.1%}"
        print(f"{row['op']:<40}{figures} {row.get('input_shapes', '')}")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gemma3-270m", help="embedded name, folder or .gguf")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--quantization", default="auto", choices=["auto", "none", "int8", "int4"])
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--warm-steps", type=int, default=4)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--shapes", action="store_true", help="a row per op and input shapes")
    parser.add_argument("--smoke", action="store_true", help="seconds: a short prompt, 3 steps")
    parser.add_argument("--out", type=Path, help="JSON output (default results/decode_profile_<model>.json)")
    ns = parser.parse_args(argv)
    if ns.smoke:
        apply_preset(parser, ns, SMOKE)
    logging.basicConfig(level=logging.WARNING)
    result = run(ns)
    print_top(result)
    write_result(result, ns.out, ns.smoke, results_path(ns.model))
    return result


if __name__ == "__main__":
    main()
