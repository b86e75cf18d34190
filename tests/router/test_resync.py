"""A lost KV event: the router (in a thread of this process, real replicas) drops one event message, finds the gap at
the next event, resynchronises from the replica's snapshot, and routes the conversation to its replica again."""

from __future__ import annotations

import time

import pytest

from radix.hashing import hash_block_tokens
from router.config import RouterArgs
from router.router import Router
from runtime.client import Client
from runtime.model.loader import load_tokenizer
from runtime.text.prompt import apply_chat_template
from tests.router.router_cases import conversation, kv_snapshot, prompt_tokens, serve_in_thread, served_by

SYSTEM = "You answer questions about trains in one short sentence, politely and without any guessing."
USERS = ["When does the first train to the coast leave?", "Is there a dining car on that train?"]


class DroppingRouter(Router):
    """Drops the first KV event that arrives after `armed` is set (a message lost on the wire)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.armed = False
        self.dropped: list[tuple[int, int]] = []  # (replica position, seq)

    def on_events(self, replica, events, now) -> None:
        if self.armed and events:
            self.armed = False
            self.dropped.append((replica.position, events[0].seq))
            events = events[1:]
        super().on_events(replica, events, now)


@pytest.fixture
def router(replicas, tiny_llama_dir):
    args = RouterArgs(
        backends=[r.endpoint for r in replicas],
        model=str(tiny_llama_dir),
        port=0,
        health_interval_s=0.2,
        health_timeout_s=1.5,
    )
    r = DroppingRouter(args, load_tokenizer(str(tiny_llama_dir)))
    with serve_in_thread(r) as served:
        yield served


def _settle(router: Router, seconds: float = 0.5) -> None:
    time.sleep(seconds)  # events travel on their own socket; give them time to arrive


def test_event_gap_resyncs_from_snapshot(replicas, router, smollm2_tokenizer):
    salt = "resync"
    router.armed = True
    cached1, served1, _ = conversation(router.endpoint, SYSTEM, USERS[:1], salt, replicas)
    _settle(router)
    ((position, seq),) = router.dropped
    assert position == served1[0]
    home = router.replicas[position]
    turn1 = apply_chat_template(
        smollm2_tokenizer, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USERS[0]}]
    )
    hashes = hash_block_tokens(turn1, 16, salt)
    assert home.index.prefix_blocks(hashes) == 0  # the lost event held this conversation's blocks
    assert router.stats.resyncs == 0

    with Client(replicas[position].endpoint) as direct:  # any later event of that replica reveals the gap
        direct.generate(prompt="An unrelated request " * 12, max_tokens=2, temperature=0.0, cache_salt="other")
    _settle(router)
    assert router.stats.resyncs == 1
    snapshot = kv_snapshot(replicas[position].endpoint).snapshot
    assert home.index.hashes == set(snapshot.block_hashes)
    assert home.index.last_seq == snapshot.last_seq > seq
    assert home.index.prefix_blocks(hashes) == len(turn1) // 16

    cached, served, _ = conversation(router.endpoint, SYSTEM, USERS, salt, replicas)
    assert served == [position, position]  # routing is right again
    assert cached[0] == (len(turn1) - 1) // 16 * 16  # turn 1 again: its whole cached prefix
    assert cached1 == [0]


def test_prompt_tokens_helper_counts_each_replica(replicas):
    before = prompt_tokens(replicas)
    with Client(replicas[1].endpoint) as c:
        out = c.generate(input_ids=[7, 8, 9], max_tokens=1, temperature=0.0)
    assert served_by(replicas, before) == 1 and out.usage.prompt_tokens == 3
