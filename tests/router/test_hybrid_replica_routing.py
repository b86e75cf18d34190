"""A hybrid replica (a tiny Gemma 3 with kv_groups auto: full-attention and sliding-window KV cache groups) behind a
router, all real processes: the replica's KV events carry the group, so the router's index learns which cached blocks
still hold their window block; once the window pool evicted the ones a conversation's next turn needs, the index cuts
that turn's prefix exactly where the replica's match cuts it (usage.cached_tokens), though group 0 still holds every
block. The snapshot lists the window group's blocks too."""

from __future__ import annotations

import time

import pytest

from radix.hashing import hash_block_tokens
from router.config import RouterArgs
from router.router import Router
from runtime.client import Client
from runtime.model.loader import load_tokenizer
from tests.router.router_cases import kv_snapshot, serve_in_thread, start
from tests.runtime.model.tiny_families import WINDOW, random_prompts, save_tiny_family

BLOCK = 8
FLAGS = [
    *("--num-blocks", "256", "--block-size", str(BLOCK), "--dtype", "float32", "--events-port", "0"),
    *("--log-interval-s", "3600", "--kv-groups", "auto", "--num-window-blocks", "20", "--chunked-prefill-size", "40"),
]


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory, smollm2_tokenizer):
    return save_tiny_family("gemma3", tmp_path_factory.mktemp("gemma3"), smollm2_tokenizer)


@pytest.fixture(scope="module")
def hybrid(gemma_dir, tmp_path_factory):
    proc = start(
        "runtime.launch",
        ["--model", str(gemma_dir), "--port", "0", *FLAGS],
        tmp_path_factory.mktemp("hybrid_logs") / "replica.log",
        "radixserve ready at ",
    )
    yield proc
    proc.stop()


@pytest.fixture
def router(hybrid, gemma_dir):
    args = RouterArgs(
        backends=[hybrid.endpoint], model=str(gemma_dir), port=0, health_interval_s=0.2, health_timeout_s=1.5
    )
    r = Router(args, load_tokenizer(str(gemma_dir)))
    with serve_in_thread(r) as served:
        yield served


def _caught_up(router, endpoint: str, seconds: float = 10.0) -> None:
    """Wait until the router's index has applied every event the replica's snapshot reflects."""
    last = kv_snapshot(endpoint).snapshot.last_seq
    deadline = time.monotonic() + seconds
    while router.replicas[0].index.last_seq < last:  # events travel on their own socket
        assert time.monotonic() < deadline, "the router's index did not catch up"
        time.sleep(0.05)


def test_the_router_cuts_a_hybrid_replicas_prefix_where_the_window_was_evicted(hybrid, router):
    first, other, more = random_prompts([97, 105, 17], seed=8)
    greedy = {"max_tokens": 24, "temperature": 0.0, "ignore_eos": True}
    index = router.replicas[0].index
    with Client(router.endpoint, timeout=120) as c:
        history = first + c.generate(input_ids=first, **greedy).token_ids  # 121 tokens: 15 full blocks computed
        hashes = hash_block_tokens(history + more, BLOCK)
        _caught_up(router, hybrid.endpoint)
        assert index.window_blocks == WINDOW // BLOCK
        assert index.tier_prefix(hashes) == (15, 0)  # every window block of turn 1 is still cached
        c.generate(input_ids=other, **greedy)  # 17 window blocks of 19 usable: turn 1's oldest 13 are evicted
        _caught_up(router, hybrid.endpoint)
        cut = index.tier_prefix(hashes)
        # group 0 holds all 15 blocks, but a hit at h needs the window blocks of [h - 4, h) and only turn 1's blocks
        # 13 and 14 kept theirs: no prefix is usable
        assert index.prefix_blocks(hashes) == 15 and cut == (0, 0)
        snapshot = kv_snapshot(hybrid.endpoint).snapshot
        assert (snapshot.sliding_window, snapshot.block_size) == (WINDOW, BLOCK)
        assert set(snapshot.window_block_hashes) == index.window_hashes
        turn2 = c.generate(input_ids=history + more, max_tokens=1, temperature=0.0)
    assert turn2.usage.cached_tokens == cut.device * BLOCK
