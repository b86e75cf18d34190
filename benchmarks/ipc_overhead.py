"""Scheduler-to-worker IPC overhead: one decode step's round trip through the real worker loop with a no-op model.

The scheduler side (this process) encodes a ForwardBatch of `batch` decode sequences at a context of `context`
tokens, sends it over an ipc:// PUSH socket to a worker subprocess running
runtime.serve.worker_process.serve_worker around a NoOpRunner (it keeps each sequence's block table, appends new
blocks and computes positions and slot_mapping like the real worker, but runs no model), and receives and decodes the
ForwardResult. The sequences are registered once
(their whole block tables, not timed); each timed step carries one token per sequence and a block id every
block_size steps, so bytes_per_step must not grow with the context (the delta format of docs/ARCHITECTURE.md).

Reported per (batch, context): us_per_step (median round trip, microseconds) and bytes_per_step (mean ForwardBatch
bytes). The target compares us_per_step with a decode step of the embedded model at the same batch
(--decode-step-ms, else measured with runtime.model.runner.ModelRunner at a short context, which only makes the step
faster and the comparison stricter).

    .venv/bin/python -m benchmarks.ipc_overhead            # batch 256, contexts 1k/2k/4k -> results/ipc_overhead.json
    .venv/bin/python -m benchmarks.ipc_overhead --smoke    # seconds; writes nothing unless --out is given
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgspec
import zmq

from benchmarks.cli import output_path
from radix.blocks import cdiv
from runtime import protocol as p
from runtime.sampling_params import SamplingParams

BLOCK_SIZE = 16
RESULTS = Path(__file__).parent / "results" / "ipc_overhead.json"


class NoOpRunner:
    """A worker without a model: applies a ForwardBatch's deltas to per-sequence block tables, derives positions and
    slot_mapping (slot = table[pos // block_size] * block_size + pos % block_size), samples token 0."""

    def __init__(self, block_size: int = BLOCK_SIZE) -> None:
        self.block_size = block_size
        self.tables: dict[int, list[int]] = {}
        self.ready = p.Ready(
            num_blocks=1 << 20,
            block_size=block_size,
            max_model_len=1 << 20,
            num_host_blocks=0,
            vocab_size=32000,
            eos_token_ids=[0],
        )

    def execute(self, batch: p.ForwardBatch) -> p.ForwardResult:
        for seq_id in batch.drop_seq_ids:
            self.tables.pop(seq_id, None)
        bs, positions, slots, sampled = self.block_size, [], [], []
        for s in batch.seqs:
            table = self.tables.setdefault(s.seq_id, []) if s.sampling_params is None else []
            if s.sampling_params is not None:
                self.tables[s.seq_id] = table
            table.extend(s.new_block_ids)
            for i in range(len(s.token_ids)):
                pos = s.start_pos + i
                positions.append(pos)
                slots.append(table[pos // bs] * bs + pos % bs)
            if s.sample:
                sampled.append(s.seq_id)
        return p.ForwardResult(batch.step_id, sampled, [0] * len(sampled), num_forward_tokens=len(positions))


def worker_main(endpoint_in: str, endpoint_out: str) -> None:
    """The worker subprocess: serve_worker around a NoOpRunner until the parent closes stdin's pipe."""
    from runtime.serve.worker_process import serve_worker

    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    pull.bind(endpoint_in)
    push.connect(endpoint_out)
    parent = os.getppid()
    serve_worker(NoOpRunner(), pull, push, lambda: os.getppid() == parent, poll_ms=100)


def measure(push: zmq.Socket, pull: zmq.Socket, batch: int, context: int, steps: int) -> dict:
    """Registers `batch` sequences at `context` tokens, then times `steps` decode steps; returns one result row."""
    enc, dec = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(p.ForwardResult)
    blocks_per_seq = cdiv(context, BLOCK_SIZE)
    sp = SamplingParams(max_tokens=steps + 1, temperature=0.0)
    first = p.ForwardBatch(
        0,
        [
            p.ScheduledSeq(
                i, [1], context - 1, list(range(1 + i * 4096, 1 + i * 4096 + blocks_per_seq)), True, sp, context - 1, 0
            )
            for i in range(batch)
        ],
    )
    push.send(enc.encode(first))
    dec.decode(pull.recv())
    times, sizes, next_block = [], [], 1 << 24
    for step in range(1, steps + 1):
        pos = context - 1 + step
        seqs = []
        for i in range(batch):
            new_blocks = [next_block + i] if pos % BLOCK_SIZE == 0 else []
            seqs.append(p.ScheduledSeq(i, [7], pos, new_blocks, True))
        if pos % BLOCK_SIZE == 0:
            next_block += batch
        t0 = time.perf_counter()
        frame = enc.encode(p.ForwardBatch(step, seqs))
        push.send(frame, copy=False)
        result = dec.decode(pull.recv())
        times.append(time.perf_counter() - t0)
        sizes.append(len(frame))
        assert len(result.seq_ids) == batch and result.error is None
    push.send(enc.encode(p.ForwardBatch(steps + 1, [], drop_seq_ids=list(range(batch)))))
    dec.decode(pull.recv())
    return {
        "batch": batch,
        "context": context,
        "us_per_step": round(statistics.median(times) * 1e6, 1),
        "bytes_per_step": round(statistics.mean(sizes), 1),
    }


def decode_step_ms(batch: int, prompt_len: int = 15, steps: int = 5) -> float | None:
    """Median decode step (ms) of the embedded model at `batch` sequences of prompt_len + step tokens (None when the
    ModelRunner is unavailable). A short context makes the step cheaper, so the overhead ratio is an upper bound."""
    try:
        from runtime.config import ServerArgs
        from runtime.model.runner import ModelRunner
    except ImportError:
        return None
    blocks = cdiv(prompt_len + steps + 1, BLOCK_SIZE)
    runner = ModelRunner(ServerArgs(model="smollm2", num_blocks=batch * blocks + 1))
    sp = SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True)
    seqs = [
        p.ScheduledSeq(
            i, [1] * prompt_len, 0, list(range(1 + i * blocks, 1 + (i + 1) * blocks)), True, sp, prompt_len, 0
        )
        for i in range(batch)
    ]
    runner.execute(p.ForwardBatch(0, seqs))
    times = []
    for step in range(1, steps + 1):
        t0 = time.perf_counter()
        batch_msg = p.ForwardBatch(
            step, [p.ScheduledSeq(i, [1], prompt_len + step - 1, [], True) for i in range(batch)]
        )
        runner.execute(batch_msg)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="batch 8, contexts 64/256, 20 steps; no model")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 2048, 4096])
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--decode-step-ms", type=float, default=None, help="skip measuring the model's decode step")
    parser.add_argument("--out", type=Path, default=None, help=f"JSON output (default {RESULTS}; none in --smoke)")
    parser.add_argument("--worker", nargs=2, metavar=("IN", "OUT"), help=argparse.SUPPRESS)
    ns = parser.parse_args(argv)
    if ns.worker:
        worker_main(*ns.worker)
        return {}
    if ns.smoke:
        ns.batch = 8
        ns.contexts = [64, 256]
        ns.steps = 32
    with tempfile.TemporaryDirectory(prefix="ipc-bench-") as tmp:
        ep_in, ep_out = f"ipc://{tmp}/worker_in", f"ipc://{tmp}/worker_out"
        ctx = zmq.Context()
        pull = ctx.socket(zmq.PULL)
        pull.bind(ep_out)
        push = ctx.socket(zmq.PUSH)
        push.connect(ep_in)
        worker = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.ipc_overhead", "--worker", ep_in, ep_out],
            cwd=Path(__file__).resolve().parents[1],
        )
        try:
            rows = [measure(push, pull, ns.batch, c, ns.steps) for c in ns.contexts]
        finally:
            worker.terminate()
            worker.wait()
            ctx.destroy(linger=0)
    step_ms = ns.decode_step_ms if ns.decode_step_ms is not None or ns.smoke else decode_step_ms(ns.batch)
    worst = max(r["us_per_step"] for r in rows)
    out = {
        "rows": rows,
        "decode_step_ms": step_ms,
        "overhead_fraction": None if not step_ms else float(f"{worst / 1e3 / step_ms:.3g}"),
        "target_fraction": 0.05,
    }
    print(json.dumps(out, indent=1))
    path = output_path(ns.out, ns.smoke, RESULTS)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(out, indent=1) + "\n")
    return out


if __name__ == "__main__":
    main()
