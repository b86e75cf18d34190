"""Multi-step decoding (num_scheduler_steps = 4: runtime/model/multi_step.py, runtime/scheduler/speculation.py)
through the Engine on tiny loopy models in float32: every output equals plain decoding's token for token (greedy,
seeded sampling with its filters, penalties, logprobs, a stop id inside a run, structured outputs, KV cache groups
past the window), each step of decodes carries 3 slots per sequence so a 40-token completion takes 11 steps instead
of 40, a waiting request closes the gate for one step, and aborts keep the manager's invariants; every block comes
back. Prefix hits and preemption by recompute and by swap under multi-step: tests/runtime/test_engine_spec_decode.py
(its LOOKAHEAD settings)."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from runtime.engine import Engine
from runtime.sampling_params import SamplingParams
from runtime.structured_outputs import StructuredOutputs
from tests.runtime.engine_helpers import assert_idle, greedy, record_batches
from tests.runtime.hybrid_helpers import LOOPY_WINDOW, save_loopy_gemma3
from tests.runtime.spec_helpers import PROMPTS, memoised_plain, one_torch_thread, save_loopy_llama
from tests.runtime.test_engine_structured import SCHEMA

STEPS = 4


@pytest.fixture(scope="module")
def plain(make_engine):
    """A plain-decoding Engine (num_scheduler_steps 1) on the loopy model."""
    return make_engine(num_scheduler_steps=1)


@pytest.fixture(scope="module")
def plain_outputs(plain):
    return memoised_plain(plain)


def _slots(batches) -> list[list[int]]:
    """Each batch's num_draft_slots per sequence, in batch order."""
    return [[s.num_draft_slots for s in b.seqs] for b in batches]


def test_greedy_equals_plain_decoding_in_11_steps_instead_of_40(make_engine, plain_outputs):
    multi = make_engine(num_scheduler_steps=STEPS)
    batches = record_batches(multi)  # checks the manager's invariants after every step
    outs = multi.generate(input_ids=PROMPTS, sampling_params=greedy(40))
    assert [o.token_ids for o in outs] == plain_outputs(PROMPTS, greedy(40))
    # step 1 prefills the three prompts (token 1); 9 steps of 4 tokens reach 37; the last has room for 3 (max_tokens)
    assert _slots(batches) == [[0, 0, 0]] + [[3, 3, 3]] * 9 + [[2, 2, 2]]
    assert multi.stats().spec_decode_num_drafts == 0  # multi-step keeps no speculation counters
    assert_idle(multi)


def test_penalties_logprobs_and_seeded_sampling_equal_plain_decoding(make_engine, plain):
    multi = make_engine(num_scheduler_steps=STEPS)
    batches = record_batches(multi)
    params = [
        greedy(24, frequency_penalty=0.5, presence_penalty=0.3),
        greedy(24, logprobs=2),
        SamplingParams(max_tokens=20, temperature=0.7, top_p=0.9, top_k=20, min_p=0.05, seed=7, ignore_eos=True),
    ]
    rids = [multi.add_request(input_ids=p, sampling_params=q) for p, q in zip(PROMPTS, params, strict=True)]
    while multi.scheduler.has_unfinished():
        multi.step()
    for rid, prompt, q in zip(rids, PROMPTS, params, strict=True):
        got = multi.result(rid)
        want = plain.generate(input_ids=[prompt], sampling_params=q)[0]
        assert got.token_ids == want.token_ids
        got_lps = got.outputs[0].logprobs or []
        want_lps = want.outputs[0].logprobs or []
        assert len(got_lps) == len(want_lps) == (24 if q.logprobs else 0)
        for a, b in zip(got_lps, want_lps, strict=True):
            assert a.top_token_ids == b.top_token_ids
            assert a.logprob == pytest.approx(b.logprob, abs=1e-5)
    assert [3, 3, 3] in _slots(batches)  # the three ran multi-step together
    assert_idle(multi)


def test_a_stop_id_inside_a_run_ends_there(make_engine, plain_outputs, plain):
    tokens = plain_outputs([PROMPTS[2]], greedy(40))[0]
    # a token whose first occurrence is inside a run of 4 (not a run's first token: completion index 1, 5, 9, ...)
    index = next(i for i, t in enumerate(tokens) if tokens.index(t) == i and i % STEPS != 1 and i > 2)
    params = SamplingParams(max_tokens=40, temperature=0.0, stop_token_ids=[tokens[index]])
    multi = make_engine(num_scheduler_steps=STEPS)
    out = multi.generate(input_ids=[PROMPTS[2]], sampling_params=params)[0]
    want = plain.generate(input_ids=[PROMPTS[2]], sampling_params=params)[0]
    assert out.token_ids == want.token_ids == tokens[: index + 1]
    assert out.finish_reason == want.finish_reason == "stop"
    assert_idle(multi)


