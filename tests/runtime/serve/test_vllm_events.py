"""KV events in vLLM's wire format (runtime/serve/vllm_events): decoded with vLLM's own classes (tests/vllm_peer.py),
they describe exactly what a KVCacheManager's radix tree stored and removed, on both tiers, through a scripted run
with eviction, write-back, load-back and a reset; the bytes are those vLLM's classes encode; the replay socket
answers as vLLM's does; the config is vLLM's."""

from __future__ import annotations

import json
import socket

import msgspec
import pytest
import zmq

from radix.events import AllBlocksCleared, BlockRemoved, BlockStored
from radix.hashing import hash_block_tokens, pack_tokens
from radix.manager import KVCacheManager
from runtime.config import InvalidConfig, ServerArgs
from runtime.serve.process import StartupError
from runtime.serve.vllm_events.config import parse_kv_events_config, rank_endpoint
from runtime.serve.vllm_events.publisher import END_SEQ, NullEventPublisher, VllmEventPublisher, make_publisher
from runtime.serve.vllm_events.wire import to_vllm_batch
from tests.radix.radix_testing import admit, finished, toks
from tests.vllm_peer import vllm_kv_events

BS = 4
TOPIC = "kv-events"


def connected_sub(ctx: zmq.Context, publisher: VllmEventPublisher) -> zmq.Socket:
    """A SUB on publisher's endpoint that is known to receive: probe messages (topic b"probe", no sequence number
    used) are sent on the PUB until one arrives, so no batch is lost to ZeroMQ's slow joiner."""
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, TOPIC.encode())
    sub.setsockopt(zmq.SUBSCRIBE, b"probe")
    sub.connect(publisher.endpoint)
    for _ in range(500):
        publisher.pub.send_multipart([b"probe"])
        if sub.poll(20):
            break
    else:
        raise AssertionError("the SUB never received a probe")
    while sub.poll(50):
        assert sub.recv_multipart() == [b"probe"]
    return sub


class Model:
    """What a vLLM consumer believes is resident, per medium: block hash -> its tokens, from the decoded batches."""

    def __init__(self, kv) -> None:
        self.kv = kv
        self.decoder = msgspec.msgpack.Decoder(kv.KVEventBatch)
        self.blocks: dict[str, dict[bytes, list[int]]] = {"GPU": {}, "CPU": {}}
        self.next_seq = 0
        self.removed: list[tuple[str, list[bytes]]] = []
        self.stored: list = []

    def receive(self, sub: zmq.Socket) -> int:
        """Applies every batch waiting on sub (in order, no gap); returns how many."""
        n = 0
        while sub.poll(200):
            topic, seq, payload = sub.recv_multipart()
            assert topic == TOPIC.encode() and int.from_bytes(seq, "big") == self.next_seq
            self.next_seq += 1
            self.apply(self.decoder.decode(payload))
            n += 1
        return n

    def apply(self, batch) -> None:
        kv = self.kv
        assert batch.data_parallel_rank == 0 and batch.ts > 0
        for e in batch.events:
            if isinstance(e, kv.BlockStored):
                assert (e.block_size, e.lora_id, e.lora_name, e.group_idx) == (BS, None, None, 0)
                assert len(e.token_ids) == BS * len(e.block_hashes)
                self.stored.append(e)
                for i, h in enumerate(e.block_hashes):
                    self.blocks[e.medium][h] = e.token_ids[i * BS : (i + 1) * BS]
            elif isinstance(e, kv.BlockRemoved):
                self.removed.append((e.medium, e.block_hashes))
                for h in e.block_hashes:
                    del self.blocks[e.medium][h]
            else:
                assert isinstance(e, kv.AllBlocksCleared)
                self.blocks = {"GPU": {}, "CPU": {}}

    def check_parents(self, parents: dict[bytes, bytes | None]) -> None:
        """Every stored block hangs under its true parent (parents: hash -> parent hash); a host-tier one is an event
        of its own (vLLM's offloading events are self-contained)."""
        for e in self.stored:
            assert e.medium == "GPU" or len(e.block_hashes) == 1
            parent = e.parent_block_hash
            for h in e.block_hashes:
                assert parent == parents[h]
                parent = h

    def check(self, m: KVCacheManager, content: dict[bytes, list[int]]) -> None:
        """The believed blocks are the tree's, tier by tier, each with its true tokens (content: hash -> tokens)."""
        snap = m.kv_snapshot()
        assert sorted(self.blocks["GPU"]) == sorted(snap.block_hashes)
        assert sorted(self.blocks["CPU"]) == sorted(snap.host_block_hashes)
        for tier in self.blocks.values():
            for h, tokens in tier.items():
                assert tokens == content[h]


