"""What `--kv-events-config` costs the scheduler: vLLM-format KV events beside radixserve's own, per step.

A step that commits a chain of `blocks` new full blocks (block_size 16) drains one BlockStored; radixserve publishes
it in its own format (radix/events.py: msgspec msgpack, 16-byte hashes, no tokens) and, with --kv-events-config, in
vLLM's (runtime/serve/vllm_events: the hashes as 64-bit ints, the blocks' token ids, an EventBatch around it).
Reported per chain length: bytes of each message, and the median microseconds to turn the drained event into the
frames and send them on a PUB socket with one subscriber (ipc). Separately, the cost inside the radix tree of keeping
the tokens in the events (`KVCacheManager(event_token_ids=True)`): microseconds per request of a admit / commit /
free cycle of a `blocks`-block prompt with the tokens kept and without.

    .venv/bin/python -m benchmarks.kv_events_wire            # -> results/kv_events_wire.json
    .venv/bin/python -m benchmarks.kv_events_wire --smoke    # seconds; writes nothing unless --out is given
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import msgspec
import zmq

from benchmarks.cli import apply_preset, run_mode, write_result
from radix.manager import KVCacheManager
from runtime.model.cpu_features import machine_facts
from runtime.serve.vllm_events.config import parse_kv_events_config
from runtime.serve.vllm_events.publisher import VllmEventPublisher

BLOCK_SIZE = 16
RESULTS = Path(__file__).parent / "results" / "kv_events_wire.json"
SMOKE = {"chains": [1, 12], "repeats": 20}


def drained_chain(blocks: int, event_token_ids: bool, first_token: int = 20_000) -> tuple[KVCacheManager, list]:
    """A manager after one request of blocks * BLOCK_SIZE + 1 tokens was computed and freed, and the events it
    drained (one BlockStored of `blocks` blocks). Token ids from 20000 up: 3 bytes each in msgpack, as most of a
    real vocabulary's."""
    m = KVCacheManager(blocks + 3, BLOCK_SIZE, record_events=True, event_token_ids=event_token_ids)
    tokens = list(range(first_token, first_token + blocks * BLOCK_SIZE + 1))
    cycle(m, 1, tokens)
    return m, m.drain_events()


def cycle(m: KVCacheManager, seq_id: int, tokens: list[int]) -> None:
    """What the scheduler does for one request: match, admit (blocks for every token), commit every token, free."""
    match = m.match_prefix(m.block_keys(tokens))
    assert m.add_sequence(seq_id, match) is not None
    m.commit_computed(seq_id, len(tokens))
    m.free(seq_id)


def median_us(fn, repeats: int) -> float:
    """Median wall time of fn() over `repeats` calls, microseconds."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return round(statistics.median(times) * 1e6, 2)


def wire_row(ctx: zmq.Context, blocks: int, repeats: int) -> dict:
    """One chain length: each format's bytes and its encode-and-send time."""
    _m, events = drained_chain(blocks, event_token_ids=True)
    name = f"ipc://@radixserve-bench-kv-{os.getpid()}-{blocks}"
    config = parse_kv_events_config(json.dumps({"enable_kv_cache_events": True, "endpoint": name}))
    publisher = VllmEventPublisher(ctx, config, "127.0.0.1")
    own = ctx.socket(zmq.PUB)
    own.bind(name + "-own")
    subs = []
    for endpoint in (publisher.endpoint, name + "-own"):
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(endpoint)
        subs.append(sub)
    encoder = msgspec.msgpack.Encoder()
    _plain, plain_events = drained_chain(blocks, event_token_ids=False)

    def send_own() -> None:
        for event in plain_events:
            own.send_multipart([b"kv", encoder.encode(event)])

    row = {
        "blocks": blocks,
        "own_bytes": sum(len(encoder.encode(e)) for e in plain_events),
        "own_us": median_us(send_own, repeats),
        "vllm_us": median_us(lambda: publisher.publish(events), repeats),
        "vllm_bytes": len(publisher.buffer[-1][1]),
    }
    publisher.close()
    for sock in (own, *subs):
        sock.close(linger=0)
    return row


def request_us(blocks: int, event_token_ids: bool, repeats: int) -> float:
    """Median microseconds of one request's cycle (a new prompt each time: its blocks are stored, the oldest
    evicted) with its events drained."""
    m = KVCacheManager(blocks + 3, BLOCK_SIZE, record_events=True, event_token_ids=event_token_ids)
    prompts = iter(range(1_000_000))

    def one() -> None:
        start = next(prompts) * 100_000
        cycle(m, 1, list(range(start, start + blocks * BLOCK_SIZE + 1)))
        m.drain_events()

    return median_us(one, repeats)


def manager_row(blocks: int, repeats: int) -> dict:
    """A request's admit / commit / free cycle with and without the tokens kept in the events."""
    return {
        "blocks": blocks,
        "us_per_request_without_tokens": request_us(blocks, False, repeats),
        "us_per_request_with_tokens": request_us(blocks, True, repeats),
    }


def main(argv: list[str] | None = None) -> dict:
    """Runs the measurements; returns (and unless --smoke, writes) the JSON result."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chains", type=int, nargs="+", default=[1, 12, 64], help="blocks per stored chain")
    parser.add_argument("--repeats", type=int, default=2000)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--out", type=Path)
    ns = parser.parse_args(argv)
    if ns.smoke:
        apply_preset(parser, ns, SMOKE)
    ctx = zmq.Context()
    try:
        wire = [wire_row(ctx, blocks, ns.repeats) for blocks in ns.chains]
    finally:
        ctx.destroy(linger=0)
    result = {
        "benchmark": "kv_events_wire",
        "mode": run_mode(ns.smoke, False),
        "block_size": BLOCK_SIZE,
        "machine": machine_facts(),
        "wire": wire,
        "manager": [manager_row(blocks, ns.repeats) for blocks in ns.chains],
    }
    write_result(result, ns.out, ns.smoke, RESULTS)
    print(json.dumps({"wire": result["wire"], "manager": result["manager"]}, indent=2))
    return result


if __name__ == "__main__":
    main()
