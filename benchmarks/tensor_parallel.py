"""Tensor parallelism: prefill and decode tokens/s at TP = 1 and TP = N, and what the ranks exchange per step.

A random Llama (written once into a temporary folder, or --model FOLDER) is run through ModelRunner.execute
(benchmarks.decode_throughput.run_runner: random prompts prefilled, then greedy decode steps) at each size of --tp.
TP = 1 runs in this process; TP = N starts N rank processes (this script with --rank), which join a gloo group
(NCCL with --device cuda, rank r on cuda:r), load their slices and execute the same steps, rank 0 relaying each
ForwardBatch's bytes as the server's worker does (runtime/serve/worker_rank.py). Rank 0 reports, per phase and per
step: the relay's broadcast bytes and seconds, the model's all-reduce and all-gather bytes and seconds (TPGroup's
counters: the time a rank spends in the collectives, waiting for the slower rank included). On a CPU, N ranks
share the cores (each takes cores / N threads), so TP > 1 shows the communication's cost, not a speed-up; the
same script sized for GPUs (--device cuda --hidden 4096 --layers 32 ...) measures the real thing.

    .venv/bin/python -m benchmarks.tensor_parallel                      # TP 1 2, batch 1 8, random 4-layer model
    .venv/bin/python -m benchmarks.tensor_parallel --device cuda --tp 1 2 4 8 --hidden 4096 --layers 32 --heads 32 \\
        --kv-heads 8 --intermediate 14336 --vocab 128256 --dtype bfloat16 --batch 1 32 --context 1024
    .venv/bin/python -m benchmarks.tensor_parallel --smoke             # seconds; writes nothing unless --out
"""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import msgspec
import torch

from benchmarks.cli import apply_preset, write_result
from benchmarks.decode_throughput import make_prompts
from radix.blocks import cdiv
from runtime.config import MIN_USABLE_BLOCKS, ServerArgs
from runtime.model.cpu_features import machine_facts
from runtime.model.parallel.group import CommStats
from runtime.model.runner import ModelRunner
from runtime.protocol import ForwardBatch, ForwardResult, ScheduledSeq
from runtime.sampling_params import SamplingParams
from runtime.serve.worker_rank import StepRelay, free_port, start_runner

RESULTS = Path(__file__).parent / "results" / "tensor_parallel.json"
STOP_STEP = -1  # the step id of the frame that ends the other ranks' loop
SMOKE = {"tp": [1, 2], "batch": [1], "context": 16, "decode_steps": 4, "hidden": 64, "layers": 2, "vocab": 512}
SMOKE_SHAPE = {"heads": 4, "kv_heads": 2, "intermediate": 128}


def save_model(folder: Path, ns: argparse.Namespace) -> Path:
    """A random float32 Llama of ns's shape (weights ~ N(0, 0.02)) written straight to safetensors."""
    from safetensors.torch import save_file

    h, d = ns.hidden, ns.hidden // ns.heads
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": ns.vocab,
        "hidden_size": h,
        "intermediate_size": ns.intermediate,
        "num_hidden_layers": ns.layers,
        "num_attention_heads": ns.heads,
        "num_key_value_heads": ns.kv_heads,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "eos_token_id": 2,
    }
    (folder / "config.json").write_text(json.dumps(config))
    g = torch.Generator().manual_seed(0)
    shapes = {"model.embed_tokens.weight": (ns.vocab, h), "lm_head.weight": (ns.vocab, h), "model.norm.weight": (h,)}
    for i in range(ns.layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (ns.heads * d, h),
            p + "self_attn.k_proj.weight": (ns.kv_heads * d, h),
            p + "self_attn.v_proj.weight": (ns.kv_heads * d, h),
            p + "self_attn.o_proj.weight": (h, ns.heads * d),
            p + "mlp.gate_proj.weight": (ns.intermediate, h),
            p + "mlp.up_proj.weight": (ns.intermediate, h),
            p + "mlp.down_proj.weight": (h, ns.intermediate),
        }
    tensors = {n: torch.randn(s, generator=g) * 0.02 for n, s in shapes.items() if not n.endswith("norm.weight")}
    tensors |= {n: torch.ones(s) for n, s in shapes.items() if n.endswith("norm.weight")}
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


