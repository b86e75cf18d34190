"""A health request never waits behind a step (issue 28, class 5): while a step is in flight the scheduler answers at
once from the step's age, "ok" while it is younger than worker_probe_timeout_s (busy, not dead) and "worker
unresponsive for N s" once older (no step progress: wedged); an idle worker is still probed.

Before: the probe queued behind the step in flight, so a replica under load answered only after its step, later than
a router's 3 s probe timeout, and was taken out of rotation with its streams failed."""

from __future__ import annotations

from radix.manager import KVCacheManager
from runtime import protocol as p
from runtime.config import ServerArgs
from runtime.sampling_params import SamplingParams
from runtime.scheduler.scheduler import Scheduler
from runtime.serve.health import FIRST_STEP_S, WorkerHealth
from runtime.serve.scheduler_process import SchedulerServer
from tests.runtime.serve.inproc import drain, link


def test_step_status_by_the_age_and_size_of_the_step():
    health = WorkerHealth(timeout_s=5.0)
    assert health.step_status(None, 10, 100.0) is None
    assert health.step_limit_s(10) == FIRST_STEP_S  # nothing timed yet: the first steps also warm up
    assert health.step_status(100.0 - FIRST_STEP_S, 10, 100.0) == f"worker unresponsive for {FIRST_STEP_S:.1f} s"
    health.on_step(0.01, 1)
    assert health.step_status(96.0, 1, 100.0) == "ok"
    assert health.step_status(95.0, 1, 100.0) == "worker unresponsive for 5.0 s"  # never below timeout_s
    for seconds, tokens in ((0.5, 10), (2.0, 8), (1.0, 100)):  # an overloaded machine: slow steps are progress
        health.on_step(seconds, tokens)
    assert health.step_limit_s(16) == 16.0  # STEP_SLACK x 16 tokens x the slowest 0.25 s per token
    assert health.step_status(84.5, 16, 100.0) == "ok"
    assert health.step_status(84.0, 16, 100.0) == "worker unresponsive for 16.0 s"


def test_a_busy_worker_is_answered_at_once_and_a_wedged_one_after_the_timeout(ctx):
    to_worker, from_scheduler = link(ctx, "worker")
    to_tok, from_tok = link(ctx, "tok")
    sched = Scheduler(
        KVCacheManager(32, 4), ServerArgs(num_blocks=32, block_size=4), max_model_len=64, eos_token_ids=[2]
    )
    server = SchedulerServer(sched, to_worker, to_tok, None, 5.0, worker_probe_timeout_s=5.0)
    sched.add_request("r", [5, 6, 7], SamplingParams(max_tokens=4))
    server.try_schedule()
    [batch] = drain(from_scheduler, p.WorkerInput)
    assert isinstance(batch, p.ForwardBatch)
    assert server.in_flight and server.step_sent is not None
    server.on_tokenizer_message(p.HealthRequest("busy"))
    assert drain(from_tok, p.TokenizerInput) == [p.HealthResponse("busy", "ok")]  # no probe behind the step
    assert drain(from_scheduler, p.WorkerInput) == []
    server.health.on_step(0.001, 1)  # steps take a millisecond a token here
    server.step_sent -= 6.0  # the step has run 6 s: no progress
    server.on_tokenizer_message(p.HealthRequest("wedged"))
    [answer] = drain(from_tok, p.TokenizerInput)
    assert answer.rid == "wedged" and answer.status.startswith("worker unresponsive for 6.")
    [seq] = batch.seqs
    server.on_worker_message(p.ForwardResult(batch.step_id, [seq.seq_id], [9], num_forward_tokens=3))
    assert server.step_sent is None
    server.on_tokenizer_message(p.HealthRequest("idle"))  # between steps: the worker is probed
    assert drain(from_scheduler, p.WorkerInput) == [p.WorkerProbe(1)]
