"""The host tier with KV cache groups (kv_groups "auto", num_host_cache_blocks) on the tiny random Gemma 3 and
Mistral models, window 32, blocks of 8: three conversations through a device pool that holds two, so group 0 writes
blocks back to the host tier and group 1 evicts window blocks on its own; each conversation's turn 2 hits its turn 1's
prompt and answer (group 0's blocks loaded back, the window before the hit still resident in group 1), and every
token equals the all-full path's, without a host tier, exactly."""

from __future__ import annotations

import pytest

from radix.hybrid_manager import HybridKVCacheManager
from runtime.engine import Engine
from tests.runtime.engine_helpers import assert_idle, greedy, record_batches
from tests.runtime.model.tiny_families import random_prompts, save_tiny_family

BLOCK = 8
ANSWER = 24


@pytest.fixture(scope="module", params=["gemma3", "mistral"])
def tiny_folder(request, tmp_path_factory, smollm2_tokenizer):
    return save_tiny_family(request.param, tmp_path_factory.mktemp(request.param), smollm2_tokenizer)


def _engine(folder, kv_groups: str, **kw) -> Engine:
    return Engine(
        model=str(folder), dtype="float32", block_size=BLOCK, chunked_prefill_size=40, kv_groups=kv_groups, **kw
    )


def _chats(engine: Engine, prompts: list[list[int]], message: list[int]) -> list[tuple[list[int], int]]:
    """Turn 1 of each conversation, one after another, then each turn 2: (tokens, cached_tokens) per turn."""
    firsts = [engine.generate(input_ids=[p], sampling_params=greedy(ANSWER))[0] for p in prompts]
    seconds = [
        engine.generate(input_ids=[p + o.token_ids + message], sampling_params=greedy(8))[0]
        for p, o in zip(prompts, firsts, strict=True)
    ]
    return [(o.token_ids, o.usage.cached_tokens) for o in firsts + seconds]


@pytest.mark.slow
def test_host_tier_hits_with_eviction_in_both_groups_equal_the_all_full_path(tiny_folder):
    *prompts, message = random_prompts([97, 105, 89, 17], seed=3)
    ref = _chats(_engine(tiny_folder, "single", num_blocks=256), prompts, message)
    # 39 usable device blocks of 8 (a conversation takes 16): the third evicts the first's blocks to the host tier;
    # 39 usable window blocks: each conversation caches one per full block, so group 1 evicts the oldest
    engine = _engine(tiny_folder, "auto", num_blocks=40, num_window_blocks=40, num_host_cache_blocks=64)
    record_batches(engine)  # the manager's invariants after every step
    outs = _chats(engine, prompts, message)
    assert [t for t, _ in outs] == [t for t, _ in ref]
    # turn 2 hits what turn 1 computed: its prompt and all but the last answer token, in whole blocks
    assert [c for _, c in outs[3:]] == [(len(p) + ANSWER - 1) // BLOCK * BLOCK for p in prompts]
    stats = engine.stats()
    assert stats.num_written_back_blocks > 0 and stats.num_loaded_back_blocks > 0 and stats.host_cached_tokens > 0
    assert stats.num_window_evicted_blocks > 0
    manager = engine.manager
    assert isinstance(manager, HybridKVCacheManager)
    assert_idle(engine)
    manager.check_invariants()
    assert manager.window_stats().in_use_blocks == 0
