"""Scheduler fault cases (C3, C5, C8, C12), abort, stop strings, lpm starvation, and a seeded stress test."""

from __future__ import annotations

import random

import pytest

from runtime.scheduler.request import UnknownRequestError
from tests.runtime.scheduler.harness import EOS, Harness, reference


def test_c3_identical_requests_in_one_step_and_abort_after_first_chunk():
    h = Harness(block_size=4)
    prompt = list(range(1, 13))
    h.add("a", prompt, max_tokens=3)
    h.add("b", prompt, max_tokens=3)
    h.run()
    assert h.tokens[("a", 0)] == h.tokens[("b", 0)] == reference(prompt, 3)
    assert h.usage[("b", 0)].cached_tokens == 8  # b waited one step for a's blocks, then hit them

    h2 = Harness(block_size=4, chunked_prefill_size=4, max_prefill_tokens=4)
    free0 = h2.manager.num_free_blocks()
    h2.add("x", prompt, max_tokens=3)
    h2.step()  # first chunk of 4 tokens written
    h2.sched.abort("x")
    h2.run()
    assert h2.finish[("x", 0)] == "abort"
    assert h2.manager.num_free_blocks() + h2.manager.num_evictable_blocks() == free0
    assert h2.manager.stats().cached_blocks == 1  # only the block whose KV finished
    h2.add("y", prompt, max_tokens=2)
    h2.run()
    assert h2.usage[("y", 0)].cached_tokens == 4
    assert h2.tokens[("y", 0)] == reference(prompt, 2)
    h2.add("z", prompt, max_tokens=2)  # aborted before any forward pass
    h2.sched.abort("z")
    h2.run()
    assert h2.finish[("z", 0)] == "abort" and h2.usage[("z", 0)].completion_tokens == 0
    h2.assert_idle()


def test_abort_waiting_prefill_decode_leaves_others_untouched():
    h = Harness(  # one token a step (num_scheduler_steps 1): the aborts land at given steps
        block_size=4, chunked_prefill_size=4, max_prefill_tokens=8, max_running_requests=2, num_scheduler_steps=1
    )
    prompts = {r: [ord(r) * 10 + j for j in range(10)] for r in "abcd"}
    for r, p in prompts.items():
        h.add(r, p, max_tokens=6)
    h.step()  # a and b prefill their first chunk; c and d wait
    h.sched.abort("b")  # mid-prefill
    h.sched.abort("d")  # waiting
    for _ in range(4):
        h.step()
    h.sched.abort("a")  # mid-decode
    with pytest.raises(UnknownRequestError):
        h.sched.abort("b")
    h.run()
    assert [h.finish[(r, 0)] for r in "abcd"] == ["abort", "abort", "length", "abort"]
    assert h.tokens[("c", 0)] == reference(prompts["c"], 6)
    assert 0 < len(h.tokens[("a", 0)]) < 6
    assert h.tokens[("a", 0)] == reference(prompts["a"], len(h.tokens[("a", 0)]))
    h.assert_idle()


def test_c5_multi_turn_key_includes_reply_and_stop_caches_nothing_past_keep():
    h = Harness(num_blocks=128, block_size=4)
    prompt = [3000 + i for i in range(100)]
    h.add("t1", prompt, max_tokens=50)
    h.run()
    reply = h.tokens[("t1", 0)]
    assert reply == reference(prompt, 50)
    turn2 = prompt + reply + [4000 + i for i in range(50)]
    h.add("t2", turn2, max_tokens=1)
    h.run()
    assert h.usage[("t2", 0)].cached_tokens == 148

    h = Harness(num_blocks=128, block_size=4, num_scheduler_steps=1)  # one token a step: 30 steps, 30 tokens
    h.add("s", prompt, max_tokens=50)
    for _ in range(30):
        h.step()
    produced = len(h.tokens[("s", 0)])
    assert produced > 20
    h.sched.stop("s", keep_tokens=9)  # a stop string ended the text at output token 9
    h.run()
    assert h.finish[("s", 0)] == "stop"
    out = h.tokens[("s", 0)]
    assert h.manager.match_prefix(h.manager.block_keys(prompt + out + [1])).num_tokens <= 100 + 9
    assert h.manager.match_prefix(h.manager.block_keys(prompt + out[:9] + [1])).num_tokens == 108


def test_eos_and_stop_token_ids_and_ignore_eos():
    prompt = [1, 2, 3, 4, 5]
    ref = reference(prompt, 6)
    for stop_tok, ignore, expect_len, reason in [(ref[2], False, 3, "stop"), (None, False, 6, "length")]:
        h = Harness(block_size=4)
        h.add("r", prompt, max_tokens=6, stop_token_ids=[stop_tok] if stop_tok else [], ignore_eos=ignore)
        h.run()
        assert h.tokens[("r", 0)] == ref[:expect_len] and h.finish[("r", 0)] == reason
    h = Harness(block_size=4, eos_token_ids=[ref[1]])
    h.add("e", prompt, max_tokens=6)
    h.add("i", prompt, max_tokens=6, ignore_eos=True)
    h.run()
    assert h.tokens[("e", 0)] == ref[:2] and h.finish[("e", 0)] == "stop"
    assert h.tokens[("i", 0)] == ref and h.finish[("i", 0)] == "length"
    assert EOS not in ref  # the fake model never samples EOS (7) by itself


