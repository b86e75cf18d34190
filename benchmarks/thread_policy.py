"""The worker's thread policy, quiet and beside a busy process: decode tok/s per OpenMP wait policy and thread count.

torch on CPU runs its intra-op work on an OpenMP pool (libgomp here: `torch.__config__.parallel_info()`), whose
idle threads spin before they sleep (GOMP_SPINCOUNT, OMP_WAIT_POLICY). Those are read once, when libgomp loads, so
each policy runs in its own child process with its variables set before torch is imported. Every child loads a
ModelRunner (the model's defaults: `--dtype auto`, `--quantization auto`) and prefills `batch` random prompts of
`context` tokens per batch size; then, `--reps` times: a quiet phase, then a busy one (beside
`python -c "while True: pass"`, one core's worth of work), each child in turn (the order rotates per repetition, so
all policies see the same load), each timing `--steps` decode steps per batch size and thread count (the counts
alternating step by step). Thread count "tuned": the runner's ThreadTuner picks (runtime/model/threads.py), in a
child of its own. decode_tok_s = batch * steps / the seconds of those steps; per row the median over the
repetitions and busy / quiet. The 1-minute load average before each phase is kept: other jobs on a shared machine
disturb the figures.

    .venv/bin/python -m benchmarks.thread_policy            # batches 1 8, context 128, 12 steps, 3 reps
    .venv/bin/python -m benchmarks.thread_policy --smoke    # seconds; writes nothing unless --out is given
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.cli import write_result
from runtime.model.threads import WAIT_KEYS

RESULTS = Path(__file__).parent / "results" / "thread_policy.json"
BUSY = "while True: pass"
SETTLE_S = 0.3  # the busy process runs this long before a busy phase is timed
TUNED = 0  # the thread count that stands for "the runner's ThreadTuner picks"
# policy name -> (the environment its child gets besides the caller's, tuned)
POLICIES: dict[str, tuple[dict[str, str], bool]] = {
    "default": ({}, False),
    "passive": ({"OMP_WAIT_POLICY": "PASSIVE"}, False),
    "spin10k": ({"GOMP_SPINCOUNT": "10000"}, False),
    "bind": ({"OMP_PROC_BIND": "TRUE", "OMP_PLACES": "cores"}, False),
    "passive_tuned": ({"OMP_WAIT_POLICY": "PASSIVE"}, True),
}
logger = logging.getLogger(__name__)


class Decoder:
    """The child's runner with `batch` prefilled sequences per batch size; step() runs one decode step of a group."""

    def __init__(self, spec: dict[str, Any], dtype: str = "auto", quantization: str = "auto") -> None:
        from benchmarks.decode_throughput import make_prompts
        from radix.blocks import cdiv
        from runtime.config import ServerArgs
        from runtime.model.runner import ModelRunner
        from runtime.protocol import ForwardBatch, ScheduledSeq
        from runtime.sampling_params import SamplingParams

        self.ForwardBatch = ForwardBatch
        self.ScheduledSeq = ScheduledSeq
        batches, context = spec["batches"], spec["context"]
        tokens = context + 2 * spec["reps"] * spec["steps"] * max(2, len(spec["threads"])) + 1
        per_seq = cdiv(tokens, 16)
        blocks = max(8, 1 + per_seq * sum(batches))
        args = ServerArgs(
            model=spec["model"],
            num_blocks=blocks,
            dtype=dtype,  # type: ignore[arg-type]
            quantization=quantization,  # type: ignore[arg-type]
            kv_groups="single",  # one block table per sequence, built here (no scheduler's window tables)
        )
        self.runner = ModelRunner(args)
        self.runner.threads.active = spec["tuned"]  # a fixed count is set by this benchmark, step by step
        greedy = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=tokens)
        self.last: dict[int, int] = {}
        self.pos: dict[int, int] = {}
        self.groups: list[list[int]] = []
        for b in batches:
            ids = list(range(len(self.last), len(self.last) + b))
            seqs = []
            for sid, prompt in zip(ids, make_prompts(b, context, self.runner.ready.vocab_size, seed=b), strict=True):
                table = list(range(1 + sid * per_seq, 1 + (sid + 1) * per_seq))
                seqs.append(ScheduledSeq(sid, prompt, 0, table, True, greedy, tokens))
                self.pos[sid] = context
            self._run(seqs)
            self.groups.append(ids)

    def _run(self, seqs: list) -> None:
        result = self.runner.execute(self.ForwardBatch(step_id=0, seqs=seqs))
        self.last.update(zip(result.seq_ids, result.token_ids, strict=True))

    def step(self, ids: list[int]) -> float:
        """One decode step of the sequences ids; returns its seconds."""
        seqs = [self.ScheduledSeq(sid, [self.last[sid]], self.pos[sid], [], True) for sid in ids]
        t0 = time.perf_counter()
        self._run(seqs)
        for sid in ids:
            self.pos[sid] += 1
        return time.perf_counter() - t0


