"""Health reaches the worker: a real server whose worker (or scheduler) is frozen with SIGSTOP answers health with
something other than "ok" (or a typed error) instead of "ok" or silence, idle or with a batch in flight (once the
step is older than the probe timeout: a younger one is busy, answered "ok" at once), and serves on when the process
is continued."""

from __future__ import annotations

import os
import re
import signal
import time

import pytest

from runtime import protocol as p
from runtime.client import ServerFailedError

PROBE_TIMEOUT_S = 1.0  # --worker-probe-timeout-s of the server under test
CONTROL_TIMEOUT_S = 3.0  # --control-timeout-s


@pytest.fixture(scope="module")
def running(tiny_llama_dir, server_factory, tmp_path_factory):
    """A tiny server with short health timeouts, shared by this module's tests; stopped at the end."""
    server = server_factory(
        str(tiny_llama_dir),
        tmp_path_factory.mktemp("logs") / "health.log",
        "--num-blocks",
        "64",
        "--worker-probe-timeout-s",
        str(PROBE_TIMEOUT_S),
        "--control-timeout-s",
        str(CONTROL_TIMEOUT_S),
    )
    yield server
    server.stop()


@pytest.fixture
def server(running):
    """(server, {role: pid}); every child is continued (SIGCONT) after the test, whatever it froze."""
    pids = running.child_pids()
    assert sorted(pids) == ["scheduler", "tokenizer", "worker"]
    yield running, pids
    for pid in pids.values():
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass


def unresponsive_for(status: str) -> float:
    """N of a "worker unresponsive for N s" health status (fails the test for any other status)."""
    match = re.fullmatch(r"worker unresponsive for (\d+\.\d) s", status)
    assert match is not None, status
    return float(match.group(1))


def health_once_ok(client, timeout_s: float = 10.0) -> str:
    """Polls health until "ok" (a probe sent while the worker was frozen may still be answered late)."""
    deadline = time.monotonic() + timeout_s
    status = client.health()
    while status != "ok" and time.monotonic() < deadline:
        status = client.health()
    return status


def test_frozen_idle_worker_is_reported_unresponsive(server):
    srv, pids = server
    with srv.client(timeout=60) as c:
        assert c.health() == "ok"
        os.kill(pids["worker"], signal.SIGSTOP)
        first = unresponsive_for(c.health())
        second = unresponsive_for(c.health())  # waits on the same unanswered probe: a longer silence
        assert PROBE_TIMEOUT_S <= first < second
        os.kill(pids["worker"], signal.SIGCONT)
        assert health_once_ok(c) == "ok"


def test_frozen_busy_worker_is_reported_unresponsive_and_the_stream_resumes(server):
    srv, pids = server
    with srv.client(timeout=120) as c, srv.client(timeout=120) as probe:  # the freeze lasts the step limit
        stream = c.stream(input_ids=[1, 2, 3], ignore_eos=True, temperature=0.0, max_tokens=300)
        first = next(stream)
        os.kill(pids["worker"], signal.SIGSTOP)  # a step in flight (or about to be sent) does not come back
        frozen_at = time.monotonic()
        status = probe.health()  # "ok" while the step in flight is younger than the probe timeout (busy, not wedged)
        while status == "ok" and time.monotonic() - frozen_at < 10 * PROBE_TIMEOUT_S:
            time.sleep(0.1)
            status = probe.health()
        assert unresponsive_for(status) >= PROBE_TIMEOUT_S
        stats = probe.stats()  # the scheduler itself still answers
        assert (stats.num_running, stats.num_waiting) == (1, 0)
        os.kill(pids["worker"], signal.SIGCONT)
        chunks = [first, *stream]
        assert health_once_ok(probe) == "ok"
    assert sum(len(ch.token_ids) for ch in chunks) == 300
    assert chunks[-1].finish_reason == "length"


def test_frozen_scheduler_fails_health_with_a_server_error(server):
    srv, pids = server
    with srv.client(timeout=60) as c:
        assert c.health() == "ok"
        os.kill(pids["scheduler"], signal.SIGSTOP)
        with pytest.raises(ServerFailedError) as info:
            c.health()
        assert info.type is ServerFailedError  # the tokenizer's answer, not the client's liveness timeout
        assert (info.value.code, info.value.message) == (
            p.ERR_SERVER,
            f"the scheduler did not answer within {CONTROL_TIMEOUT_S} s",
        )
        os.kill(pids["scheduler"], signal.SIGCONT)
        assert health_once_ok(c) == "ok"
