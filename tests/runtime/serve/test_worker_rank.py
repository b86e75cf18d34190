"""Tensor parallelism's flags and roles (runtime/config.py's block, runtime/serve/worker_rank.py): each rule of the
flags names its field, `-tp` is `--tensor-parallel-size`, each node starts its own ranks on its own devices, and the
in-process Engine refuses more than one rank. No process is started."""

from __future__ import annotations

import time

import pytest

from runtime.config import InvalidConfig, ServerArgs
from runtime.engine import Engine
from runtime.serve.launch import build_parser
from runtime.serve.worker_rank import StepRelay, rank_device, rank_of, worker_roles


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"tensor_parallel_size": 0}, "tensor_parallel_size must be >= 1, got 0"),
        ({"tensor_parallel_size": 4, "nnodes": 3}, "nnodes must be a divisor of tensor_parallel_size, got 3"),
        ({"tensor_parallel_size": 4, "nnodes": 2, "master_port": 29500, "node_rank": 2}, "node_rank must be in"),
        ({"tensor_parallel_size": 4, "nnodes": 2}, "master_port must be set when nnodes > 1, got None"),
        ({"tp_timeout_s": 0.0}, "tp_timeout_s must be > 0, got 0.0"),
    ],
)
def test_each_rule_names_its_field(fields, message):
    with pytest.raises(InvalidConfig, match=message):
        ServerArgs(**fields)


def test_tp_is_the_short_flag():
    ns = build_parser().parse_args(["-tp", "4", "--nnodes", "2", "--node-rank", "1", "--master-port", "29500"])
    assert (ns.tensor_parallel_size, ns.nnodes, ns.node_rank, ns.master_port) == (4, 2, 1, 29500)


def test_each_node_starts_its_ranks_on_its_devices():
    node0 = ServerArgs(tensor_parallel_size=4, nnodes=2, master_port=29500, device="cuda")
    node1 = ServerArgs(tensor_parallel_size=4, nnodes=2, node_rank=1, master_port=29500, device="cuda")
    assert worker_roles(node0) == ["worker", "worker-rank1"]
    assert worker_roles(node1) == ["worker-rank2", "worker-rank3"]
    assert [rank_of(role) for role in worker_roles(node1)] == [2, 3]
    assert [rank_device(node1, rank) for rank in (2, 3)] == ["cuda:0", "cuda:1"]
    shifted = ServerArgs(tensor_parallel_size=2, device="cuda:2")
    assert [rank_device(shifted, rank) for rank in (0, 1)] == ["cuda:2", "cuda:3"]
    assert rank_device(ServerArgs(tensor_parallel_size=2), 1) == "cpu"
    assert worker_roles(ServerArgs()) == ["worker"]


def test_the_engine_refuses_more_than_one_rank(tiny_llama_dir):
    with pytest.raises(InvalidConfig, match="tensor_parallel_size > 1 needs the server"):
        Engine(model=str(tiny_llama_dir), tensor_parallel_size=2)


class _Broadcasts:
    """A TPGroup stand-in that records what rank 0 broadcasts."""

    def __init__(self) -> None:
        self.sent: list[bytes | None] = []

    def broadcast_bytes(self, payload: bytes | None) -> bytes:
        self.sent.append(payload)
        return payload or b""


def test_the_heartbeat_goes_out_once_per_period_however_often_the_loop_idles():
    group = _Broadcasts()
    relay = StepRelay(group, heartbeat_s=0.2)  # type: ignore[arg-type]
    relay.send(b"step")
    for _ in range(50):  # probes answered back to back: no heartbeat within the period of the last frame
        relay.idle()
    assert group.sent == [b"step"]
    time.sleep(0.25)
    relay.idle()
    relay.idle()
    assert group.sent == [b"step", b""]
