"""Generation, the HTTP server's run of one request through the backend, folds the backend's chunks with the same
CompletionFold as the ZeroMQ client: the non-streamed choices and the request's usage, with every Usage field
(queue_time_s, host_cached_tokens), equal what AsyncClient.generate returns for the same chunks; the OpenAI usage
body carries the token counts only. Against a scripted ROUTER backend, no model (seconds)."""

from __future__ import annotations

import asyncio
import threading
import time

import msgspec
import pytest
import zmq

from runtime import protocol as p
from runtime.client import AsyncClient
from runtime.serve.http.generation import Generation
from runtime.serve.http.request_map import BackendRequest
from runtime.serve.http.responses import usage_body

USAGE = p.Usage(7, 2, 3, 0.25, 4)  # every field set: queue_time_s and host_cached_tokens too


def script(rid: str, n: int) -> list[p.StreamChunk]:
    """Completion i: "a", "b", "c" + str(i), token ids 10 + i, 20, 30, logprobs on the first and last token; the
    completions' chunks interleaved."""
    out = []
    for j, word in enumerate(["a", "b", "c"]):
        for i in range(n):
            last = j == 2
            out.append(
                p.StreamChunk(
                    rid=rid,
                    index=i,
                    text=word + (str(i) if last else ""),
                    token_ids=[10 * (j + 1) + (i if j == 0 else 0)],
                    logprobs=None if j == 1 else [p.TokenLogprobs(-0.5 * (j + 1), [], [])],
                    finish_reason="stop" if last else None,
                    usage=USAGE if last else None,
                )
            )
    return out


class ScriptedBackend(threading.Thread):
    """A ROUTER answering every GenerateRequest with script(rid, n), until stop is set."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.endpoint = f"tcp://127.0.0.1:{self.sock.bind_to_random_port('tcp://127.0.0.1')}"
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            if not self.sock.poll(20):
                continue
            ident, frame = self.sock.recv_multipart()
            msg = p.decode_client_frame(frame, 1 << 20)
            if isinstance(msg, p.GenerateRequest):
                for chunk in script(msg.rid, msg.sampling_params.n):
                    self.sock.send_multipart([ident, msgspec.msgpack.encode(chunk)])
        self.sock.close(linger=0)


@pytest.fixture
def backend():
    server = ScriptedBackend()
    server.start()
    yield server
    server.stop.set()
    server.join(10)


def test_http_choices_and_usage_equal_the_zeromq_clients_with_every_usage_field(backend):
    async def both():
        async with AsyncClient(backend.endpoint, timeout=30.0) as client:
            params = p.SamplingParams(n=2, logprobs=0)
            request = p.GenerateRequest(rid="http-1", prompt="hi", sampling_params=params, stream=True)
            gen = Generation(client, BackendRequest(request, {}, "prompt", False), None, time.perf_counter())
            choices = await gen.collect()
            direct = await client.generate(prompt="hi", n=2, logprobs=0)
            return choices, gen.usage(), direct

    choices, usage, direct = asyncio.run(both())
    assert usage == direct.usage == p.Usage(7, 2, 6, 0.25, 4)  # completion_tokens summed over the 2 choices
    assert choices == direct.choices
    lp = [p.TokenLogprobs(-0.5, [], []), None, p.TokenLogprobs(-1.5, [], [])]
    assert [(c.index, c.text, c.token_ids, c.logprobs, c.finish_reason) for c in choices] == [
        (0, "abc0", [10, 20, 30], lp, "stop"),
        (1, "abc1", [11, 20, 30], lp, "stop"),
    ]
    # the OpenAI usage object has no field for queue_time_s or host_cached_tokens: the body carries the token counts
    assert usage_body(usage) == {
        "prompt_tokens": 7,
        "completion_tokens": 6,
        "total_tokens": 13,
        "prompt_tokens_details": {"cached_tokens": 2},
    }
