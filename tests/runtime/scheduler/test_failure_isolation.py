"""A step that fails for one sequence fails only that sequence's request (issue 12, class 2), and no per-request or
per-sequence state outlives its request (class 5): the ModelRunner bisects a failing forward down to its culprits,
the Scheduler fails whole requests, the scheduler process answers RequestFailed for those only, the Engine ends them
with "abort" and an error. The failure is injected from the test by wrapping runner.model."""

from __future__ import annotations

import re
from collections import deque

import msgspec
import pytest
import torch

from radix.manager import KVCacheManager
from runtime import protocol as p
from runtime.config import ServerArgs
from runtime.engine import Engine
from runtime.model.runner import ModelRunner
from runtime.sampling_params import SamplingParams
from runtime.scheduler.request import RequestFailure, SeqStatus
from runtime.scheduler.scheduler import Scheduler
from runtime.serve.scheduler_process import SchedulerServer
from runtime.structured_outputs import NO_TOKEN
from tests.runtime.scheduler.harness import FakeRunner, Harness, reference

POISON = 4242  # a token id that only the poisoned prompts contain


class PoisonedModel:
    """runner.model, except that a forward whose input ids contain POISON raises; counts the forwards."""

    def __init__(self, model) -> None:
        self.model = model
        self.calls = 0

    def __call__(self, input_ids: torch.Tensor, *args):
        self.calls += 1
        if bool((input_ids == POISON).any()):
            raise RuntimeError(f"poisoned token {POISON}")
        return self.model(input_ids, *args)


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def new_seq(seq_id: int, tokens: list[int], blocks: list[int]) -> p.ScheduledSeq:
    return p.ScheduledSeq(seq_id, tokens, 0, blocks, True, SamplingParams(temperature=0.0), len(tokens))


def leftovers(obj, deep: bool = True) -> dict[str, int]:
    """Sizes of the non-empty dict / list / set / deque attributes of obj (and, when deep, of the runtime objects
    it holds, e.g. the scheduler's waiting queue)."""
    out: dict[str, int] = {}
    for name, value in vars(obj).items():
        if isinstance(value, (dict, list, set, deque)):
            if value:
                out[name] = len(value)
        elif deep and type(value).__module__.startswith("runtime.") and hasattr(value, "__dict__"):
            out.update({f"{name}.{k}": n for k, n in leftovers(value, deep=False).items()})
    return out


# ---------------------------------------------------------------------------------------------- the ModelRunner
@pytest.fixture(scope="module")
def tiny(tiny_llama_dir):
    return str(tiny_llama_dir)


def test_runner_bisects_a_failing_forward_down_to_its_culprit(tiny):
    prompts = {1: list(range(100, 110)), 2: list(range(200, 207)), 3: [300, 301, POISON, 303], 4: list(range(400, 409))}
    blocks = {1: [1, 2, 3], 2: [4, 5], 3: [6], 4: [7, 8, 9]}
    clean = ModelRunner(ServerArgs(model=tiny, num_blocks=16, block_size=4, dtype="float32"))
    want = clean.execute(p.ForwardBatch(0, [new_seq(s, prompts[s], blocks[s]) for s in (1, 2, 4)]))
    runner = ModelRunner(ServerArgs(model=tiny, num_blocks=16, block_size=4, dtype="float32"))
    runner.model = model = PoisonedModel(runner.model)
    got = runner.execute(p.ForwardBatch(0, [new_seq(s, prompts[s], blocks[s]) for s in (1, 2, 3, 4)]))
    assert (got.failed_seq_ids, got.failed_errors, got.error) == ([3], [f"RuntimeError: poisoned token {POISON}"], None)
    assert (got.seq_ids, got.token_ids, got.num_forward_tokens) == ([1, 2, 4], want.token_ids, 10 + 7 + 9)
    assert model.calls == 5  # [1 2 3 4] fails, [1 2] runs, [3 4] fails, [3] fails, [4] runs
    assert sorted(runner.seqs) == [1, 2, 4]
    # the re-run prefills wrote the right KV: the next decode step equals the clean runner's
    decode = [
        p.ScheduledSeq(s, [t], len(prompts[s]), [], True) for s, t in zip(got.seq_ids, got.token_ids, strict=True)
    ]
    assert runner.execute(p.ForwardBatch(1, decode)).token_ids == clean.execute(p.ForwardBatch(1, decode)).token_ids
    assert model.calls == 6


