"""Health probes and start-up plumbing without a model: WorkerHealth's bookkeeping, the scheduler's health path over
inproc sockets, the worker loop answering a probe between steps, and the process helpers (ipc names, one-line causes,
the tokenizer's stop reason)."""

from __future__ import annotations

import os
import sys
import threading

import msgspec
import pytest
import zmq

from radix.manager import KVCacheManager
from runtime import protocol as p
from runtime.config import InvalidConfig, ServerArgs
from runtime.scheduler.scheduler import Scheduler
from runtime.serve.health import WorkerHealth
from runtime.serve.process import ChildSpec, Endpoints, new_ipc_base, one_line, remove_ipc_base, stop_message
from runtime.serve.scheduler_process import SchedulerServer
from runtime.serve.worker_process import serve_worker
from tests.runtime.serve.inproc import drain, link


def test_worker_health_answers_ok_only_after_the_reply_and_times_out_per_request():
    health = WorkerHealth(timeout_s=2.0)
    assert health.on_request("a", 10.0) == p.WorkerProbe(1)
    assert health.on_request("b", 11.0) is None  # waits on the probe already out
    assert health.expire(11.9) == []
    assert health.expire(12.0) == [p.HealthResponse("a", "worker unresponsive for 2.0 s")]
    assert health.on_request("c", 12.5) is None  # the unanswered probe stays out: no second probe queues behind it
    assert health.expire(13.0) == [p.HealthResponse("b", "worker unresponsive for 3.0 s")]
    assert health.on_reply(p.WorkerProbeReply(0)) == []  # not the probe that is out
    assert health.on_reply(p.WorkerProbeReply(1)) == [p.HealthResponse("c", "ok")]
    assert health.on_reply(p.WorkerProbeReply(1)) == []  # a duplicate answers no one
    assert health.expire(100.0) == []
    assert health.on_request("d", 101.0) == p.WorkerProbe(2)
    assert health.on_reply(p.WorkerProbeReply(2)) == [p.HealthResponse("d", "ok")]
    assert health.waiting == {} and health.probe_sent is None


def test_scheduler_answers_health_after_the_worker(ctx):
    to_worker, from_scheduler = link(ctx, "worker")
    to_tok, from_tok = link(ctx, "tok")
    args = ServerArgs(num_blocks=32, block_size=4)
    sched = Scheduler(KVCacheManager(32, 4), args, max_model_len=64, eos_token_ids=[2])
    server = SchedulerServer(sched, to_worker, to_tok, None, 5.0, worker_probe_timeout_s=0.0)
    server.on_tokenizer_message(p.HealthRequest("h1"))
    server.on_tokenizer_message(p.HealthRequest("h2"))
    assert drain(from_scheduler, p.WorkerInput) == [p.WorkerProbe(1)]
    assert drain(from_tok, p.TokenizerInput) == []  # nothing before the worker answered
    server.on_worker_message(p.WorkerProbeReply(1))
    assert drain(from_tok, p.TokenizerInput) == [p.HealthResponse("h1", "ok"), p.HealthResponse("h2", "ok")]
    server.on_tokenizer_message(p.HealthRequest("h3"))
    assert drain(from_scheduler, p.WorkerInput) == [p.WorkerProbe(2)]
    sent = server.health.probe_sent
    assert sent is not None
    server.expire_health(sent + 1.5)
    assert drain(from_tok, p.TokenizerInput) == [p.HealthResponse("h3", "worker unresponsive for 1.5 s")]


class BlockingRunner:
    """A step runner whose execute waits until `release` is set (a long step)."""

    ready = p.Ready(num_blocks=8, block_size=4, max_model_len=32, num_host_blocks=0, vocab_size=100, eos_token_ids=[2])

    def __init__(self) -> None:
        self.started = threading.Event()
        self.release = threading.Event()

    def execute(self, batch: p.ForwardBatch) -> p.ForwardResult:
        self.started.set()
        assert self.release.wait(10)
        return p.ForwardResult(batch.step_id, [], [], num_forward_tokens=7)


def test_worker_answers_a_probe_between_steps_not_during_one(ctx):
    to_worker, worker_in = link(ctx, "w-in")
    worker_out, from_worker = link(ctx, "w-out")
    runner = BlockingRunner()
    stop = threading.Event()
    loop = threading.Thread(target=serve_worker, args=(runner, worker_in, worker_out, lambda: not stop.is_set(), 20))
    loop.start()
    try:
        to_worker.send(msgspec.msgpack.encode(p.ForwardBatch(5, [])))
        assert runner.started.wait(10)
        to_worker.send(msgspec.msgpack.encode(p.WorkerProbe(9)))
        assert drain(from_worker, p.WorkerOutput) == []  # the step is in flight: the probe waits behind it
        runner.release.set()
        out = drain(from_worker, p.WorkerOutput)
        assert out == [p.ForwardResult(5, [], [], num_forward_tokens=7), p.WorkerProbeReply(9)]
    finally:
        runner.release.set()
        stop.set()
        loop.join(10)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="abstract ipc names are Linux-only")
def test_ipc_endpoints_are_abstract_names_on_linux(ctx):
    base = new_ipc_base()
    assert base.startswith("@radixserve-") and len(base) == len("@radixserve-") + 16
    endpoints = Endpoints.under(base)
    assert endpoints.base == base and endpoints.worker_in == f"ipc://{base}/worker_in"
    pull = ctx.socket(zmq.PULL)
    pull.bind(endpoints.launcher)
    assert f"{base}/launcher" in open("/proc/net/unix").read()
    assert not os.path.exists(base) and not os.path.exists("/tmp/" + base[1:])
    pull.close(linger=0)
    remove_ipc_base(base)  # nothing to remove; must not raise


def test_one_line_names_the_exception_and_joins_lines():
    assert one_line(ValueError("bad pool:\n  3 blocks\n\n")) == "ValueError: bad pool: 3 blocks"
    assert one_line(KeyboardInterrupt()) == "KeyboardInterrupt"


def test_stop_message_tells_a_dead_launcher_from_a_sigterm():
    endpoints = Endpoints.under("@radixserve-test")
    alive = ChildSpec("tokenizer", os.getppid(), endpoints, ServerArgs())
    dead = ChildSpec("tokenizer", os.getppid() + 1, endpoints, ServerArgs())
    assert stop_message(dead) == p.Shutdown("the launcher died", p.ERR_SERVER)
    assert stop_message(alive) == p.Shutdown("the tokenizer process was stopped (no signal)", p.ERR_SHUTDOWN)


def test_health_timeouts_are_validated():
    assert (ServerArgs().worker_probe_timeout_s, ServerArgs().control_timeout_s) == (5.0, 10.0)
    with pytest.raises(InvalidConfig, match=r"^worker_probe_timeout_s must be > 0, got 0.0$"):
        ServerArgs(worker_probe_timeout_s=0.0)
    with pytest.raises(InvalidConfig, match=r"^control_timeout_s must be > worker_probe_timeout_s, got 5.0$"):
        ServerArgs(control_timeout_s=5.0)
