"""Engine serving behavior on a tiny random Llama: real cache hits (worker forward counts), n > 1 with copy-on-write,
memory pressure with both preemption modes, aborts at every stage, streaming and text / chat inputs."""

from __future__ import annotations

import pytest

from runtime.engine import Engine
from runtime.sampling_params import SamplingParams
from tests.runtime.engine_helpers import assert_idle, greedy, record_batches
from tests.runtime.forward_counts import forward_tokens_by_seq

SYSTEM = [3000 + 11 * i for i in range(24)]
PROMPTS = [SYSTEM + [100 + 13 * i + j for j in range(3 + i)] for i in range(6)]


@pytest.fixture(scope="module")
def make_engine(tiny_llama_dir):
    def make(**kw) -> Engine:
        kw.setdefault("num_blocks", 128)
        kw.setdefault("block_size", 4)
        kw.setdefault("dtype", "float32")  # outputs are compared token for token with the unpressured run
        return Engine(model=str(tiny_llama_dir), **kw)

    return make


@pytest.fixture(scope="module")
def unpressured(make_engine):
    """Greedy outputs of PROMPTS on a roomy engine with caching off (12 tokens each)."""
    engine = make_engine(enable_prefix_caching=False, num_blocks=256)
    return [o.token_ids for o in engine.generate(input_ids=PROMPTS, sampling_params=greedy(12))]


@pytest.mark.slow
def test_forward_tokens_equal_prompt_minus_cached(make_engine, unpressured):
    engine = make_engine()
    batches = record_batches(engine)
    rids = [engine.add_request(input_ids=p, sampling_params=greedy(12)) for p in PROMPTS]
    seq_of = {r: engine.scheduler.requests[r].seqs[0].seq_id for r in rids}
    while engine.scheduler.has_unfinished():
        engine.step()
    outs = [engine.result(r) for r in rids]
    assert [o.usage.cached_tokens for o in outs] == [0, 24, 24, 24, 24, 24]
    for r, o in zip(rids, outs, strict=True):
        u = o.usage
        # every prompt token not served from the cache ran through the model once; each decode feeds one token
        assert forward_tokens_by_seq(batches)[seq_of[r]] == u.prompt_tokens - u.cached_tokens + 12 - 1
    assert [o.token_ids for o in outs] == unpressured
    assert_idle(engine)


@pytest.mark.slow
def test_parallel_samples_share_one_prefill_and_copy_on_write(make_engine):
    engine = make_engine()
    batches = record_batches(engine)
    free0 = engine.manager.num_free_blocks()
    prompt = list(range(1, 15))  # 14 tokens: prompt[:-1] ends inside block 3, shared by the 4 children
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=7, n=4, ignore_eos=True)
    out = engine.generate(input_ids=[prompt], sampling_params=params)[0]
    prefill = [s for b in batches for s in b.seqs if len(s.token_ids) > 1]
    assert [len(s.token_ids) for s in prefill] == [13]  # the prompt is prefilled once
    assert sum(len(b.copies) for b in batches) == 3  # the last child writes the shared block in place
    assert [o.index for o in out.outputs] == [0, 1, 2, 3]
    assert all(len(o.token_ids) == 6 and o.finish_reason == "length" for o in out.outputs)
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1
    assert out.usage.completion_tokens == 24 and out.usage.prompt_tokens == 14
    again = engine.generate(input_ids=[prompt], sampling_params=params)[0]
    assert [o.token_ids for o in again.outputs] == [o.token_ids for o in out.outputs]  # seeded: reproducible
    assert engine.manager.num_free_blocks() + engine.manager.num_evictable_blocks() == free0
    assert_idle(engine)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_memory_pressure_every_request_completes_unchanged(make_engine, unpressured, mode):
    engine = make_engine(num_blocks=20, preemption_mode=mode, num_host_blocks=64 if mode == "swap" else 0)
    record_batches(engine)
    outs = engine.generate(input_ids=PROMPTS, sampling_params=greedy(12))
    s = engine.stats()
    assert s.num_preemptions > 0 and (mode == "recompute" or s.num_swaps > 0)
    assert s.num_evictable_blocks + s.num_free_blocks == s.num_blocks - 1
    assert [o.token_ids for o in outs] == unpressured
    assert all(o.finish_reason == "length" for o in outs)
    assert_idle(engine)


@pytest.mark.slow
def test_abort_waiting_mid_prefill_mid_decode(make_engine, unpressured):
    # one token a step (num_scheduler_steps 1): the aborts land mid-prefill and mid-decode at given steps
    engine = make_engine(chunked_prefill_size=8, max_prefill_tokens=16, max_running_requests=2, num_scheduler_steps=1)
    free0 = engine.manager.num_free_blocks()
    rids = [engine.add_request(input_ids=p, sampling_params=greedy(12)) for p in PROMPTS[:4]]
    engine.step()  # requests 0 and 1 prefill their first 8 tokens; 2 and 3 wait
    aborted = {1: engine.abort(rids[1]), 3: engine.abort(rids[3])}  # mid-prefill, waiting
    for _ in range(6):
        engine.step()
    aborted[0] = engine.abort(rids[0])  # mid-decode
    while engine.scheduler.has_unfinished():
        engine.step()
    outs = [aborted[i] if i in aborted else engine.result(r) for i, r in enumerate(rids)]
    with pytest.raises(KeyError):
        engine.result(rids[0])  # abort handed the output out and kept nothing
    assert [o.finish_reason for o in outs] == ["abort", "abort", "length", "abort"]
    assert 0 < len(outs[0].token_ids) < 12 and outs[0].token_ids == unpressured[0][: len(outs[0].token_ids)]
    assert outs[2].token_ids == unpressured[2]
    assert engine.manager.num_free_blocks() + engine.manager.num_evictable_blocks() == free0
    assert_idle(engine)


def test_stream_text_prompts_and_chat(make_engine, smollm2_tokenizer):
    engine = make_engine()
    text = "The cat sat on the mat while the dog slept by the door"
    full = engine.generate(prompts=[text], sampling_params=greedy(10))[0]
    assert full.text == smollm2_tokenizer.decode(full.token_ids, skip_special_tokens=True)
    chunks = list(engine.stream(prompts=text, sampling_params=greedy(10)))
    assert [t for c in chunks for t in c.token_ids] == full.token_ids
    assert "".join(c.text for c in chunks) == full.text
    assert chunks[-1].finish_reason == "length" and chunks[-1].usage.completion_tokens == 10
    assert chunks[-1].usage.cached_tokens > 0  # the second run hit the first one's blocks
    chat = [{"role": "user", "content": "hi"}]
    out = engine.generate(messages=[chat], sampling_params=greedy(3))[0]
    assert out.prompt_token_ids == smollm2_tokenizer.apply_chat_template(chat, add_generation_prompt=True)["input_ids"]
    abandoned = engine.stream(input_ids=[[5, 6, 7]], sampling_params=greedy(50))
    next(abandoned)
    abandoned.close()  # abandoning the stream aborts the request
    assert_idle(engine)
    engine.shutdown()