def test_a_waiting_request_closes_the_gate_for_its_prefill(make_engine, plain_outputs):
    multi = make_engine(num_scheduler_steps=STEPS)
    batches = record_batches(multi)
    first = multi.add_request(input_ids=PROMPTS[0], sampling_params=greedy(20))
    multi.step()
    multi.step()
    second = multi.add_request(input_ids=PROMPTS[1], sampling_params=greedy(20))
    multi.step()  # the second one's prefill: no slots for anyone
    multi.step()  # both decode, none waits: 3 slots each
    assert _slots(batches) == [[0], [3], [0, 0], [3, 3]]
    while multi.scheduler.has_unfinished():
        multi.step()
    assert multi.result(first).token_ids == plain_outputs([PROMPTS[0]], greedy(20))[0]
    assert multi.result(second).token_ids == plain_outputs([PROMPTS[1]], greedy(20))[0]
    assert_idle(multi)


def test_abort_mid_run_returns_every_block(make_engine):
    multi = make_engine(num_scheduler_steps=STEPS)
    record_batches(multi)
    rids = [multi.add_request(input_ids=p, sampling_params=greedy(40)) for p in PROMPTS]
    for _ in range(3):
        multi.step()
    aborted = [multi.abort(rids[0]), multi.abort(rids[2])]
    assert [o.finish_reason for o in aborted] == ["abort", "abort"]
    assert [len(o.token_ids) for o in aborted] == [9, 9]  # 1 + 4 + 4: two steps of 4 after the prefill
    while multi.scheduler.has_unfinished():
        multi.step()
    assert multi.result(rids[1]).finish_reason == "length"
    multi.step()  # delivers the drops
    assert_idle(multi)
    assert multi.runner.seqs == {}


def test_kv_cache_groups_past_the_window_equal_plain_decoding(tmp_path, smollm2_tokenizer):
    folder = save_loopy_gemma3(tmp_path / "loopy_gemma3", smollm2_tokenizer)

    def make(**kw) -> Engine:
        kw = {"dtype": "float32", "block_size": 4, "num_blocks": 128, "chunked_prefill_size": 16, **kw}
        return Engine(model=str(folder), kv_groups="auto", num_window_blocks=40, **kw)

    want = [o.token_ids for o in make(num_scheduler_steps=1).generate(input_ids=PROMPTS, sampling_params=greedy(48))]
    multi = make(num_scheduler_steps=STEPS)
    assert multi.manager.window == LOOPY_WINDOW
    batches = record_batches(multi)  # both groups' invariants after every step
    assert [o.token_ids for o in multi.generate(input_ids=PROMPTS, sampling_params=greedy(48))] == want
    assert max(s.start_pos for b in batches for s in b.seqs if s.num_draft_slots) > 2 * LOOPY_WINDOW
    assert_idle(multi)
    window = multi.manager.window_stats()
    assert window.in_use_blocks == 0 and window.free_blocks + window.evictable_blocks == window.total_blocks


def test_structured_outputs_equal_plain_decoding(tmp_path, smollm2_tokenizer):
    folder = save_loopy_llama(tmp_path / "loopy_llama_49k", smollm2_tokenizer, vocab_size=49152)

    def make(**kw) -> Engine:
        return Engine(model=str(folder), num_blocks=256, block_size=4, dtype="float32", **kw)

    repeat = r"(ab|cd)+x{3,9}"
    params = [
        SamplingParams(max_tokens=48, temperature=0.0, structured_outputs=StructuredOutputs(json=json.dumps(SCHEMA))),
        SamplingParams(max_tokens=48, temperature=0.3, seed=5, structured_outputs=StructuredOutputs(regex=repeat)),
        SamplingParams(
            max_tokens=48, temperature=0.0, frequency_penalty=0.3, structured_outputs=StructuredOutputs(regex=repeat)
        ),
    ]
    with one_torch_thread():
        plain, multi = make(num_scheduler_steps=1), make(num_scheduler_steps=STEPS)
        batches = record_batches(multi)
        for prompt, q in zip(PROMPTS, params, strict=True):
            got = multi.generate(input_ids=[prompt], sampling_params=q)[0]
            want = plain.generate(input_ids=[prompt], sampling_params=q)[0]
            assert (got.token_ids, got.finish_reason) == (want.token_ids, want.finish_reason)
            assert got.finish_reason == "stop"  # complete: EOS inside or at the end of a run
            if q.structured_outputs.json is not None:
                jsonschema.validate(json.loads(got.text), SCHEMA)
            else:
                assert re.fullmatch(repeat, got.text), got.text
    assert any(3 in row for row in _slots(batches))
    multi.generate(input_ids=[[1, 2, 3]], sampling_params=greedy(1))  # carries the last drops to the worker
    assert len(multi.runner.grammars) == 0
    assert_idle(multi)
