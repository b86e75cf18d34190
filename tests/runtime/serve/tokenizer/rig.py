"""A TokenizerServer on inproc sockets with named clients (Rig), and a tokenizer whose large encodes and decodes wait
for a gate (GatedTokenizer): the tokenizer process's handlers driven in process, as its loop drives them."""

from __future__ import annotations

import threading

import msgspec
import zmq

from runtime import protocol as p
from runtime.serve.tokenizer.server import TokenizerServer

READY = p.Ready(
    num_blocks=1024, block_size=16, max_model_len=8192, num_host_blocks=0, vocab_size=49152, eos_token_ids=[2]
)


class GatedTokenizer:
    """The SmolLM2 tokenizer, except that encoding a text over 10,000 characters or decoding over 10,000 ids waits
    until `gate` is set (it hides backend_tokenizer, so runtime.text.prompt.encode_text and
    runtime.text.token_text.decode_text call this encode and decode)."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer
        self.gate = threading.Event()
        self.started = threading.Event()

    def encode(self, text, **kwargs):
        if len(text) > 10_000:
            self.started.set()
            assert self.gate.wait(30)
        return self._tokenizer.encode(text, **kwargs)

    def decode(self, ids, **kwargs):
        if len(ids) > 10_000:
            self.started.set()
            assert self.gate.wait(30)
        return self._tokenizer.decode(ids, **kwargs)

    def __len__(self) -> int:
        return len(self._tokenizer)

    def __getattr__(self, name):
        if name == "backend_tokenizer":
            raise AttributeError(name)
        return getattr(self._tokenizer, name)


class Rig:
    """A TokenizerServer on inproc sockets with named client DEALERs and the scheduler side's PULL."""

    def __init__(self, ctx: zmq.Context, name: str, tokenizer, clients: tuple[str, ...]) -> None:
        router = ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        router.bind(f"inproc://{name}")
        self.sched_pull = ctx.socket(zmq.PULL)
        push = ctx.socket(zmq.PUSH)
        self.sched_pull.bind(f"inproc://{name}-sched")
        push.connect(f"inproc://{name}-sched")
        self.server = TokenizerServer(tokenizer, READY, 8 << 20, router, push)
        self.clients = {}
        for c in clients:
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.IDENTITY, c.encode())
            sock.connect(f"inproc://{name}")
            self.clients[c] = sock

    def send(self, client: str, msg, handle: bool = True) -> None:
        self.clients[client].send(msgspec.msgpack.encode(msg))
        if handle:
            self.server.on_client_frames(self.server.router.recv_multipart())

    def forwarded(self) -> list:
        out = []
        while self.sched_pull.poll(50):
            out.append(msgspec.msgpack.decode(self.sched_pull.recv(), type=p.SchedulerInput))
        return out

    def replies(self, client: str, wait_ms: int = 50) -> list:
        out = []
        sock = self.clients[client]
        while sock.poll(wait_ms):
            out.append(msgspec.msgpack.decode(sock.recv(), type=p.ServerMessage))
        return out
