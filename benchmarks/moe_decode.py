"""Decode tokens/s of a small random Qwen3-MoE or Mixtral per number of experts each token runs (top-k), on CPU.

One random model (transformers' Qwen3MoeConfig, or MixtralConfig with `--family mixtral`: the same sizes, Mistral's
attention and Mixtral's always-renormalised routing; saved once into a temporary folder) is served at each top-k: the
weights are the same, only num_experts_per_tok changes, so the figures show what each further active expert costs
a decode step (at batch 1 a layer runs top-k experts; at batch B up to min(E, B * top-k), counted and recorded as
active_experts: distinct experts per sparse layer per decode step, averaged). Every run prefills random prompts and
decodes greedily through ModelRunner.execute (benchmarks.decode_throughput.run_runner), best of --repeats, timed
by the wall clock and by this process's CPU time (with --threads 1 the CPU time is the work done, which a machine
shared with other jobs stretches less than the wall clock).

    .venv/bin/python -m benchmarks.moe_decode            # top-k 1 2 4 8 of 16 experts, B = 1, 8; context 128; 32 steps
    .venv/bin/python -m benchmarks.moe_decode --threads 1 --out benchmarks/results/moe_decode.json   # as recorded
    .venv/bin/python -m benchmarks.moe_decode --quantization int8 --out /tmp/moe_int8.json
    .venv/bin/python -m benchmarks.moe_decode --family mixtral --threads 1 --out benchmarks/results/moe_mixtral.json
    .venv/bin/python -m benchmarks.moe_decode --smoke    # seconds; top-k 1 2, B = 1; writes nothing unless --out
"""

from __future__ import annotations

import argparse
import json
import logging
import tempfile
from pathlib import Path
from typing import Any, cast

import torch

from benchmarks.cli import output_path
from benchmarks.decode_throughput import make_prompts, run_runner
from radix.blocks import cdiv
from runtime.config import MIN_USABLE_BLOCKS, ServerArgs
from runtime.model.models.moe import SparseMoeBlock
from runtime.model.runner import ModelRunner

RESULTS = Path(__file__).parent / "results" / "moe_decode.json"
NUM_EXPERTS = 16
FAMILIES = {"qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM"}


def save_model(
    folder: Path, hidden: int, layers: int, expert_width: int, vocab: int, family: str = "qwen3_moe"
) -> Path:
    """A random float32 model of family (a FAMILIES key) with NUM_EXPERTS experts per layer (every layer sparse)
    saved into folder."""
    from transformers import AutoModelForCausalLM, MixtralConfig, Qwen3MoeConfig

    shape = {
        "vocab_size": vocab,
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": hidden // 4,
        "num_experts_per_tok": 2,
        "initializer_range": 0.1,
        "max_position_embeddings": 2048,
    }
    if family == "mixtral":  # Mixtral's intermediate_size is each expert's width
        config = MixtralConfig(**shape, intermediate_size=expert_width, num_local_experts=NUM_EXPERTS)
    else:
        config = Qwen3MoeConfig(
            **shape,
            intermediate_size=4 * hidden,
            moe_intermediate_size=expert_width,
            num_experts=NUM_EXPERTS,
            norm_topk_prob=True,
        )
    config.architectures = [FAMILIES[family]]
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(str(folder))
    return folder


def set_top_k(folder: Path, top_k: int) -> None:
    """Rewrite folder/config.json's num_experts_per_tok."""
    path = folder / "config.json"
    raw = json.loads(path.read_text())
    raw["num_experts_per_tok"] = top_k
    path.write_text(json.dumps(raw))