def test_c8_hit_rate_counts_each_request_once_and_never_recomputation():
    h = Harness(block_size=4, chunked_prefill_size=4, max_prefill_tokens=4)
    h.add("a", list(range(1, 13)), max_tokens=1)
    h.run()
    s = h.sched.stats()
    kv = h.manager.stats()
    counts = (s.prompt_tokens, s.cached_tokens, kv.prefix_queries_tokens, kv.prefix_hits_tokens)
    assert counts == (12, 0, 12, 0)
    assert [len(b.seqs[0].token_ids) for b in h.runner.steps] == [4, 4, 4]

    rng = random.Random(5)
    h = Harness(num_blocks=11, block_size=4, max_running_requests=8)
    for i in range(12):
        h.add(f"r{i}", [rng.randrange(10, 1000) for _ in range(rng.randrange(5, 14))], max_tokens=8)
    h.run()
    s = h.sched.stats()
    kv = h.manager.stats()
    assert s.num_preemptions > 0 and s.recomputed_tokens > 0
    assert s.hit_rate == 0.0 and kv.prefix_hits_tokens == 0
    prompt_tokens = sum(h.usage[(f"r{i}", 0)].prompt_tokens for i in range(12))
    assert s.prompt_tokens == kv.prefix_queries_tokens == prompt_tokens


def test_c12_cache_salt_isolates_tenants():
    h = Harness(block_size=4)
    prompt = list(range(1, 13))
    for rid, salt in [("A", "s1"), ("B", "s2"), ("C", "s1"), ("D", None)]:
        h.add(rid, prompt, max_tokens=1, salt=salt)
        h.run()
    assert [h.usage[(r, 0)].cached_tokens for r in "ABCD"] == [0, 0, 8, 0]
    assert all(h.tokens[(r, 0)] == reference(prompt, 1) for r in "ABCD")


def test_lpm_prefers_cached_prefix_but_never_starves():
    h = Harness(num_blocks=512, block_size=4, schedule_policy="lpm", max_running_requests=1)
    hot = list(range(1, 41))
    h.add("warm", hot + [999], max_tokens=1)
    h.run()
    h.add("cold", [500 + i for i in range(20)], max_tokens=2)
    admitted_cold_at = None
    for step in range(60):
        h.add(f"hot{step}", hot + [600 + step], max_tokens=2)
        h.step()
        if admitted_cold_at is None and h.runner.forward_tokens_by_seq.get(2):
            admitted_cold_at = step
    assert admitted_cold_at is not None and admitted_cold_at <= h.sched.lpm_starvation_steps + 2
    assert admitted_cold_at >= 2  # hot requests went first
    h.run()
    assert h.tokens[("cold", 0)] == reference([500 + i for i in range(20)], 2)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_stress_submit_abort_stop_step(mode):
    rng = random.Random(1234 if mode == "recompute" else 99)
    h = Harness(
        num_blocks=16,
        block_size=4,
        num_host_blocks=40 if mode == "swap" else 0,
        preemption_mode=mode,
        max_prefill_tokens=16,
        chunked_prefill_size=8,
        max_running_requests=6,
    )
    shared = [rng.randrange(10, 1000) for _ in range(12)]
    live: dict[str, tuple[list[int], int, int]] = {}
    for i in range(300):
        op = rng.random()
        if op < 0.3:
            prompt = shared[: rng.randrange(0, 13)] + [rng.randrange(10, 1000) for _ in range(rng.randrange(1, 12))]
            n = rng.choice([1, 1, 1, 2, 3])
            max_tokens = rng.randrange(1, 16)
            h.add(f"r{i}", prompt, max_tokens=max_tokens, n=n, temperature=1.0 if n > 1 else 0.0, seed=i)
            live[f"r{i}"] = (prompt, max_tokens, n)
        elif op < 0.37 and h.sched.requests:
            h.sched.abort(rng.choice(sorted(h.sched.requests)))
        elif op < 0.42 and h.sched.requests:
            rid = rng.choice(sorted(h.sched.requests))
            h.sched.stop(rid, rng.randrange(0, 4), rng.randrange(0, live[rid][2]))
        h.step()
    h.run()
    for rid, (prompt, max_tokens, n) in live.items():
        for i in range(n):
            got = h.tokens.get((rid, i), [])
            reason = h.finish[(rid, i)]
            ref = reference(prompt, max_tokens, i, 1.0 if n > 1 else 0.0)
            assert got == ref[: len(got)], rid
            if reason == "length":
                assert got == ref
    h.assert_idle()
    assert h.sched.counters.num_preemptions > 0


def test_c8_request_retried_before_admission_is_counted_once_and_metrics():
    h = Harness(num_blocks=10, block_size=4)
    h.add("big", list(range(1, 33)), max_tokens=4)  # 8 of the 9 usable blocks, 9 with its output
    h.add("late", list(range(100, 112)), max_tokens=2)  # needs 3 blocks: waits until big finishes
    h.step()
    metrics = h.request_metrics("big")
    assert metrics.prompt_tokens == 32 and metrics.cached_tokens == 0 and metrics.completion_tokens == 1
    waited = 0
    while "late" in h.sched.requests and not h.runner.forward_tokens_by_seq.get(2):
        assert h.step()
        waited += 1
    assert waited >= 3
    h.run()
    s = h.sched.stats()
    kv = h.manager.stats()
    assert (s.prompt_tokens, kv.prefix_queries_tokens, s.cached_tokens) == (44, 44, 0)
    assert (s.num_running, s.num_waiting, s.kv_usage, s.num_preemptions) == (0, 0, 0.0, 0)
    assert h.tokens[("late", 0)] == reference(list(range(100, 112)), 2)
