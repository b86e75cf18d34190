"""The scheduler with a host tier (radix/host_tier.py), against the FakeRunner of test_scheduler.py, which really
moves "KV" between its device and host stores: a wrong write-back, a load read too early or into the wrong block
changes the sampled tokens. Multi-turn conversations on a tiny device pool load earlier turns back; a request waits
one step for its loads; an abort while loads are pending returns every block of both tiers."""

from __future__ import annotations

from tests.runtime.scheduler.harness import Harness, reference

BS = 4


def conversation_turns(h: Harness, convs: int, turns: int, user: int = 6, max_tokens: int = 4) -> dict[str, list]:
    """Runs the turns one request at a time, conversations round robin (each turn's prompt = the previous prompt +
    its output + a new user message). Returns rid -> [prompt, output, usage]."""
    history = {c: [] for c in range(convs)}
    out = {}
    for t in range(turns):
        for c in range(convs):
            prompt = history[c] + [100 * (c + 1) + 10 * t + i for i in range(user)]
            rid = f"c{c}t{t}"
            h.add(rid, prompt, max_tokens=max_tokens, ignore_eos=True)
            h.run()
            out[rid] = [prompt, h.tokens[(rid, 0)], h.usage[(rid, 0)]]
            history[c] = prompt + h.tokens[(rid, 0)]
    h.assert_idle()
    return out


def test_multi_turn_on_a_tiny_pool_with_a_host_tier_hits_like_an_unlimited_pool():
    unlimited = Harness(num_blocks=256, block_size=BS)
    device_only = Harness(num_blocks=11, block_size=BS)  # 10 usable blocks: about one conversation
    tiered = Harness(num_blocks=11, block_size=BS, num_host_cache_blocks=64)
    runs = {
        name: conversation_turns(h, convs=3, turns=3)
        for name, h in (("unlimited", unlimited), ("device_only", device_only), ("tiered", tiered))
    }
    for name, run in runs.items():
        for rid, (prompt, output, _usage) in run.items():
            assert output == reference(prompt, 4), (name, rid)
    cached = {name: [u.cached_tokens for _p, _o, u in run.values()] for name, run in runs.items()}
    assert cached["tiered"] == cached["unlimited"]
    assert sum(cached["device_only"]) < sum(cached["unlimited"]) // 2
    late = [u.host_cached_tokens for rid, (_p, _o, u) in runs["tiered"].items() if not rid.endswith("t0")]
    assert all(n > 0 for n in late[-3:]), late  # by the last round every turn loads its history back
    assert all(u.host_cached_tokens == 0 for _p, _o, u in runs["unlimited"].values())
    stats = {name: h.sched.stats() for name, h in (("unlimited", unlimited), ("tiered", tiered))}
    assert stats["tiered"].prefill_tokens_computed == stats["unlimited"].prefill_tokens_computed
    assert stats["tiered"].host_cached_tokens == sum(late) > 0
    assert stats["tiered"].num_loaded_back_blocks == sum(late) // BS
    assert stats["tiered"].num_written_back_blocks >= stats["tiered"].num_loaded_back_blocks
    assert stats["tiered"].num_host_cache_used_blocks == 0  # nothing pinned once idle


def _two_turns_on_host(h: Harness) -> list[int]:
    """c0's first turn computed, then pushed to the host tier by another request; returns c0's next prompt."""
    prompt = list(range(200, 214))  # 14 tokens
    h.add("c0t0", prompt, max_tokens=4, ignore_eos=True)
    h.run()
    h.add("other", list(range(300, 336)), max_tokens=2, ignore_eos=True)  # 38 tokens: needs every device block
    h.run()
    assert h.manager.stats().host_cached_blocks == 4  # the 4 full blocks of c0t0's 18 tokens
    return prompt + h.tokens[("c0t0", 0)] + [7, 8, 9]


def test_a_request_waits_one_step_for_its_loads():
    h = Harness(num_blocks=11, block_size=BS, num_host_cache_blocks=16)
    prompt = _two_turns_on_host(h)
    h.add("c0t1", prompt, max_tokens=3, ignore_eos=True)
    first = h.sched.schedule()
    assert first is not None and first.seqs == [] and len(first.swap_in) == 4  # only the loads run this step
    h.collect(h.sched.process_result(h.runner.execute(first)))
    second = h.sched.schedule()
    assert second is not None and [(s.start_pos, len(s.token_ids)) for s in second.seqs] == [(16, 5)]
    assert second.swap_in == []
    h.collect(h.sched.process_result(h.runner.execute(second)))
    h.run()
    assert h.tokens[("c0t1", 0)] == reference(prompt, 3)
    assert (h.usage[("c0t1", 0)].cached_tokens, h.usage[("c0t1", 0)].host_cached_tokens) == (16, 16)
    h.assert_idle()


def test_abort_while_loads_are_pending_returns_every_block_of_both_tiers():
    h = Harness(num_blocks=11, block_size=BS, num_host_cache_blocks=16)
    prompt = _two_turns_on_host(h)
    h.add("c0t1", prompt, max_tokens=3, ignore_eos=True)
    batch = h.sched.schedule()
    assert batch is not None and len(batch.swap_in) == 4
    h.sched.abort("c0t1")  # while its loads are in flight
    h.manager.check_invariants()
    pinned = len(batch.swap_in) + len(batch.swap_out)  # its loads, and the write-backs of what it evicted
    assert h.manager.stats().host_cache_in_use_blocks == pinned == 9  # still pinned by the copies in flight
    h.collect(h.sched.process_result(h.runner.execute(batch)))
    assert h.finish[("c0t1", 0)] == "abort"
    h.run()
    h.assert_idle()
    kv = h.manager.stats()
    assert (kv.host_cache_in_use_blocks, kv.host_cache_free_blocks + kv.host_cache_evictable_blocks) == (0, 16)
    h.add("again", prompt, max_tokens=3, ignore_eos=True)  # the loaded blocks are on the device now
    h.run()
    assert h.tokens[("again", 0)] == reference(prompt, 3)
    assert (h.usage[("again", 0)].cached_tokens, h.usage[("again", 0)].host_cached_tokens) == (16, 0)
    h.assert_idle()


def test_parallel_samples_fork_after_their_prompt_is_loaded_back():
    h = Harness(num_blocks=11, block_size=BS, num_host_cache_blocks=16)
    prompt = _two_turns_on_host(h)[:17]  # prompt[:-1] is the 4 blocks on the host: the parent only loads them
    h.add("n2", prompt, max_tokens=3, ignore_eos=True, n=2, temperature=1.0, seed=5)
    h.run()
    for i in range(2):
        assert h.tokens[("n2", i)] == reference(prompt, 3, sample_index=i, temperature=1.0)
    assert h.usage[("n2", 0)].host_cached_tokens == 16
    h.assert_idle()


def test_a_host_tier_full_of_pinned_blocks_never_stalls_admission():
    """A one-block tier, many conversations at once: write-backs find no host block and drop instead, loads pin it."""
    h = Harness(num_blocks=13, block_size=BS, num_host_cache_blocks=1)
    history = {c: [] for c in range(4)}
    for t in range(3):
        for c in range(4):
            h.add(f"c{c}t{t}", history[c] + [50 * (c + 1) + t] * 5, max_tokens=3, ignore_eos=True)
        h.run()
        for c in range(4):
            prompt = history[c] + [50 * (c + 1) + t] * 5
            assert h.tokens[(f"c{c}t{t}", 0)] == reference(prompt, 3)
            history[c] = prompt + h.tokens[(f"c{c}t{t}", 0)]
    h.assert_idle()
    assert h.manager.stats().written_back_blocks > 0
