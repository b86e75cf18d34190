"""A replica that answers its probe with anything but "ok" (a wedged worker) is suspended, not failed (issue 28,
class 5): out of rotation, its unstarted requests re-sent elsewhere, its started streams left to it (they go on), and
back in rotation at its next "ok"; only a probe left unanswered for health_timeout_s fails its streams. In process:
the replica's and the clients' sends are recorded, no replica runs."""

from __future__ import annotations

import pytest
import zmq

from router.config import RouterArgs
from router.router import Router
from runtime import protocol as p
from runtime.sampling_params import SamplingParams

WEDGED = "worker unresponsive for 6.0 s"


@pytest.fixture
def rig():
    """(router, its one replica, what the clients were sent, what the replica was sent); requests "s" (started)
    and "u" (not started) on the replica."""
    ctx = zmq.Context()
    router = Router(RouterArgs(backends=["tcp://127.0.0.1:1"], health_timeout_s=10.0), None, ctx)
    replica = router.replicas[0]
    replica.up = True
    to_clients: list = []
    to_replica: list = []
    router.clients.send = lambda identity, msg: to_clients.append(msg) or True  # type: ignore[method-assign]
    replica.send = lambda msg: to_replica.append(msg) or True  # type: ignore[method-assign]
    for rid in ("s", "u"):
        req = p.GenerateRequest(rid=rid, prompt="hi", sampling_params=SamplingParams(max_tokens=5), stream=True)
        router.on_generate(b"client", req, 0.0)
    router.on_replica_message(replica, p.StreamChunk(rid=to_replica[0].rid, index=0, text="a", token_ids=[1]), 0.1)
    yield router, replica, to_clients, to_replica
    router.close()
    ctx.destroy(linger=0)


def test_a_wedged_replica_is_suspended_and_its_stream_goes_on(rig):
    router, replica, to_clients, to_replica = rig
    started, unstarted = to_replica[0].rid, to_replica[1].rid
    replica.probe_rid = "probe-1"
    router.on_replica_message(replica, p.HealthResponse("probe-1", WEDGED), 1.0)
    assert (replica.up, replica.suspended) == (False, f"its health probe answered {WEDGED!r}")
    assert replica.in_flight == {started} and replica.load_tokens == 0
    assert list(router.pending) == [unstarted] and router.requests[unstarted].replica is None
    assert p.AbortRequest(unstarted) in to_replica
    assert [type(m) for m in to_clients] == [p.StreamChunk]  # nothing failed
    last = p.StreamChunk(rid=started, index=0, text="b", token_ids=[2], finish_reason="length")
    router.on_replica_message(replica, last, 1.5)  # the suspended replica ends its own stream
    assert to_clients[-1].finish_reason == "length" and to_clients[-1].rid == "s" and started not in router.requests
    assert replica.tick(2.0, 0.2, 10.0)
    probe = to_replica[-1]
    assert isinstance(probe, p.HealthRequest)  # not a snapshot: a suspended replica must answer "ok" to come back
    router.on_replica_message(replica, p.HealthResponse(probe.rid, "ok"), 2.1)
    assert (replica.up, replica.suspended) == (True, None)
    assert router.requests[unstarted].replica is replica and to_replica[-1].rid == unstarted  # dispatched again
    assert not any(isinstance(m, p.ErrorResponse) for m in to_clients)


def test_a_suspended_replica_that_stops_answering_fails_its_streams(rig):
    router, replica, to_clients, to_replica = rig
    replica.probe_rid = "probe-1"
    router.on_replica_message(replica, p.HealthResponse("probe-1", WEDGED), 1.0)
    router.tick(1.1)  # sends the next probe
    router.tick(12.0)  # unanswered for more than health_timeout_s: dead
    assert replica.suspended is None and not replica.up and replica.in_flight == set()
    [error] = [m for m in to_clients if isinstance(m, p.ErrorResponse)]
    assert error.rid == "s" and error.code == p.ERR_SERVER and "no answer to a health probe" in error.message
