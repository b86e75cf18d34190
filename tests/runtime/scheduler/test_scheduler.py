"""Scheduler against the real KVCacheManager and a fake worker that really stores "KV" in slots.

FakeRunner keeps, per slot, the (token, position) written there; a sampled token is a hash of the tokens read back
through the block table, so any wrong block table, missed copy-on-write, bad swap or premature cache entry changes
the output. `reference` is the same function on a plain token list (a cold solo run).
"""

from __future__ import annotations

import pytest

from runtime.protocol import Usage
from runtime.scheduler.request import RequestRejected
from tests.runtime.scheduler.harness import Harness, reference


def test_single_request_matches_reference():
    h = Harness()
    prompt = list(range(1, 12))
    h.add("a", prompt, max_tokens=6)
    h.run()
    assert h.tokens[("a", 0)] == reference(prompt, 6)
    assert h.finish[("a", 0)] == "length"
    assert h.usage[("a", 0)] == Usage(11, 0, 6, h.usage[("a", 0)].queue_time_s)
    h.assert_idle()


def test_usage_queue_time_from_arrival_to_first_admission():
    now = [10.0]
    h = Harness(max_running_requests=1, clock=lambda: now[0])
    h.add("a", list(range(1, 12)), max_tokens=3)
    h.add("b", list(range(20, 31)), max_tokens=3)  # both arrive at 10.0; b waits for a's slot
    now[0] = 10.5
    assert h.step()  # admits a only
    now[0] = 12.0
    h.run()
    assert h.usage[("a", 0)] == Usage(11, 0, 3, 0.5)
    assert h.usage[("b", 0)] == Usage(11, 0, 3, 2.0)
    h.assert_idle()


def test_c1_whole_prompt_cached():
    h = Harness(block_size=4)
    a = list(range(1, 9))
    h.add("A", a, max_tokens=1)
    h.run()
    h.add("B", a, max_tokens=1)
    h.run()
    assert h.usage[("B", 0)].cached_tokens == 4
    assert h.tokens[("B", 0)] == h.tokens[("A", 0)]
    h.add("C", list(range(1, 13)), max_tokens=1)
    h.run()
    assert h.usage[("C", 0)].cached_tokens == 8
    h.add("D", list(range(1, 10)), max_tokens=1)
    h.run()
    assert h.usage[("D", 0)].cached_tokens == 8
    d_seq = max(h.runner.forward_tokens_by_seq)
    assert h.runner.forward_tokens_by_seq[d_seq] == 1
    h.add("E", [1, 2, 3], max_tokens=1)
    h.run()
    assert h.usage[("E", 0)].cached_tokens == 0
    for rid, prompt in [("B", a), ("C", list(range(1, 13))), ("D", list(range(1, 10))), ("E", [1, 2, 3])]:
        assert h.tokens[(rid, 0)] == reference(prompt, 1)
    h.assert_idle()


def test_forward_tokens_equal_prompt_minus_cached():
    h = Harness(block_size=4)
    system = list(range(100, 120))
    for i in range(6):
        h.add(f"r{i}", system + [200 + i, 300 + i, 400 + i], max_tokens=5)
    h.run()
    for i, sid in enumerate(sorted(h.runner.forward_tokens_by_seq)):
        u = h.usage[(f"r{i}", 0)]
        assert h.runner.forward_tokens_by_seq[sid] == u.prompt_tokens - u.cached_tokens + u.completion_tokens - 1
        assert h.tokens[(f"r{i}", 0)] == reference(system + [200 + i, 300 + i, 400 + i], 5)
    assert [h.usage[(f"r{i}", 0)].cached_tokens for i in range(6)] == [0, 20, 20, 20, 20, 20]


def test_shared_uncached_prefix_is_computed_once():
    """32 requests arriving together with one 512-token system prompt: ~512 + 32 x suffix prefill tokens."""
    h = Harness(num_blocks=2048, block_size=16, max_prefill_tokens=4096, chunked_prefill_size=512)
    system = [1000 + i for i in range(512)]
    for i in range(32):
        h.add(f"q{i}", system + [5000 + 64 * i + j for j in range(64)], max_tokens=2)
    h.run()
    assert h.sched.counters.prefill_tokens_computed == 512 + 32 * 64
    assert [h.usage[(f"q{i}", 0)].cached_tokens for i in range(32)] == [0] + [512] * 31
    assert h.sched.stats().hit_rate == pytest.approx(31 * 512 / (32 * 576))


def test_chunked_prefill_splits_long_prompt_and_budget():
    h = Harness(block_size=4, max_prefill_tokens=8, chunked_prefill_size=4)
    prompt = list(range(1, 13))
    h.add("a", prompt, max_tokens=2)
    h.add("b", list(range(50, 55)), max_tokens=2)
    h.step()
    first = h.runner.steps[0]
    assert [(s.seq_id, s.start_pos, len(s.token_ids)) for s in first.seqs] == [(1, 0, 4), (2, 0, 4)]
    h.run()
    assert h.tokens[("a", 0)] == reference(prompt, 2)
    assert h.tokens[("b", 0)] == reference(list(range(50, 55)), 2)


