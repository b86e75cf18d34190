"""Where one decode step's time goes: scheduler, IPC, the worker's input preparation, the forward, sampling.

Per (dtype, batch), `batch` requests of `context` random prompt tokens (distinct prompts: no prefix is shared, so
attention reads batch x context tokens of KV as in a real batch) are prefilled through a real Scheduler over a real
KVCacheManager (sized from the ModelRunner's Ready, events recorded as in the scheduler process) and the ModelRunner,
in this process. Then every timed greedy decode step is split into:

- scheduler: Scheduler.schedule + process_result + drain_failures + draining the KV events (the scheduler process's
  Python per step, runtime/serve/scheduler_process.py).
- ipc: msgspec encode of that step's real ForwardBatch, its decode as the worker's WorkerInput, encode of the real
  ForwardResult, its decode as WorkerOutput, encode of the step's TokenOutputs (scheduler -> tokenizer), plus a zmq
  ipc:// round trip of those bytes (ForwardBatch to a peer process, ForwardResult back; benchmarks/ipc_overhead.py
  times the worker loop the same way).
- prepare: ModelRunner.apply_structure + ModelRunner.prepare (block tables, positions, slot_mapping, input ids).
- forward: the model's forward (logits of the sampling rows).
- sampling: ModelRunner.sample + finish_step (penalties applied and counted when on, the ForwardResult built).

Threads 1 and 2 (torch intra-op threads) alternate step by step in the same run, so their figures are side by side on
the same load (machine facts, load average included, are saved with them). ms per step is the median over the timed
steps, per part; share = part / sum of the parts' medians. One extra row per thread count runs `--penalty-batch`
requests with frequency_penalty = 0.5 (the last dtype), to show the penalties' cost. overlap_bound = (scheduler +
ipc) / step: what an overlap scheduler (SGLang's) could hide at most, the forward running meanwhile.

    .venv/bin/python -m benchmarks.step_breakdown          # batches 1 8 32, context 512, float32 and auto, 16 steps
    .venv/bin/python -m benchmarks.step_breakdown --smoke  # seconds; writes nothing unless --out is given
    .venv/bin/python -m benchmarks.step_breakdown --per-layer   # adds "per_layer": benchmarks/layer_breakdown.py's
        # single-stream split of the forward per layer (norm, qkv, rotary, store KV, attention, o, MLP) and its profile
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import msgspec
import torch
import zmq

from benchmarks import layer_breakdown
from benchmarks.cli import write_result
from radix.blocks import cdiv
from radix.manager import KVCacheManager
from runtime import protocol as p
from runtime.config import ServerArgs
from runtime.model.cpu_features import machine_facts
from runtime.model.runner import ModelRunner
from runtime.sampling_params import SamplingParams
from runtime.scheduler.scheduler import Scheduler

RESULTS = Path(__file__).parent / "results" / "step_breakdown.json"
PARTS = ("scheduler", "ipc", "prepare", "forward", "sampling")
WARM_STEPS = 2  # decode steps run before the timed ones
logger = logging.getLogger(__name__)


# The peer process: blocks in poll (as the worker does), answers frame 2; an empty frame 2 or its parent's end ends it.
ECHO = """
import os, sys, zmq
ctx, parent = zmq.Context(), os.getppid()
pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
pull.connect(sys.argv[1])
push.connect(sys.argv[2])
while os.getppid() == parent:
    if not pull.poll(1000):
        continue
    _, result = pull.recv_multipart(copy=False)
    if not result.bytes:
        break
    push.send(result, copy=False)
ctx.destroy(linger=0)
"""


@contextmanager
def echo_peer() -> Iterator[tuple[zmq.Socket, zmq.Socket]]:
    """A peer process on ipc:// sockets that answers each two-frame message [batch, result] with its second frame:
    the worker's side of a step's round trip. Yields (push, pull) of this side."""
    with tempfile.TemporaryDirectory(prefix="step-bench-") as tmp:
        ep_in, ep_out = f"ipc://{tmp}/in", f"ipc://{tmp}/out"
        ctx = zmq.Context()
        push, pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
        pull.bind(ep_out)
        push.bind(ep_in)
        peer = subprocess.Popen([sys.executable, "-c", ECHO, ep_in, ep_out])
        try:
            push.send_multipart([b"", b"hello"])
            assert pull.poll(60_000) and pull.recv() == b"hello", "the echo peer did not answer"
            yield push, pull
        finally:
            push.send_multipart([b"", b""])  # an empty result frame ends the peer
            try:
                peer.wait(timeout=30)
            except subprocess.TimeoutExpired:
                peer.kill()
                peer.wait()
            ctx.destroy(linger=0)


class Codec:
    """The encoders and typed decoders of the scheduler and worker processes."""

    def __init__(self) -> None:
        self.encoder = msgspec.msgpack.Encoder()
        self.worker_in = msgspec.msgpack.Decoder(p.WorkerInput)
        self.worker_out = msgspec.msgpack.Decoder(p.WorkerOutput)


def worker_step(runner: ModelRunner, batch: p.ForwardBatch, times: dict[str, float]) -> p.ForwardResult:
    """ModelRunner.execute's work on a batch no sequence of which fails, timed per part into times (seconds)."""
    t0 = time.perf_counter()
    with torch.inference_mode():
        step = runner.apply_structure(batch)
        assert not step.invalid, step.invalid
        inputs = runner.prepare(step.runnable)
        t1 = time.perf_counter()
        logits = runner.model(inputs.input_ids, inputs.meta, runner.k_cache, runner.v_cache)
        t2 = time.perf_counter()
        sampled = runner.sample(logits, inputs.sample_seqs)
        result = runner.finish_step(batch.step_id, step.runnable, sampled, {})
    t3 = time.perf_counter()
    times["prepare"], times["forward"], times["sampling"] = t1 - t0, t2 - t1, t3 - t2
    return result


