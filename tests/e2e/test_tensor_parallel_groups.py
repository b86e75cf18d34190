"""Tensor parallelism with KV cache groups (issue 25): a real server with --tensor-parallel-size 2 (two gloo worker
ranks) and --kv-groups auto on the tiny random Gemma 3 (local and global layers, window 32; one KV head a rank) gives
the same tokens as the in-process Engine at TP = 1 with groups (and without: the all-full path), in float32: long
prompts prefilled in chunks across the window, decodes past it, a window pool small enough to preempt (by swap, both
groups), and a chat's turn 2 hitting turn 1's prompt and answer; every rank's window pool has the same block ids (the
server's counters equal the Engine's), and every block of both groups comes back. With n-gram speculation on the
loopy tiny Gemma 3 (tests/runtime/hybrid_helpers.py) the TP = 2 server's tokens equal the TP = 1 Engine's plain
decoding."""

from __future__ import annotations

import pytest

from runtime.engine import Engine
from runtime.sampling_params import SamplingParams
from tests.e2e.servers import start_server, wait_until_idle
from tests.runtime.hybrid_helpers import save_loopy_gemma3
from tests.runtime.model.tiny_families import random_prompts, save_tiny_family
from tests.runtime.spec_helpers import NGRAM, PROMPTS

pytestmark = pytest.mark.slow

BLOCK = 8
NEW_TOKENS = 40  # decodes past the 32-token window
PROMPT_LENS = [203, 229, 251]
# 18 window blocks: too few for the three sequences' windows and chunks, so sequences are preempted by swap (every
# rank copies its heads' blocks of both groups out and back) however the three submissions land between the server's
# steps: the Engine swaps 17-20 times for every arrival up to 5 steps apart (with 20 blocks, none when the third came
# one step after the first two, which made the server's count depend on timing)
GROUPS = {"kv_groups": "auto", "num_window_blocks": 18, "preemption_mode": "swap", "num_host_blocks": 64}
POOL = {"dtype": "float32", "block_size": BLOCK, "num_blocks": 256, "chunked_prefill_size": 40, "quantization": "none"}


def _greedy(n: int = NEW_TOKENS) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def _flags(**kw) -> list[str]:
    return [f"--{k.replace('_', '-')}={v}" for k, v in kw.items()]


def test_tp2_with_window_groups_equals_tp1(tmp_path, smollm2_tokenizer):
    folder = save_tiny_family("gemma3", tmp_path / "gemma3", smollm2_tokenizer)
    prompts = random_prompts(PROMPT_LENS, seed=4)
    engine = Engine(model=str(folder), **POOL, **GROUPS)
    ref = [o.token_ids for o in engine.generate(input_ids=prompts, sampling_params=_greedy())]
    full = Engine(model=str(folder), **POOL, kv_groups="single")
    assert ref == [o.token_ids for o in full.generate(input_ids=prompts, sampling_params=_greedy())]
    chat = random_prompts([PROMPT_LENS[0]], seed=5)[0]  # a chat alone after the swaps: its turn 2 hits turn 1's KV
    ref_turn1 = engine.generate(input_ids=[chat], sampling_params=_greedy())[0].token_ids
    turn2 = chat + ref_turn1 + prompts[1][:37]
    ref_turn2 = engine.generate(input_ids=[turn2], sampling_params=_greedy(8))[0]
    ref_stats = engine.stats()
    server = start_server(str(folder), tmp_path / "tp2.log", "--tensor-parallel-size", "2", *_flags(**POOL, **GROUPS))
    try:
        with server.client(timeout=180) as c:
            rids = [c.submit(input_ids=p, max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True) for p in prompts]
            greedy = [c.result(rid).token_ids for rid in rids]
            turn1 = c.generate(input_ids=chat, max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
            more = c.generate(input_ids=turn2, max_tokens=8, temperature=0.0, ignore_eos=True)
            stats = wait_until_idle(c)
    finally:
        assert server.stop() == 0
    assert greedy == ref
    assert turn1.token_ids == ref_turn1
    assert more.token_ids == ref_turn2.token_ids
    assert more.usage.cached_tokens == ref_turn2.usage.cached_tokens == (len(chat) + NEW_TOKENS - 1) // 8 * 8
    assert ref_stats.num_swaps > 0 and stats.num_swaps > 0
    assert stats.num_window_blocks == ref_stats.num_window_blocks == 18
    assert stats.num_window_used_blocks == stats.num_used_blocks == 0
    assert stats.num_window_cached_blocks > 0


def test_tp2_with_window_groups_and_speculation_equals_tp1_plain_decoding(tmp_path, smollm2_tokenizer):
    """n-gram speculation at TP = 2 with groups: every rank cuts both of its tables alike at each rollback."""
    folder = save_loopy_gemma3(tmp_path / "loopy", smollm2_tokenizer)
    pool = {"dtype": "float32", "block_size": 4, "num_blocks": 128, "num_window_blocks": 40, "quantization": "none"}
    engine = Engine(model=str(folder), chunked_prefill_size=16, kv_groups="auto", **pool)
    ref = [o.token_ids for o in engine.generate(input_ids=PROMPTS, sampling_params=_greedy(48))]
    flags = _flags(**pool, chunked_prefill_size=16, kv_groups="auto", speculative_config=NGRAM)
    server = start_server(str(folder), tmp_path / "spec.log", "--tensor-parallel-size", "2", *flags)
    try:
        with server.client(timeout=180) as c:
            rids = [c.submit(input_ids=p, max_tokens=48, temperature=0.0, ignore_eos=True) for p in PROMPTS]
            greedy = [c.result(rid).token_ids for rid in rids]
            stats = wait_until_idle(c)
    finally:
        assert server.stop() == 0
    assert greedy == ref
    assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens
    assert stats.num_window_used_blocks == stats.num_used_blocks == 0
