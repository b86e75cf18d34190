"""The host tier end to end in the Engine on the tiny random Llama, float32: greedy outputs of a multi-turn
conversation on a tiny device pool with a host tier equal, token for token, those of an unlimited pool (and their
logprobs, bit for bit: the same prefix hits mean the same computation, so wrong loaded KV would show), while later
turns load earlier turns back from the host tier; the tier's size comes from ServerArgs (blocks or bytes)."""

from __future__ import annotations

import pytest
import torch

from runtime.engine import Engine
from runtime.model.kv_cache import kv_block_bytes
from runtime.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=2)


def chat(engine: Engine, convs: int = 3, turns: int = 3) -> list[tuple[list, int, int]]:
    """Turns one request at a time, conversations round robin (each prompt: the history so far + 6 new tokens).
    Returns ([(token id, TokenLogprobs)], cached_tokens, host_cached_tokens) per request, in order."""
    history: dict[int, list[int]] = {c: [] for c in range(convs)}
    out = []
    for t in range(turns):
        for c in range(convs):
            prompt = history[c] + [1000 + 97 * c + 13 * t + i for i in range(6)]
            res = engine.generate(input_ids=[prompt], sampling_params=GREEDY)[0]
            logprobs = res.outputs[0].logprobs
            assert logprobs is not None
            out.append(
                (list(zip(res.token_ids, logprobs, strict=True)), res.usage.cached_tokens, res.usage.host_cached_tokens)
            )
            history[c] = prompt + res.token_ids
    return out


@pytest.fixture(scope="module")
def make(tiny_llama_dir):
    def build(**kw) -> Engine:
        return Engine(model=str(tiny_llama_dir), dtype="float32", block_size=4, **kw)

    return build


@pytest.mark.slow
def test_a_tiny_pool_with_a_host_tier_gives_the_unlimited_pools_outputs(make):
    unlimited = chat(make(num_blocks=256))
    engine = make(num_blocks=12, num_host_cache_blocks=64)  # 11 usable device blocks (44 tokens) for 3 chats
    tiered = chat(engine)
    assert [(o, c) for o, c, _h in tiered] == [(o, c) for o, c, _h in unlimited]  # token for token, same hits
    assert all(h == 0 for _o, _c, h in unlimited)
    assert all(h > 0 for _o, _c, h in tiered[-3:]), tiered  # the last turns load their history back
    stats = engine.stats()
    assert stats.host_cached_tokens == sum(h for _o, _c, h in tiered) == 4 * stats.num_loaded_back_blocks > 0
    assert stats.num_host_cache_used_blocks == 0 and stats.num_used_blocks == 0  # nothing pinned or held once idle
    device_only = chat(make(num_blocks=12))
    assert sum(c for _o, c, _h in device_only) < sum(c for _o, c, _h in unlimited) // 2  # the pool is pressured


@pytest.mark.slow
def test_host_tier_size_from_bytes_or_blocks(make):
    per_block = kv_block_bytes(2, 4, 2, 16, torch.float32)  # the tiny Llama: 2 layers, 2 KV heads of 16
    engine = make(num_blocks=12, num_host_blocks=3, host_cache_memory=10 * per_block + per_block // 2)
    assert engine.runner.ready.num_host_cache_blocks == 10 and engine.manager.stats().host_cache_total_blocks == 10
    assert tuple(engine.runner.host_k_cache.shape[:2]) == (2, 3 + 10)  # the swap pool first, then the tier
    blocks = make(num_blocks=12, host_cache_memory=10 * per_block, num_host_cache_blocks=5)
    assert blocks.runner.ready.num_host_cache_blocks == 5  # the block count overrides the bytes
    off = make(num_blocks=12, num_host_cache_blocks=5, enable_prefix_caching=False)
    assert off.runner.ready.num_host_cache_blocks == 0  # no prefix cache, no tier