def child(spec: dict[str, Any]) -> None:
    """A policy's child: prints "ready", then answers each phase name read from stdin with one JSON line of
    "batch/threads" -> decode tok/s. torch is imported here, after the environment was set."""
    import torch

    decoder = Decoder(spec)
    print(json.dumps({"ready": str(decoder.runner.dtype)}), flush=True)
    threads = [TUNED] if spec["tuned"] else spec["threads"]
    for _ in sys.stdin:
        got = {}
        for b, ids in zip(spec["batches"], decoder.groups, strict=True):
            seconds = dict.fromkeys(threads, 0.0)
            for i in range(spec["steps"] * len(spec["threads"])):
                t = threads[i % len(threads)]
                if t != TUNED:
                    torch.set_num_threads(t)
                seconds[t] += decoder.step(ids)
            steps = spec["steps"] * len(spec["threads"]) / len(threads)
            got.update({f"{b}/{t}": b * steps / seconds[t] for t in threads})
        print(json.dumps(got), flush=True)


def start_child(policy: str, spec: dict[str, Any]) -> tuple[subprocess.Popen, str]:
    """Starts a policy's child and waits for its "ready"; returns it and the runner's dtype."""
    env, tuned = POLICIES[policy]
    drop = ("RADIXSERVE_THREADS", *WAIT_KEYS, "OMP_PROC_BIND", "OMP_PLACES")
    full = {**{k: v for k, v in os.environ.items() if k not in drop}, **env}
    cmd = [sys.executable, "-m", "benchmarks.thread_policy", "--child", json.dumps({**spec, "tuned": tuned})]
    proc = subprocess.Popen(cmd, env=full, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    ready = json.loads(proc.stdout.readline())
    return proc, ready["ready"]


def ask(proc: subprocess.Popen, phase: str) -> dict[str, float]:
    """One phase of a child: its "batch/threads" -> decode tok/s."""
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(phase + "\n")
    proc.stdin.flush()
    return json.loads(proc.stdout.readline())


def measure(policies: list[str], spec: dict[str, Any]) -> tuple[dict, dict, str]:
    """Every phase of every policy, interleaved; returns policy -> "phase/batch/threads" -> tok/s per rep, the load
    averages per phase, and the runners' dtype."""
    children = {}
    dtype = ""
    for policy in policies:
        children[policy], dtype = start_child(policy, spec)
    samples: dict[str, dict[str, list[float]]] = {policy: {} for policy in policies}
    loads: dict[str, list[float]] = {"quiet": [], "busy": []}
    try:
        for rep in range(spec["reps"]):
            order = policies[rep % len(policies) :] + policies[: rep % len(policies)]
            for phase in ("quiet", "busy"):
                loads[phase].append(round(os.getloadavg()[0], 2))
                busy = subprocess.Popen([sys.executable, "-c", BUSY]) if phase == "busy" else None
                time.sleep(SETTLE_S if busy else 0.0)
                try:
                    for policy in order:
                        for key, value in ask(children[policy], phase).items():
                            samples[policy].setdefault(f"{phase}/{key}", []).append(value)
                finally:
                    if busy is not None:
                        busy.kill()
                        busy.wait()
    finally:
        for proc in children.values():
            proc.communicate(timeout=60)
    return samples, loads, dtype


def rows_of(policy: str, samples: dict[str, list[float]], batches: list[int], threads: list[int]) -> list[dict]:
    """Per (batch, threads): median decode tok/s quiet and busy, and busy / quiet."""
    rows = []
    for b in batches:
        for t in [TUNED] if POLICIES[policy][1] else threads:
            quiet = samples[f"quiet/{b}/{t}"]
            busy = samples[f"busy/{b}/{t}"]
            rows.append(
                {
                    "policy": policy,
                    "env": POLICIES[policy][0],
                    "batch": b,
                    "threads": t or "tuned",
                    "quiet_tok_s": round(statistics.median(quiet), 1),
                    "busy_tok_s": round(statistics.median(busy), 1),
                    "busy_over_quiet": round(statistics.median(busy) / statistics.median(quiet), 3),
                    "quiet_samples": [round(x, 1) for x in quiet],
                    "busy_samples": [round(x, 1) for x in busy],
                }
            )
    return rows


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="batch 1, context 16, 2 steps, 1 rep, 2 policies")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--policies", nargs="+", default=list(POLICIES), choices=list(POLICIES))
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--steps", type=int, default=12, help="timed decode steps per thread count and phase")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None, help=f"JSON output (default {RESULTS}; none in --smoke)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    ns = parser.parse_args(argv)
    if ns.child:
        child(json.loads(ns.child))
        return {}
    logging.basicConfig(level=logging.WARNING)
    if ns.smoke:
        ns.policies = ["default", "passive_tuned"]
        ns.batches = [1]
        ns.context = 16
        ns.steps = 2
        ns.reps = 1
    from runtime.model.cpu_features import machine_facts

    spec = {k: getattr(ns, k) for k in ("model", "batches", "context", "steps", "reps", "threads")}
    machine = machine_facts()
    samples, loads, dtype = measure(ns.policies, spec)
    rows = [row for policy in ns.policies for row in rows_of(policy, samples[policy], ns.batches, ns.threads)]
    result = {"machine": machine, **spec, "dtype": dtype, "load_average": loads, "rows": rows}
    write_result(result, ns.out, ns.smoke, RESULTS)
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
