"""Replicas under full load behind a router with a 1 s probe timeout (issue 28, class 5): a replica whose step runs
longer than the router's probe timeout (its worker frozen 2.5 s with SIGSTOP, a slow step: shorter than the
replica's own 5 s worker-probe timeout) is busy, not dead. It answers the router's probes at once (the scheduler
answers from the step's age: runtime/serve/health.py), stays in rotation, and not one stream of either replica fails.

Before: the probe waited behind the step, the router took the replica out of rotation after 1 s ("no answer to a
health probe") and failed every stream it had started."""

from __future__ import annotations

import os
import signal
import time

import pytest

from runtime.client import Client
from tests.e2e.processes import role_pids
from tests.router.router_cases import start_router

PROMPT = "Count slowly from one to a thousand, one number per line."
LONG = {"max_tokens": 80, "temperature": 0.0, "ignore_eos": True}
STREAMS = 8


@pytest.mark.slow
def test_a_slow_step_under_full_load_fails_no_stream(replicas, tiny_llama_dir, tmp_path):
    router = start_router(
        tiny_llama_dir,
        [r.endpoint for r in replicas],
        tmp_path / "router.log",
        "--policy",
        "round_robin",
        "--health-timeout-s",
        "1.0",
    )
    worker = role_pids(replicas[0].proc.pid)["worker"]
    try:
        with Client(router.endpoint, timeout=120) as c:
            rids = [c.submit(prompt=PROMPT, cache_salt=f"busy-{i}", **LONG) for i in range(STREAMS)]
            with replicas[0].client() as r0:
                deadline = time.monotonic() + 30
                while r0.stats().num_running == 0:  # its share is running
                    assert time.monotonic() < deadline
                    time.sleep(0.02)
            os.kill(worker, signal.SIGSTOP)  # its step in flight takes 2.5 s
            time.sleep(2.5)
            os.kill(worker, signal.SIGCONT)
            results = [c.result(rid) for rid in rids]
    finally:
        os.kill(worker, signal.SIGCONT)
        router.stop()
    assert [len(r.token_ids) for r in results] == [LONG["max_tokens"]] * STREAMS
    assert {r.finish_reason for r in results} == {"length"}
    log = (tmp_path / "router.log").read_text()
    assert "out of rotation" not in log, log[-2000:]
