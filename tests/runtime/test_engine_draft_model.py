"""Speculative decoding with a draft model through the Engine on the tiny loopy Llama in float32: every output equals
plain decoding's token for token, with the target itself as the draft (every draft accepted) and with a tiny random
draft of the same vocabulary (most rejected), across block boundaries, prefix-cache hits, preemption and aborts; the
manager's invariants hold after every step and every block comes back. Config refusals: no model, a vocabulary of
another size."""

from __future__ import annotations

import json

import pytest

from runtime.config import InvalidConfig, ServerArgs
from runtime.model.draft_model import DraftVocabMismatch
from runtime.model.draft_runner import DraftRunner
from runtime.sampling_params import SamplingParams
from tests.runtime.engine_helpers import assert_idle, greedy, record_batches
from tests.runtime.spec_helpers import PROMPTS, loopy_engine_maker, memoised_plain, save_loopy_llama

K = 3


def _config(model, k: int = K) -> str:
    """disable_by_batch_size 64: every step of these small batches drafts (the measured gate of spec_gate.py would
    close on the random draft's rejections; tests/runtime/scheduler/test_spec_gate.py tests the gate)."""
    config = {"method": "draft_model", "model": str(model), "num_speculative_tokens": k, "disable_by_batch_size": 64}
    return json.dumps(config)


@pytest.fixture(scope="module")
def loopy_dir(tmp_path_factory, smollm2_tokenizer):
    return save_loopy_llama(tmp_path_factory.mktemp("loopy_llama"), smollm2_tokenizer)


@pytest.fixture(scope="module")
def random_draft_dir(tmp_path_factory, smollm2_tokenizer):
    """A one-layer random Llama with the loopy model's vocabulary (512): its drafts are mostly rejected."""
    from transformers import LlamaConfig

    from tests.conftest import _save_tiny

    config = LlamaConfig(
        vocab_size=512,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        initializer_range=0.1,
        bos_token_id=1,
        eos_token_id=2,
    )
    config.architectures = ["LlamaForCausalLM"]
    return _save_tiny(tmp_path_factory.mktemp("random_draft"), config, smollm2_tokenizer, seed=11)


@pytest.fixture(scope="module")
def make_engine(loopy_dir):
    return loopy_engine_maker(loopy_dir)


@pytest.fixture(scope="module")
def plain_outputs(make_engine):
    """Plain decoding's output of (prompts, params), memoised."""
    return memoised_plain(make_engine())


def _slots(batches) -> int:
    return sum(s.num_draft_slots for b in batches for s in b.seqs)


def test_self_draft_accepts_every_token(make_engine, plain_outputs, loopy_dir):
    spec = make_engine(speculative_config=_config(loopy_dir))
    batches = record_batches(spec)  # checks the manager's invariants after every step
    assert [o.token_ids for o in spec.generate(input_ids=PROMPTS, sampling_params=greedy(40))] == plain_outputs(
        PROMPTS, greedy(40)
    )
    c = spec.scheduler.speculation.counters
    # the scheduler sends slots, the worker fills them in place (in-process the recorded batch is the same object)
    assert all(s.num_draft_tokens == s.num_draft_slots for b in batches for s in b.seqs)
    assert c.num_draft_tokens == c.num_accepted_tokens == _slots(batches) > 0
    assert c.accepted_per_pos[0] == c.num_drafts
    assert_idle(spec)
    assert isinstance(spec.runner.draft, DraftRunner)
    spec.step()  # delivers the drops
    assert spec.runner.draft.seqs == {}  # the draft state leaves with the sequences


def test_random_draft_mostly_rejected(make_engine, plain_outputs, random_draft_dir):
    spec = make_engine(speculative_config=_config(random_draft_dir))
    batches = record_batches(spec)
    assert [o.token_ids for o in spec.generate(input_ids=PROMPTS, sampling_params=greedy(40))] == plain_outputs(
        PROMPTS, greedy(40)
    )
    c = spec.scheduler.speculation.counters
    assert c.num_draft_tokens == _slots(batches) > 0
    assert c.num_accepted_tokens < c.num_draft_tokens // 2
    assert c.num_accepted_tokens == sum(c.accepted_per_pos)
    assert_idle(spec)


def test_kv_pool_split_by_both_models(make_engine, loopy_dir):
    budget = 2**20
    plain = make_engine(num_blocks=None, kv_cache_memory=budget)
    spec = make_engine(num_blocks=None, kv_cache_memory=budget, speculative_config=_config(loopy_dir))
    assert spec.runner.num_blocks == plain.runner.num_blocks // 2  # the draft's KV bytes equal the target's
    draft = spec.runner.draft
    assert isinstance(draft, DraftRunner) and draft.kv is not None
    assert draft.kv.k_cache.shape[1] == spec.runner.num_blocks


