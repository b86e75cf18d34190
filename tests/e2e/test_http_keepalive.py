"""A streamed beam search (issue 28, class 7), which sends nothing until its beams end: the response headers come
within KEEPALIVE_S, a `: keep-alive` SSE comment every KEEPALIVE_S until the first event, and the events are those of
the same request's ZeroMQ stream. The openai SDK skips the comments. A streamed request that fails at once is still a
plain 400.

Before: nothing, not even the headers, until the beam search ended."""

from __future__ import annotations

import json
import socket
import time
import urllib.parse

import pytest

from runtime.serve.http.keepalive import KEEPALIVE_S
from tests.e2e.http_servers import MODEL
from tests.e2e.http_servers import http as request

PROMPT = list(range(700, 720))
BEAM = {"use_beam_search": True, "n": 4, "temperature": 0.0, "max_tokens": 900, "ignore_eos": True}


def timed_lines(url: str, body: dict) -> list[tuple[float, str]]:
    """(seconds since the request was sent, line) of a raw HTTP/1.1 answer read until the server closes it."""
    u = urllib.parse.urlsplit(url)
    data = json.dumps(body).encode()
    sock = socket.create_connection((u.hostname, u.port), timeout=120)
    head = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(data)}"
    sock.sendall(f"{head}\r\nConnection: close\r\n\r\n".encode() + data)
    start = time.monotonic()
    out, buf = [], b""
    while chunk := sock.recv(65536):
        now = time.monotonic() - start
        buf += chunk
        *lines, buf = buf.split(b"\n")
        out.extend((now, line.decode().rstrip("\r")) for line in lines)
    sock.close()
    return out


@pytest.mark.slow
def test_a_beam_search_stream_starts_at_once_and_stays_alive(http, tiny_server):
    lines = timed_lines(http.url, {"model": MODEL, "prompt": PROMPT, "stream": True, **BEAM})
    status_at, status = lines[0]
    assert status == "HTTP/1.1 200 OK"
    assert status_at < KEEPALIVE_S + 1.0
    events = [(t, line[6:]) for t, line in lines if line.startswith("data: ")]
    comments = [t for t, line in lines if line == ": keep-alive"]
    first_event_at = events[0][0]
    assert first_event_at > 2 * KEEPALIVE_S, "the beam search ended too soon to show keep-alives"
    assert len(comments) >= int(first_event_at / KEEPALIVE_S) - 1 >= 1
    assert all(t < first_event_at for t in comments)
    gaps = [b - a for a, b in zip([status_at, *comments], [*comments, first_event_at], strict=True)]
    assert max(gaps) < KEEPALIVE_S + 1.0  # never silent much longer than KEEPALIVE_S
    assert events[-1][1] == "[DONE]"
    choices = sorted((c for _, e in events[:-1] for c in json.loads(e)["choices"]), key=lambda c: c["index"])
    with tiny_server.client(timeout=300) as c:
        want = c.generate(input_ids=PROMPT, **BEAM)
    assert [ch["text"] for ch in choices] == [ch.text for ch in want.choices]


def test_a_streamed_request_that_fails_at_once_is_still_a_400(http):
    status, body = request("POST", http.url + "/v1/completions", {"prompt": list(range(5000)), "stream": True})
    assert status == 400 and json.loads(body)["error"]["code"] == "context_length_exceeded"
