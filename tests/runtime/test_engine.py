"""Engine-level prefix-cache cases C1-C8 and C12 on a tiny random Llama (exact cached_tokens, exact forward counts).

Every output is compared with a cold solo run of the same prompt on a fresh engine (the "reference"), so a cache hit
that served wrong KV, a bad copy-on-write or a lost swap shows up as a different greedy token.
"""

from __future__ import annotations

import pytest

from runtime.engine import Engine
from runtime.protocol import ForwardBatch
from runtime.sampling_params import SamplingParams
from runtime.scheduler.request import RequestRejected
from tests.runtime.engine_helpers import assert_idle, greedy, record_batches
from tests.runtime.forward_counts import forward_tokens_by_seq

GREEDY = SamplingParams(max_tokens=4, temperature=0.0)


@pytest.fixture(scope="module")
def make_engine(tiny_llama_dir):
    def make(**kw) -> Engine:
        kw.setdefault("num_blocks", 128)
        kw.setdefault("block_size", 4)
        kw.setdefault("dtype", "float32")  # outputs are compared token for token with the cold reference
        return Engine(model=str(tiny_llama_dir), **kw)

    return make


@pytest.fixture(scope="module")
def cold(make_engine):
    """Greedy tokens of a cold solo run: cold(prompt, n) on a fresh engine with prefix caching off."""
    engine = make_engine(enable_prefix_caching=False)
    memo: dict[tuple, list[int]] = {}

    def run(prompt: list[int], n: int) -> list[int]:
        key = (tuple(prompt), n)
        if key not in memo:
            memo[key] = engine.generate(input_ids=[prompt], sampling_params=greedy(n))[0].token_ids
        return memo[key]

    return run


def test_c1_c2_whole_prompt_cached(make_engine, cold):
    engine = make_engine()
    batches = record_batches(engine)
    free0 = engine.manager.num_free_blocks()
    a = list(range(1, 9))
    out_a = engine.generate(input_ids=[a], sampling_params=greedy(1))[0]
    out_b = engine.generate(input_ids=[a], sampling_params=greedy(1))[0]
    assert (out_a.usage.cached_tokens, out_b.usage.cached_tokens) == (0, 4)
    assert out_b.token_ids == out_a.token_ids == cold(a, 1)
    # C2: B recomputed its last block into a fresh block; the duplicate went back, nothing leaked
    assert engine.manager.stats().cached_blocks == 2
    assert engine.manager.num_free_blocks() + engine.manager.num_evictable_blocks() == free0
    c = engine.add_request(input_ids=list(range(1, 13)), sampling_params=greedy(1))
    d = engine.add_request(input_ids=list(range(1, 10)), sampling_params=greedy(1))
    e = engine.add_request(input_ids=[1, 2, 3], sampling_params=greedy(1))
    seqs = {r: engine.scheduler.requests[r].seqs[0].seq_id for r in (c, d, e)}
    while engine.scheduler.has_unfinished():
        engine.step()
    outs = {r: engine.result(r) for r in (c, d, e)}
    assert [outs[r].usage.cached_tokens for r in (c, d, e)] == [8, 8, 0]
    assert [forward_tokens_by_seq(batches)[seqs[r]] for r in (c, d, e)] == [4, 1, 3]
    assert outs[d].token_ids == cold(list(range(1, 10)), 1)
    assert outs[c].token_ids == cold(list(range(1, 13)), 1)
    assert_idle(engine)


@pytest.mark.slow
def test_c3_same_step_duplicates_and_abort_after_first_chunk(make_engine, cold):
    engine = make_engine(chunked_prefill_size=4, max_prefill_tokens=8)
    prompt = list(range(20, 32))
    outs = engine.generate(input_ids=[prompt, prompt], sampling_params=greedy(3))
    assert outs[0].token_ids == outs[1].token_ids == cold(prompt, 3)
    assert [o.usage.cached_tokens for o in outs] == [0, 8]

    engine = make_engine(chunked_prefill_size=4, max_prefill_tokens=4)
    free0 = engine.manager.num_free_blocks()
    rid = engine.add_request(input_ids=prompt, sampling_params=greedy(3))
    engine.step()  # first chunk (4 tokens) written
    assert engine.abort(rid).finish_reason == "abort"
    assert engine.manager.num_free_blocks() + engine.manager.num_evictable_blocks() == free0
    waiting = engine.add_request(input_ids=prompt, sampling_params=greedy(3))
    engine.abort(waiting)  # before any forward pass
    out = engine.generate(input_ids=[prompt], sampling_params=greedy(2))[0]
    assert out.usage.cached_tokens == 4 and out.token_ids == cold(prompt, 2)
    assert_idle(engine)


