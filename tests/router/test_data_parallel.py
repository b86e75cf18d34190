"""`radixserve --data-parallel-size 2`: one command, one endpoint (ZeroMQ and HTTP) in front of two replicas behind
the cache-aware router; a repeated prompt hits the cache of the replica that computed it (and only that replica's
vLLM-format KV events, on its own rank's endpoint, name its blocks); stats and /metrics are the two replicas' sums;
Ctrl-C stops every process it started."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import msgspec
import zmq
from prometheus_client.parser import text_string_to_metric_families

from radix.hashing import hash_block_tokens
from runtime.client import Client
from tests.e2e.processes import descendants, stop_process
from tests.paths import ROOT
from tests.router.router_cases import ROUTER_FLAGS
from tests.vllm_peer import vllm_kv_events

NUM_BLOCKS = 64
FLAGS = ["--num-blocks", str(NUM_BLOCKS), "--block-size", "16", "--dtype", "float32", "--log-interval-s", "3600"]
PROMPT = list(range(1000, 1040))  # 40 tokens: 2 full blocks (32 tokens) cached after the first request
REPLAY = f"ipc://@radixserve-test-dp-replay-{os.getpid()}"  # rank 1's: REPLAY + "_dp1" (runtime/serve/vllm_events)
KV_EVENTS = {"enable_kv_cache_events": True, "endpoint": REPLAY + "-pub", "replay_endpoint": REPLAY}


def start_data_parallel(model: Path, log: Path) -> tuple[subprocess.Popen, str, str]:
    """`python -m runtime.launch --data-parallel-size 2 --http-port 0`: (process, ZeroMQ endpoint, HTTP URL) once
    its ready line is out."""
    cmd = [sys.executable, "-m", "runtime.launch", "--model", str(model), "--port", "0", "--http-port", "0"]
    cmd += ["--data-parallel-size", "2", "--served-model-name", "m", "--log-level", "WARNING", *FLAGS, *ROUTER_FLAGS]
    cmd += ["--kv-events-config", json.dumps(KV_EVENTS)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "RADIXSERVE_LOG_LEVEL": "WARNING"}
    env["VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES"] = "0"
    with open(log, "w") as err:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=err, text=True, env=env)
    assert proc.stdout is not None
    url = ""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.startswith("radixserve http ready at "):
            url = line.split()[-1]
        if line.startswith("radixserve ready at "):
            return proc, line.split()[-1], url
        if not line and proc.poll() is not None:
            break
    proc.kill()
    raise RuntimeError(f"the data-parallel server did not start; log:\n{log.read_text()[-4000:]}")


def stored_by_rank(endpoint: str) -> tuple[set[int], list[bytes]]:
    """(the data_parallel_rank of every batch, the hashes of every BlockStored) a replica's replay socket returns."""
    kv = vllm_kv_events()
    decoder = msgspec.msgpack.Decoder(kv.KVEventBatch)
    ctx = zmq.Context()
    try:
        req = ctx.socket(zmq.DEALER)
        req.connect(endpoint)
        req.send_multipart([b"", (0).to_bytes(8, "big")])
        ranks, stored = set(), []
        while True:
            assert req.poll(10_000), "no replay answer"
            _empty, _topic, seq, payload = req.recv_multipart()
            if seq == (-1).to_bytes(8, "big", signed=True):
                return ranks, stored
            batch = decoder.decode(payload)
            ranks.add(batch.data_parallel_rank)
            stored += [h for e in batch.events if isinstance(e, kv.BlockStored) for h in e.block_hashes]
    finally:
        ctx.destroy(linger=0)


def test_data_parallel_serves_through_one_endpoint(tiny_llama_dir, tmp_path):
    proc, endpoint, url = start_data_parallel(tiny_llama_dir, tmp_path / "dp.log")
    try:
        started = descendants(proc.pid)
        assert len(started) == 8  # the router, the HTTP server, and each replica's worker, scheduler and tokenizer
        with Client(endpoint, timeout=60) as c:
            outs = [c.generate(input_ids=PROMPT, max_tokens=4, temperature=0.0, ignore_eos=True) for _ in range(4)]
            stats = c.stats()
        assert [o.usage.cached_tokens for o in outs] == [0, 32, 32, 32]  # every repeat on the replica holding it
        assert len({o.text for o in outs}) == 1
        assert stats.num_blocks == 2 * NUM_BLOCKS  # both replicas' stats, merged by the router
        assert (stats.prompt_tokens, stats.cached_tokens, stats.generated_tokens) == (160, 96, 16)
        with urllib.request.urlopen(f"{url}/metrics", timeout=30) as resp:
            families = text_string_to_metric_families(resp.read().decode())
        samples = {s.name: s.value for f in families for s in f.samples if not s.name.endswith("_bucket")}
        assert samples["radixserve:prompt_tokens_total"] == 160.0  # the HTTP server's /metrics: the merged stats
        assert samples["radixserve:prefix_cache_hits_total"] == 96.0
        replays = [stored_by_rank(REPLAY), stored_by_rank(REPLAY + "_dp1")]
        served = 0 if replays[0][1] else 1
        assert replays[served] == ({served}, hash_block_tokens(PROMPT, 16))  # the prompt's blocks, once, its rank
        assert replays[1 - served] == (set(), [])  # the other replica stored nothing
    finally:
        assert stop_process(proc, timeout=60) == 0
    deadline = time.monotonic() + 10
    while any(Path(f"/proc/{pid}").exists() for pid in started) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [pid for pid in started if Path(f"/proc/{pid}").exists()] == []  # no orphan left
