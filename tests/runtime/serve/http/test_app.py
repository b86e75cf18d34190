"""The HTTP app in process against a scripted ZeroMQ backend (a ROUTER thread that answers like the tokenizer
process): readiness, the SSE shape with n > 2 and include_usage, the metrics it observes, the body limit while
reading, the AbortRequest a client disconnect sends, and /tokenize, /detokenize and logprobs token texts answered by
the backend, all without model or server processes (seconds)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import msgspec
import pytest
import zmq

from runtime import protocol as p
from runtime.serve.http.app import build_app
from runtime.serve.http.config import HttpConfig
from runtime.serve.http.metrics import HttpMetrics
from tests.paths import ROOT

WORDS = ["Hel", "lo", "!"]


class FakeBackend:
    """A ROUTER on a free port: answers health once `healthy` is set, stats, and each GenerateRequest with one chunk
    per word per completion (finish "stop" on the last) unless `hold` is set (then one chunk, then nothing).
    Records every message it got in `got`."""

    def __init__(self) -> None:
        self.healthy = threading.Event()
        self.hold = threading.Event()
        self.stop = threading.Event()
        self.got: list[p.ClientMessage] = []
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        enc = msgspec.msgpack.Encoder()
        while not self.stop.is_set():
            if not self.sock.poll(20):
                continue
            ident, frame = self.sock.recv_multipart()
            msg = p.decode_client_frame(frame, 1 << 20)
            self.got.append(msg)
            for reply in self._replies(msg):
                self.sock.send_multipart([ident, enc.encode(reply)])
        self.sock.close(linger=0)

    def _replies(self, msg) -> Iterator:
        if isinstance(msg, p.HealthRequest) and self.healthy.is_set():
            yield p.HealthResponse(msg.rid, "ok")
        elif isinstance(msg, p.StatsRequest):
            yield p.StatsResponse(msg.rid, p.ServerStats(num_blocks=9, prompt_tokens=7))
        elif isinstance(msg, p.TokenizeRequest):  # one id per character, or per message
            yield p.TokenizeResponse(msg.rid, list(range(len(msg.prompt or msg.messages or ()))))
        elif isinstance(msg, p.DetokenizeRequest):
            bad = [i for i, t in enumerate(msg.token_ids) if t >= 100]
            if bad:
                text = f"token_ids[{bad[0]}] = {msg.token_ids[bad[0]]} is outside the vocabulary [0, 100)"
                yield p.ErrorResponse(msg.rid, p.ERR_INVALID, text)
            else:
                yield p.DetokenizeResponse(msg.rid, "".join(WORDS[t % 3] for t in msg.token_ids))
        elif isinstance(msg, p.GenerateRequest):
            words = WORDS[:1] if self.hold.is_set() else WORDS
            logprobs = msg.sampling_params.logprobs is not None
            for i in range(msg.sampling_params.n):
                for j, word in enumerate(words):
                    last = j == len(WORDS) - 1
                    yield p.StreamChunk(
                        rid=msg.rid,
                        index=i,
                        text=word,
                        token_ids=[100 + j],
                        logprobs=[p.TokenLogprobs(-0.5, [100 + j, 7], [-0.5, -1.5])] if logprobs else None,
                        token_texts=[p.TokenText(word, [word, "§"])] if logprobs else None,
                        finish_reason="stop" if last else None,
                        usage=p.Usage(7, 2, 3, 0.25) if last else None,
                    )

    def aborted(self) -> list[str]:
        return [m.rid for m in self.got if isinstance(m, p.AbortRequest)]

    def generated(self) -> list[str]:
        return [m.rid for m in self.got if isinstance(m, p.GenerateRequest)]


@pytest.fixture
def backend():
    fake = FakeBackend()
    yield fake
    fake.stop.set()
    fake.thread.join()


class Call:
    """One ASGI HTTP call: body sent in `parts`; after the body, receive() blocks until disconnect() (or the
    response is complete). Collects the status and body."""

    def __init__(self, method: str, path: str, parts: list[bytes], headers: list[tuple[bytes, bytes]]) -> None:
        self.scope = {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": "1.1",
            "method": method,
            "path": path,
            "raw_path": path.encode(),
            "query_string": b"",
            "headers": headers,
            "scheme": "http",
            "server": ("t", 80),
            "client": ("c", 1),
            "root_path": "",
        }
        self.parts = list(parts)
        self.gone = asyncio.Event()
        self.status: int | None = None
        self.body = b""
        self.events: list[bytes] = []

    async def receive(self) -> dict:
        if self.parts:
            part = self.parts.pop(0)
            return {"type": "http.request", "body": part, "more_body": bool(self.parts)}
        await self.gone.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
        elif message.get("body"):
            self.body += message["body"]
            self.events.append(message["body"])

    def json(self) -> dict:
        return json.loads(self.body)


def call(
    app,
    method: str,
    path: str,
    body: dict | bytes | None = None,
    parts: list[bytes] | None = None,
    headers: dict[str, str] | None = None,
) -> Call:
    data = json.dumps(body).encode() if isinstance(body, dict) else (body or b"")
    raw = [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    return Call(method, path, parts if parts is not None else [data], raw)


async def run(app, c: Call) -> Call:
    await app(c.scope, c.receive, c.send)
    return c


async def until(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline
        await asyncio.sleep(0.01)


def served(backend: FakeBackend, **config):
    """(app, metrics) for an HttpConfig on the fake backend; use inside `async with app.router.lifespan_context`."""
    metrics = HttpMetrics("m")
    cfg = HttpConfig(
        backend=f"tcp://127.0.0.1:{backend.port}",
        model="smollm2",
        served_model_name="m",
        health_timeout_s=0.2,
        **config,
    )
    return build_app(cfg, metrics), metrics


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def test_503_until_the_backend_answers_a_probe(backend):
    async def go():
        app, _ = served(backend)
        async with app.router.lifespan_context(app):
            health = await run(app, call(app, "GET", "/health"))
            chat = await run(app, call(app, "POST", "/v1/chat/completions", CHAT))
            assert (health.status, health.json()["error"]["code"]) == (503, "backend_unavailable")
            assert (chat.status, chat.json()["error"]["type"]) == (503, "service_unavailable_error")
            scrape = await run(app, call(app, "GET", "/metrics"))  # only the HTTP series while there are no stats
            assert scrape.status == 200 and b"request_success_total" in scrape.body
            assert b"prompt_tokens_total" not in scrape.body
            backend.healthy.set()
            await asyncio.wait_for(app.state.backend.ready.wait(), 10)
            assert (await run(app, call(app, "GET", "/health"))).json() == {"status": "ok"}
            assert (await run(app, call(app, "POST", "/v1/chat/completions", CHAT))).status == 200

    asyncio.run(go())


def test_stream_shape_with_n2_include_usage_and_the_metrics_observed(backend):
    backend.healthy.set()

    async def go():
        app, metrics = served(backend)
        async with app.router.lifespan_context(app):
            await app.state.backend.ready.wait()
            body = {**CHAT, "n": 2, "stream": True, "stream_options": {"include_usage": True}}
            c = await run(app, call(app, "POST", "/v1/chat/completions", body))
            assert c.status == 200
            text = c.body.decode()
            assert text.endswith("data: [DONE]\n\n")
            events = [json.loads(e[len("data: ") :]) for e in text.split("\n\n")[:-2]]
            choices = [
                (e["choices"][0]["index"], e["choices"][0]["delta"], e["choices"][0]["finish_reason"])
                for e in events[:-1]
            ]
            assert choices == [
                (0, {"role": "assistant", "content": "Hel"}, None),
                (0, {"content": "lo"}, None),
                (0, {"content": "!"}, "stop"),
                (1, {"role": "assistant", "content": "Hel"}, None),
                (1, {"content": "lo"}, None),
                (1, {"content": "!"}, "stop"),
            ]
            assert all(e["usage"] is None for e in events[:-1])
            assert (events[-1]["choices"], events[-1]["usage"]) == (
                [],
                {
                    "prompt_tokens": 7,
                    "completion_tokens": 6,
                    "total_tokens": 13,
                    "prompt_tokens_details": {"cached_tokens": 2},
                },
            )
            exposition = (await run(app, call(app, "GET", "/metrics"))).body.decode()
        assert 'radixserve:request_success_total{finish_reason="stop",model_name="m"} 2.0' in exposition
        assert 'radixserve:time_to_first_token_seconds_count{model_name="m"} 2.0' in exposition
        assert 'radixserve:inter_token_latency_seconds_count{model_name="m"} 4.0' in exposition
        assert 'radixserve:request_queue_time_seconds_sum{model_name="m"} 0.5' in exposition
        assert 'radixserve:prompt_tokens_total{model_name="m"} 7.0' in exposition  # the stats of the scrape
        assert metrics is not None

    asyncio.run(go())


@pytest.mark.parametrize("stream", [False, True])
def test_a_disconnect_sends_the_abort(backend, stream):
    backend.healthy.set()
    backend.hold.set()

    async def go():
        app, _ = served(backend)
        async with app.router.lifespan_context(app):
            await app.state.backend.ready.wait()
            c = call(app, "POST", "/v1/chat/completions", {**CHAT, "stream": stream})
            task = asyncio.ensure_future(run(app, c))
            await until(lambda: backend.generated() and (not stream or c.events))
            assert backend.aborted() == []
            c.gone.set()
            await asyncio.wait_for(asyncio.shield(task), 5)  # the disconnect itself ends the call
            await until(lambda: backend.aborted() == backend.generated())

    asyncio.run(go())


def test_body_limit_on_content_length_and_while_reading(backend):
    backend.healthy.set()

    async def go():
        app, _ = served(backend, max_body_bytes=1000)
        async with app.router.lifespan_context(app):
            await app.state.backend.ready.wait()
            declared = call(app, "POST", "/v1/completions", parts=[b"{}"], headers={"Content-Length": "1001"})
            streamed = call(app, "POST", "/v1/completions", parts=[b" " * 600, b" " * 600])
            for c in (await run(app, declared), await run(app, streamed)):
                assert (c.status, c.json()["error"]["code"]) == (413, "request_too_large")
            ok = call(app, "POST", "/v1/completions", parts=[b'{"prompt": "a",', b' "max_tokens": 2}'])
            assert (await run(app, ok)).json()["choices"][0]["text"] == "Hello!"

    asyncio.run(go())


def test_tokenize_detokenize_and_token_texts_come_from_the_backend(backend):
    """The HTTP process has no tokenizer: /tokenize and /detokenize are the backend's TokenizeRequest and
    DetokenizeRequest (chat messages mapped as the chat route maps them), its refusal the 400 naming the body's
    field, and logprobs name tokens by the texts the backend sent with them."""
    backend.healthy.set()

    async def go():
        app, _ = served(backend)
        async with app.router.lifespan_context(app):
            await app.state.backend.ready.wait()
            developer = [{"role": "developer", "content": "be brief"}, {"role": "user", "content": "hi"}]
            c = await run(app, call(app, "POST", "/tokenize", {"messages": developer}))
            assert (c.status, c.json()) == (200, {"count": 2, "tokens": [0, 1]})
            c = await run(app, call(app, "POST", "/tokenize", {"prompt": "abc", "add_special_tokens": False}))
            assert (c.status, c.json()) == (200, {"count": 3, "tokens": [0, 1, 2]})
            c = await run(app, call(app, "POST", "/detokenize", {"tokens": [0, 1, 2]}))
            assert (c.status, c.json()) == (200, {"prompt": "Hello!"})
            c = await run(app, call(app, "POST", "/detokenize", {"tokens": [0, 1, 250]}))
            assert (c.status, c.json()) == (
                400,
                {
                    "error": {
                        "message": "tokens[2] = 250 is outside the vocabulary [0, 100)",
                        "type": "invalid_request_error",
                        "param": "tokens[2]",
                        "code": "invalid_value",
                    }
                },
            )
            body = {**CHAT, "logprobs": True, "top_logprobs": 1}
            c = await run(app, call(app, "POST", "/v1/chat/completions", body))
            [entry, *_] = c.json()["choices"][0]["logprobs"]["content"]
            assert entry == {
                "token": "Hel",
                "logprob": -0.5,
                "bytes": [72, 101, 108],
                "top_logprobs": [
                    {"token": "Hel", "logprob": -0.5, "bytes": [72, 101, 108]},
                    {"token": "§", "logprob": -1.5, "bytes": [194, 167]},
                ],
            }

    asyncio.run(go())
    sent = [m for m in backend.got if isinstance(m, (p.TokenizeRequest, p.DetokenizeRequest))]
    assert [(type(m).__name__, m.rid != "") for m in sent] == [
        ("TokenizeRequest", True),
        ("TokenizeRequest", True),
        ("DetokenizeRequest", True),
        ("DetokenizeRequest", True),
    ]
    assert sent[0].messages == [p.ChatMessage("system", "be brief"), p.ChatMessage("user", "hi")]
    assert (sent[1].prompt, sent[1].add_special_tokens) == ("abc", False)


IMPORTS_AFTER_START = """
import asyncio, sys
from runtime.serve.http.app import build_app
from runtime.serve.http.config import HttpConfig
from runtime.serve.http.metrics import HttpMetrics

async def main():
    config = HttpConfig(backend="tcp://127.0.0.1:9", model="smollm2", health_timeout_s=0.1)
    app = build_app(config, HttpMetrics("m"))
    async with app.router.lifespan_context(app):
        await asyncio.sleep(0.3)

asyncio.run(main())
print(sorted(m for m in ("transformers", "tokenizers", "torch", "runtime.model.loader") if m in sys.modules))
"""


def test_the_http_server_loads_no_tokenizer():
    """Started (its lifespan run), the HTTP app has imported neither transformers nor tokenizers (nor torch): it
    loads no tokenizer of its own, whatever its model argument names."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-c", IMPORTS_AFTER_START], env=env, capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.strip() == "[]"