def test_c4_eviction_then_recompute(make_engine, cold):
    engine = make_engine(num_blocks=5)  # 4 usable blocks of 4 tokens
    a = list(range(1, 9))
    assert engine.generate(input_ids=[a], sampling_params=greedy(1))[0].token_ids == cold(a, 1)
    assert engine.manager.stats().cached_blocks == 2
    b = list(range(40, 56))
    out_b = engine.generate(input_ids=[b], sampling_params=greedy(1))[0]
    assert out_b.finish_reason == "length" and out_b.token_ids == cold(b, 1)  # 16 tokens fill the pool
    out_c = engine.generate(input_ids=[a], sampling_params=greedy(2))[0]
    assert out_c.usage.cached_tokens == 0 and out_c.token_ids == cold(a, 2)
    assert_idle(engine)


@pytest.mark.slow
def test_c5_multi_turn_cache_includes_reply_and_stop_string_keeps_cache_short(make_engine, cold, smollm2_tokenizer):
    engine = make_engine(num_blocks=96)
    prompt = [1000 + 7 * i for i in range(100)]
    reply = engine.generate(input_ids=[prompt], sampling_params=greedy(50))[0].token_ids
    turn2 = prompt + reply + [2000 + i for i in range(50)]
    out = engine.generate(input_ids=[turn2], sampling_params=greedy(1))[0]
    assert out.usage.cached_tokens == 148

    engine = make_engine(num_blocks=96)
    short = prompt[:20]
    full = engine.generate(input_ids=[short], sampling_params=greedy(12))[0]
    engine.manager.tree.clear()
    text = smollm2_tokenizer.decode(full.token_ids[6:9])
    stopped = engine.generate(input_ids=[short], sampling_params=greedy(12, stop=[text]))[0]
    assert stopped.finish_reason == "stop" and text not in stopped.text
    k = len(stopped.token_ids)
    assert k <= 7 and stopped.token_ids == full.token_ids[:k]
    assert engine.manager.match_prefix(engine.manager.block_keys(short + full.token_ids + [1])).num_tokens <= 20 + k
    assert_idle(engine)


def test_c6_prefix_of_a_cached_sequence(make_engine, cold):
    engine = make_engine()
    batches = record_batches(engine)
    a = list(range(300, 316))
    gen = engine.generate(input_ids=[a], sampling_params=greedy(8))[0].token_ids
    engine.generate(input_ids=[a + gen], sampling_params=greedy(1))  # 24 tokens cached
    b = a[:10]
    rid = engine.add_request(input_ids=b, sampling_params=greedy(3))
    seq_id = engine.scheduler.requests[rid].seqs[0].seq_id
    while engine.scheduler.has_unfinished():
        engine.step()
    out = engine.result(rid)
    assert out.usage.cached_tokens == 8 and forward_tokens_by_seq(batches)[seq_id] == 2 + 2
    assert out.token_ids == cold(b, 3)


def test_c7_prompt_beyond_the_pool_is_rejected_and_others_run(make_engine, cold):
    engine = make_engine(num_blocks=10, max_model_len=64)
    with pytest.raises(RequestRejected):
        engine.add_request(input_ids=list(range(1, 46)), sampling_params=greedy(2))
    assert engine.generate(input_ids=[[1, 2, 3, 4]], sampling_params=greedy(2))[0].token_ids == cold([1, 2, 3, 4], 2)
    with pytest.raises(RequestRejected):
        engine.generate(input_ids=[list(range(100, 137))])
    with pytest.raises(RequestRejected, match="max_tokens may be at most 1"):
        engine.generate(input_ids=[list(range(100, 136))], sampling_params=greedy(20))
    out = engine.generate(input_ids=[list(range(100, 136))], sampling_params=greedy(30))[0]  # past max_model_len
    assert out.finish_reason == "length" and len(out.token_ids) == 1
    long = engine.generate(input_ids=[list(range(1, 9))], sampling_params=greedy(60))[0]
    assert long.finish_reason == "length" and len(long.token_ids) == 29  # 36 slots - 8 prompt + 1 sampled last
    assert_idle(engine)