def server_args(ns: argparse.Namespace, tp: int, port: int | None) -> ServerArgs:
    """The runner's settings: a pool that holds the largest batch's sequences, one prefill step for all of them."""
    blocks = max(MIN_USABLE_BLOCKS, max(ns.batch) * cdiv(ns.context + ns.decode_steps, 16)) + 1
    return ServerArgs(
        model=str(ns.model),
        device=ns.device,
        dtype=ns.dtype,
        quantization="none",
        num_blocks=blocks,
        max_prefill_tokens=max(ns.batch) * ns.context,
        tensor_parallel_size=tp,
        master_port=port,
        kv_groups="single",  # one block table per sequence, built here (no scheduler's window tables)
    )


class RelayedRunner:
    """Rank 0's runner as run_phases sees it: each batch's bytes go to the other ranks before it runs (as the
    server's worker loop does: runtime/serve/worker_process.py)."""

    def __init__(self, runner: ModelRunner, relay: StepRelay) -> None:
        self.runner = runner
        self.relay = relay
        self.block_size = runner.block_size
        self.encoder = msgspec.msgpack.Encoder()

    def execute(self, batch: ForwardBatch) -> ForwardResult:
        self.relay.send(self.encoder.encode(batch))
        return self.runner.execute(batch)


def _phase(stats: CommStats | None, steps: int, seconds: float, tokens: int) -> dict[str, Any]:
    """tok/s and ms per step of one phase, and per step of it each collective's bytes, ms and calls (then reset)."""
    row: dict[str, Any] = {"tok_s": round(tokens / seconds, 1), "step_ms": round(1000 * seconds / steps, 3)}
    if stats is None:
        return row
    for kind in sorted(stats.calls):
        row[f"{kind}_bytes_per_step"] = stats.bytes[kind] // steps
        row[f"{kind}_ms_per_step"] = round(1000 * stats.seconds[kind] / steps, 3)
        row[f"{kind}_calls_per_step"] = round(stats.calls[kind] / steps, 2)
    stats.reset()
    return row


def run_phases(runner, prompts: list[list[int]], decode_steps: int, first_seq_id: int, stats) -> dict[str, Any]:
    """One prefill step of every prompt, then decode_steps greedy steps (as decode_throughput.run_runner, with the
    collectives counted per phase); the sequences are dropped after."""
    bs, context = runner.block_size, len(prompts[0])
    per_seq = cdiv(context + decode_steps, bs)
    ids = list(range(first_seq_id, first_seq_id + len(prompts)))
    tables = [list(range(1 + i * per_seq, 1 + (i + 1) * per_seq)) for i in range(len(prompts))]
    greedy = SamplingParams(max_tokens=decode_steps + 1, temperature=0.0, ignore_eos=True)
    if stats is not None:
        stats.reset()
    start = time.perf_counter()
    seqs = [ScheduledSeq(i, p, 0, t, True, greedy, context) for i, p, t in zip(ids, prompts, tables, strict=True)]
    result = runner.execute(ForwardBatch(step_id=first_seq_id, seqs=seqs))
    row = {"prefill": _phase(stats, 1, time.perf_counter() - start, len(prompts) * context)}
    last = dict(zip(result.seq_ids, result.token_ids, strict=True))
    start = time.perf_counter()
    for step in range(decode_steps):
        seqs = [ScheduledSeq(i, [last[i]], context + step, [], True) for i in ids]
        result = runner.execute(ForwardBatch(step_id=first_seq_id + 1 + step, seqs=seqs))
        last.update(zip(result.seq_ids, result.token_ids, strict=True))
    row["decode"] = _phase(stats, decode_steps, time.perf_counter() - start, len(prompts) * decode_steps)
    runner.execute(ForwardBatch(step_id=first_seq_id + decode_steps + 1, seqs=[], drop_seq_ids=ids))
    if stats is not None:
        stats.reset()
    return row


def measure(runner, ns: argparse.Namespace, stats: CommStats | None) -> list[dict[str, Any]]:
    """Per batch size: the prefill and decode figures of the best of ns.repeats runs (by decode time), after one
    warm-up run."""
    rows = []
    for batch in ns.batch:
        prompts = make_prompts(batch, ns.context, ns.vocab)
        runs = [run_phases(runner, prompts, ns.decode_steps, 10_000 * r, stats) for r in range(ns.repeats + 1)]
        best = max(runs[1:], key=lambda row: row["decode"]["tok_s"])
        rows.append({"batch": batch, **best})
    return rows


