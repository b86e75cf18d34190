"""Prefill and decode throughput of the ModelRunner versus transformers' generate, embedded model, this CPU.

For each batch size B: B random prompts of `context` tokens (the same inputs for both engines, in the same run).
- runner: prefill in steps of at most `max_prefill_tokens` tokens (as the scheduler would), then `decode_steps`
  greedy decode steps of all B sequences together (one forward per step).
- transformers: one generate(max_new_tokens=decode_steps + 1) (greedy, EOS ignored, no padding: all prompts have
  the same length), timed by a no-op logits processor: prefill = start -> first sampling point, decode = first ->
  last sampling point (decode_steps forwards).
prefill_tok_s = B * context / prefill seconds; decode_tok_s = B * decode_steps / decode seconds (wall clock,
best of `repeats`); the *_per_cpu_s twins divide by this process's CPU seconds instead (less sensitive to other jobs
on a shared machine). ratio_vs_transformers = runner decode_tok_s / transformers decode_tok_s at the largest batch
(ratio_vs_transformers_cpu_time: the same with CPU seconds).

    .venv/bin/python -m benchmarks.decode_throughput            # B = 1, 8, 32; context 512; 32 decode steps
    .venv/bin/python -m benchmarks.decode_throughput --quick    # B = 1, 8, 32; context 512; 8 decode steps
    .venv/bin/python -m benchmarks.decode_throughput --smoke    # seconds; B = 1, 2; context 32; 2 decode steps;
                                                                # writes nothing unless --out is given
Target: ratio_vs_transformers >= 1.5 (goal 2).
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

import torch

from runtime.config import ServerArgs
from runtime.model.loader import resolve_model
from runtime.model.runner import ModelRunner
from runtime.protocol import ForwardBatch, ScheduledSeq
from runtime.sampling_params import SamplingParams

RESULTS = Path(__file__).parent / "results" / "decode_throughput.json"
Times = tuple[float, float]  # (wall-clock seconds, CPU seconds of this process)
GREEDY = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=4096)


def make_prompts(batch: int, context: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """batch random prompts of context token ids (ids >= 3 skip SmolLM2's special tokens)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (batch, context), generator=g).tolist()


def run_runner(runner: ModelRunner, prompts: list[list[int]], decode_steps: int, max_prefill_tokens: int,
               first_seq_id: int) -> tuple[Times, Times]:
    """Prefill then decode prompts through runner.execute; returns (prefill, decode) (wall, cpu) seconds."""
    bs, context = runner.block_size, len(prompts[0])
    blocks_per_seq = -(-(context + decode_steps) // bs)
    ids = list(range(first_seq_id, first_seq_id + len(prompts)))
    tables = [list(range(1 + i * blocks_per_seq, 1 + (i + 1) * blocks_per_seq)) for i in range(len(prompts))]
    per_step = max(1, max_prefill_tokens // context)
    last: dict[int, int] = {}
    start = _now()
    for lo in range(0, len(prompts), per_step):
        seqs = [ScheduledSeq(ids[i], prompts[i], 0, tables[i], True, GREEDY, context)
                for i in range(lo, min(len(prompts), lo + per_step))]
        result = runner.execute(ForwardBatch(step_id=lo, seqs=seqs))
        last.update(zip(result.seq_ids, result.token_ids, strict=True))
    prefill = _elapsed(start, _now())
    start = _now()
    for step in range(decode_steps):  # each step feeds the last sampled token (position context + step)
        seqs = [ScheduledSeq(sid, [last[sid]], context + step, [], True) for sid in ids]
        result = runner.execute(ForwardBatch(step_id=10**6 + step, seqs=seqs))
        last.update(zip(result.seq_ids, result.token_ids, strict=True))
    decode = _elapsed(start, _now())
    runner.execute(ForwardBatch(step_id=2 * 10**6, seqs=[], drop_seq_ids=ids))
    return prefill, decode


class _StepClock:
    """A logits processor that only records when generate reaches each sampling point (after each forward)."""

    def __init__(self) -> None:
        self.times: list[tuple[float, float]] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.times.append(_now())
        return scores


def _now() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()


def _elapsed(a: tuple[float, float], b: tuple[float, float]) -> tuple[float, float]:
    return b[0] - a[0], b[1] - a[1]


def run_transformers(model, prompts: list[list[int]], decode_steps: int) -> tuple[Times, Times]:
    """(prefill, decode) (wall, cpu) seconds of one transformers greedy generate of decode_steps + 1 tokens: prefill is
    the time to the first sampling point, decode the time from there to the last (decode_steps forwards)."""
    from transformers import LogitsProcessorList

    inputs = torch.tensor(prompts)
    clock = _StepClock()
    start = _now()
    out = model.generate(inputs, attention_mask=torch.ones_like(inputs), max_new_tokens=decode_steps + 1,
                         min_new_tokens=0, do_sample=False, pad_token_id=0,
                         logits_processor=LogitsProcessorList([clock]))
    assert out.shape[1] == inputs.shape[1] + decode_steps + 1 and len(clock.times) == decode_steps + 1
    return _elapsed(start, clock.times[0]), _elapsed(clock.times[0], clock.times[-1])


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--batches", type=int, nargs="+")
    parser.add_argument("--repeats", type=int)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--threads", type=int, help="torch threads of both engines (default: set_cpu_threads)")
    parser.add_argument("--model", default="smollm2", help="model name, folder or .gguf (default: the embedded one)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    if args.smoke:
        batches, context, decode_steps, repeats = [1, 2], 32, 2, 1
    else:
        batches, context, decode_steps, repeats = [1, 8, 32], 512, 8 if args.quick else 32, 1
    batches = args.batches or batches
    repeats = args.repeats or repeats
    out_path = args.out if args.out is not None else (None if args.smoke else RESULTS)

    from transformers import AutoModelForCausalLM

    max_prefill_tokens = ServerArgs().max_prefill_tokens
    blocks = 1 + max(batches) * -(-(context + decode_steps) // 16)
    runner = ModelRunner(ServerArgs(model=args.model, num_blocks=blocks))
    hf = AutoModelForCausalLM.from_pretrained(str(resolve_model(args.model)), dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    if args.threads:  # after the runner, which sets its own default (runtime.model.runner.set_cpu_threads)
        torch.set_num_threads(args.threads)
    rows = []
    ratio = cpu_ratio = None
    for batch in batches:
        prompts = make_prompts(batch, context, runner.config.vocab_size, seed=batch)
        mine = [run_runner(runner, prompts, decode_steps, max_prefill_tokens, 1000 * (r + 1)) for r in range(repeats)]
        with torch.inference_mode():
            ref = [run_transformers(hf, prompts, decode_steps) for _ in range(repeats)]
        for engine, times in (("radixserve", mine), ("transformers", ref)):
            best_prefill = min(times, key=lambda t: t[0][0])[0]
            best_decode = min(times, key=lambda t: t[1][0])[1]
            rows.append({"engine": engine, "batch": batch,
                         "prefill_tok_s": round(batch * context / best_prefill[0], 1),
                         "decode_tok_s": round(batch * decode_steps / best_decode[0], 1),
                         "prefill_tok_per_cpu_s": round(batch * context / best_prefill[1], 1),
                         "decode_tok_per_cpu_s": round(batch * decode_steps / best_decode[1], 1)})
        ratio = round(rows[-2]["decode_tok_s"] / rows[-1]["decode_tok_s"], 3)
        cpu_ratio = round(rows[-2]["decode_tok_per_cpu_s"] / rows[-1]["decode_tok_per_cpu_s"], 3)
        logging.getLogger(__name__).warning("batch %d: %s", batch, rows[-2:])
    result = {
        "model": args.model, "dtype": "float32", "device": "cpu", "threads": torch.get_num_threads(),
        "context": context, "decode_steps": decode_steps, "rows": rows,
        "ratio_vs_transformers": ratio, "ratio_vs_transformers_cpu_time": cpu_ratio,
        "ratio_batch": batches[-1], "target_ratio": 1.5,
    }
    text = json.dumps(result, indent=2)
    if out_path is not None:
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(text + "\n")
    print(text)
    return result


if __name__ == "__main__":
    main()
