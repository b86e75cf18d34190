"""Shared system prompt: prefix caching on vs off in one run, through the in-process Engine.

`requests` requests arrive together, each = one shared `system`-token system prompt + its own `question`-token
question, greedy, `output` tokens each (EOS ignored so both modes do the same decode work). Each mode runs on its own
Engine (same weights, same ServerArgs except enable_prefix_caching), after a short warm-up that is not timed.

Reported per mode: prefill_tokens_computed (prompt tokens the worker actually ran, from the scheduler's counter and
checked against the worker's per-sequence forward counts), wall_s (all requests submitted -> all finished), cpu_s
(this process's CPU time over the same span: robust when other jobs share the cores),
hit_rate (cached prompt tokens / prompt tokens), ttft_p50_s (median time to first token from submission); and
speedup = off wall / on wall. Targets (full run): prefill tokens with caching on <= 1.1 x (system + requests x
question); speedup >= 3.

    .venv/bin/python -m benchmarks.shared_prefix            # 32 x (512 + 64), 32 out -> results/shared_prefix.json
    .venv/bin/python -m benchmarks.shared_prefix --smoke    # seconds; writes nothing unless --out is given
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import statistics
import time
from pathlib import Path
from typing import Any

from benchmarks.cli import output_path
from runtime.engine import Engine
from runtime.sampling_params import SamplingParams

RESULTS = Path(__file__).parent / "results" / "shared_prefix.json"


def make_prompts(requests: int, system: int, question: int, vocab: int = 49152) -> list[list[int]]:
    """Deterministic token ids: one shared system prompt, then a distinct question per request (ids in [100, vocab))."""
    sys_ids = [100 + (i * 7919) % (vocab - 100) for i in range(system)]
    return [sys_ids + [100 + (r * 104729 + j * 131) % (vocab - 100) for j in range(question)] for r in range(requests)]


def run_mode(model: str, caching: bool, prompts: list[list[int]], output: int, engine_kwargs: dict[str, Any]) -> dict:
    """One mode on a fresh Engine; returns the mode's figures (see the module docstring)."""
    engine = Engine(model=model, enable_prefix_caching=caching, **engine_kwargs)
    engine.generate(input_ids=[[1, 2, 3, 4]], sampling_params=SamplingParams(max_tokens=2, temperature=0.0))
    before = engine.stats()
    params = SamplingParams(max_tokens=output, temperature=0.0, ignore_eos=True)
    start, cpu_start = time.perf_counter(), time.process_time()
    outs = engine.generate(input_ids=prompts, sampling_params=params)
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    c = engine.stats()
    prefill = c.prefill_tokens_computed - before.prefill_tokens_computed
    forward = c.forward_tokens - before.forward_tokens  # tokens the worker reports having run
    decode_fed = sum(len(o.token_ids) - 1 for o in outs)
    assert forward - decode_fed == prefill, f"worker ran {forward - decode_fed} prompt tokens, scheduler says {prefill}"
    prompt_tokens = sum(o.usage.prompt_tokens for o in outs)
    cached = sum(o.usage.cached_tokens for o in outs)
    result = {
        "prefill_tokens_computed": prefill,
        "wall_s": round(wall, 3),
        "cpu_s": round(cpu, 3),
        "hit_rate": round(cached / prompt_tokens, 4),
        "ttft_p50_s": round(statistics.median(o.ttft_s for o in outs), 3),
        "prompt_tokens": prompt_tokens,
        "cached_tokens": cached,
        "completion_tokens": sum(o.usage.completion_tokens for o in outs),
        "steps": c.num_steps - before.num_steps,
        "output_token_ids_head": [o.token_ids[:4] for o in outs[:2]],
    }
    engine.shutdown()
    return result


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--system", type=int, default=512, help="shared system prompt tokens")
    ap.add_argument("--question", type=int, default=64, help="per-request question tokens")
    ap.add_argument("--output", type=int, default=32, help="generated tokens per request")
    ap.add_argument("--num-blocks", type=int, default=2048)
    ap.add_argument("--max-prefill-tokens", type=int, default=2048)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--smoke", action="store_true", help="4 x (32 + 8) tokens, 2 out; writes only with --out")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    if args.smoke:
        args.requests = 4
        args.system = 32
        args.question = 8
        args.output = 2
    prompts = make_prompts(args.requests, args.system, args.question)
    kw = {
        "num_blocks": args.num_blocks,
        "block_size": 16,
        "max_prefill_tokens": args.max_prefill_tokens,
        "chunked_prefill_size": 512,
        "max_running_requests": max(64, args.requests),
        "device": args.device,
    }
    off = run_mode(args.model, False, prompts, args.output, kw)
    on = run_mode(args.model, True, prompts, args.output, kw)
    ideal = args.system + args.requests * args.question
    report = {
        "config": {
            "model": args.model,
            "requests": args.requests,
            "system_tokens": args.system,
            "question_tokens": args.question,
            "output_tokens": args.output,
            "block_size": 16,
            "max_prefill_tokens": args.max_prefill_tokens,
            "device": args.device,
            "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        },
        "on": on,
        "off": off,
        "speedup": round(off["wall_s"] / on["wall_s"], 3),
        "speedup_cpu_time": round(off["cpu_s"] / on["cpu_s"], 3),
        "targets": {
            "prefill_on_max": round(1.1 * ideal, 1),
            "prefill_on_ok": on["prefill_tokens_computed"] <= 1.1 * ideal,
            "speedup_min": 3.0,
            "speedup_ok": off["wall_s"] / on["wall_s"] >= 3.0,
        },
        "same_outputs": on["output_token_ids_head"] == off["output_token_ids_head"],
    }
    out = output_path(args.out, args.smoke, RESULTS)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