def run_rank(ns: argparse.Namespace) -> None:
    """One rank of a TP = ns.tp[0] run: rank 0 measures and prints its rows as JSON; the others execute what it
    relays until the stop frame."""
    args = server_args(ns, ns.tp[0], ns.port)
    runner, relay, group = start_runner(args, ns.rank)
    assert isinstance(relay, StepRelay) and group is not None
    if ns.rank == 0:
        rows = measure(RelayedRunner(runner, relay), ns, group.stats)
        relay.send(msgspec.msgpack.encode(ForwardBatch(step_id=STOP_STEP, seqs=[])))
        print(json.dumps({"rows": rows, "threads": torch.get_num_threads()}), flush=True)
    else:
        decoder = msgspec.msgpack.Decoder(ForwardBatch)
        while True:
            frame = relay.receive()
            if not frame:
                continue
            batch = decoder.decode(frame)
            if batch.step_id == STOP_STEP:
                break
            runner.execute(batch)
    group.close()


def run_tp(ns: argparse.Namespace, tp: int) -> dict[str, Any]:
    """The rows of TP = tp: in this process for 1, else from tp rank processes (rank 0's JSON line)."""
    if tp == 1:
        runner = ModelRunner(server_args(ns, 1, None))
        return {"tp": 1, "rows": measure(runner, ns, None), "threads": torch.get_num_threads()}
    port = free_port("127.0.0.1")
    base = [sys.executable, "-m", "benchmarks.tensor_parallel", *ns.argv, "--model", str(ns.model)]
    procs = [
        subprocess.Popen(
            [*base, "--tp", str(tp), "--rank", str(r), "--port", str(port)], stdout=subprocess.PIPE, text=True
        )
        for r in range(tp)
    ]
    outs = [proc.communicate(timeout=ns.timeout)[0] for proc in procs]
    if any(proc.returncode for proc in procs):
        raise RuntimeError(f"a rank of TP = {tp} failed: exit statuses {[proc.returncode for proc in procs]}")
    return {"tp": tp, **json.loads(outs[0].strip().splitlines()[-1])}


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2], help="tensor-parallel sizes to run")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8], help="sequences per step")
    parser.add_argument("--context", type=int, default=128, help="prompt tokens per sequence (one prefill step)")
    parser.add_argument("--decode-steps", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2, help="timed runs per batch size (after one warm-up)")
    parser.add_argument("--model", type=Path, default=None, help="a model folder (default: a random Llama)")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--intermediate", type=int, default=2816)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds a TP > 1 run may take")
    parser.add_argument("--smoke", action="store_true", help="a tiny model, a few steps: seconds")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=None, help=argparse.SUPPRESS)
    ns = parser.parse_args(argv)
    if ns.smoke:
        apply_preset(parser, ns, {**SMOKE, **SMOKE_SHAPE, "repeats": 1})
    ns.argv = [a for a in (argv if argv is not None else sys.argv[1:]) if a != "--smoke"]
    ns.argv = _without(ns.argv, ("--tp", "--model", "--out", "--rank", "--port"))
    if ns.smoke:
        ns.argv += _preset_flags(ns)
    return ns


def _without(argv: list[str], flags: tuple[str, ...]) -> list[str]:
    """argv without each of flags and the values after it."""
    out: list[str] = []
    skipping = False
    for a in argv:
        if a.startswith("--"):
            skipping = a in flags
        if not skipping:
            out.append(a)
    return out


def _preset_flags(ns: argparse.Namespace) -> list[str]:
    flags = []
    for key in (*SMOKE, *SMOKE_SHAPE, "repeats"):
        if key == "tp":
            continue
        value = getattr(ns, key)
        flags += [f"--{key.replace('_', '-')}", *[str(v) for v in (value if isinstance(value, list) else [value])]]
    return flags


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Runs the benchmark (or one rank of it); returns the result written to --out (RESULTS; nothing for --smoke)."""
    logging.basicConfig(level=logging.WARNING)
    ns = parse(argv)
    if ns.rank is not None:
        run_rank(ns)
        return {}
    with tempfile.TemporaryDirectory() as tmp:
        if ns.model is None:
            ns.model = save_model(Path(tmp), ns)
        runs = [run_tp(ns, tp) for tp in ns.tp]
    result = {
        "benchmark": "tensor_parallel",
        "command": "python -m benchmarks.tensor_parallel " + " ".join(argv if argv is not None else sys.argv[1:]),
        "model": {k: getattr(ns, k) for k in ("hidden", "layers", "heads", "kv_heads", "intermediate", "vocab")},
        "context": ns.context,
        "decode_steps": ns.decode_steps,
        "device": ns.device,
        "dtype": ns.dtype,
        "runs": runs,
        "machine": machine_facts(),
    }
    write_result(result, ns.out, ns.smoke, RESULTS)
    print(json.dumps(runs, indent=1))
    return result


if __name__ == "__main__":
    main()
