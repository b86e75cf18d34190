"""A replica whose health probe answers anything but "ok" (its worker is frozen: runtime.serve.health) leaves the
rotation at once; an "ok" answer keeps it. In process: no replica runs, the router's sockets only connect."""

from __future__ import annotations

import pytest
import zmq

from router.config import RouterArgs
from router.router import Router
from runtime import protocol as p


@pytest.fixture
def router():
    ctx = zmq.Context()
    r = Router(RouterArgs(backends=["tcp://127.0.0.1:1", "tcp://127.0.0.1:2"]), None, ctx)
    for replica in r.replicas:
        replica.up = True
    yield r
    r.close()
    ctx.destroy(linger=0)


def test_not_ok_health_answer_takes_the_replica_out(router):
    sick, well = router.replicas
    sick.probe_rid = "probe-1"
    well.probe_rid = "probe-2"
    router.on_replica_message(sick, p.HealthResponse("probe-1", "worker unresponsive for 6.0 s"), 10.0)
    router.on_replica_message(well, p.HealthResponse("probe-2", "ok"), 10.0)
    assert (sick.up, well.up) == (False, True)
    assert router.stats.failures == 1
    assert (sick.probe_rid, well.probe_rid) == (None, None)


def test_stale_not_ok_answer_is_ignored(router):
    replica = router.replicas[0]
    replica.probe_rid = "probe-2"
    router.on_replica_message(replica, p.HealthResponse("probe-1", "worker unresponsive for 6.0 s"), 10.0)
    assert replica.up and router.stats.failures == 0 and replica.probe_rid == "probe-2"