def timed_step(
    sched: Scheduler, runner: ModelRunner, codec: Codec, peer: tuple[zmq.Socket, zmq.Socket]
) -> tuple[dict[str, float], list[p.TokenOutput]]:
    """One step through every stage; returns its seconds per part and the step's TokenOutputs."""
    times: dict[str, float] = {}
    t0 = time.perf_counter()
    batch = sched.schedule()
    assert batch is not None
    t1 = time.perf_counter()
    frame = codec.encoder.encode(batch)
    decoded = codec.worker_in.decode(frame)
    t2 = time.perf_counter()
    assert isinstance(decoded, p.ForwardBatch)
    result = worker_step(runner, decoded, times)
    t3 = time.perf_counter()
    result_frame = codec.encoder.encode(result)
    push, pull = peer
    push.send_multipart([frame, result_frame], copy=False)
    got = codec.worker_out.decode(pull.recv())
    t4 = time.perf_counter()
    assert isinstance(got, p.ForwardResult)
    outputs = sched.process_result(got)
    assert not sched.drain_failures()
    events = sched.manager.drain_events()
    t5 = time.perf_counter()
    codec.encoder.encode(p.TokenOutputs(outputs))
    for event in events:
        codec.encoder.encode(event)
    t6 = time.perf_counter()
    times["scheduler"] = (t1 - t0) + (t5 - t4)
    times["ipc"] = (t2 - t1) + (t4 - t3) + (t6 - t5)
    return times, outputs


