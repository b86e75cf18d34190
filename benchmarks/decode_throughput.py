"""Prefill and decode throughput of the ModelRunner versus transformers' generate, embedded model, this CPU.

For each batch size B: B random prompts of `context` tokens (the same inputs for every engine, in the same run).
- runner: one ModelRunner per `--dtypes` entry (ServerArgs.dtype; default float32 and auto side by side, auto being
  bfloat16 on CPUs with native bfloat16, float32 elsewhere: runtime.model.cpu_features.resolve_dtype), each row
  recording the dtype asked for and the one it resolved to; `--quantization` applies to every runner. Each prefills
  in steps of at most `max_prefill_tokens` tokens (as the scheduler would), then runs `decode_steps` greedy decode
  steps of all B sequences together (one forward per step).
- transformers: one generate(max_new_tokens=decode_steps + 1) (greedy, EOS ignored, no padding: all prompts have
  the same length), timed by a no-op logits processor: prefill = start -> first sampling point, decode = first ->
  last sampling point (decode_steps forwards).
prefill_tok_s = B * context / prefill seconds; decode_tok_s = B * decode_steps / decode seconds (wall clock,
best of `repeats`); the *_per_cpu_s twins divide by this process's CPU seconds instead (less sensitive to other jobs
on a shared machine). ratios[dtype]: runner decode_tok_s / transformers decode_tok_s per batch (vs_transformers,
and vs_transformers_cpu_time with CPU seconds) and / the float32 runner's (vs_float32, where float32 ran);
ratio_vs_transformers: auto's (else the first dtype's) at the largest batch. machine:
runtime.model.cpu_features.machine_facts().
Figures from a machine shared with other work are disturbed: compare the rows of one run, side by side.

    .venv/bin/python -m benchmarks.decode_throughput            # B = 1, 8, 32; context 512; 32 decode steps
    .venv/bin/python -m benchmarks.decode_throughput --quick    # B = 1, 8, 32; context 512; 8 decode steps
    .venv/bin/python -m benchmarks.decode_throughput --smoke    # seconds; B = 1, 2; context 32; 2 decode steps;
                                                                # writes nothing unless --out is given
    .venv/bin/python -m benchmarks.decode_throughput --dtypes auto --quantization int8 --out /tmp/int8.json
    .venv/bin/python -m benchmarks.decode_throughput --quick --architectures llama qwen3 phi3 mistral gemma3 \
        qwen3_moe mixtral
        # a random model of each supported architecture, one shape (benchmarks/family_models.py; the MoE ones 8
        # experts, top-2: benchmarks/moe_decode.py has tokens/s per active expert count); rows per architecture
        # into results/decode_throughput_architectures.json
Target: ratio_vs_transformers >= 1.5 (goal 2).
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path
from typing import Any, cast

import torch

from benchmarks.cli import output_path
from benchmarks.family_models import ARCHITECTURES
from radix.blocks import cdiv
from runtime.config import MIN_USABLE_BLOCKS, ServerArgs
from runtime.model.loader import resolve_model
from runtime.model.runner import ModelRunner
from runtime.protocol import ForwardBatch, ScheduledSeq
from runtime.sampling_params import SamplingParams

RESULTS = Path(__file__).parent / "results" / "decode_throughput.json"
RESULTS_ARCHITECTURES = Path(__file__).parent / "results" / "decode_throughput_architectures.json"
Times = tuple[float, float]  # (wall-clock seconds, CPU seconds of this process)
GREEDY = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=4096)


def make_prompts(batch: int, context: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """batch random prompts of context token ids (ids >= 3 skip SmolLM2's special tokens)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (batch, context), generator=g).tolist()


def run_runner(
    runner: ModelRunner, prompts: list[list[int]], decode_steps: int, max_prefill_tokens: int, first_seq_id: int
) -> tuple[Times, Times]:
    """Prefill then decode prompts through runner.execute; returns (prefill, decode) (wall, cpu) seconds."""
    bs, context = runner.block_size, len(prompts[0])
    blocks_per_seq = cdiv(context + decode_steps, bs)
    ids = list(range(first_seq_id, first_seq_id + len(prompts)))
    tables = [list(range(1 + i * blocks_per_seq, 1 + (i + 1) * blocks_per_seq)) for i in range(len(prompts))]
    per_step = max(1, max_prefill_tokens // context)
    last: dict[int, int] = {}
    start = _now()
    for lo in range(0, len(prompts), per_step):
        seqs = [
            ScheduledSeq(ids[i], prompts[i], 0, tables[i], True, GREEDY, context)
            for i in range(lo, min(len(prompts), lo + per_step))
        ]
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
    out = model.generate(
        inputs,
        attention_mask=torch.ones_like(inputs),
        max_new_tokens=decode_steps + 1,
        min_new_tokens=0,
        do_sample=False,
        pad_token_id=0,
        logits_processor=LogitsProcessorList([clock]),
    )
    assert out.shape[1] == inputs.shape[1] + decode_steps + 1 and len(clock.times) == decode_steps + 1
    return _elapsed(start, clock.times[0]), _elapsed(clock.times[0], clock.times[-1])


DTYPES = ("auto", "float32", "bfloat16", "float16")


def measure_batch(
    runners: dict[str, ModelRunner],
    hf,
    batch: int,
    context: int,
    decode_steps: int,
    repeats: int,
    max_prefill_tokens: int,
) -> list[dict]:
    """One row per runner (dtype order) then transformers' row: tokens/s of the best of repeats (wall clock and CPU
    time of this process)."""
    first = next(iter(runners.values()))
    prompts = make_prompts(batch, context, first.config.vocab_size, seed=batch)
    timed: list[tuple[dict, list[tuple[Times, Times]]]] = []
    for dtype, runner in runners.items():
        mine = [run_runner(runner, prompts, decode_steps, max_prefill_tokens, 1000 * (r + 1)) for r in range(repeats)]
        timed.append(
            ({"engine": "radixserve", "dtype": dtype, "resolved_dtype": str(runner.dtype).removeprefix("torch.")}, mine)
        )
    with torch.inference_mode():
        ref = [run_transformers(hf, prompts, decode_steps) for _ in range(repeats)]
    timed.append(({"engine": "transformers", "dtype": "float32", "resolved_dtype": "float32"}, ref))
    rows = []
    for head, times in timed:
        best_prefill = min(times, key=lambda t: t[0][0])[0]
        best_decode = min(times, key=lambda t: t[1][0])[1]
        rows.append(
            {
                **head,
                "batch": batch,
                "prefill_tok_s": round(batch * context / best_prefill[0], 1),
                "decode_tok_s": round(batch * decode_steps / best_decode[0], 1),
                "prefill_tok_per_cpu_s": round(batch * context / best_prefill[1], 1),
                "decode_tok_per_cpu_s": round(batch * decode_steps / best_decode[1], 1),
            }
        )
    return rows


def dtype_ratios(rows: list[dict], dtypes: list[str]) -> dict[str, dict]:
    """Per dtype: its resolved dtype and, per batch (a str key), decode_tok_s / transformers' (vs_transformers; wall
    clock), the same with CPU seconds (vs_transformers_cpu_time) and / the float32 runner's (vs_float32)."""
    ref = {r["batch"]: r for r in rows if r["engine"] == "transformers"}
    f32 = {r["batch"]: r for r in rows if r["engine"] == "radixserve" and r["dtype"] == "float32"}
    out: dict[str, dict] = {}
    for dtype in dtypes:
        mine = [r for r in rows if r["engine"] == "radixserve" and r["dtype"] == dtype]
        entry: dict = {
            "resolved_dtype": mine[0]["resolved_dtype"],
            "vs_transformers": {
                str(r["batch"]): round(r["decode_tok_s"] / ref[r["batch"]]["decode_tok_s"], 3) for r in mine
            },
            "vs_transformers_cpu_time": {
                str(r["batch"]): round(r["decode_tok_per_cpu_s"] / ref[r["batch"]]["decode_tok_per_cpu_s"], 3)
                for r in mine
            },
        }
        if f32:
            entry["vs_float32"] = {
                str(r["batch"]): round(r["decode_tok_s"] / f32[r["batch"]]["decode_tok_s"], 3) for r in mine
            }
        out[dtype] = entry
    return out


def measure_model(
    model: str, args: argparse.Namespace, batches: list[int], context: int, decode_steps: int, repeats: int, dtypes
) -> dict:
    """The benchmark's result for one model (name, folder or .gguf): rows per batch, ratios, the machine."""
    from transformers import AutoModelForCausalLM

    from runtime.model.cpu_features import machine_facts

    max_prefill_tokens = ServerArgs().max_prefill_tokens
    blocks = max(MIN_USABLE_BLOCKS + 1, 1 + max(batches) * cdiv(context + decode_steps, 16))
    runners = {
        dtype: ModelRunner(
            ServerArgs(
                model=model,
                num_blocks=blocks,
                dtype=cast(Any, dtype),
                quantization=cast(Any, args.quantization),
                kv_groups="single",  # one block table per sequence, built here (no scheduler's window tables)
            )
        )
        for dtype in dtypes
    }
    hf = AutoModelForCausalLM.from_pretrained(str(resolve_model(model)), dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    if args.threads:  # after the runners, which set their own default (runtime.model.runner.set_cpu_threads)
        torch.set_num_threads(args.threads)
    rows = []
    for batch in batches:
        rows += measure_batch(runners, hf, batch, context, decode_steps, repeats, max_prefill_tokens)
        logging.getLogger(__name__).warning("batch %d: %s", batch, rows[-len(runners) - 1 :])
    ratios = dtype_ratios(rows, dtypes)
    main_dtype = "auto" if "auto" in dtypes else dtypes[0]
    return {
        "model": model,
        "dtypes": dtypes,
        "quantization": args.quantization,
        "device": "cpu",
        "threads": torch.get_num_threads(),
        "machine": machine_facts(),
        "context": context,
        "decode_steps": decode_steps,
        "rows": rows,
        "ratios": ratios,
        "ratio_vs_transformers": ratios[main_dtype]["vs_transformers"][str(batches[-1])],
        "ratio_vs_transformers_cpu_time": ratios[main_dtype]["vs_transformers_cpu_time"][str(batches[-1])],
        "ratio_dtype": main_dtype,
        "ratio_batch": batches[-1],
        "target_ratio": 1.5,
    }


def measure_architectures(
    args: argparse.Namespace, batches: list[int], context: int, decode_steps: int, repeats: int, dtypes
) -> dict:
    """measure_model on a random model of each of args.architectures (benchmarks.family_models, one shape for all);
    `rows` holds one row per architecture, dtype and batch (radixserve's decode_tok_s and transformers')."""
    import tempfile

    from benchmarks.family_models import save_family_model

    per_arch = {}
    with tempfile.TemporaryDirectory(prefix="families-") as tmp:
        for name in args.architectures:
            folder = save_family_model(name, Path(tmp) / name, small=args.smoke)
            per_arch[name] = measure_model(str(folder), args, batches, context, decode_steps, repeats, dtypes)
            per_arch[name]["model"] = name
    rows = []
    for name, result in per_arch.items():
        ref = {r["batch"]: r["decode_tok_s"] for r in result["rows"] if r["engine"] == "transformers"}
        for r in result["rows"]:
            if r["engine"] == "radixserve":
                row = {
                    "architecture": name,
                    "dtype": r["dtype"],
                    "batch": r["batch"],
                    "decode_tok_s": r["decode_tok_s"],
                }
                rows.append({**row, "transformers_decode_tok_s": ref[r["batch"]]})
    first = next(iter(per_arch.values()))
    shared = {
        k: first[k] for k in ("dtypes", "quantization", "device", "threads", "machine", "context", "decode_steps")
    }
    return {**shared, "architectures": list(args.architectures), "rows": rows, "per_architecture": per_arch}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--batches", type=int, nargs="+")
    parser.add_argument(
        "--dtypes",
        nargs="+",
        choices=DTYPES,
        default=["float32", "auto"],
        help="one runner per dtype, side by side (default: float32 auto)",
    )
    parser.add_argument(
        "--quantization", choices=["auto", "none", "int8", "int4"], default="none", help="every runner's"
    )
    parser.add_argument("--repeats", type=int)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--threads", type=int, help="torch threads of every engine (default: set_cpu_threads)")
    parser.add_argument("--model", default="smollm2", help="model name, folder or .gguf (default: the embedded one)")
    parser.add_argument(
        "--architectures",
        nargs="+",
        choices=ARCHITECTURES,
        help="instead of --model: a random model of each architecture (benchmarks/family_models.py), a row each",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    if args.smoke:
        batches, context, decode_steps, repeats = [1, 2], 32, 2, 1
    else:
        batches, context, decode_steps, repeats = [1, 8, 32], 512, 8 if args.quick else 32, 1
    batches = args.batches or batches
    repeats = args.repeats or repeats
    dtypes = list(dict.fromkeys(args.dtypes))
    if args.architectures:
        result = measure_architectures(args, batches, context, decode_steps, repeats, dtypes)
        out_path = output_path(args.out, args.smoke, RESULTS_ARCHITECTURES)
    else:
        result = measure_model(args.model, args, batches, context, decode_steps, repeats, dtypes)
        out_path = output_path(args.out, args.smoke, RESULTS)
    text = json.dumps(result, indent=2)
    if out_path is not None:
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(text + "\n")
    print(text)
    return result


if __name__ == "__main__":
    main()
