"""A repeated prompt on a tiny KV pool gets the same completion length as the first time (issue 12: with 5 usable
blocks of 16 tokens, the 2nd and 3rd runs of a 32-token prompt stopped "length" at 17 of 20 tokens).

Cause: the cache hit stops one block short of the prompt (its last token is computed again), so the request writes a
second copy of its last prompt block and of every output block the first run cached; each such copy used to make the
idle resident block a "shadow" the request also held, so one request held 5 blocks for 4 blocks of tokens. The tree
now adopts the request's copy of an idle duplicate and frees its own (radix/tree.py insert_chain).
"""

from __future__ import annotations

from runtime.protocol import Usage
from tests.runtime.scheduler.harness import Harness, reference

BS = 16


def _run(h: Harness, rid: str, prompt: list[int], max_tokens: int) -> tuple[list[int], str, Usage]:
    h.add(rid, prompt, max_tokens=max_tokens, ignore_eos=True)
    h.run()
    h.assert_idle()
    u = h.usage[(rid, 0)]  # queue_time_s is wall-clock: compared separately
    assert u.queue_time_s is not None and u.queue_time_s >= 0.0
    return h.tokens[(rid, 0)], h.finish[(rid, 0)], Usage(u.prompt_tokens, u.cached_tokens, u.completion_tokens)


def _blocks(h: Harness) -> tuple[int, int, int]:
    s = h.manager.stats()
    return s.free_blocks, s.evictable_blocks, s.cached_blocks


def test_a_repeated_prompt_gets_every_token_on_a_tiny_pool():
    h = Harness(num_blocks=6, block_size=BS)  # 5 usable blocks: 80 tokens
    prompt = [41] * 32  # 32 + 20 = 52 tokens: 4 blocks
    want = reference(prompt, 20)
    for i, cached in enumerate((0, 16, 16)):
        assert _run(h, f"r{i}", prompt, 20) == (want, "length", Usage(32, cached, 20))
        # cached: the 2 prompt blocks and the first output block (tokens 32-47); the partial block 48-51 is free
        assert _blocks(h) == (2, 3, 3)
    assert h.runner.num_copies == 0


def test_a_prompt_that_fills_the_pool_gets_as_many_tokens_on_a_cache_hit():
    h = Harness(num_blocks=6, block_size=BS)
    prompt = [43] * 64  # 4 blocks: 16 more positions fit, so 17 tokens (the 17th needs no KV slot)
    want = reference(prompt, 17)
    assert _run(h, "cold", prompt, 17) == (want, "length", Usage(64, 0, 17))
    assert _blocks(h) == (0, 5, 5)
    assert _run(h, "hit", prompt, 17) == (want, "length", Usage(64, 48, 17))  # was 1 token: 5 blocks held for 4
    assert _blocks(h) == (0, 5, 5)
