"""Where a single-stream decode step's forward goes, per layer: norm, qkv, rotary, store KV, attention, o, MLP, other.

One ModelRunner (`--dtype`, `--quantization`: the server's defaults unless given) prefills one random prompt of
`context` tokens, then runs `--steps` greedy decode steps through ModelRunner.execute three ways, one after the
other on the same sequence:
- plain: no instrumentation; step_ms is the median step (the reference the other two disturb a little).
- timed: forward hooks on every layer's modules (the norms, qkv_proj, the shared rotary, o_proj, the MLP, the layer
  itself) and timed wrappers around kernels.store_kv / kernels.paged_attention add each call's perf_counter seconds
  to its part; per part, ms per layer per step = total / steps / layers. other = the layers' time less their parts
  (residual adds, views, the hooks' own cost); head = the final norm + lm_head; outside = the rest of the step
  (embedding, metadata, sampling). CPU ops are synchronous, so the wall clock of a call is its work.
- profiled: torch.profiler (CPU) over the steps; the ops with the most self CPU time, per step: calls and ms; and
  op_calls_per_step, every op the profiler saw (nested ones included) per step.

    .venv/bin/python -m benchmarks.layer_breakdown   # smollm2, context 512, 32 steps -> results/layer_breakdown.json
    .venv/bin/python -m benchmarks.layer_breakdown --smoke --model <tiny model folder>   # seconds; no file
    .venv/bin/python -m benchmarks.step_breakdown --per-layer    # the same, inside step_breakdown's JSON
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

import kernels
from benchmarks.cli import write_result

RESULTS = Path(__file__).parent / "results" / "layer_breakdown.json"
PARTS = ("norm", "qkv", "rotary", "store_kv", "attention", "o", "mlp", "other")
TOP_OPS = 15
logger = logging.getLogger(__name__)


class PartClock:
    """Seconds per part, summed over calls, from forward hooks and kernel wrappers (see the module docstring)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._starts: dict[int, list[float]] = defaultdict(list)

    def hook(self, module: torch.nn.Module, part: str) -> list[Any]:
        """Adds module's forward time to part; returns the hook handles."""

        def pre(mod: torch.nn.Module, args: Any) -> None:
            self._starts[id(mod)].append(time.perf_counter())

        def post(mod: torch.nn.Module, args: Any, out: Any) -> None:
            self.seconds[part] += time.perf_counter() - self._starts[id(mod)].pop()
            self.calls[part] += 1

        return [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]

    def wrap(self, fn: Callable[..., Any], part: str) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[part] += time.perf_counter() - t0
                self.calls[part] += 1

        return timed


@contextmanager
def timed_parts(model: torch.nn.Module) -> Iterator[PartClock]:
    """Hooks every layer's parts of model (a runtime.model.models.decoder.CausalLM) and wraps the two attention
    kernels for the duration; removes them all on the way out."""
    clock = PartClock()
    handles = []
    for layer in model.layers:
        handles += clock.hook(layer, "layer")
        for name in ("input_layernorm", "post_attention_norm", "pre_mlp_norm", "post_mlp_norm"):
            if not isinstance(getattr(layer, name), torch.nn.Identity):
                handles += clock.hook(getattr(layer, name), "norm")
        handles += clock.hook(layer.self_attn.qkv_proj, "qkv")
        handles += clock.hook(layer.self_attn.o_proj, "o")
        handles += clock.hook(layer.mlp, "mlp")
    for rotary in {id(m): m for m in (model.rotary, model.local_rotary)}.values():
        handles += clock.hook(rotary, "rotary")
    handles += clock.hook(model.norm, "head")
    handles += clock.hook(model.lm_head, "head")
    saved = (kernels.store_kv, kernels.paged_attention)
    kernels.store_kv = clock.wrap(saved[0], "store_kv")
    kernels.paged_attention = clock.wrap(saved[1], "attention")
    try:
        yield clock
    finally:
        kernels.store_kv = saved[0]
        kernels.paged_attention = saved[1]
        for handle in handles:
            handle.remove()


def per_layer(clock: PartClock, steps: int, layers: int, step_s: float) -> dict[str, Any]:
    """ms per layer per step of each PART (other: the layer less its parts), the layers' and the head's ms per step,
    and outside = step - layers - head."""
    ms = {part: clock.seconds[part] / steps / layers * 1e3 for part in PARTS if part != "other"}
    layer_ms = clock.seconds["layer"] / steps / layers * 1e3
    ms["other"] = layer_ms - sum(ms.values())
    head_ms = clock.seconds["head"] / steps * 1e3
    return {
        "per_layer_ms": {part: round(ms[part], 4) for part in PARTS},
        "layer_ms": round(layer_ms, 4),
        "layers_ms": round(layer_ms * layers, 3),
        "head_ms": round(head_ms, 3),
        "outside_ms": round(step_s * 1e3 - layer_ms * layers - head_ms, 3),
        "calls_per_step": {part: round(n / steps, 2) for part, n in sorted(clock.calls.items())},
    }


def top_ops(prof: torch.profiler.profile, steps: int) -> list[dict[str, Any]]:
    """The TOP_OPS ops with the most self CPU time: name, calls per step, self ms per step."""
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:TOP_OPS]
    return [
        {"op": e.key, "calls": round(e.count / steps, 1), "self_ms": round(e.self_cpu_time_total / steps / 1e3, 3)}
        for e in events
    ]


def measure(decoder: Any, steps: int) -> dict[str, Any]:
    """The three passes of the module docstring over `steps` decode steps each of decoder (a
    benchmarks.thread_policy.Decoder with one sequence)."""
    ids = decoder.groups[0]
    model = decoder.runner.model
    layers = len(model.layers)
    for _ in range(2):
        decoder.step(ids)  # warm-up
    plain = [decoder.step(ids) for _ in range(steps)]
    with timed_parts(model) as clock:
        timed = sum(decoder.step(ids) for _ in range(steps))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            decoder.step(ids)
    return {
        "layers": layers,
        "step_ms": round(statistics.median(plain) * 1e3, 3),
        "timed_step_ms": round(timed / steps * 1e3, 3),
        **per_layer(clock, steps, layers, timed / steps),
        "op_calls_per_step": round(sum(e.count for e in prof.key_averages()) / steps, 1),
        "top_ops": top_ops(prof, steps),
    }


def run(model: str, context: int, steps: int, dtype: str, quantization: str) -> dict[str, Any]:
    """Loads the runner, prefills, measures; the JSON-ready result (without the machine)."""
    from benchmarks.thread_policy import Decoder

    spec = {"model": model, "batches": [1], "context": context, "steps": 3 * steps + 2, "reps": 1, "threads": [1]}
    decoder = Decoder({**spec, "tuned": False}, dtype=dtype, quantization=quantization)
    runner = decoder.runner
    return {
        "model": model,
        "dtype": str(runner.dtype).removeprefix("torch."),
        "quantization": runner.quantization.describe(),
        "threads": torch.get_num_threads(),
        "context": context,
        "steps": steps,
        **measure(decoder, steps),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="context 16, 3 steps; writes nothing unless --out")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--quantization", default="auto", choices=["auto", "none", "int8", "int4"])
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--out", type=Path, default=None, help=f"JSON output (default {RESULTS}; none in --smoke)")
    ns = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    if ns.smoke:
        ns.context = 16
        ns.steps = 3
    from runtime.model.cpu_features import machine_facts

    machine = machine_facts()
    result = {"machine": machine, **run(ns.model, ns.context, ns.steps, ns.dtype, ns.quantization)}
    write_result(result, ns.out, ns.smoke, RESULTS)
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
