"""A lost connection fails every request in flight at once (issue 28, class 4): ClientCore.lost marks the open
requests, each gives the replies already routed to it and then raises ServerGoneError; a request opened afterwards is
not touched. The AsyncClient calls lost() when its socket monitor reports the connection closed (a dead tokenizer)."""

from __future__ import annotations

import asyncio

import msgspec
import pytest
import zmq
import zmq.asyncio

from runtime import protocol as p
from runtime.client import AsyncClient, ServerGoneError
from runtime.client.core import ClientCore
from runtime.sampling_params import SamplingParams

ENDPOINT = "tcp://127.0.0.1:9"


def test_lost_fails_open_requests_after_their_routed_replies():
    core = ClientCore(ENDPOINT, None, None, now=0.0)
    a = core.open_request(p.GenerateRequest(rid="a", prompt="x", sampling_params=SamplingParams(), stream=True))
    b = core.open_control(p.HealthRequest)
    core.receive(msgspec.msgpack.encode(p.StreamChunk(rid="a", index=0, text="t", token_ids=[5])), 1.0)
    assert sorted(core.lost("the connection closed")) == sorted([a.rid, b.rid])
    later = core.open_control(p.StatsRequest)
    assert core.pop(a.rid).token_ids == [5]  # routed before the loss: still delivered
    for rid in (a.rid, b.rid):
        with pytest.raises(ServerGoneError, match="the connection closed"):
            core.pop(rid)
    assert core.open_rids() == [later.rid] and core.pop(later.rid) is None


def test_async_client_fails_a_waiting_request_when_its_server_dies():
    async def run() -> None:
        ctx = zmq.asyncio.Context.instance()
        server = ctx.socket(zmq.ROUTER)
        port = server.bind_to_random_port("tcp://127.0.0.1")
        async with AsyncClient(f"tcp://127.0.0.1:{port}", timeout=None, liveness_s=None) as client:
            health = asyncio.ensure_future(client.health())
            await server.recv_multipart()  # the request reached the server, which dies without a word
            server.close(linger=0)
            with pytest.raises(ServerGoneError, match="closed: the server is gone"):
                await asyncio.wait_for(health, 5.0)

    asyncio.run(run())