def prompts(batch: int, context: int, vocab: int, seed: int) -> list[list[int]]:
    """batch random prompts of context ids (>= 3: no special token)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (batch, context), generator=g).tolist()


def max_tokens(batch: int, steps: int, threads: list[int]) -> int:
    """Completion tokens a request may reach in measure: the prefill's token, the warm and timed steps, and one per
    later prefill step (a request admitted earlier decodes while the others prefill; at most `batch` steps)."""
    return 1 + WARM_STEPS + steps * len(threads) + batch


def measure(
    runner: ModelRunner,
    peer: tuple[zmq.Socket, zmq.Socket],
    batch: int,
    context: int,
    steps: int,
    threads: list[int],
    penalty: bool = False,
) -> dict[int, dict[str, list[float]]]:
    """Prefill `batch` requests through a fresh Scheduler, then `steps` timed decode steps per thread count, the
    thread counts alternating step by step. Returns threads -> part -> seconds of each step."""
    ready = runner.ready
    args = ServerArgs(  # one token a step: the figures are per decode step
        model=runner.args.model, num_blocks=ready.num_blocks, block_size=ready.block_size, num_scheduler_steps=1
    )
    manager = KVCacheManager(ready.num_blocks, ready.block_size, True, ready.num_host_blocks, record_events=True)
    sched = Scheduler(manager, args, ready.max_model_len, ready.eos_token_ids, vocab_size=ready.vocab_size)
    params = SamplingParams(
        temperature=0.0,
        ignore_eos=True,
        max_tokens=max_tokens(batch, steps, threads),
        frequency_penalty=0.5 if penalty else 0.0,
    )
    rids = [f"r{i}" for i in range(batch)]
    for rid, ids in zip(rids, prompts(batch, context, ready.vocab_size, seed=batch), strict=True):
        sched.add_request(rid, ids, params)
    torch.set_num_threads(max(threads))
    decoding: set[str] = set()
    while len(decoding) < batch:  # prefill (not timed): until every request has its first token
        step = sched.schedule()
        assert step is not None
        decoding.update(o.rid for o in sched.process_result(runner.execute(step)) if o.token_ids)
    for _ in range(WARM_STEPS):
        step = sched.schedule()
        assert step is not None
        sched.process_result(runner.execute(step))
    codec = Codec()
    out: dict[int, dict[str, list[float]]] = {t: {part: [] for part in PARTS} for t in threads}
    for i in range(steps * len(threads)):
        t = threads[i % len(threads)]
        torch.set_num_threads(t)
        times, outputs = timed_step(sched, runner, codec, peer)
        assert sum(len(o.token_ids) for o in outputs) == batch  # every sequence decoded one token
        for part in PARTS:
            out[t][part].append(times[part])
    for rid in rids:
        sched.abort(rid)
    drops = sched.schedule()
    if drops is not None:
        runner.execute(drops)
    assert not runner.seqs
    return out


def summarize(dtype: str, batch: int, threads: int, penalty: bool, times: dict[str, list[float]], context: int) -> dict:
    """One result row: median ms per part, share of the step, decode tok/s of the step."""
    ms = {part: statistics.median(times[part]) * 1e3 for part in PARTS}
    step = sum(ms.values())
    return {
        "dtype": dtype,
        "batch": batch,
        "threads": threads,
        "context": context,
        "frequency_penalty": 0.5 if penalty else 0.0,
        "steps": len(times["forward"]),
        "ms": {part: round(v, 3) for part, v in ms.items()},
        "step_ms": round(step, 3),
        "share": {part: round(v / step, 4) for part, v in ms.items()},
        "overlap_bound": round((ms["scheduler"] + ms["ipc"]) / step, 4),
        "decode_tok_s": round(batch / step * 1e3, 1),
    }


def run(
    model: str,
    dtypes: list[str],
    batches: list[int],
    threads: list[int],
    context: int,
    steps: int,
    penalty_batch: int | None,
) -> list[dict]:
    """Every row of the benchmark (see the module docstring)."""
    rows = []
    with echo_peer() as peer:
        for dtype in dtypes:
            most = max(batches + [penalty_batch or 0])
            blocks = 1 + most * cdiv(context + max_tokens(most, steps, threads), 16)
            # one KV cache group: the plain KVCacheManager below makes the block tables
            args = ServerArgs(  # one token a step: the figures are per decode step
                model=model,
                dtype=dtype,  # type: ignore[arg-type]
                num_blocks=blocks,
                kv_groups="single",
                num_scheduler_steps=1,
            )
            runner = ModelRunner(args)
            name = str(runner.dtype).removeprefix("torch.")
            label = name if dtype != "auto" else f"auto ({name})"
            cases = [(b, False) for b in batches]
            if penalty_batch and dtype == dtypes[-1]:
                cases.append((penalty_batch, True))
            for batch, penalty in cases:
                per_thread = measure(runner, peer, batch, context, steps, threads, penalty)
                for t, times in per_thread.items():
                    rows.append(summarize(label, batch, t, penalty, times, context))
                    logger.warning("%s", rows[-1])
            del runner
    return rows


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="batches 1 2, context 32, 3 steps, float32, 1 thread")
    parser.add_argument("--model", default="smollm2", help="model name, folder or .gguf (default: the embedded one)")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "auto"])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument(
        "--threads", type=int, nargs="+", help="torch threads, alternating per step (default 1 2; --smoke: 1)"
    )
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--steps", type=int, default=16, help="timed decode steps per thread count")
    parser.add_argument("--penalty-batch", type=int, default=32, help="batch of the frequency_penalty rows (0: none)")
    parser.add_argument("--out", type=Path, default=None, help=f"JSON output (default {RESULTS}; none in --smoke)")
    parser.add_argument("--per-layer", action="store_true", help="add the single-stream per-layer split (last dtype)")
    ns = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    if ns.smoke:
        ns.dtypes = ["float32"]
        ns.batches = [1, 2]
        ns.context = 32
        ns.steps = 3
        ns.penalty_batch = 2
        ns.threads = ns.threads or [1]
    ns.threads = ns.threads or [1, 2]
    machine = machine_facts()  # before any runner sets torch's threads
    rows = run(ns.model, ns.dtypes, ns.batches, ns.threads, ns.context, ns.steps, ns.penalty_batch or None)
    result = {
        "model": ns.model,
        "machine": machine,
        "context": ns.context,
        "steps": ns.steps,
        "threads": ns.threads,
        "parts": list(PARTS),
        "rows": rows,
    }
    if ns.per_layer:
        steps = ns.steps if ns.smoke else 2 * ns.steps
        result["per_layer"] = layer_breakdown.run(ns.model, ns.context, steps, ns.dtypes[-1], "auto")
    write_result(result, ns.out, ns.smoke, RESULTS)
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
