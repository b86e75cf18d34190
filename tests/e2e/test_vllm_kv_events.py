"""A real server with --kv-events-config publishes its KV events in vLLM's wire format: decoded with vLLM's own
classes (tests/vllm_peer.py), a scripted run of requests with eviction leaves a consumer believing exactly the blocks
the server's radix tree holds (its KV snapshot), each with its true tokens; live PUB messages and the replay agree."""

from __future__ import annotations

import json
import os
import time

import msgspec
import zmq

from radix.hashing import hash_packed_block, pack_tokens
from tests.e2e.servers import start_server
from tests.router.router_cases import kv_snapshot
from tests.vllm_peer import vllm_kv_events

BS = 16
TOPIC = "kv-events"
# 11 usable blocks of 16 tokens: six 40-token prompts (3 blocks each while they run) evict the first ones
FLAGS = ["--num-blocks", "12", "--block-size", str(BS), "--dtype", "float32", "--log-interval-s", "3600"]


def prompts() -> list[list[int]]:
    """Six distinct 40-token prompts, then the last one again (a hit) and the first one again (recomputed)."""
    distinct = [[1000 + 50 * i + j for j in range(40)] for i in range(6)]
    return [*distinct, distinct[5], distinct[0]]


def replay(ctx: zmq.Context, endpoint: str) -> list[list[bytes]]:
    """Every batch the server buffered, from sequence number 0, through vLLM's replay protocol."""
    req = ctx.socket(zmq.DEALER)
    req.connect(endpoint)
    req.send_multipart([b"", (0).to_bytes(8, "big")])
    out = []
    while True:
        assert req.poll(10_000), "no replay answer"
        frames = req.recv_multipart()  # b"", topic, seq, payload
        if frames[2] == (-1).to_bytes(8, "big", signed=True):
            return out
        out.append(frames[1:])


def test_vllm_format_events_describe_the_tree(tiny_llama_dir, tmp_path):
    kv = vllm_kv_events()
    name = f"radixserve-test-vllm-events-{os.getpid()}"
    config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"ipc://@{name}",
        "replay_endpoint": f"ipc://@{name}-replay",
        "topic": TOPIC,
    }
    env = {"VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES": "0"}  # our 16-byte hashes: comparable with the KV snapshot
    server = start_server(
        str(tiny_llama_dir), tmp_path / "server.log", *FLAGS, "--kv-events-config", json.dumps(config), env=env
    )
    ctx = zmq.Context()
    try:
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, TOPIC.encode())
        sub.connect(config["endpoint"])
        time.sleep(0.5)  # the SUB's subscription reaches the PUB before the first event (no request ran yet)
        with server.client() as c:
            cached = [
                c.generate(input_ids=p, max_tokens=4, temperature=0.0, ignore_eos=True).usage.cached_tokens
                for p in prompts()
            ]
        assert cached[:6] == [0] * 6 and cached[6] == 32 and cached[7] == 0  # the first prompt was evicted
        snapshot = kv_snapshot(server.endpoint).snapshot
        batches = replay(ctx, config["replay_endpoint"])
        live = []
        while sub.poll(500):
            live.append(sub.recv_multipart())
    finally:
        server.stop()
        ctx.destroy(linger=0)
    assert live == batches  # every batch went out live too, in order, the same bytes
    assert [int.from_bytes(seq, "big") for _topic, seq, _payload in batches] == list(range(len(batches)))

    decoder = msgspec.msgpack.Decoder(kv.KVEventBatch)
    gpu: dict[bytes, list[int]] = {}
    removed = []
    for _topic, _seq, payload in batches:
        batch = decoder.decode(payload)
        assert batch.data_parallel_rank == 0
        for e in batch.events:
            if isinstance(e, kv.BlockStored):
                assert e.medium == "GPU" and e.block_size == BS and len(e.token_ids) == BS * len(e.block_hashes)
                parent = e.parent_block_hash
                for i, h in enumerate(e.block_hashes):
                    tokens = e.token_ids[i * BS : (i + 1) * BS]
                    assert hash_packed_block(parent, pack_tokens(tokens)) == h  # the hash is of exactly these tokens
                    gpu[h] = tokens
                    parent = h
            else:
                assert isinstance(e, kv.BlockRemoved) and e.medium == "GPU"
                removed.extend(e.block_hashes)
                for h in e.block_hashes:
                    del gpu[h]
    assert sorted(gpu) == sorted(snapshot.block_hashes)  # the consumer's view is the tree's, block for block
    first = prompts()[0]
    first_chain = [hash_packed_block(None, pack_tokens(first[:BS]))]
    first_chain.append(hash_packed_block(first_chain[0], pack_tokens(first[BS : 2 * BS])))
    assert set(first_chain) <= set(removed)  # the first prompt's blocks were evicted, and said so
    assert all(gpu[h] == first[i * BS : (i + 1) * BS] for i, h in enumerate(first_chain))  # and stored again
