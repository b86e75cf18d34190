"""A replica with a host tier behind a router, all real processes: the replica's KV events carry the tier (medium),
so the router's index learns which of a conversation's blocks a small device pool wrote back to the host; the next
turn loads them back (usage.host_cached_tokens) and the snapshot lists both tiers."""

from __future__ import annotations

import random
import time

import pytest

from radix.hashing import hash_block_tokens
from router.config import RouterArgs
from router.router import Router
from runtime.client import Client
from runtime.model.loader import load_tokenizer
from tests.router.router_cases import REPLICA_FLAGS, kv_snapshot, serve_in_thread, start

SMALL_POOL = ["--num-blocks", "24", "--num-host-cache-blocks", "64"]  # 23 usable blocks of 16: 368 tokens


@pytest.fixture(scope="module")
def tiered(tiny_llama_dir, tmp_path_factory):
    flags = REPLICA_FLAGS[2:] + SMALL_POOL  # REPLICA_FLAGS without its --num-blocks 512
    assert REPLICA_FLAGS[:2] == ["--num-blocks", "512"]
    proc = start(
        "runtime.launch",
        ["--model", str(tiny_llama_dir), "--port", "0", *flags],
        tmp_path_factory.mktemp("tier_logs") / "replica.log",
        "radixserve ready at ",
    )
    yield proc
    proc.stop()


@pytest.fixture
def router(tiered, tiny_llama_dir):
    args = RouterArgs(
        backends=[tiered.endpoint], model=str(tiny_llama_dir), port=0, health_interval_s=0.2, health_timeout_s=1.5
    )
    r = Router(args, load_tokenizer(str(tiny_llama_dir)))
    with serve_in_thread(r) as served:
        yield served


def _wait(condition, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():  # events travel on their own socket
        assert time.monotonic() < deadline, "the router's index did not catch up"
        time.sleep(0.05)


def test_router_index_learns_the_host_tier_and_the_next_turn_loads_back(tiered, router):
    rng = random.Random(15)
    first = [rng.randrange(100, 40000) for _ in range(200)]
    other = [rng.randrange(100, 40000) for _ in range(300)]
    greedy = {"max_tokens": 4, "temperature": 0.0, "ignore_eos": True}
    index = router.replicas[0].index
    with Client(router.endpoint, timeout=60) as c:
        turn1 = c.generate(input_ids=first, **greedy)
        history = first + turn1.token_ids
        hashes = hash_block_tokens(history, 16)  # 204 tokens: 12 full blocks, all computed
        _wait(lambda: index.tier_prefix(hashes) == (12, 0))
        c.generate(input_ids=other, **greedy)  # 19 blocks: evicts the deepest 8 of turn 1's 12, written back
        _wait(lambda: index.tier_prefix(hashes) == (4, 8))
        snapshot = kv_snapshot(tiered.endpoint).snapshot
        assert set(hashes[4:12]) <= set(snapshot.host_block_hashes) and not set(hashes[4:12]) & set(
            snapshot.block_hashes
        )
        turn2 = c.generate(input_ids=history + [rng.randrange(100, 40000) for _ in range(20)], **greedy)
        assert (turn2.usage.cached_tokens, turn2.usage.host_cached_tokens) == (192, 128)
        stats = c.stats()
    assert stats.num_loaded_back_blocks == 8 and stats.host_cached_tokens == 128
    assert stats.num_host_cache_blocks == 64 and stats.num_host_cache_used_blocks == 0
    _wait(lambda: index.tier_prefix(hashes)[0] == 12)  # loaded back: on the device again (and still on the host)
