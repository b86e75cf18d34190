"""Bad input to the HTTP server, each kind with its exact status, error type, code and param, in the OpenAI error
shape; clients that leave mid-stream or mid-request abort their requests; the backend's readiness drives /health.
Afterwards the server still serves and every KV block is back in the pool (exact counts from the backend's stats).
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.parse
from http.client import HTTPConnection

import openai
import pytest

from tests.e2e.frozen import frozen, wait_stats, worker_pid
from tests.e2e.http_servers import MODEL, assert_idle, scrape, start_tiny_http
from tests.e2e.servers import TINY_FLAGS
from tests.paths import ROOT

KEY = "sk-radixserve-test"
LIMIT = 262144  # --max-body-bytes of the server under test
M = [{"role": "user", "content": "hello"}]
INVALID, CHAT, TEXT = "invalid_request_error", "/v1/chat/completions", "/v1/completions"
LONG = {"ignore_eos": True, "temperature": 0.0, "max_tokens": 1000}


@pytest.fixture(scope="module")
def http(tiny_server, tiny_llama_dir, tmp_path_factory):
    """The module's HTTP server (the conftest's, with a body limit and an API key)."""
    logs = tmp_path_factory.mktemp("logs")
    server = start_tiny_http(
        tiny_server, tiny_llama_dir, logs, "--max-body-bytes", str(LIMIT), env={"RADIXSERVE_API_KEY": KEY}
    )
    yield server
    assert server.stop() == 0


def connect(url: str) -> HTTPConnection:
    u = urllib.parse.urlsplit(url)
    return HTTPConnection(u.hostname, u.port, timeout=60)


def send(
    url: str,
    method: str,
    path: str,
    body: bytes | dict | None = None,
    key: str | None = KEY,
    headers: dict | None = None,
    chunked: bool = False,
) -> tuple[int, dict]:
    """One request on its own connection: (status, JSON body)."""
    conn = connect(url)
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    hdrs = {
        "Content-Type": "application/json",
        **({"Authorization": f"Bearer {key}"} if key else {}),
        **(headers or {}),
    }
    if chunked:
        conn.request(
            method,
            path,
            body=iter([data[i : i + 65536] for i in range(0, len(data), 65536)]),
            headers=hdrs,
            encode_chunked=True,
        )
    else:
        conn.request(method, path, body=data, headers=hdrs)
    resp = conn.getresponse()
    out = resp.status, json.loads(resp.read())
    conn.close()
    return out


def chat(**fields) -> dict:
    return {"model": MODEL, "messages": M, "max_tokens": 4, **fields}


def text(**fields) -> dict:
    return {"model": MODEL, "max_tokens": 4, **fields}


BIG = json.dumps(chat(messages=[{"role": "user", "content": "x" * (LIMIT + 10)}])).encode()
# kind -> (path, body, send options, status, type, code, param)
CASES = {
    "not JSON": (CHAT, b"{model: tiny", {}, 400, INVALID, "invalid_json", None),
    "invalid UTF-8": (
        CHAT,
        b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}',
        {},
        400,
        INVALID,
        "invalid_json",
        None,
    ),
    "lone surrogate": (
        CHAT,
        b'{"messages": [{"role": "user", "content": "\\udc00"}]}',
        {},
        400,
        INVALID,
        "invalid_json",
        None,
    ),
    "not an object": (CHAT, b"[1]", {}, 400, INVALID, "invalid_type", None),
    "wrong type": (CHAT, chat(max_tokens="ten"), {}, 400, INVALID, "invalid_type", "max_tokens"),
    "wrong nested type": (
        CHAT,
        chat(messages=[{"role": "user", "content": 3}]),
        {},
        400,
        INVALID,
        "invalid_type",
        "messages[0].content",
    ),
    "missing messages": (CHAT, {"model": MODEL}, {}, 400, INVALID, "missing_required_parameter", "messages"),
    "unimplemented known field": (
        CHAT,
        chat(prediction={"type": "content", "content": "x"}),
        {},
        400,
        INVALID,
        "unsupported_parameter",
        "prediction",
    ),
    "unsupported field": (
        CHAT,
        chat(functions=[{"name": "f"}]),
        {},
        400,
        INVALID,
        "unsupported_parameter",
        "functions",
    ),
    "bad tool name": (
        CHAT,
        chat(tools=[{"type": "function", "function": {"name": "no spaces"}}]),
        {},
        400,
        INVALID,
        "invalid_value",
        "tools[0].function.name",
    ),
    "unknown response_format type": (
        CHAT,
        chat(response_format={"type": "xml"}),
        {},
        400,
        INVALID,
        "invalid_value",
        "response_format.type",
    ),
    "max_tokens 0": (CHAT, chat(max_tokens=0), {}, 400, INVALID, "invalid_value", "max_tokens"),
    "max_completion_tokens -1": (
        CHAT,
        chat(max_completion_tokens=-1),
        {},
        400,
        INVALID,
        "invalid_value",
        "max_completion_tokens",
    ),
    "temperature -1": (CHAT, chat(temperature=-1), {}, 400, INVALID, "invalid_value", "temperature"),
    "top_p 5": (CHAT, chat(top_p=5), {}, 400, INVALID, "invalid_value", "top_p"),
    "n 0": (CHAT, chat(n=0), {}, 400, INVALID, "invalid_value", "n"),
    "seed 2**63": (CHAT, chat(seed=2**63), {}, 400, INVALID, "invalid_value", "seed"),
    "top_logprobs 21": (CHAT, chat(logprobs=True, top_logprobs=21), {}, 400, INVALID, "invalid_value", "top_logprobs"),
    "top_logprobs without logprobs": (CHAT, chat(top_logprobs=2), {}, 400, INVALID, "invalid_value", "top_logprobs"),
    "presence_penalty 3": (CHAT, chat(presence_penalty=3), {}, 400, INVALID, "invalid_value", "presence_penalty"),
    "empty stop string": (CHAT, chat(stop=""), {}, 400, INVALID, "invalid_value", "stop"),
    "empty messages": (CHAT, chat(messages=[]), {}, 400, INVALID, "invalid_value", "messages"),
    "unknown role": (
        CHAT,
        chat(messages=[{"role": "wizard", "content": "x"}]),
        {},
        400,
        INVALID,
        "invalid_value",
        "messages[0].role",
    ),
    "empty prompt": (TEXT, text(prompt=""), {}, 400, INVALID, "invalid_request", "prompt"),
    "a bad prompt in a list": (TEXT, text(prompt=["a", [5, 60000]]), {}, 400, INVALID, "invalid_request", "prompt"),
    "token id outside the vocabulary": (TEXT, text(prompt=[5, 60000]), {}, 400, INVALID, "invalid_request", "prompt"),
    "prompt beyond the context": (TEXT, text(prompt=[7] * 1100), {}, 400, INVALID, "context_length_exceeded", "prompt"),
    "huge body": (CHAT, BIG, {}, 413, INVALID, "request_too_large", None),
    "over the backend's message limit": (
        TEXT,
        text(prompt="y" * 70000),
        {},
        413,
        INVALID,
        "message_too_large",
        "prompt",
    ),
    "huge chunked body": (CHAT, BIG, {"chunked": True}, 413, INVALID, "request_too_large", None),
    "wrong model": (CHAT, chat(model="gpt-4o"), {}, 404, "not_found_error", "model_not_found", "model"),
    "unknown route": ("/v1/embeddings", chat(), {}, 404, "not_found_error", "not_found", None),
    "missing API key": (CHAT, chat(), {"key": None}, 401, "authentication_error", "invalid_api_key", None),
    "wrong API key": (CHAT, chat(), {"key": KEY + "x"}, 401, "authentication_error", "invalid_api_key", None),
}


@pytest.mark.parametrize("kind", list(CASES))
def test_bad_input(http, kind):
    path, body, options, status, kind_type, code, param = CASES[kind]
    got_status, got = send(http.url, "POST", path, body, **options)
    assert set(got) == {"error"} and set(got["error"]) == {"message", "type", "param", "code"}
    assert (got_status, got["error"]["type"], got["error"]["code"], got["error"]["param"]) == (
        status,
        kind_type,
        code,
        param,
    )
    assert got["error"]["message"]


def test_the_openai_sdk_raises_the_matching_errors(http):
    with http.openai(api_key=KEY) as oai:
        with pytest.raises(openai.BadRequestError) as bad:
            oai.chat.completions.create(model=MODEL, messages=M, temperature=-1)
        assert (bad.value.status_code, bad.value.code, bad.value.param) == (400, "invalid_value", "temperature")
        with pytest.raises(openai.NotFoundError) as missing:
            oai.chat.completions.create(model="nope", messages=M)
        assert missing.value.code == "model_not_found"
        with pytest.raises(openai.BadRequestError) as long:
            oai.completions.create(model=MODEL, prompt=[7] * 1100, stream=True)  # before the stream starts
        assert long.value.code == "context_length_exceeded"
    with http.openai(api_key="wrong") as oai, pytest.raises(openai.AuthenticationError) as auth:
        oai.models.list()
    assert auth.value.code == "invalid_api_key"


def test_v1_needs_the_key_and_health_and_metrics_do_not(http):
    assert send(http.url, "GET", "/health", key=None) == (200, {"status": "ok"})
    for path in ("/v1/models", "/v1/nope"):
        assert send(http.url, "GET", path, key=None)[0] == 401
    assert send(http.url, "GET", "/nope", key=None)[0] == 404
    assert scrape(http.url)  # /metrics: no key needed, as in vLLM


def successes(url: str) -> float:
    """request_success_total of the HTTP server at url, summed over finish reasons."""
    samples = scrape(url, {"Authorization": f"Bearer {KEY}"})
    return sum(v for (name, _), v in samples.items() if name == "radixserve:request_success_total")


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_leaves_aborts_its_request(http, zmq, wait_idle, tiny_server, stream):
    """Once the request has generated tokens, the worker is frozen (tests/e2e/frozen.py), so no step can finish it:
    the request leaves the running set only through the abort that the disconnect causes, nothing is generated after
    that, the HTTP server counts no completion, and every block comes back."""
    assert_idle(zmq, wait_idle)
    worker = worker_pid(tiny_server)
    before = zmq.stats().generated_tokens
    served = successes(http.url)
    conn = connect(http.url)
    body = json.dumps(text(prompt=[300, 301, 302, 303], stream=stream, **LONG)).encode()
    conn.request(
        "POST", TEXT, body=body, headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    )
    if stream:
        resp = conn.getresponse()
        assert resp.status == 200
        assert resp.readline().startswith(b"data: {")
    else:
        wait_stats(zmq, lambda s: s.num_running == 1 and s.generated_tokens > before, "the request never decoded")
    with frozen(worker):
        held = zmq.stats()
        assert held.num_running == 1, "the request finished before its worker was frozen"
        conn.sock.shutdown(socket.SHUT_RDWR)
        conn.close()
        aborted = wait_stats(zmq, lambda s: s.num_running == 0, "the disconnect did not abort the request")
    assert_idle(zmq, wait_idle)
    decoded = held.generated_tokens - before
    # at most the step in flight when the worker stopped was applied after `held`
    assert 1 <= decoded <= aborted.generated_tokens - before <= decoded + 1 < LONG["max_tokens"]
    assert zmq.stats().generated_tokens == aborted.generated_tokens  # nothing decoded after the abort
    assert successes(http.url) == served


def test_after_all_that_the_server_serves_and_every_block_is_back(http, zmq, wait_idle):
    with http.openai(api_key=KEY) as oai:
        r = oai.chat.completions.create(
            model=MODEL, messages=M, max_tokens=3, temperature=0.0, extra_body={"ignore_eos": True}
        )
    assert (r.usage.completion_tokens, r.choices[0].finish_reason) == (3, "length")
    stats = wait_idle(zmq)
    assert (stats.num_running, stats.num_waiting, stats.num_used_blocks, stats.num_swapped) == (0, 0, 0, 0)
    assert stats.num_free_blocks + stats.num_evictable_blocks == stats.num_blocks - 1 == 1023


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_health_follows_the_backend(tiny_llama_dir, tmp_path, server_factory):
    """503 before the backend is up (and completions 503), 200 once it answered a probe, 503 once it is gone."""
    backend_port, port = free_port(), free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [
        sys.executable,
        "-m",
        "runtime.serve.http",
        "--backend",
        f"tcp://127.0.0.1:{backend_port}",
        "--port",
        str(port),
        "--model",
        str(tiny_llama_dir),
        "--served-model-name",
        MODEL,
        "--health-timeout-s",
        "1",
    ]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                status, body = send(url, "GET", "/health")
                break
            except OSError:
                assert time.monotonic() < deadline and proc.poll() is None
                time.sleep(0.1)
        assert (status, body["error"]["type"], body["error"]["code"]) == (
            503,
            "service_unavailable_error",
            "backend_unavailable",
        )
        assert send(url, "POST", CHAT, chat())[0] == 503
        server = server_factory(str(tiny_llama_dir), tmp_path / "backend.log", *TINY_FLAGS, "--port", str(backend_port))
        try:
            assert proc.stdout.readline() == f"radixserve http ready at {url}\n"
            assert send(url, "GET", "/health") == (200, {"status": "ok"})
            assert send(url, "POST", CHAT, chat(max_tokens=2, temperature=0.0))[0] == 200
        finally:
            server.stop()
        status, body = send(url, "GET", "/health")
        assert (status, body["error"]["code"]) == (503, "backend_unavailable")
    finally:
        proc.terminate()
        assert proc.wait(20) == 0
