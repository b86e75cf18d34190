"""Speculative decoding on the scheduler side, with the worker's verification written by hand: the n-gram proposer's
drafts in a step (tests/runtime/scheduler/test_ngram.py tests the proposer itself), the 1 + k decode plan and its
blocks, EOS / stop ids / max_tokens cutting inside an accepted run as plain decoding would, the rollback of rejected
slots (blocks back to the pool, only accepted tokens' full blocks in the tree), the per-step disable rule, and
--speculative-config's errors."""

from __future__ import annotations

import json

import pytest

from radix.manager import KVCacheManager
from runtime.config import InvalidConfig, ServerArgs
from runtime.protocol import ForwardBatch, ForwardResult, TokenLogprobs
from runtime.sampling_params import SamplingParams
from runtime.scheduler.scheduler import Scheduler
from runtime.scheduler.speculation import may_speculate
from runtime.structured_outputs import StructuredOutputs

EOS = 2
REGEX = StructuredOutputs(regex="[a-z]+")
CONFIG = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2})


@pytest.mark.parametrize(
    ("config", "field"),
    [
        ('{"method": "ngram"}', "num_speculative_tokens"),
        ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens"),
        ('{"method": "eagle", "num_speculative_tokens": 2}', "method"),
        ('{"method": "draft_model", "num_speculative_tokens": 2}', "model is required"),
        ('{"method": "ngram", "model": "m", "num_speculative_tokens": 2}', "model is only used"),
        ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 3, "prompt_lookup_max": 2}', "max"),
        ('{"method": "ngram", "num_speculative_tokens": 2, "lookup": 2}', "lookup"),
        ('{"method": "ngram", "num_speculative_tokens": "2"}', "num_speculative_tokens"),
        ("{not json", "speculative_config"),
    ],
)
def test_bad_speculative_config_names_the_field(config, field):
    with pytest.raises(InvalidConfig, match=field):
        ServerArgs(speculative_config=config)


def _scheduler(num_blocks: int = 16, config: str | None = CONFIG) -> tuple[Scheduler, KVCacheManager]:
    manager = KVCacheManager(num_blocks, 4)
    args = ServerArgs(speculative_config=config, max_running_requests=4)
    return Scheduler(manager, args, max_model_len=64, eos_token_ids=[EOS]), manager


def _answer(batch: ForwardBatch, tokens: dict[int, list[int]]) -> ForwardResult:
    """The worker's result: tokens[seq_id] = its accepted draft tokens + the token drawn after them."""
    seq_ids = [s.seq_id for s in batch.seqs if s.sample]
    accepted = {s.seq_id: tokens[s.seq_id][:-1] for s in batch.seqs if s.num_draft_tokens}
    return ForwardResult(batch.step_id, seq_ids, [tokens[i][-1] for i in seq_ids], accepted_token_ids=accepted or None)


PROMPT = [5, 6, 7, 8, 9, 5, 6]  # prompt lookup proposes [7, 8, 9] after it


def _start(sched: Scheduler, params: SamplingParams) -> int:
    sched.add_request("r", PROMPT, params)
    batch = sched.schedule()
    assert batch is not None
    sched.process_result(_answer(batch, {1: [5]}))  # the prefill samples 5: tokens end [..., 5, 6, 5]
    return 1


def test_plan_verify_and_roll_back():
    sched, manager = _scheduler()
    seq_id = _start(sched, SamplingParams(max_tokens=10, temperature=0.0))
    batch = sched.schedule()
    assert batch is not None
    (s,) = batch.seqs
    assert (s.token_ids, s.start_pos, s.num_draft_tokens, s.sample) == ([5, 6, 7, 8], 7, 3, True)
    assert manager.block_table(seq_id) == [1, 2, 3]  # slots for positions 0..10
    outs = sched.process_result(_answer(batch, {seq_id: [6, 7, 1]}))  # 6, 7 accepted; 1 instead of 8
    assert [o.token_ids for o in outs] == [[6], [7], [1]]
    assert manager.num_computed_tokens(seq_id) == 10  # through the last accepted token
    assert manager.block_table(seq_id) == [1, 2, 3]  # cdiv(10, 4): nothing to release
    assert manager.stats().cached_blocks == 2  # [5 6 7 8] [9 5 6 5]; the block of 6 7 1 is not full
    c = sched.speculation.counters
    assert (c.num_drafts, c.num_draft_tokens, c.num_accepted_tokens, c.accepted_per_pos) == (1, 3, 2, [1, 1, 0])
    # next: tokens [..., 5, 6, 7, 1]: [1] never occurred before: a plain decode
    batch = sched.schedule()
    assert batch is not None and batch.seqs[0].num_draft_tokens == 0 and batch.seqs[0].token_ids == [1]
    sched.process_result(_answer(batch, {seq_id: [5]}))
    manager.check_invariants()


def test_rejection_releases_the_draft_blocks():
    sched, manager = _scheduler()
    seq_id = _start(sched, SamplingParams(max_tokens=10, temperature=0.0))
    sched.process_result(_answer(sched.schedule(), {seq_id: [6, 7, 8, 9]}))  # all 3 accepted + 9: 12 tokens
    batch = sched.schedule()  # [..., 8, 9]: draft [5, 6, 5]? n = 2 [8, 9] at 3 -> [5, 6, 5]
    assert batch is not None and batch.seqs[0].token_ids == [9, 5, 6, 5]
    assert manager.block_table(seq_id) == [1, 2, 3, 4]  # positions 11..14
    free = manager.num_free_blocks()
    sched.process_result(_answer(batch, {seq_id: [3]}))  # nothing accepted
    assert manager.num_computed_tokens(seq_id) == 12
    assert manager.block_table(seq_id) == [1, 2, 3]  # block 4 held only rejected slots: back to the pool
    assert manager.num_free_blocks() == free + 1
    manager.check_invariants()