def test_config_refusals(make_engine, tmp_path, smollm2_tokenizer):
    with pytest.raises(InvalidConfig, match="model is required"):
        ServerArgs(speculative_config=json.dumps({"method": "draft_model", "num_speculative_tokens": 2}))
    from transformers import LlamaConfig

    from tests.conftest import _save_tiny

    config = LlamaConfig(
        vocab_size=640, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2
    )
    config.architectures = ["LlamaForCausalLM"]
    other = _save_tiny(tmp_path / "other_vocab", config, smollm2_tokenizer, seed=1)
    with pytest.raises(DraftVocabMismatch, match="vocab_size 640, the target model has 512"):
        make_engine(speculative_config=_config(other))


def test_catch_up_is_what_keeps_every_draft_accepted(make_engine, loopy_dir, monkeypatch):
    """With the target as its own draft, every step accepts all k drafts, so each next step must first run d_k
    through the draft (catch-up); without it the draft reads a stale slot and some drafts are rejected."""
    monkeypatch.setattr(DraftRunner, "_catch_up", lambda self, s: [])
    spec = make_engine(speculative_config=_config(loopy_dir))
    spec.generate(input_ids=PROMPTS, sampling_params=greedy(40))
    c = spec.scheduler.speculation.counters
    assert c.num_accepted_tokens < c.num_draft_tokens


def test_prefix_cache_hit_is_a_hit_for_the_draft(make_engine, plain_outputs, loopy_dir):
    spec = make_engine(speculative_config=_config(loopy_dir))
    first = spec.generate(input_ids=[PROMPTS[1]], sampling_params=greedy(20))[0]
    turn2 = PROMPTS[1] + first.token_ids + [3, 4, 3]
    before = spec.scheduler.speculation.counters.num_draft_tokens
    out = spec.generate(input_ids=[turn2], sampling_params=greedy(20))[0]
    assert out.usage.cached_tokens == 24  # the whole blocks of turn 1 (prompt + reply: 27 tokens, 6 blocks of 4)
    assert out.token_ids == plain_outputs([turn2], greedy(20))[0]
    c = spec.scheduler.speculation.counters
    assert c.num_draft_tokens > before
    assert c.num_accepted_tokens == c.num_draft_tokens  # the cached blocks carry the draft's KV too
    assert_idle(spec)


def test_stop_string_inside_an_accepted_run(make_engine, loopy_dir, smollm2_tokenizer):
    plain = make_engine()
    full = plain.generate(input_ids=[PROMPTS[2]], sampling_params=greedy(24))[0]
    text = smollm2_tokenizer.decode(full.token_ids[10:12])
    params = greedy(24, stop=[text])
    want = plain.generate(input_ids=[PROMPTS[2]], sampling_params=params)[0]
    spec = make_engine(speculative_config=_config(loopy_dir))
    got = spec.generate(input_ids=[PROMPTS[2]], sampling_params=params)[0]
    assert want.finish_reason == got.finish_reason == "stop"
    assert (got.token_ids, got.text) == (want.token_ids, want.text)
    c = spec.scheduler.speculation.counters
    assert c.num_accepted_tokens == c.num_draft_tokens > 0  # the stop falls inside an accepted run
    assert_idle(spec)


def test_seeded_sampling_equals_plain_decoding(make_engine, plain_outputs, random_draft_dir):
    spec = make_engine(speculative_config=_config(random_draft_dir))
    params = SamplingParams(max_tokens=20, temperature=0.7, top_p=0.9, top_k=20, seed=7, ignore_eos=True)
    got = [o.token_ids for o in spec.generate(input_ids=PROMPTS, sampling_params=params)]
    assert got == plain_outputs(PROMPTS, params)
    assert spec.scheduler.speculation.counters.num_drafts > 0
    assert_idle(spec)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_with_a_draft_model(make_engine, plain_outputs, loopy_dir, mode):
    spec = make_engine(speculative_config=_config(loopy_dir), num_blocks=24, preemption_mode=mode, num_host_blocks=64)
    record_batches(spec)
    outs = spec.generate(input_ids=PROMPTS, sampling_params=greedy(40))
    assert [o.token_ids for o in outs] == plain_outputs(PROMPTS, greedy(40))
    stats = spec.stats()
    assert stats.num_preemptions > 0
    assert (stats.num_swaps > 0) == (mode == "swap")
    assert spec.scheduler.speculation.counters.num_accepted_tokens > 0
    assert_idle(spec)


def test_abort_mid_run_returns_every_block(make_engine, random_draft_dir):
    spec = make_engine(speculative_config=_config(random_draft_dir))
    record_batches(spec)
    rids = [spec.add_request(input_ids=p, sampling_params=greedy(40)) for p in PROMPTS]
    for _ in range(6):
        spec.step()
    assert spec.scheduler.speculation.counters.num_drafts > 0
    aborted = [spec.abort(rids[0]), spec.abort(rids[2])]
    assert [o.finish_reason for o in aborted] == ["abort", "abort"]
    while spec.scheduler.has_unfinished():
        spec.step()
    assert spec.result(rids[1]).finish_reason == "length"
    spec.step()  # delivers the drops
    assert_idle(spec)
    assert spec.runner.seqs == {}
    draft = spec.runner.draft
    assert isinstance(draft, DraftRunner) and draft.seqs == {}