def chain(tokens: list[int]) -> dict[bytes, list[int]]:
    """hash -> tokens of every full block of a prompt (radix/hashing.py's chain)."""
    hashes = hash_block_tokens(tokens, BS)
    return {h: tokens[i * BS : (i + 1) * BS] for i, h in enumerate(hashes)}


def chain_parents(tokens: list[int]) -> dict[bytes, bytes | None]:
    """hash -> parent hash of every full block of a prompt (None: the first)."""
    hashes = hash_block_tokens(tokens, BS)
    return dict(zip(hashes, [None, *hashes[:-1]], strict=True))


@pytest.fixture
def kv():
    return vllm_kv_events()


def test_the_events_describe_the_trees_blocks_on_both_tiers(ctx, kv, monkeypatch):
    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "0")  # the 16 bytes themselves: comparable with the tree
    config = parse_kv_events_config(f'{{"enable_kv_cache_events": true, "endpoint": "tcp://*:0", "topic": "{TOPIC}"}}')
    publisher = VllmEventPublisher(ctx, config, "127.0.0.1")
    assert publisher.endpoint.startswith("tcp://127.0.0.1:")  # the wildcard binds --host, not every interface
    sub = connected_sub(ctx, publisher)
    m = KVCacheManager(5, block_size=BS, num_host_cache_blocks=3, record_events=True, event_token_ids=True)
    model = Model(kv)
    content: dict[bytes, list[int]] = {}
    parents: dict[bytes, bytes | None] = {}

    def step(expected_batches: int) -> None:
        publisher.publish(m.drain_events())
        assert model.receive(sub) == expected_batches
        model.check(m, content)

    a, b, big = toks(1, 9), toks(1, 13), toks(100, 115)
    for prompt in (a, b, big):
        content.update(chain(prompt))
        parents.update(chain_parents(prompt))
    finished(m, 1, a)  # blocks [1-4], [5-8] stored
    step(1)
    h1, h2, h3 = hash_block_tokens(b, BS)
    assert model.blocks["GPU"] == {h1: toks(1, 4), h2: toks(5, 8)}
    finished(m, 2, b)  # [9-12] stored under h2
    step(1)
    assert admit(m, 3, big) == 0  # needs every device block: the three cached ones go to the host tier
    m.take_tier_copies()
    m.tier_copies_done()
    m.commit_computed(3, len(big))
    m.free(3)
    step(1)
    assert model.removed == [("GPU", [h3, h2, h1])]
    assert sorted(model.blocks["CPU"]) == sorted([h1, h2, h3])
    assert admit(m, 4, toks(1, 14)) == 12  # a hit on the host tier: loaded back (BlockStored GPU), evicting big's
    m.take_tier_copies()
    m.tier_copies_done()
    m.free(4)
    step(1)
    assert {h1, h2, h3} <= set(model.blocks["GPU"])
    assert m.tree.clear()  # AllBlocksCleared
    step(1)
    assert model.blocks == {"GPU": {}, "CPU": {}}
    model.check_parents(parents)
    assert [e.medium for e in model.stored] == ["GPU", "GPU", "CPU", "CPU", "CPU", "GPU", "GPU"]
    publisher.publish([])  # nothing changed: no batch, no sequence number used
    assert model.receive(sub) == 0 and publisher.next_seq == 5
    publisher.close()


def test_int_hashes_are_the_last_8_bytes_and_the_replay_answers_like_vllms(ctx, kv):
    config = parse_kv_events_config(
        '{"enable_kv_cache_events": true, "endpoint": "tcp://*:0", "replay_endpoint": "tcp://*:0", "buffer_steps": 2}'
    )
    publisher = VllmEventPublisher(ctx, config, "127.0.0.1")
    m = KVCacheManager(9, block_size=BS, record_events=True, event_token_ids=True)
    for i in range(3):
        finished(m, i, toks(10 * i, 10 * i + 8))
        publisher.publish(m.drain_events())
    req = ctx.socket(zmq.DEALER)
    req.connect(publisher.replay_endpoint)
    req.send_multipart([b"", (1).to_bytes(8, "big")])
    assert publisher.replay is not None and publisher.replay.poll(5000)
    publisher.serve_replay()
    decoder = msgspec.msgpack.Decoder(kv.KVEventBatch)
    replies = [req.recv_multipart() for _ in range(3)]
    assert [r[:3] for r in replies[:2]] == [[b"", b"", (1).to_bytes(8, "big")], [b"", b"", (2).to_bytes(8, "big")]]
    assert replies[2] == [b"", b"", END_SEQ, b""]  # vLLM's end marker; seq 0 fell out of the 2-batch buffer
    stored = decoder.decode(replies[1][3]).events[0]
    expected = hash_block_tokens(toks(20, 28), BS)
    assert stored.block_hashes == [int.from_bytes(h[-8:], "big") for h in expected]
    assert stored.token_ids == toks(20, 27) and stored.parent_block_hash is None and stored.medium == "GPU"
    publisher.close()