@pytest.mark.parametrize(
    ("params", "reason", "output"),
    [
        (SamplingParams(max_tokens=10, temperature=0.0), "stop", [6, EOS]),  # EOS accepted inside the run
        (SamplingParams(max_tokens=10, temperature=0.0, stop_token_ids=[6]), "stop", [6]),
        (SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True), None, [6, EOS, 9, 4]),
        (SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True), "length", [6, EOS]),
    ],
)
def test_finish_inside_an_accepted_run(params, reason, output):
    sched, manager = _scheduler()
    sched.add_request("r", [5, 6, EOS, 9, 5, 6], params)
    sched.process_result(_answer(sched.schedule(), {1: [5]}))  # [..., 5, 6, 5]: [5] at 4 -> draft [6, EOS, 9]
    batch = sched.schedule()
    assert batch is not None
    num_draft = min(3, params.max_tokens - 2)  # never past max_tokens: 1 token out, 1 to sample unverified
    assert batch.seqs[0].token_ids == [5, 6, EOS, 9][: 1 + num_draft]
    outs = sched.process_result(_answer(batch, {1: [6, EOS, 9, 4][: num_draft + 1]}))
    assert [t for o in outs for t in o.token_ids] == output  # nothing after the finish is emitted
    assert outs[-1].finish_reason == reason
    if reason is None:
        assert manager.block_table(1) == [1, 2, 3]  # 10 computed tokens
        return
    assert "r" not in sched.requests and not sched.running
    assert manager.stats().in_use_blocks == 0
    assert manager.num_free_blocks() + manager.num_evictable_blocks() == 15
    manager.check_invariants()


def test_disable_by_batch_size_and_ineligible_params():
    config = json.loads(CONFIG) | {"disable_by_batch_size": 2}
    sched, _ = _scheduler(config=json.dumps(config))
    sched.add_request("a", PROMPT, SamplingParams(max_tokens=10, temperature=0.0))
    other = [t + 10 for t in PROMPT]  # not PROMPT: a prompt being computed makes its twin wait a step
    params = SamplingParams(max_tokens=10, temperature=0.0, presence_penalty=0.5, structured_outputs=REGEX)
    sched.add_request("b", other, params)
    sched.process_result(_answer(sched.schedule(), {1: [5], 2: [15]}))
    batch = sched.schedule()
    assert [s.num_draft_tokens for s in batch.seqs] == [0, 0]  # two running: off
    sched.abort("a")
    sched.process_result(_answer(batch, {1: [1], 2: [16]}))
    batch = sched.schedule()
    assert [s.num_draft_tokens for s in batch.seqs] == [3]  # one running: penalties and a grammar do draft
    sched.add_request("c", PROMPT, SamplingParams(n=2, use_beam_search=True, temperature=0.0, max_tokens=10))
    assert not may_speculate(sched.requests["c"].seqs[0])  # beam search never drafts
    assert may_speculate(sched.requests["b"].seqs[0])


def test_draft_model_slots_then_the_workers_draft():
    """With method draft_model the scheduler reserves 1 + k slots and sends num_draft_slots (the one token sampled
    last step, no draft tokens); the draft the worker returns is verified as any draft."""
    config = json.dumps({"method": "draft_model", "model": "unused-by-the-scheduler", "num_speculative_tokens": 3})
    sched, manager = _scheduler(config=config)
    seq_id = _start(sched, SamplingParams(max_tokens=10, temperature=0.0))
    batch = sched.schedule()
    assert batch is not None
    (s,) = batch.seqs
    assert (s.token_ids, s.start_pos, s.num_draft_tokens, s.num_draft_slots, s.sample) == ([5], 7, 0, 3, True)
    assert manager.block_table(seq_id) == [1, 2, 3]  # slots for positions 0..10
    result = ForwardResult(
        batch.step_id, [seq_id], [1], accepted_token_ids={seq_id: [6, 7]}, draft_token_ids={seq_id: [6, 7, 8]}
    )
    outs = sched.process_result(result)  # 6, 7 accepted; 1 instead of 8
    assert [o.token_ids for o in outs] == [[6], [7], [1]]
    assert manager.num_computed_tokens(seq_id) == 10
    c = sched.speculation.counters
    assert (c.num_drafts, c.num_draft_tokens, c.num_accepted_tokens, c.accepted_per_pos) == (1, 3, 2, [1, 1, 0])
    batch = sched.schedule()  # the draft model drafts every decode, whatever the tokens
    assert batch is not None and (batch.seqs[0].token_ids, batch.seqs[0].num_draft_slots) == ([1], 3)
    manager.check_invariants()


def _lp(token: int) -> TokenLogprobs:
    return TokenLogprobs(-0.5 - token, [token], [-0.5 - token])


def test_logprobs_ride_with_each_accepted_token():
    sched, _ = _scheduler()
    seq_id = _start(sched, SamplingParams(max_tokens=10, temperature=0.0, logprobs=1, frequency_penalty=0.5))
    batch = sched.schedule()
    assert batch is not None and batch.seqs[0].num_draft_tokens == 3  # penalties and logprobs speculate
    result = _answer(batch, {seq_id: [6, 7, 1]})
    result.logprobs = [_lp(1)]
    result.accepted_logprobs = {seq_id: [_lp(6), _lp(7)]}
    outs = sched.process_result(result)
    assert [o.token_ids for o in outs] == [[6], [7], [1]]
    assert [o.logprobs for o in outs] == [[_lp(6)], [_lp(7)], [_lp(1)]]