def test_runner_fails_each_invalid_delta_by_itself(tiny):
    runner = ModelRunner(ServerArgs(model=tiny, num_blocks=10, block_size=4, max_model_len=16, dtype="float32"))
    solo = ModelRunner(ServerArgs(model=tiny, num_blocks=10, block_size=4, max_model_len=16, dtype="float32"))
    ok = new_seq(1, [5, 6, 7, 8, 9], [1, 2])
    result = runner.execute(
        p.ForwardBatch(
            0,
            [
                p.ScheduledSeq(2, [5], 3, [], True),  # unknown, no sampling_params
                ok,
                new_seq(3, list(range(10, 16)), [3]),  # 6 tokens in one block of 4
                new_seq(4, list(range(20, 37)), [4, 5, 6, 7, 8]),  # 17 tokens > max_model_len 16
                new_seq(5, [1, 2], [10]),  # block 10 is outside the pool of 10
            ],
        )
    )
    assert result.failed_seq_ids == [2, 3, 4, 5]
    assert result.failed_errors == [
        "WorkerError: seq 2 is not known to the worker and carries no sampling_params",
        "WorkerError: seq 3: 1 blocks of 4 cannot hold 6 tokens",
        "WorkerError: seq 4: context 17 exceeds max_model_len 16",
        "WorkerError: seq 5: block ids [10] outside the pool [1, 10)",
    ]
    assert (result.seq_ids, result.num_forward_tokens, result.error) == ([1], 5, None)
    assert result.token_ids == solo.execute(p.ForwardBatch(0, [ok])).token_ids
    assert list(runner.seqs) == [1]


# ---------------------------------------------------------------------------------------------- the Scheduler
class FailingRunner(FakeRunner):
    """FakeRunner that fails every sequence whose input holds POISON, or (fail_at) the sequence fail_at[0] at its
    position fail_at[1]; the other sequences of the batch run as usual."""

    def __init__(self, *args, fail_at: tuple[int, int] | None = None, **kw) -> None:
        super().__init__(*args, **kw)
        self.fail_at = fail_at

    def execute(self, batch: p.ForwardBatch) -> p.ForwardResult:
        bad = [s.seq_id for s in batch.seqs if POISON in s.token_ids or (s.seq_id, s.start_pos) == self.fail_at]
        rest = [s for s in batch.seqs if s.seq_id not in bad]
        result = super().execute(
            p.ForwardBatch(batch.step_id, rest, batch.drop_seq_ids, batch.swap_out, batch.swap_in, batch.copies)
        )
        for sid in bad:
            self.tables.pop(sid, None)
        result.failed_seq_ids = bad
        result.failed_errors = [f"RuntimeError: boom {sid}" for sid in bad]
        return result


@pytest.mark.parametrize("where", ["prefill", "decode"])
def test_a_failed_sequence_fails_its_whole_request_and_nothing_else(where):
    """p (n=2) fails in its parent's prefill (seq 2), or in the first decode of its child 4 (step 3): both
    completions end "abort" with what they had, a and b run as if p were not there."""
    h = Harness(block_size=4)
    prompts = {"a": list(range(10, 19)), "p": list(range(30, 39)), "b": list(range(50, 61))}
    if where == "prefill":
        prompts["p"][4] = POISON
    h.runner = FailingRunner(64, 4, fail_at=None if where == "prefill" else (4, 9))
    h.add("a", prompts["a"], max_tokens=6)
    h.add("p", prompts["p"], max_tokens=6, n=2, temperature=1.0, seed=1)
    h.add("b", prompts["b"], max_tokens=6)
    failures = []
    while h.sched.has_unfinished():
        h.step()
        failures += h.sched.drain_failures()
    assert h.finish[("p", 0)] == h.finish[("p", 1)] == "abort"
    produced = 0 if where == "prefill" else 1
    for i in (0, 1):
        assert h.tokens.get(("p", i), []) == reference(prompts["p"], produced, i, 1.0)
    for rid in "ab":
        assert h.tokens[(rid, 0)] == reference(prompts[rid], 6) and h.finish[(rid, 0)] == "length"
    step, seq = (1, 2) if where == "prefill" else (3, 4)
    assert failures == [RequestFailure("p", f"the worker failed step {step}: RuntimeError: boom {seq}")]
    h.assert_idle()
    assert h.step() and h.runner.steps[-1].seqs == [] and not h.step()  # a last batch only delivers the drops
    assert leftovers(h.sched) == {} and h.runner.tables == {}