def test_parallel_sampling_forks_after_one_prefill():
    h = Harness(block_size=4)
    prompt = list(range(1, 11))  # 10 tokens: prompt[:-1] ends inside block 2, which the 4 children share
    free0 = h.manager.num_free_blocks()
    h.add("p", prompt, max_tokens=3, n=4, temperature=1.0, seed=3)
    h.run()
    parent = min(h.runner.forward_tokens_by_seq)
    assert h.runner.forward_tokens_by_seq[parent] == 9
    children = sorted(h.runner.forward_tokens_by_seq)[1:]
    assert [h.runner.forward_tokens_by_seq[c] for c in children] == [3, 3, 3, 3]  # last prompt token + 2 decodes
    assert h.runner.num_copies == 3  # the last child writes the shared block in place
    for i in range(4):
        assert h.tokens[("p", i)] == reference(prompt, 3, i, 1.0)
        assert h.finish[("p", i)] == "length"
    assert len({tuple(h.tokens[("p", i)]) for i in range(4)}) == 4
    assert h.manager.num_free_blocks() + h.manager.num_evictable_blocks() == free0
    h.assert_idle()


def test_stats_block_counts_have_one_meaning_each():
    """num_cached_blocks: every block in the tree; num_evictable_blocks: those no sequence references."""
    h = Harness(num_blocks=32, block_size=4)
    prompt = list(range(1, 14))
    h.add("a", prompt, max_tokens=1)
    h.run()
    h.add("b", prompt, max_tokens=3)
    h.step()  # b holds the 3 cached prompt blocks and a private one
    s = h.sched.stats()
    kv = h.manager.stats()
    assert (s.num_cached_blocks, s.num_evictable_blocks, s.num_used_blocks) == (kv.cached_blocks, 0, 4) == (3, 0, 4)
    assert s.num_free_blocks + s.num_evictable_blocks + s.num_used_blocks == s.num_blocks - 1 == 31
    assert (s.num_running, s.num_waiting, s.num_swapped, s.kv_usage) == (1, 0, 0, 4 / 31)
    h.run()
    s = h.sched.stats()
    assert (s.num_cached_blocks, s.num_evictable_blocks, s.num_used_blocks) == (3, 3, 0)
    # steps: a's prefill; b's prefill, then one multi-step decode of 2 tokens (num_scheduler_steps 4, capped by
    # max_tokens)
    assert (s.prompt_tokens, s.cached_tokens, s.generated_tokens, s.num_steps) == (26, 12, 4, 3)
    assert s.forward_tokens == sum(h.runner.forward_tokens_by_seq.values()) and s.tokens_per_s == 0.0


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_memory_pressure_preempts_and_outputs_are_unchanged(mode):
    h = Harness(num_blocks=13, block_size=4, num_host_blocks=64 if mode == "swap" else 0, preemption_mode=mode)
    prompts = [[i * 50 + j for j in range(1, 10)] for i in range(1, 7)]
    for i, p in enumerate(prompts):
        h.add(f"r{i}", p, max_tokens=10)
    h.run()
    assert h.sched.counters.num_preemptions > 0
    if mode == "swap":
        assert h.sched.counters.num_swaps > 0
    # the served ServerStats carries the same counters (so a user can see that swap mode swapped)
    from runtime.serve.scheduler_process import SchedulerServer

    served = SchedulerServer(h.sched, None, None, None, 5.0).server_stats()
    assert (served.num_preemptions, served.num_swaps, served.recomputed_tokens) == (
        h.sched.counters.num_preemptions,
        h.sched.counters.num_swaps,
        h.sched.counters.recomputed_tokens,
    )
    assert (served.num_swaps > 0) == (mode == "swap") and (served.recomputed_tokens > 0) == (mode == "recompute")
    for i, p in enumerate(prompts):
        assert h.tokens[(f"r{i}", 0)] == reference(p, 10)
        assert h.finish[(f"r{i}", 0)] == "length"
    h.assert_idle()


def test_c7_prompt_that_never_fits_is_rejected_and_others_run():
    h = Harness(num_blocks=10, block_size=4, max_model_len=64)
    with pytest.raises(RequestRejected, match="9"):
        h.add("big", list(range(1, 46)))
    h.add("small", [1, 2, 3, 4], max_tokens=2)
    h.run()
    assert h.tokens[("small", 0)] == reference([1, 2, 3, 4], 2)
    with pytest.raises(RequestRejected):
        h.add("37", list(range(100, 137)))
    with pytest.raises(RequestRejected, match="max_tokens may be at most 1"):  # the pool, not max_tokens, would end it
        h.add("36", list(range(100, 136)), max_tokens=20)
    h.add("36", list(range(100, 136)), max_tokens=100)  # past max_model_len: "until the context"
    h.run()
    assert h.finish[("36", 0)] == "length"
    assert h.tokens[("36", 0)] == reference(list(range(100, 136)), 1)  # the 37th token has no block left
    with pytest.raises(RequestRejected, match="max_model_len"):
        h.add("ctx", list(range(1, 65)))
    h.assert_idle()


def test_scheduler_and_tokenizer_modules_do_not_import_torch():
    import subprocess
    import sys

    code = "import sys, runtime.scheduler.scheduler, runtime.text; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
