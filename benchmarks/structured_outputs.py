"""Structured outputs: what a JSON-schema constraint adds to a decode step, and grammar compile time.

Decode: B requests (B in --batches, default 1 / 8 / 32) decode together on an Engine; after every row's prefill, the
median wall time of --steps engine.step() calls is taken, for (a) no constraint (ignore_eos), (b) the same JSON
schema on every row (runtime/model/grammar/: one xgrammar matcher per row, the bitmask filled and applied each step),
and (c) half the rows constrained and half not. The schema (a long array of short strings) keeps every row decoding
through the measured steps. The two are run alternately --repeats times and the medians of the runs reported, so a
load change on the machine hits both. grammar_ms is the grammar's own share of a step, timed inside it: the bitmask
fill (GrammarState.rows), the masking stage (apply_token_bitmask) and the matchers' advance (GrammarState.record).
overhead_pct = (constrained - none) / none; the target is under 10% at batch 8. In the mixed batch the unconstrained
rows are not touched by the grammar (the stage gathers only the constrained rows): their cost is the step's.

Compile: each of three schemas compiled cold for the model's vocabulary (GrammarCache emptied first) and cached.

Reported (benchmarks/results/structured_outputs.json): step_ms[none|json|mixed][B], grammar_ms[json|mixed][B],
overhead_pct[B], compile_ms[cold|cached][schema], the model, dtype, device, and the machine
(runtime.model.cpu_features.machine_facts).

    .venv/bin/python -m benchmarks.structured_outputs                 # smollm2 -> results/structured_outputs.json
    .venv/bin/python -m benchmarks.structured_outputs --smoke --model DIR   # seconds (tests: a tiny model)
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.cli import write_result

RESULTS = Path(__file__).parent / "results" / "structured_outputs.json"
LONG_ARRAY = {
    "type": "object",
    "properties": {"values": {"type": "array", "items": {"type": "string", "maxLength": 6}, "minItems": 200}},
    "required": ["values"],
}
COMPILE_SCHEMAS = {
    "long_array": LONG_ARRAY,
    "person": {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"],
    },
    "order": {
        "type": "object",
        "properties": {
            "items": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "sku": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{4}$"},
                        "qty": {"type": "integer"},
                    },
                    "required": ["sku", "qty"],
                },
                "minItems": 1,
            },
            "status": {"enum": ["open", "paid", "shipped"]},
            "note": {"type": "string"},
        },
        "required": ["items", "status"],
    },
}


class GrammarTimer:
    """Wraps the runner's GrammarState.rows / record and the sampler's bitmask stage, summing their seconds."""

    def __init__(self, engine: Any) -> None:
        import runtime.model.sampler as sampler_module

        self.seconds = 0.0
        grammars = engine.runner.grammars
        grammars.rows = self._timed(grammars.rows)
        grammars.record = self._timed(grammars.record)
        sampler_module.apply_token_bitmask = self._timed(sampler_module.apply_token_bitmask)

    def _timed(self, fn: Callable) -> Callable:
        def run(*args: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                self.seconds += time.perf_counter() - t0

        return run


def decode_steps(engine: Any, timer: GrammarTimer, batch: int, constrained: int, steps: int) -> tuple[float, float]:
    """(median step ms, mean grammar ms per step) of `steps` decode steps of `batch` rows, `constrained` of them
    with LONG_ARRAY. Every request is aborted afterwards."""
    from runtime.sampling_params import SamplingParams
    from runtime.structured_outputs import StructuredOutputs

    so = StructuredOutputs(json=json.dumps(LONG_ARRAY))
    rids = []
    for i in range(batch):
        if i < constrained:
            params = SamplingParams(max_tokens=steps + 64, temperature=0.0, structured_outputs=so)
        else:
            params = SamplingParams(max_tokens=steps + 64, temperature=0.0, ignore_eos=True)
        rids.append(engine.add_request(prompt=f"Write a list of {i + 3} short words as JSON.", sampling_params=params))
    while engine.stats().num_waiting or any(s.num_output == 0 for s in engine.scheduler.running):
        engine.step()
    engine.step()
    times = []
    timer.seconds = 0.0
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    grammar_ms = timer.seconds / steps * 1e3
    assert engine.stats().num_running == batch, "a row finished inside the measured steps"
    for rid in rids:
        engine.abort(rid)
    return statistics.median(times) * 1e3, grammar_ms


def compile_times(engine: Any) -> dict[str, dict[str, float]]:
    """ms to compile each COMPILE_SCHEMAS schema cold (the cache emptied) and cached."""
    from runtime.structured_outputs import StructuredOutputs

    cache = engine.runner.grammars.cache
    out: dict[str, dict[str, float]] = {"cold": {}, "cached": {}}
    for name, schema in COMPILE_SCHEMAS.items():
        so = StructuredOutputs(json=json.dumps(schema))
        cache.clear()
        t0 = time.perf_counter()
        cache.compile_now(so)
        out["cold"][name] = round((time.perf_counter() - t0) * 1e3, 2)
        t0 = time.perf_counter()
        cache.compile_now(so)
        out["cached"][name] = round((time.perf_counter() - t0) * 1e3, 4)
    return out


def run(model: str, dtype: str, device: str, batches: list[int], steps: int, repeats: int) -> dict:
    from runtime.engine import Engine
    from runtime.model.cpu_features import machine_facts

    engine = Engine(  # one token a step (num_scheduler_steps 1): the figures are per decode step
        model=model, dtype=dtype, device=device, max_running_requests=max(batches), num_scheduler_steps=1
    )
    timer = GrammarTimer(engine)
    compile_ms = compile_times(engine)
    step_ms: dict[str, dict[str, float]] = {"none": {}, "json": {}, "mixed": {}}
    grammar_ms: dict[str, dict[str, float]] = {"json": {}, "mixed": {}}
    for b in batches:
        runs: dict[str, list[tuple[float, float]]] = {"none": [], "json": [], "mixed": []}
        for _ in range(repeats):
            runs["none"].append(decode_steps(engine, timer, b, 0, steps))
            runs["json"].append(decode_steps(engine, timer, b, b, steps))
            runs["mixed"].append(decode_steps(engine, timer, b, b // 2, steps))
        for kind, values in runs.items():
            step_ms[kind][str(b)] = round(statistics.median(v[0] for v in values), 3)
            if kind != "none":
                grammar_ms[kind][str(b)] = round(statistics.median(v[1] for v in values), 3)
    overhead = {
        k: round((step_ms["json"][k] - step_ms["none"][k]) / step_ms["none"][k] * 100, 1) for k in step_ms["none"]
    }
    return {
        "model": model,
        "dtype": str(engine.runner.dtype).removeprefix("torch."),
        "device": device,
        "steps": steps,
        "repeats": repeats,
        "step_ms": step_ms,
        "grammar_ms": grammar_ms,
        "overhead_pct": overhead,
        "compile_ms": compile_ms,
        **machine_facts(),
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--steps", type=int, default=20, help="decode steps timed per run")
    parser.add_argument("--repeats", type=int, default=3, help="alternating runs per batch size")
    parser.add_argument("--smoke", action="store_true", help="batches 1 and 4, 3 steps, 1 repeat; writes nothing")
    parser.add_argument("--out", type=Path, default=None, help=f"JSON output (default {RESULTS}; none in --smoke)")
    ns = parser.parse_args(argv)
    if ns.smoke:
        ns.batches = [1, 4]
        ns.steps = 3
        ns.repeats = 1
    result = run(ns.model, ns.dtype, ns.device, ns.batches, ns.steps, ns.repeats)
    write_result(result, ns.out, ns.smoke, RESULTS)
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