def test_a_failed_decode_keeps_the_tokens_sent_before_it():
    h = Harness(block_size=4, num_scheduler_steps=1)  # one token a step: the test fails a given step's decode
    h.runner = FailingRunner(64, 4, fail_at=(1, 11))  # a's third decode (a: seq 1, 9 prompt tokens)
    h.add("a", list(range(10, 19)), max_tokens=6)
    h.add("b", list(range(50, 61)), max_tokens=6)
    h.run()
    [failure] = h.sched.drain_failures()
    assert failure == RequestFailure("a", "the worker failed step 4: RuntimeError: boom 1")
    assert h.finish[("a", 0)] == "abort" and h.tokens[("a", 0)] == reference(list(range(10, 19)), 3)
    assert h.tokens[("b", 0)] == reference(list(range(50, 61)), 6)
    h.assert_idle()


def test_the_length_finish_of_a_sequence_alone_in_a_full_pool_is_logged(caplog):
    h = Harness(num_blocks=10, block_size=4, max_model_len=64)
    h.add("r36", list(range(100, 136)), max_tokens=100)  # past max_model_len: "until the context", not refused
    with caplog.at_level("WARNING", logger="runtime.scheduler.scheduler"):
        h.run()
    assert h.finish[("r36", 0)] == "length" and len(h.tokens[("r36", 0)]) == 1
    assert [r.getMessage() for r in caplog.records] == [
        'request r36 finishes "length" at 1 of max_tokens 100 completion tokens: alone, it fills the KV pool '
        "(9 usable blocks of 4 = 36 tokens)"
    ]


# ---------------------------------------------------------------------------------------------- scheduler process
class FakeSocket:
    """A PUSH socket that keeps what is sent, decoded as msg_type."""

    def __init__(self, msg_type) -> None:
        self.decoder = msgspec.msgpack.Decoder(msg_type)
        self.sent = []

    def send(self, data, copy: bool = True) -> None:
        self.sent.append(self.decoder.decode(data))


def test_on_result_answers_request_failed_for_the_culprit_only():
    sched = Scheduler(
        KVCacheManager(32, 4),
        ServerArgs(num_blocks=32, block_size=4, num_scheduler_steps=1),  # one token a step: it counts them
        max_model_len=64,
        eos_token_ids=[2],
        clock=lambda: 0.0,
    )
    to_worker = FakeSocket(p.ForwardBatch)
    to_tok = FakeSocket(p.TokenizerInput)
    server = SchedulerServer(sched, to_worker, to_tok, None, 5.0)
    for rid, ids in (("a", [5, 6, 7]), ("b", [8, 9, 10]), ("c", [11, 12])):
        server.on_tokenizer_message(p.TokenizedRequest(rid=rid, input_ids=ids, sampling_params=greedy(3)))
    server.try_schedule()
    [batch] = to_worker.sent
    assert [s.seq_id for s in batch.seqs] == [1, 2, 3]
    server.on_result(
        p.ForwardResult(
            batch.step_id,
            [1, 3],
            [40, 41],
            num_forward_tokens=5,
            failed_seq_ids=[2],
            failed_errors=["RuntimeError: boom"],
        )
    )
    assert to_tok.sent == [
        p.RequestFailed("b", p.ERR_SERVER, f"the worker failed step {batch.step_id}: RuntimeError: boom"),
        p.TokenOutputs(
            [
                p.TokenOutput("a", 0, [40], None, p.Usage(3, 0, 1, 0.0)),
                p.TokenOutput("c", 0, [41], None, p.Usage(2, 0, 1, 0.0)),
            ]
        ),
    ]
    server.try_schedule()
    nxt = to_worker.sent[1]
    assert (nxt.drop_seq_ids, [(s.seq_id, s.token_ids) for s in nxt.seqs]) == ([2], [(1, [40]), (3, [41])])
    stats = server.server_stats()
    assert (stats.num_running, stats.num_used_blocks) == (2, 2)
    assert sorted(sched.requests) == ["a", "c"]


def test_a_constraint_that_allows_no_token_fails_its_request_as_invalid():
    """The worker's NO_TOKEN error (the request's regex matches no string) is the client's: RequestFailed with
    ERR_INVALID and the worker's message (a 400 naming the field over HTTP), not ERR_SERVER "the worker failed"."""
    sched = Scheduler(
        KVCacheManager(32, 4), ServerArgs(num_blocks=32, block_size=4), max_model_len=64, eos_token_ids=[2]
    )
    to_worker = FakeSocket(p.ForwardBatch)
    to_tok = FakeSocket(p.TokenizerInput)
    server = SchedulerServer(sched, to_worker, to_tok, None, 5.0)
    server.on_tokenizer_message(p.TokenizedRequest(rid="r", input_ids=[5, 6, 7], sampling_params=greedy(3)))
    server.try_schedule()
    [batch] = to_worker.sent
    why = NO_TOKEN + " here: it matches no text"
    server.on_result(
        p.ForwardResult(batch.step_id, [], [], num_forward_tokens=3, failed_seq_ids=[1], failed_errors=[why])
    )
    assert to_tok.sent == [p.RequestFailed("r", p.ERR_INVALID, why)]
    server.try_schedule()
    assert server.server_stats().num_used_blocks == 0 and sched.requests == {}


