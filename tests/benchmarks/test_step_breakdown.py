"""benchmarks/step_breakdown.py: its timed step computes what ModelRunner.execute computes, and --smoke writes every
row (dtype x batch x threads, plus the penalty rows) with shares that add up."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.step_breakdown import PARTS, Codec, echo_peer, main, timed_step
from radix.manager import KVCacheManager
from runtime.config import ServerArgs
from runtime.model.runner import ModelRunner
from runtime.sampling_params import SamplingParams
from runtime.scheduler.scheduler import Scheduler

PARAMS = [
    SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=6),
    SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=4, frequency_penalty=1.5),
    SamplingParams(temperature=0.9, seed=3, ignore_eos=True, max_tokens=5, presence_penalty=0.5),
]


def _serve(model: str, timed: bool) -> dict[str, list[int]]:
    """Three requests (greedy, greedy with a frequency penalty, seeded with a presence penalty) to the end through a
    Scheduler and a ModelRunner, each step through timed_step (timed) or ModelRunner.execute: rid -> token ids."""
    args = ServerArgs(model=model, dtype="float32", num_blocks=40, block_size=4)
    runner = ModelRunner(args)
    ready = runner.ready
    sched = Scheduler(
        KVCacheManager(ready.num_blocks, ready.block_size, True, 0, record_events=True),
        args,
        ready.max_model_len,
        ready.eos_token_ids,
        vocab_size=ready.vocab_size,
    )
    for i, params in enumerate(PARAMS):
        sched.add_request(f"r{i}", [100 + 7 * i + j for j in range(9 + i)], params)
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(PARAMS))}
    with echo_peer() as peer:
        codec = Codec()
        while sched.has_unfinished():
            if timed:
                times, outputs = timed_step(sched, runner, codec, peer)
                assert set(times) == set(PARTS) and min(times.values()) > 0
            else:
                batch = sched.schedule()
                assert batch is not None
                outputs = sched.process_result(runner.execute(batch))
            for out in outputs:
                tokens[out.rid].extend(out.token_ids)
    assert not runner.seqs or sched.schedule() is not None  # the last drops are still to be delivered
    return tokens


def test_the_timed_step_computes_what_execute_computes(tiny_llama_dir):
    want = _serve(str(tiny_llama_dir), timed=False)
    assert [len(t) for t in want.values()] == [6, 4, 5]
    assert _serve(str(tiny_llama_dir), timed=True) == want


def test_smoke_writes_every_row(tmp_path: Path, tiny_llama_dir):
    out = tmp_path / "step_breakdown.json"
    argv = ["--smoke", "--model", str(tiny_llama_dir), "--threads", "1", "2", "--out", str(out), "--per-layer"]
    result = main(argv)
    assert json.loads(out.read_text()) == result
    assert result["per_layer"]["layers"] == 2 and result["per_layer"]["calls_per_step"]["attention"] == 2.0
    assert result["parts"] == list(PARTS) and result["threads"] == [1, 2] and result["context"] == 32
    assert {"cpu_model", "cpu_capability", "flags", "cores", "load_average"} <= set(result["machine"])
    rows = result["rows"]
    keys = [(r["dtype"], r["batch"], r["threads"], r["frequency_penalty"]) for r in rows]
    assert keys == [("float32", b, t, pen) for b, pen in ((1, 0.0), (2, 0.0), (2, 0.5)) for t in (1, 2)]
    for r in rows:
        assert r["steps"] == 3 and set(r["ms"]) == set(PARTS) and min(r["ms"].values()) > 0
        assert abs(sum(r["ms"].values()) - r["step_ms"]) < 0.01
        assert abs(sum(r["share"].values()) - 1.0) < 1e-3
        assert r["overlap_bound"] == pytest.approx(r["share"]["scheduler"] + r["share"]["ipc"], abs=2e-4)
        assert r["decode_tok_s"] == pytest.approx(r["batch"] / r["step_ms"] * 1e3, rel=1e-3, abs=0.1)
