"""A replica killed mid-run: the router keeps serving on the other; requests that had sent nothing to their client
are re-sent there (no error), a stream already under way fails with a typed error; the replica, started again on the
same port, is taken back into rotation with a fresh snapshot."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from runtime.client import Client, ServerFailedError
from tests.e2e.processes import children as direct_children
from tests.router.router_cases import prompt_tokens, start_replica, start_router

PROMPT = "Count slowly from one to a thousand, one number per line."
LONG = {"max_tokens": 120, "temperature": 0.0, "ignore_eos": True}


def _wait_gone(pids: list[int], timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while any(Path(f"/proc/{pid}").exists() for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)


def _wait_running(replica, n: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    with replica.client() as c:
        while c.stats().num_running != n:
            assert time.monotonic() < deadline, "requests did not reach the replica"
            time.sleep(0.02)


def test_killed_replica(tiny_llama_dir, tmp_path):
    victim = start_replica(tiny_llama_dir, tmp_path / "victim.log")
    survivor = start_replica(tiny_llama_dir, tmp_path / "survivor.log")
    router = start_router(
        tiny_llama_dir, [victim.endpoint, survivor.endpoint], tmp_path / "router.log", "--policy", "round_robin"
    )
    try:
        with survivor.client() as c:
            want = c.generate(prompt=PROMPT, **LONG).token_ids
        with Client(router.endpoint, timeout=120) as streamer, Client(router.endpoint, timeout=120) as batch:
            stream = streamer.stream(prompt=PROMPT, **LONG)  # round robin: the victim (first backend)
            first = next(stream)
            rids = [batch.submit(prompt=PROMPT, **LONG) for _ in range(4)]  # survivor, victim, survivor, victim
            _wait_running(victim, 3)
            children = direct_children(victim.proc.pid)
            os.kill(victim.proc.pid, signal.SIGKILL)  # the launcher; its children follow (parent-death signal)
            with pytest.raises(ServerFailedError):
                for _chunk in stream:
                    pass
            results = [batch.result(rid) for rid in rids]  # no error: the victim's two are re-sent
        assert first.token_ids
        assert [r.token_ids for r in results] == [want] * 4
        with survivor.client() as c:
            assert c.stats().prompt_tokens == 5 * results[0].usage.prompt_tokens  # want, its two, the victim's two
        _wait_gone(children)
        victim = start_replica(tiny_llama_dir, tmp_path / "victim2.log", port=victim.port)  # back on its port
        deadline = time.monotonic() + 30
        with router.client() as c:
            while c.stats().num_blocks != 2 * 512:  # both replicas in rotation again
                assert time.monotonic() < deadline, "the restarted replica was not taken back"
                time.sleep(0.1)
            outs = [c.generate(prompt=PROMPT, max_tokens=4, temperature=0.0, ignore_eos=True) for _ in range(2)]
        assert [o.token_ids for o in outs] == [want[:4]] * 2
        assert prompt_tokens([victim])[0] == outs[0].usage.prompt_tokens  # round robin sent one to it
    finally:
        for proc in (router, victim, survivor):
            proc.stop()