def active_experts(runner: ModelRunner, prompts: list[list[int]], steps: int) -> float:
    """Distinct experts per sparse layer per decode step, averaged over a short untimed run (forward hooks)."""
    seen: list[int] = []
    decoding = [False]

    def count(module: torch.nn.Module, args: tuple[torch.Tensor, ...], _out: torch.Tensor) -> None:
        if decoding[0]:
            seen.append(int(cast(SparseMoeBlock, module).route(args[0]).ids.unique().numel()))

    def mark_decode(_m: torch.nn.Module, args: tuple[Any, ...]) -> None:
        decoding[0] = int(args[0].shape[0]) == len(prompts)  # one token per sequence: a decode step

    blocks = [m for m in runner.model.modules() if isinstance(m, SparseMoeBlock)]
    handles = [b.register_forward_hook(count) for b in blocks]
    handles.append(runner.model.register_forward_pre_hook(mark_decode))
    try:
        run_runner(runner, prompts, steps, ServerArgs().max_prefill_tokens, 10**5)
    finally:
        for h in handles:
            h.remove()
    return round(sum(seen) / max(len(seen), 1), 2)


def measure(folder: Path, top_k: int, batch: int, args: argparse.Namespace, context: int, steps: int) -> dict:
    """One row: decode and prefill tokens/s (wall clock, best of args.repeats) of top_k at batch."""
    set_top_k(folder, top_k)
    blocks = max(MIN_USABLE_BLOCKS + 1, 1 + batch * cdiv(context + steps, 16))
    server_args = ServerArgs(
        model=str(folder),
        num_blocks=blocks,
        dtype=cast(Any, args.dtype),
        quantization=cast(Any, args.quantization),
        kv_groups="single",  # one block table per sequence, built here (no scheduler's window tables)
    )
    runner = ModelRunner(server_args)
    if args.threads:  # after the runner, which sets its own default (runtime.model.runner.set_cpu_threads)
        torch.set_num_threads(args.threads)
    prompts = make_prompts(batch, context, runner.config.vocab_size, seed=batch)
    limit = server_args.max_prefill_tokens
    times = [run_runner(runner, prompts, steps, limit, 1000 * (r + 1)) for r in range(args.repeats)]
    prefill = min(t[0][0] for t in times)
    decode = min(t[1][0] for t in times)
    decode_cpu = min(t[1][1] for t in times)
    return {
        "top_k": top_k,
        "batch": batch,
        "active_experts": active_experts(runner, prompts, min(steps, 4)),
        "decode_tok_s": round(batch * steps / decode, 1),
        "decode_ms_per_step": round(1000 * decode / steps, 2),
        "decode_tok_per_cpu_s": round(batch * steps / decode_cpu, 1),
        "decode_cpu_ms_per_step": round(1000 * decode_cpu / steps, 2),
        "prefill_tok_s": round(batch * context / prefill, 1),
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--family", choices=list(FAMILIES), default="qwen3_moe")
    parser.add_argument("--top-k", type=int, nargs="+", dest="top_k")
    parser.add_argument("--batches", type=int, nargs="+")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "auto"], default="float32")
    parser.add_argument("--quantization", choices=["none", "int8", "int4"], default="none")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--threads", type=int, help="torch threads (default: set_cpu_threads; 1 on a loaded machine)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    if args.smoke:
        top_ks, batches, context, steps, size = [1, 2], [1], 16, 2, (64, 2, 32, 512)
        args.repeats = 1
    else:
        top_ks, batches, context, steps, size = [1, 2, 4, 8], [1, 8], 128, 32, (512, 4, 256, 4096)
    top_ks = args.top_k or top_ks
    batches = args.batches or batches
    out_path = output_path(args.out, args.smoke, RESULTS)

    from runtime.model.cpu_features import machine_facts

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = save_model(Path(tmp), *size, family=args.family)
        for top_k in top_ks:
            for batch in batches:
                rows.append(measure(folder, top_k, batch, args, context, steps))
                logging.getLogger(__name__).warning("%s", rows[-1])
    hidden, layers, width, vocab = size
    result = {
        "model": {"family": FAMILIES[args.family], "hidden": hidden, "layers": layers, "experts": NUM_EXPERTS},
        "expert_width": width,
        "vocab": vocab,
        "dtype": args.dtype,
        "quantization": args.quantization,
        "context": context,
        "decode_steps": steps,
        "repeats": args.repeats,
        "threads": torch.get_num_threads(),
        "machine": machine_facts(),
        "rows": rows,
    }
    text = json.dumps(result, indent=2)
    if out_path is not None:
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(text + "\n")
    print(text)
    return result


if __name__ == "__main__":
    main()