@pytest.mark.slow
def test_c8_hit_rate_and_chunks(make_engine):
    engine = make_engine(chunked_prefill_size=4, max_prefill_tokens=4)
    batches = record_batches(engine)
    engine.generate(input_ids=[list(range(1, 13))], sampling_params=greedy(1))
    assert [len(b.seqs[0].token_ids) for b in batches] == [4, 4, 4]
    s, kv = engine.stats(), engine.manager.stats()
    assert (s.hit_rate, kv.prefix_hits_tokens, kv.prefix_queries_tokens) == (0.0, 0, 12)

    engine = make_engine(num_blocks=12, max_running_requests=6)
    prompts = [[500 + 37 * i + 3 * j for j in range(9 + i % 4)] for i in range(8)]
    engine.generate(input_ids=prompts, sampling_params=greedy(8))
    s, kv = engine.stats(), engine.manager.stats()
    assert s.num_preemptions > 0 and s.recomputed_tokens > 0
    assert s.hit_rate == 0.0 and s.prompt_tokens == kv.prefix_queries_tokens == sum(map(len, prompts))


def test_c12_cache_salt(make_engine):
    engine = make_engine()
    prompt = list(range(1, 13))
    cached = [
        engine.generate(input_ids=[prompt], sampling_params=greedy(1), cache_salt=salt)[0].usage.cached_tokens
        for salt in ("s1", "s2", "s1", None)
    ]
    assert cached == [0, 0, 8, 0]


def test_token_ids_outside_the_vocabulary_are_rejected_and_the_engine_keeps_serving(make_engine, cold):
    engine = make_engine()
    vocab = engine.runner.ready.vocab_size
    for bad in ([1, vocab], [1, -5], [10**6]):
        with pytest.raises(RequestRejected, match="outside the vocabulary") as info:
            engine.generate(input_ids=[bad], sampling_params=GREEDY)
        assert info.value.code == "invalid_request"
    stats = engine.stats()
    assert (stats.num_running, stats.num_waiting, stats.num_used_blocks) == (0, 0, 0)
    assert engine.generate(input_ids=[[5, 6, 7]], sampling_params=greedy(3))[0].token_ids == cold([5, 6, 7], 3)


def test_a_call_with_one_prompt_that_can_never_run_queues_none_of_its_prompts(make_engine, cold):
    engine = make_engine(num_blocks=10, max_model_len=64)  # 9 usable blocks of 4 tokens: 36 slots
    with pytest.raises(RequestRejected) as info:
        engine.generate(input_ids=[[1, 2, 3], [4, 5, 6], list(range(100, 140))], sampling_params=greedy(2))
    assert info.value.code == "context_length_exceeded"
    assert str(info.value) == "prompt 2: prompt of 40 tokens needs 10 KV blocks; the pool has 9"
    assert not engine.scheduler.requests and not engine.scheduler.has_unfinished()
    assert engine.step() == []  # the withdrawn prompts left no output behind
    assert_idle(engine)
    assert engine.generate(input_ids=[[4, 5, 6]], sampling_params=greedy(2))[0].token_ids == cold([4, 5, 6], 2)


def test_a_failed_forward_step_aborts_its_requests_and_returns_their_blocks(make_engine, cold):
    from runtime.engine import EngineError

    engine = make_engine()
    execute = engine.runner.execute

    def fail_once(batch: ForwardBatch):
        engine.runner.execute = execute
        raise RuntimeError("injected worker failure")

    engine.runner.execute = fail_once
    with pytest.raises(EngineError, match="injected worker failure"):
        engine.generate(input_ids=[list(range(1, 10))], sampling_params=greedy(3))
    stats = engine.stats()
    assert (stats.num_running, stats.num_waiting, stats.num_used_blocks) == (0, 0, 0)
    assert stats.num_free_blocks + stats.num_evictable_blocks == stats.num_blocks - 1
    engine.manager.check_invariants()
    assert engine.generate(input_ids=[list(range(1, 10))], sampling_params=greedy(3))[0].token_ids == cold(
        list(range(1, 10)), 3
    )
