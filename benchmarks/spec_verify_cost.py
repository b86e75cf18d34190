"""What a speculative verify step costs against a plain decode step, by batch size: the measurement behind the
per-step rule of runtime/scheduler/speculation.py (speculation off when verification cannot pay).

Two Engines of one model (off, and speculative with k = --k, every draft k tokens: FullDraft), this CPU. Each batch
size B in --batch-sizes runs B requests together (distinct prompts of a repeated English text) in both Engines,
interleaved over --repeats rounds (a shared machine's load then falls on both alike). Timed: the runner's execute
(worker forward + sampling) of
- decode steps: B sequences, one token each (the off Engine);
- verify steps: B sequences, each 1 + k tokens (its last token and a full draft; the ngram Engine).
Reported per B: the median of each in this process's CPU ms (every thread: less disturbed than wall time by other
jobs on a shared machine; wall ms beside), ratio = verify / decode (CPU), wall_ratio, and acceptance_to_pay =
(ratio - 1) / k: the draft acceptance at which a verify step's 1 + acceptance * k tokens per sequence pay for it.
The rule (runtime/scheduler/spec_gate.py) takes the ratios as VERIFY_COST_RATIOS. For reference, a least-squares fit
of a + b * N over the CPU medians (N: tokens of the step; tokens_cost_c = b / a, model_ratio = (1 + c * B * (1 + k))
/ (1 + c * B)): where model_ratio misses ratio, a step's cost is not one line in its tokens (the decode and the
extend paths differ).
machine: runtime.model.cpu_features.machine_facts() (its load average is the disturbance to read the figures by).

    .venv/bin/python -m benchmarks.spec_verify_cost              # SmolLM2, B = 1 2 4 8 16, k = 4, 1 round
    .venv/bin/python -m benchmarks.spec_verify_cost --smoke      # seconds: writes nothing unless --out is given
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from pathlib import Path
from typing import Any

from benchmarks.cli import apply_preset, write_result
from runtime.engine import Engine
from runtime.model.cpu_features import machine_facts
from runtime.protocol import ForwardBatch, ForwardResult
from runtime.sampling_params import SamplingParams

RESULTS = Path(__file__).parent / "results" / "spec_verify_cost.json"


class FullDraft:
    """A proposer whose draft is always max_tokens copies of the last token: every decode step of the ngram Engine
    then verifies a full draft whatever the model writes (the cost of a verify step does not depend on what is
    accepted). Replaces the Engine's scheduler.speculation._proposer (the measurement's harness)."""

    def propose(self, seq_id: int, token_ids: list[int], max_tokens: int) -> list[int]:
        """[last token] * max_tokens."""
        return [token_ids[-1]] * max_tokens

    def release(self, seq_id: int) -> None:
        """Nothing held."""


class StepTimes:
    """Wraps engine.runner.execute: the wall seconds of each step whose batch is B sequences of `tokens` tokens
    each (tokens - 1 of them a draft), by B."""

    def __init__(self, engine: Engine, tokens: int) -> None:
        self.seconds: dict[int, list[float]] = {}
        self.cpu_seconds: dict[int, list[float]] = {}
        self._tokens = tokens
        self._execute = engine.runner.execute
        engine.runner.execute = self._timed  # type: ignore[method-assign]

    def _timed(self, batch: ForwardBatch) -> ForwardResult:
        start = time.perf_counter()
        cpu = time.process_time()
        result = self._execute(batch)
        elapsed = time.perf_counter() - start
        seqs = batch.seqs
        if seqs and all(len(s.token_ids) == self._tokens and s.num_draft_tokens == self._tokens - 1 for s in seqs):
            self.seconds.setdefault(len(seqs), []).append(elapsed)
            self.cpu_seconds.setdefault(len(seqs), []).append(time.process_time() - cpu)
        return result


TEXT = (
    "The reading room reopens on Wednesday morning at nine, and the story hour moves to Thursday at eleven. "
    "Books due on Monday may be returned on Tuesday without a fine. "
)


def prompts(engine: Engine, batch: int, length: int) -> list[list[int]]:
    """batch distinct prompts of about length tokens: a numbered request line, then TEXT repeated."""
    assert engine.tokenizer is not None, "spec_verify_cost needs the model's tokenizer"
    unit = engine.tokenizer.encode(TEXT, add_special_tokens=False)
    out = []
    for i in range(batch):
        head = engine.tokenizer.encode(f"Request {i}: repeat this.\n", add_special_tokens=False)
        out.append(head + (unit * (length // len(unit) + 1))[: max(length - len(head), len(unit))])
    return out


def fit(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Least squares a, b of seconds = a + b * tokens over (tokens, seconds) points."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    b = sum((x - mx) * (y - my) for x, y in points) / sxx
    return my - b * mx, b


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=96)
    p.add_argument("--decode-tokens", type=int, default=6, help="tokens per request of the off Engine")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--smoke", action="store_true", help="seconds: B = 1 2, 1 round, short requests")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    if args.smoke:
        apply_preset(p, args, {"batch_sizes": [1, 2], "repeats": 1, "prompt_len": 32, "decode_tokens": 4})
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    spec = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    big = max(args.batch_sizes)
    off = Engine(  # one token a step: the plain decode step the verification is weighed against
        model=args.model, dtype=args.dtype, max_running_requests=max(big, 16), num_scheduler_steps=1
    )
    ngram = Engine(
        model=args.model,
        dtype=args.dtype,
        max_running_requests=max(big, 16),
        speculative_config=json.dumps(spec | {"disable_by_batch_size": big + 1}),
    )
    ngram.scheduler.speculation._proposer = FullDraft()
    decode = StepTimes(off, 1)
    verify = StepTimes(ngram, 1 + args.k)
    for r in range(args.repeats):
        for b in args.batch_sizes:
            ids = prompts(off, b, args.prompt_len)
            off.generate(input_ids=ids, sampling_params=SamplingParams(max_tokens=args.decode_tokens, ignore_eos=True))
            # a draft never runs past max_tokens: decode_tokens full drafts when every one is rejected
            verify_params = SamplingParams(max_tokens=args.decode_tokens + args.k + 1, ignore_eos=True)
            ngram.generate(input_ids=ids, sampling_params=verify_params)
            d = statistics.median(decode.cpu_seconds[b])
            v = statistics.median(verify.cpu_seconds[b])
            logging.info("round %d B=%d: CPU ms decode %.1f, verify %.1f, ratio %.3f", r, b, 1e3 * d, 1e3 * v, v / d)
    rows = []
    points = []
    for b in args.batch_sizes:
        d = statistics.median(decode.cpu_seconds[b])
        v = statistics.median(verify.cpu_seconds[b])
        points += [(b, d), (b * (1 + args.k), v)]
        row = {"batch_size": b, "decode_cpu_ms": round(1e3 * d, 2), "verify_cpu_ms": round(1e3 * v, 2)}
        row["ratio"] = round(v / d, 3)
        wall_d = statistics.median(decode.seconds[b])
        wall_v = statistics.median(verify.seconds[b])
        row["decode_wall_ms"] = round(1e3 * wall_d, 2)
        row["verify_wall_ms"] = round(1e3 * wall_v, 2)
        row["wall_ratio"] = round(wall_v / wall_d, 3)
        row["decode_steps"] = len(decode.seconds[b])
        row["verify_steps"] = len(verify.seconds[b])
        rows.append(row)
    a, slope = fit(points)
    c = slope / a if a > 0 and slope >= 0 else None  # None: the points fit no line with a positive fixed cost
    for row in rows:
        bk = row["batch_size"]
        row["model_ratio"] = None if c is None else round((1 + c * bk * (1 + args.k)) / (1 + c * bk), 3)
        row["acceptance_to_pay"] = round((row["ratio"] - 1) / args.k, 3)  # (1 + acceptance * k) / ratio >= 1
    result = {
        "benchmark": "spec_verify_cost",
        "model": args.model,
        "dtype": args.dtype,
        "k": args.k,
        "prompt_len": args.prompt_len,
        "fit_a_cpu_ms": round(1e3 * a, 3),
        "fit_b_cpu_ms_per_token": round(1e3 * slope, 4),
        "tokens_cost_c": None if c is None else round(c, 4),
        "machine": machine_facts(),
        "rows": rows,
    }
    write_result(result, args.out, args.smoke, RESULTS)
    return result


if __name__ == "__main__":
    main()
