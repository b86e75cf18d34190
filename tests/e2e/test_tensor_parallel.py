"""Tensor parallelism end to end (issue 27): a real server with --tensor-parallel-size 2 (two gloo worker ranks on
this machine) gives the same tokens as the in-process Engine at TP = 1, in float32, on tiny random Llama (GQA 2:1,
untied head), Qwen3 (q/k norms, head_dim unlike hidden / heads) and Gemma 3 (local and global layers, tied
embeddings, softcap): greedy, seeded sampling, concurrent requests in a pool small enough to preempt, a
prefix-cache hit and a regex-constrained request. A rank killed mid-decode fails the stream at once and leaves no
process behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest

from runtime.client import ServerFailedError
from runtime.engine import Engine
from runtime.sampling_params import SamplingParams
from runtime.serve.process import ChildSpec
from runtime.serve.worker_rank import free_port
from runtime.structured_outputs import StructuredOutputs
from tests.e2e.processes import descendants, stop_process
from tests.e2e.servers import Server, exact_flags, start_server
from tests.e2e.test_server_lifecycle import wait_gone
from tests.paths import ROOT
from tests.runtime.model.tiny_families import random_prompts, save_tiny_family

pytestmark = pytest.mark.slow

BLOCK = 16
NUM_BLOCKS = 24  # 23 usable blocks (368 tokens) for 4 requests of ~100 tokens each: the scheduler must preempt
NEW_TOKENS = 40
PROMPT_LENS = [61, 47, 70, 55]
FLAGS = ("--dtype", "float32", "--block-size", str(BLOCK), "--num-blocks", str(NUM_BLOCKS))


@pytest.fixture(scope="module", params=["llama", "qwen3", "gemma3"])
def folder(request, tiny_llama_dir, tmp_path_factory, smollm2_tokenizer) -> Path:
    if request.param == "llama":
        return tiny_llama_dir
    return save_tiny_family(request.param, tmp_path_factory.mktemp(request.param), smollm2_tokenizer)


def _greedy() -> SamplingParams:
    return SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


# Seeded draws over top_k: at TP = 2 the logits differ from TP = 1 by float rounding (the all-reduce sums the ranks'
# partial products in another order), so an inverse-CDF draw whose uniform falls within that rounding of a CDF step
# may differ, as a greedy near-tie may. Over the whole 49k vocabulary of a random model at temperature 1 (~2e-5 per
# token) one draw in 80 did; over the top 50 tokens the steps are far wider than the rounding.
SEEDED = {"temperature": 0.8, "top_k": 50, "seed": 11}


def _seeded() -> SamplingParams:
    return SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True, **SEEDED)


REGEX = StructuredOutputs(regex="[a-z]{2,6}( [a-z]{2,6}){3}")  # every rank masks its rows; all hold the same back


def _constrained() -> SamplingParams:
    return SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, structured_outputs=REGEX)


def _tp1(folder: Path, prompts: list[list[int]]) -> dict[str, list[list[int]]]:
    """The Engine's tokens at TP = 1 with the server's pool: greedy (all prompts at once), seeded, and the first
    prompt extended (a prefix-cache hit on the server)."""
    engine = Engine(model=str(folder), dtype="float32", block_size=BLOCK, num_blocks=NUM_BLOCKS, quantization="none")
    greedy = [o.token_ids for o in engine.generate(input_ids=prompts, sampling_params=_greedy())]
    seeded = [o.token_ids for o in engine.generate(input_ids=prompts[:2], sampling_params=_seeded())]
    hit = engine.generate(input_ids=[prompts[0] + [5, 6, 7]], sampling_params=_greedy())[0].token_ids
    constrained = engine.generate(input_ids=prompts[1:2], sampling_params=_constrained())[0].token_ids
    return {"greedy": greedy, "seeded": seeded, "hit": [hit], "constrained": [constrained]}


def test_tp2_server_equals_tp1_engine(folder, tmp_path):
    prompts = random_prompts(PROMPT_LENS, seed=4)
    ref = _tp1(folder, prompts)
    server = start_server(str(folder), tmp_path / "tp2.log", "--tensor-parallel-size", "2", *FLAGS)
    try:
        with server.client(timeout=120) as c:
            rids = [c.submit(input_ids=p, max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True) for p in prompts]
            greedy = [c.result(rid).token_ids for rid in rids]
            assert c.stats().num_preemptions > 0
            seeded = [c.generate(input_ids=p, max_tokens=NEW_TOKENS, ignore_eos=True, **SEEDED) for p in prompts[:2]]
            hit = c.generate(input_ids=prompts[0] + [5, 6, 7], max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
            constrained = c.generate(
                input_ids=prompts[1], max_tokens=NEW_TOKENS, temperature=0.0, structured_outputs=REGEX
            )
    finally:
        assert server.stop() == 0
    assert greedy == ref["greedy"]
    assert [s.token_ids for s in seeded] == ref["seeded"]
    assert hit.usage.cached_tokens == (len(prompts[0]) // BLOCK) * BLOCK
    assert [hit.token_ids] == ref["hit"]
    assert [constrained.token_ids] == ref["constrained"]
    assert constrained.finish_reason == "stop" and len(constrained.text.split(" ")) == 4


BEAM = {"use_beam_search": True, "n": 3, "temperature": 0.0, "max_tokens": 10, "ignore_eos": True}
HOST = {"preemption_mode": "swap", "num_host_blocks": 64, "num_host_cache_blocks": 64}


def test_tp2_swap_host_tier_and_beam_search_equal_tp1(tiny_llama_dir, tmp_path):
    """Preemption by swap (every rank copies its heads' blocks out and back), the host tier's write-backs and
    load-backs, and beam search's forks and copies, at TP = 2 against the Engine at TP = 1."""
    prompts = random_prompts(PROMPT_LENS, seed=5)
    engine = Engine(
        model=str(tiny_llama_dir), dtype="float32", block_size=BLOCK, num_blocks=NUM_BLOCKS, quantization="none", **HOST
    )
    ref = [o.token_ids for o in engine.generate(input_ids=prompts, sampling_params=_greedy())]
    ref_beams = [
        o.token_ids for o in engine.generate(input_ids=prompts[:1], sampling_params=SamplingParams(**BEAM))[0].outputs
    ]
    fill = random_prompts([150, 150], seed=6)  # new prompts that evict prompt 0's blocks to the host tier
    ref_fill = [o.token_ids for o in engine.generate(input_ids=fill[:1], sampling_params=_greedy())]
    ref_fill += [o.token_ids for o in engine.generate(input_ids=fill[1:], sampling_params=_greedy())]
    ref_hit = engine.generate(input_ids=[prompts[0] + [5, 6, 7]], sampling_params=_greedy())[0].token_ids
    host = [f"--{k.replace('_', '-')}={v}" for k, v in HOST.items()]
    server = start_server(str(tiny_llama_dir), tmp_path / "swap.log", "--tensor-parallel-size", "2", *FLAGS, *host)
    try:
        with server.client(timeout=120) as c:
            rids = [c.submit(input_ids=p, max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True) for p in prompts]
            greedy = [c.result(rid).token_ids for rid in rids]
            beams = c.generate(input_ids=prompts[0], **BEAM)
            filled = [c.generate(input_ids=p, max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True) for p in fill]
            hit = c.generate(input_ids=prompts[0] + [5, 6, 7], max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
            stats = c.stats()
    finally:
        assert server.stop() == 0
    assert stats.num_swaps > 0 and stats.num_written_back_blocks > 0
    assert greedy == ref
    assert [ch.token_ids for ch in beams.choices] == ref_beams
    assert [f.token_ids for f in filled] == ref_fill
    assert hit.token_ids == ref_hit
    assert hit.usage.cached_tokens == 48 and hit.usage.host_cached_tokens > 0  # loaded back from the host tier


def _rank_pid(server: Server, role: str) -> int:
    for pid in descendants(server.proc.pid):
        if f'"role":"{role}"'.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
            return pid
    raise AssertionError(f"no {role} process")


def test_a_rank_killed_mid_decode_fails_the_stream_and_stops_everything(tiny_llama_dir, tmp_path):
    server = start_server(str(tiny_llama_dir), tmp_path / "kill.log", "--tensor-parallel-size", "2", *FLAGS)
    pids = descendants(server.proc.pid)
    assert len(pids) == 4  # worker (rank 0), worker-rank1, scheduler, tokenizer
    try:
        with server.client(timeout=30) as c:
            stream = c.stream(input_ids=[1, 2, 3], ignore_eos=True, temperature=0.0, max_tokens=300)
            next(stream)
            os.kill(_rank_pid(server, "worker-rank1"), signal.SIGKILL)
            with pytest.raises(ServerFailedError) as info:
                for _ in stream:
                    pass
        assert "worker" in info.value.message
        assert server.proc.wait(30) == 1
        assert wait_gone(pids) == []
    finally:
        server.stop()


def test_a_hung_rank_makes_health_unhealthy_then_fails_the_worker(tiny_llama_dir, tmp_path):
    """SIGSTOP of rank 1 mid-decode: rank 0 waits in the step's all-reduce, so /health (the scheduler's view of the
    step in flight) says the worker is unresponsive within the probe timeout; after tp_timeout_s the collective
    gives up, the worker exits, the client is told, and the launcher stops everything (the stopped rank included)."""
    flags = ("--tensor-parallel-size", "2", "--tp-timeout-s", "8", "--worker-probe-timeout-s", "1", *FLAGS)
    server = start_server(str(tiny_llama_dir), tmp_path / "hang.log", *flags)
    pids = descendants(server.proc.pid)
    try:
        with server.client(timeout=60) as c, server.client(timeout=10) as probe:
            stream = c.stream(input_ids=[1, 2, 3], ignore_eos=True, temperature=0.0, max_tokens=300)
            next(stream)
            os.kill(_rank_pid(server, "worker-rank1"), signal.SIGSTOP)
            deadline = time.monotonic() + 6
            health = probe.health()
            while "unresponsive" not in health and time.monotonic() < deadline:
                time.sleep(0.1)
                health = probe.health()
            assert "unresponsive" in health
            start = time.monotonic()
            with pytest.raises(ServerFailedError) as info:
                for _ in stream:
                    pass
            assert time.monotonic() - start < 20
        assert "worker process failed: RankLost: rank 0: " in info.value.message  # the collective that timed out
        assert server.proc.wait(30) == 1
        assert wait_gone(pids) == []
    finally:
        server.stop()


def test_two_nodes_on_one_host_serve_as_one_tp2_worker(tiny_llama_dir, tmp_path):
    """--nnodes 2: node 1's launcher starts rank 1 alone, node 0's the rest; the tokens equal TP = 1's; node 1 exits
    (status 1) once node 0 stops, its rank having lost rank 0."""
    prompt = random_prompts([45], seed=9)[0]
    engine = Engine(model=str(tiny_llama_dir), dtype="float32", block_size=BLOCK, num_blocks=NUM_BLOCKS)
    ref = engine.generate(input_ids=[prompt], sampling_params=_greedy())[0].token_ids
    nodes = ("--tensor-parallel-size", "2", "--nnodes", "2", "--master-port", str(free_port("127.0.0.1")), *FLAGS)
    cmd = [sys.executable, "-m", "runtime.launch", "--model", str(tiny_llama_dir), "--node-rank", "1"]
    with open(tmp_path / "node1.log", "w") as log:
        node1 = subprocess.Popen([*cmd, *exact_flags(nodes)], cwd=ROOT, stdout=subprocess.PIPE, stderr=log, text=True)
    try:
        server = start_server(str(tiny_llama_dir), tmp_path / "node0.log", "--node-rank", "0", *nodes)
        assert node1.stdout is not None
        assert node1.stdout.readline().strip() == "radixserve node 1: worker ranks ready"
        assert _roles(node1.pid) == ["worker-rank1"]
        with server.client(timeout=60) as c:
            assert (
                c.generate(input_ids=prompt, max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True).token_ids == ref
            )
        assert server.stop() == 0
        assert node1.wait(30) == 1
    finally:
        stop_process(node1)


def _roles(launcher_pid: int) -> list[str]:
    """The roles of a launcher's children (their ChildSpec JSON on the command line)."""
    roles = []
    for pid in descendants(launcher_pid):
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        if b"--child" in argv:
            roles.append(msgspec.json.decode(argv[argv.index(b"--child") + 1], type=ChildSpec).role)
    return sorted(roles)