def test_the_config_is_vllms(kv):
    config = parse_kv_events_config('{"enable_kv_cache_events": true, "publisher": "zmq", "topic": "t"}')
    assert config.enabled and (config.endpoint, config.buffer_steps, config.hwm) == ("tcp://*:5557", 10_000, 100_000)
    assert not parse_kv_events_config('{"enable_kv_cache_events": true, "publisher": "null"}').enabled
    assert not parse_kv_events_config("{}").enabled
    for endpoint in ("tcp://*:5557", "tcp://*:0", "tcp://10.0.0.1:6000", "inproc://kv"):
        for rank in (0, 1, 3):
            assert rank_endpoint(endpoint, rank) == kv.ZmqEventPublisher.offset_endpoint_port(endpoint, rank)
    assert rank_endpoint("ipc:///tmp/kv", 2) == "ipc:///tmp/kv_dp2"  # vLLM refuses ipc beyond rank 0; we name one
    with pytest.raises(InvalidConfig, match="unknown field `enable_events`"):
        ServerArgs(kv_events_config='{"enable_events": true}')
    with pytest.raises(InvalidConfig, match="endpoint must be a tcp://"):
        ServerArgs(kv_events_config='{"endpoint": "udp://x:1"}')
    with pytest.raises(InvalidConfig, match="data_parallel_rank"):
        ServerArgs(data_parallel_size=2, data_parallel_rank=2)


def test_the_bytes_are_those_vllm_encodes(kv):
    h1, h2 = hash_block_tokens(toks(1, 8), BS)
    ours = [
        BlockStored(0, [h1, h2], None, BS, "device", pack_tokens(toks(1, 8)), [], ["tenant", None]),
        BlockStored(1, [h2], None, BS, "host", pack_tokens(toks(5, 8)), [h1], [None]),
        BlockRemoved(2, [h2, h1]),
        AllBlocksCleared(3),
    ]
    theirs = kv.KVEventBatch(
        ts=1.5,
        events=[
            kv.BlockStored([h1, h2], None, toks(1, 8), BS, None, "GPU", None, [("tenant",), None], group_idx=0),
            kv.BlockStored([h2], h1, toks(5, 8), BS, None, "CPU", None, [None], group_idx=0),
            kv.BlockRemoved([h2, h1], "GPU", group_idx=0),
            kv.AllBlocksCleared(),
        ],
        data_parallel_rank=3,
    )
    encode = msgspec.msgpack.encode
    assert encode(to_vllm_batch(ours, 1.5, 3, int_hashes=False)) == encode(theirs)


def test_a_salted_prompts_first_block_carries_its_salt_on_both_tiers(kv):
    m = KVCacheManager(5, block_size=BS, num_host_cache_blocks=4, record_events=True, event_token_ids=True)
    assert admit(m, 1, toks(1, 9), cache_salt="tenant-a") == 0
    m.commit_computed(1, 9)
    m.free(1)
    assert admit(m, 2, toks(100, 115)) == 0  # evicts both: written back to the host tier
    m.take_tier_copies()
    m.tier_copies_done()
    m.free(2)
    decoder = msgspec.msgpack.Decoder(kv.KVEventBatch)
    batch = decoder.decode(msgspec.msgpack.encode(to_vllm_batch(m.drain_events(), 1.0, 0, int_hashes=False)))
    events = [e for e in batch.events if isinstance(e, kv.BlockStored)]
    stored = [(e.medium, e.block_hashes, e.parent_block_hash, e.extra_keys) for e in events]
    h1, h2 = hash_block_tokens(toks(1, 8), BS, cache_salt="tenant-a")
    assert stored[0] == ("GPU", [h1, h2], None, [("tenant-a",), None])  # vLLM's shape: the salt, first block only
    assert stored[1:] == [("CPU", [h2], h1, [None]), ("CPU", [h1], None, [("tenant-a",)])]  # leaf first


def test_a_busy_endpoint_is_a_one_line_startup_error(ctx):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        config = parse_kv_events_config(json.dumps({"enable_kv_cache_events": True, "endpoint": f"tcp://*:{port}"}))
        expected = f"^cannot bind kv_events endpoint tcp://127.0.0.1:{port}: Address already in use$"
        with pytest.raises(StartupError, match=expected):
            VllmEventPublisher(ctx, config, "127.0.0.1")
    assert isinstance(make_publisher(ctx, None, "127.0.0.1", 0), NullEventPublisher)
    assert isinstance(make_publisher(ctx, '{"enable_kv_cache_events": false}', "127.0.0.1", 0), NullEventPublisher)
