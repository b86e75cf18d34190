"""What scoring costs: a prompt-only request with prompt logprobs (max_tokens 0, prompt_logprobs k: what
lm-evaluation-harness's loglikelihood requests become) against the same prompts' plain prefill (max_tokens 1), through
the in-process Engine, prefix caching off (a scoring request takes nothing from the cache anyway).

Each mode runs the same `prompts` seeded random prompts of `prompt_len` tokens in one batch, `repeats` times; the
figure is the median wall time. Reported (benchmarks/results/scoring.json): seconds[mode], prompt_tokens_per_s[mode],
overhead_pct[mode] (against prefill), result_bytes_per_position[mode] (the msgpack ForwardResults of the run over
its prompt positions: what the worker sends back), and the machine (runtime.model.cpu_features.machine_facts).

    .venv/bin/python -m benchmarks.scoring                      # smollm2, 8 x 256 tokens, 3 repeats
    .venv/bin/python -m benchmarks.scoring --smoke --model DIR  # 2 x 32 tokens, 1 repeat; writes nothing by default
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import msgspec

from benchmarks.cli import write_result
from runtime.engine import Engine
from runtime.model.cpu_features import machine_facts
from runtime.protocol import ForwardBatch, ForwardResult
from runtime.sampling_params import SamplingParams

RESULTS = Path(__file__).parent / "results" / "scoring.json"
MODES = {
    "prefill": SamplingParams(max_tokens=1, temperature=0.0),
    "scoring_k0": SamplingParams(max_tokens=0, prompt_logprobs=0),
    "scoring_k5": SamplingParams(max_tokens=0, prompt_logprobs=5),
}


def prompts_of(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, vocab) for _ in range(length)] for _ in range(count)]


def run_mode(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> tuple[float, int]:
    """(wall seconds, bytes of the run's msgpack-encoded ForwardResults) of one batch of prompts."""
    sizes: list[int] = []
    execute = engine.runner.execute
    encoder = msgspec.msgpack.Encoder()

    def measured(batch: ForwardBatch) -> ForwardResult:
        result = execute(batch)
        sizes.append(len(encoder.encode(result)))
        return result

    engine.runner.execute = measured  # type: ignore[method-assign]
    try:
        t0 = time.perf_counter()
        outs = engine.generate(input_ids=prompts, sampling_params=params)
        elapsed = time.perf_counter() - t0
    finally:
        engine.runner.execute = execute  # type: ignore[method-assign]
    assert all(o.finish_reason == "length" for o in outs)
    if params.prompt_logprobs is not None:
        assert all(
            o.prompt_logprobs is not None and len(o.prompt_logprobs.token_ids) == len(p)
            for o, p in zip(outs, prompts, strict=True)
        )
    return elapsed, sum(sizes)


def run(model: str, count: int, length: int, repeats: int, seed: int) -> dict:
    engine = Engine(model=model, enable_prefix_caching=False, dtype="float32", max_model_len=length + 8)
    prompts = prompts_of(count, length, engine.runner.config.vocab_size, seed)
    run_mode(engine, prompts[:1], MODES["prefill"])  # warm-up
    seconds: dict[str, float] = {}
    result_bytes: dict[str, float] = {}
    for name, params in MODES.items():
        runs = [run_mode(engine, prompts, params) for _ in range(repeats)]
        seconds[name] = round(statistics.median(r[0] for r in runs), 4)
        result_bytes[name] = round(runs[0][1] / (count * length), 1)
    engine.shutdown()
    base = seconds["prefill"]
    return {
        "model": model,
        "prompts": count,
        "prompt_len": length,
        "repeats": repeats,
        "seconds": seconds,
        "prompt_tokens_per_s": {k: round(count * length / v, 1) for k, v in seconds.items()},
        "overhead_pct": {k: round(100.0 * (v - base) / base, 1) for k, v in seconds.items()},
        "result_bytes_per_position": result_bytes,
        **machine_facts(),
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--smoke", action="store_true", help="2 x 32 tokens, 1 repeat; writes nothing by default")
    parser.add_argument("--out", type=Path, default=None, help=f"JSON output (default {RESULTS}; none in --smoke)")
    ns = parser.parse_args(argv)
    if ns.smoke:
        ns.prompts = 2
        ns.prompt_len = 32
        ns.repeats = 1
    result = run(ns.model, ns.prompts, ns.prompt_len, ns.repeats, ns.seed)
    write_result(result, ns.out, ns.smoke, RESULTS)
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
