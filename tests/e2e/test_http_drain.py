"""Admission control and graceful drain, each on a server of its own (their flags change how it stops and admits):
--max-queued-requests answers 429 with Retry-After at once and serves again once a slot frees; SIGTERM to the
launcher with 8 streams in flight (held by freezing the worker) answers new requests 503, lets all 8 finish, then
every process exits, the launcher with status 0."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import time

import openai
import pytest

from tests.e2e.frozen import frozen, worker_pid
from tests.e2e.http_servers import MODEL, assert_idle, http, start_http_server, start_tiny_http
from tests.e2e.processes import descendants, role_pids
from tests.e2e.servers import TINY_FLAGS

LONG = {"temperature": 0.0, "extra_body": {"ignore_eos": True}}
STREAM_TOKENS = 40  # each of the 8 drained streams


def test_a_request_over_the_queue_limit_is_a_429_and_the_server_serves_after(
    tiny_server, tiny_llama_dir, tmp_path, zmq, wait_idle
):
    """Limit 2 in flight (1 running slot + 1 queued). Two streams are held mid-answer by freezing the worker, so the
    third request finds both in flight whatever the machine's speed."""
    flags = ("--max-running-requests", "1", "--max-queued-requests", "1")
    server = start_tiny_http(tiny_server, tiny_llama_dir, tmp_path, *flags)
    try:
        with server.openai() as oai:
            streams = [
                oai.completions.create(model=MODEL, prompt=[600 + i, 601], max_tokens=60, stream=True, **LONG)
                for i in range(2)
            ]
            firsts = [next(iter(s)) for s in streams]
            assert all(f.choices[0].index == 0 for f in firsts)
            with frozen(worker_pid(tiny_server)):
                with pytest.raises(openai.RateLimitError) as info:
                    oai.completions.create(model=MODEL, prompt="over the limit", max_tokens=2)
            assert (info.value.status_code, info.value.code) == (429, "rate_limit_exceeded")
            assert info.value.response.headers["retry-after"] == "1"
            assert all(sum(1 for _ in s) > 0 for s in streams)  # both run to their end
            deadline = time.monotonic() + 10
            while True:  # the two slots free as their answers end
                try:
                    r = oai.completions.create(model=MODEL, prompt="after", max_tokens=3, **LONG)
                    break
                except openai.RateLimitError:
                    assert time.monotonic() < deadline
                    time.sleep(0.05)
            assert (r.choices[0].finish_reason, r.usage.completion_tokens) == ("length", 3)
        assert_idle(zmq, wait_idle)
        assert len([line for line in server.log.read_text().splitlines() if "status 429" in line]) >= 1
    finally:
        assert server.stop() == 0


async def _stream(client: openai.AsyncOpenAI, i: int, started: asyncio.Event, seen: list[int]) -> tuple:
    stream = await client.completions.create(
        model="tiny",
        prompt=[700 + i, 701, 702],
        max_tokens=STREAM_TOKENS,
        stream=True,
        stream_options={"include_usage": True},
        **LONG,
    )
    finish = usage = None
    async for chunk in stream:
        if chunk.choices:
            finish = chunk.choices[0].finish_reason or finish
            if len(seen) <= i or seen[i] == 0:
                seen[i] = 1
                if sum(seen) == len(seen):
                    started.set()
        else:
            usage = chunk.usage.completion_tokens
    return finish, usage


@pytest.mark.slow  # its own server (about 20 s to start on 2 loaded cores), then 8 x 40 tokens
def test_sigterm_drains_eight_streams_then_exits_0(tiny_llama_dir, tmp_path):
    server = start_http_server(
        str(tiny_llama_dir),
        tmp_path / "drain.log",
        *TINY_FLAGS,
        "--shutdown-timeout",
        "120",
        "--served-model-name",
        "tiny",
        "--log-level",
        "INFO",  # the drain's log line is checked (an earlier in-process launch may have left a quieter level)
        env={**os.environ, "RADIXSERVE_THREADS": "1", "RADIXSERVE_LOG_LEVEL": "INFO"},
    )
    pids = descendants(server.proc.pid)
    assert len(pids) == 4
    worker = role_pids(server.proc.pid)["worker"]
    status, card = http("GET", server.url + "/v1/models/tiny")
    assert (status, json.loads(card)["max_model_len"]) == (200, 1024)  # the tiny model's context, as the scheduler said

    async def run() -> list[tuple]:
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
        started = asyncio.Event()
        seen = [0] * 8
        tasks = [asyncio.ensure_future(_stream(client, i, started, seen)) for i in range(8)]
        await asyncio.wait_for(started.wait(), 60)
        with frozen(worker):  # the streams stay in flight through the drain's start, however fast the model is
            server.proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 20
            while (await asyncio.to_thread(http, "GET", server.url + "/health"))[0] != 503:
                assert time.monotonic() < deadline, "the server never started draining"
                await asyncio.sleep(0.05)
            status, body = await asyncio.to_thread(
                http, "POST", server.url + "/v1/completions", {"prompt": "late", "max_tokens": 2}
            )
            assert status == 503 and b"shutting down" in body
            assert not any(t.done() for t in tasks), "a stream ended while the worker was frozen"
        results = await asyncio.gather(*tasks)
        await client.close()
        return results

    results = asyncio.run(run())
    assert results == [("length", STREAM_TOKENS)] * 8
    assert server.proc.wait(60) == 0
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in pids):
        assert time.monotonic() < deadline, "a child outlived the launcher"
        time.sleep(0.05)
    drained = re.findall(r"SIGTERM: draining (\d+) requests in flight", server.log.read_text())
    assert drained in (["8"], ["9"])  # the 8 streams, and maybe a /health poll sent before the drain began


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except OSError:
        return False