# ---------------------------------------------------------------------------------------------- the Engine
CLEAN = [[1000 + 37 * i + 3 * j for j in range(9 + 2 * i)] for i in range(4)]
POISONED = [2000 + j for j in range(12)] + [POISON] + [2100 + j for j in range(7)]  # POISON in its 2nd chunk of 8
ENGINE_KW = dict(num_blocks=128, block_size=4, chunked_prefill_size=8, max_prefill_tokens=24, dtype="float32")


@pytest.fixture(scope="module")
def clean_outputs(tiny):
    engine = Engine(model=tiny, **ENGINE_KW)
    outs = [o.token_ids for o in engine.generate(input_ids=CLEAN, sampling_params=greedy(10))]
    assert all(POISON not in o for o in outs)
    return outs


@pytest.mark.slow
def test_engine_a_failing_request_leaves_the_others_of_its_steps_unchanged(tiny, clean_outputs):
    engine = Engine(model=tiny, **ENGINE_KW)
    engine.runner.model = model = PoisonedModel(engine.runner.model)
    free0 = engine.manager.num_free_blocks()
    outs = engine.generate(input_ids=CLEAN[:2] + [POISONED] + CLEAN[2:], sampling_params=greedy(10))
    bad = outs.pop(2)
    assert (bad.finish_reason, bad.token_ids, bad.usage.completion_tokens) == ("abort", [], 0)
    assert re.fullmatch(rf"the worker failed step 2: RuntimeError: poisoned token {POISON}", bad.error)
    assert [o.token_ids for o in outs] == clean_outputs
    assert all(o.finish_reason == "length" and o.error is None for o in outs)
    assert model.calls > engine.stats().num_steps  # the failing step was bisected
    s = engine.stats()
    assert (s.num_used_blocks, s.num_running, s.num_waiting) == (0, 0, 0)
    assert s.num_free_blocks + s.num_evictable_blocks == s.num_blocks - 1 == 127
    assert engine.manager.num_free_blocks() + engine.manager.num_evictable_blocks() == free0
    engine.manager.check_invariants()
    # the failed chunk's KV never entered the cache: only the 2 blocks of its first (successful) chunk did
    assert engine.manager.match_prefix(engine.manager.block_keys(POISONED)).num_tokens == 8


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_engine_keeps_no_state_of_requests_that_ended(tiny, mode):
    engine = Engine(
        model=tiny,
        num_blocks=20,
        block_size=4,
        max_running_requests=4,
        preemption_mode=mode,
        num_host_blocks=64 if mode == "swap" else 0,
    )
    engine.runner.model = PoisonedModel(engine.runner.model)
    prompts = [[3000 + 11 * i for i in range(24)] + [100 + 13 * k + j for j in range(3 + k)] for k in range(6)]
    rids = [engine.add_request(input_ids=q, sampling_params=greedy(12)) for q in prompts]
    rids.append(engine.add_request(input_ids=[7, 8, POISON, 9], sampling_params=greedy(4)))
    outs = {rids[5]: engine.abort(rids[5])}  # aborted while waiting
    preempted = None
    while engine.scheduler.has_unfinished():
        engine.step()
        victim = next((s for s in engine.scheduler.waiting if s.preempted), None) or next(
            iter(engine.scheduler.swapped), None
        )
        if preempted is None and victim is not None and victim.req.rid != rids[6]:
            preempted = victim.req.rid
            assert victim.status == (SeqStatus.WAITING if mode == "recompute" else SeqStatus.SWAPPED)
            outs[preempted] = engine.abort(preempted)  # aborted while preempted (recompute) or swapped out
    assert preempted is not None
    outs.update({r: engine.result(r) for r in rids if r not in outs})
    assert outs[rids[6]].error is not None and outs[rids[6]].finish_reason == "abort"
    assert [outs[r].finish_reason for r in rids].count("length") == 4
    assert all(outs[r].finish_reason == "abort" for r in (rids[5], preempted))
    with pytest.raises(KeyError):
        engine.result(preempted)
    assert engine.step() == []  # delivers the last drops to the worker
    assert leftovers(engine.scheduler) == {} and engine.runner.seqs == {}
    assert leftovers(engine, deep=False) == {} and engine.manager.stats().num_sequences == 0