def test_parallel_samples_fork_with_the_draft(make_engine, plain_outputs, loopy_dir):
    """n = 2: the children fork after the prompt and trust its draft KV (greedy: every self-draft accepted). Seeded
    sampling draws plain decoding's tokens; its acceptance is the target's probability of the greedy draft (low on
    this near-flat model), so only the greedy run counts acceptance."""
    spec = make_engine(speculative_config=_config(loopy_dir))
    plain = make_engine()
    for params in [
        SamplingParams(n=2, max_tokens=16, temperature=0.0, ignore_eos=True),
        SamplingParams(n=2, max_tokens=16, temperature=0.8, seed=3, ignore_eos=True),
    ]:
        got = spec.generate(input_ids=PROMPTS[:1], sampling_params=params)
        want = plain.generate(input_ids=PROMPTS[:1], sampling_params=params)
        assert [c.token_ids for o in got for c in o.outputs] == [c.token_ids for o in want for c in o.outputs]
        c = spec.scheduler.speculation.counters
        if params.temperature == 0.0:
            assert c.num_accepted_tokens == c.num_draft_tokens > 0
    assert_idle(spec)


def test_slots_and_drafts_cross_the_wire():
    """The new protocol fields survive msgpack (array_like: appended last, with defaults)."""
    import msgspec

    from runtime.protocol import ForwardBatch, ForwardResult, ScheduledSeq, WorkerOutput

    seq = ScheduledSeq(7, [42], 9, [3], True, num_draft_slots=3)
    batch = msgspec.msgpack.decode(msgspec.msgpack.encode(ForwardBatch(1, [seq])), type=ForwardBatch)
    assert (batch.seqs[0].num_draft_slots, batch.seqs[0].num_draft_tokens) == (3, 0)
    result = ForwardResult(1, [7], [5], accepted_token_ids={7: [8]}, draft_token_ids={7: [8, 6, 4]})
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(result), type=WorkerOutput)
    assert isinstance(back, ForwardResult) and back.draft_token_ids == {7: [8, 6, 4]}


def test_host_tier_moves_the_drafts_kv_with_the_targets(make_engine, plain_outputs, loopy_dir):
    """A turn whose prefix (the first prompt's full blocks, computed by prefill in both models) comes back from the
    host tier: the draft's blocks took the same write-back and load-back pairs, so the target as its own draft has
    every draft accepted; with the draft's transfers skipped, it does not."""
    a = PROMPTS[2]  # 25 tokens: 6 full blocks
    turn2 = a + [7, 8, 9]

    def run(move_draft: bool) -> tuple[list[int], int, int]:
        spec = make_engine(num_blocks=12, num_host_cache_blocks=64, speculative_config=_config(loopy_dir))
        draft = spec.runner.draft
        assert isinstance(draft, DraftRunner) and draft.kv is not None
        if not move_draft:
            draft.kv.swap = lambda swap_out, swap_in: None  # type: ignore[method-assign]
        spec.generate(input_ids=[a], sampling_params=greedy(8))
        spec.generate(input_ids=[list(range(100, 130))], sampling_params=greedy(8))  # evicts a's blocks
        c = spec.scheduler.speculation.counters
        drafted = c.num_draft_tokens
        accepted = c.num_accepted_tokens
        out = spec.generate(input_ids=[turn2], sampling_params=greedy(8))[0]
        assert out.usage.host_cached_tokens == 20  # 5 of its 6 cached blocks (24 tokens) from the host
        assert_idle(spec)
        return out.token_ids, c.num_draft_tokens - drafted, c.num_accepted_tokens - accepted

    want = plain_outputs([turn2], greedy(8))[0]
    tokens, drafted, accepted = run(move_draft=True)
    assert tokens == want
    assert accepted == drafted > 0
    tokens, drafted, accepted = run(move_draft=False)
    assert tokens == want  # correctness never depends on the draft's KV
    assert accepted < drafted


@pytest.mark.parametrize("draft", ["self", "random"])
def test_draft_with_penalties_and_logprobs(make_engine, loopy_dir, random_draft_dir, draft):
    """The draft model's rows carry the penalties of the draft tokens before them and each emitted token its row's
    logprobs: tokens equal plain decoding's, logprobs within 1e-5, with the self draft (all accepted) and the random
    one (mostly rejected)."""
    params = greedy(30, frequency_penalty=0.7, presence_penalty=0.3, repetition_penalty=1.2, logprobs=2)
    plain = make_engine().generate(input_ids=PROMPTS, sampling_params=params)
    model = loopy_dir if draft == "self" else random_draft_dir
    spec = make_engine(speculative_config=_config(model))
    record_batches(spec)
    outs = spec.generate(input_ids=PROMPTS, sampling_params=params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    for got, want in zip(outs, plain, strict=True):
        got_lps = got.outputs[0].logprobs
        want_lps = want.outputs[0].logprobs
        assert got_lps is not None and want_lps is not None and len(got_lps) == len(want_lps) == 30
        assert [lp.top_token_ids for lp in got_lps] == [lp.top_token_ids for lp in want_lps]
        assert [lp.logprob for lp in got_lps] == pytest.approx([lp.logprob for lp in want_lps], abs=1e-5)
    assert spec.scheduler.speculation.counters.num_draft_tokens > 0
    assert_idle(spec)
