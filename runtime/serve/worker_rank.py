"""The worker as tensor_parallel_size rank processes (issue 27): which roles a node starts, how each rank gets the
step, and the loop of the ranks other than 0.

Roles: "worker" is rank 0 (it binds worker_in / worker_out and is the scheduler's only peer, as at TP = 1);
"worker-rank<r>" is rank r. Node n of nnodes starts the ranks n * per_node .. (n + 1) * per_node - 1 (per_node =
tensor_parallel_size / nnodes), each on device local index r % per_node; node 0 also starts the scheduler and the
tokenizer (runtime/serve/launch.py).

The step's path to every rank: rank 0 receives the ForwardBatch on its PULL socket and, before it executes it,
broadcasts the same msgpack bytes over the gloo CPU group (StepRelay: an int64 length, then the bytes as a uint8
tensor); every rank decodes and executes it alike and samples the same tokens; rank 0 alone sends the ForwardResult.
Health probes stay on rank 0. While idle, rank 0 broadcasts an empty frame every poll period (500 ms), so a rank
waiting for the next step hears within tp_timeout_s that rank 0 is alive, and fails (RankFailure: the process exits,
the launcher stops the server as for any worker death) when it does not.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import msgspec
import zmq

from runtime import protocol as p
from runtime.config import ServerArgs
from runtime.serve.process import POLL_MS, ChildSpec, parent_alive, report, report_failure

if TYPE_CHECKING:
    from runtime.model.parallel.group import TPGroup
    from runtime.model.runner import ModelRunner

logger = logging.getLogger(__name__)

WORKER = "worker"  # rank 0's role
RANK_ROLE = "worker-rank"  # + the rank: the other ranks' roles


class Relay(Protocol):
    """How the worker loop shares each step with the other ranks."""

    def send(self, frame: bytes) -> None:
        """Give the other ranks this step's ForwardBatch bytes (before rank 0 executes it)."""
        ...

    def idle(self) -> None:
        """Called by rank 0's loop after each idle poll period."""
        ...


class NoRelay:
    """tensor_parallel_size 1: nothing to share."""

    def send(self, frame: bytes) -> None:
        """Nothing (a single rank)."""

    def idle(self) -> None:
        """Nothing (a single rank)."""


class StepRelay:
    """Rank 0's step bytes to every rank over the group's CPU broadcast (the module docstring). Each call is a
    collective: every rank calls send (rank 0) or receive (the others) once per step or heartbeat. Raises
    RankFailure when a rank is gone or late past the group's timeout."""

    def __init__(self, group: TPGroup, heartbeat_s: float = POLL_MS / 1000) -> None:
        self.group = group
        self.heartbeat_s = heartbeat_s
        self.last_sent = time.monotonic()

    def send(self, frame: bytes) -> None:
        """Rank 0: broadcast a step's bytes (non-empty)."""
        self.group.broadcast_bytes(frame)
        self.last_sent = time.monotonic()

    def idle(self) -> None:
        """Rank 0: broadcast the empty heartbeat frame when nothing went out for heartbeat_s seconds (the loop calls
        it after each idle poll and each probe, so probes arriving faster than the poll period cannot starve it)."""
        if time.monotonic() - self.last_sent >= self.heartbeat_s:
            self.group.broadcast_bytes(b"")
            self.last_sent = time.monotonic()

    def receive(self) -> bytes:
        """The other ranks: the next frame rank 0 broadcasts (b"": a heartbeat)."""
        return self.group.broadcast_bytes(None)


class RankLost(RuntimeError):
    """A collective of this rank failed (a peer died, or hung past tp_timeout_s): the rank's loop ends with it, and
    the child's crash report (ProcessFailed) names the cause to the launcher, which stops the server."""


def run_rank_loop(loop: Callable[[], None]) -> None:
    """Run a rank's loop (TP > 1); the RankFailure that ends it (a BaseException, so that no step's failure handling
    swallows it) leaves as RankLost, an Exception the process entry reports in one line."""
    from runtime.model.parallel.group import RankFailure  # imports torch: only ranks of TP > 1 get here

    try:
        loop()
    except RankFailure as exc:
        raise RankLost(str(exc)) from None


def rank_of(role: str) -> int:
    """The tensor-parallel rank of a worker role ("worker": 0, "worker-rank3": 3)."""
    return 0 if role == WORKER else int(role.removeprefix(RANK_ROLE))


def worker_roles(args: ServerArgs) -> list[str]:
    """The worker roles node args.node_rank starts (the module docstring), rank order."""
    per_node = args.tensor_parallel_size // args.nnodes
    first = args.node_rank * per_node
    return [WORKER if r == 0 else f"{RANK_ROLE}{r}" for r in range(first, first + per_node)]


def free_port(host: str) -> int:
    """A TCP port free on host now (the single-node default of master_port)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def rank_device(args: ServerArgs, rank: int) -> str:
    """The device of a rank: args.device on CPU; on CUDA the GPU after args.device's index by the rank's local index."""
    if not args.device.startswith("cuda") or args.tensor_parallel_size == 1:
        return args.device
    per_node = args.tensor_parallel_size // args.nnodes
    base = int(args.device.split(":")[1]) if ":" in args.device else 0
    return f"cuda:{base + rank % per_node}"


def start_runner(args: ServerArgs, rank: int) -> tuple[ModelRunner, Relay, TPGroup | None]:
    """This rank's ModelRunner (the whole model at tensor_parallel_size 1), the relay rank 0's loop uses, and the
    rank's group (None at size 1). Collective for size > 1: blocks until every rank joined (tp_timeout_s at most).
    Raises what ModelRunner and init_group raise."""
    from runtime.model.runner import ModelRunner

    if args.tensor_parallel_size == 1:
        return ModelRunner(args, shares_cores=True), NoRelay(), None
    from runtime.model.loader import resolve_model
    from runtime.model.parallel.group import RankInfo, init_group

    resolve_model(args.model)  # a first GGUF conversion happens before the group's timeout runs
    args = dataclasses.replace(args, device=rank_device(args, rank))
    assert args.master_port is not None, "the launcher sets master_port"
    info = RankInfo(rank, args.tensor_parallel_size, args.master_addr, args.master_port, args.tp_timeout_s)
    group = init_group(info, args.device)
    return ModelRunner(args, group, shares_cores=True), StepRelay(group), group


def follow_steps(runner: ModelRunner, relay: StepRelay, spec: ChildSpec) -> None:
    """The loop of a rank other than 0: execute every ForwardBatch rank 0 relays, as rank 0 does, until the launcher
    dies. A step that raises is logged (rank 0 reports it to the scheduler). Raises RankFailure when rank 0 is gone
    or silent past tp_timeout_s."""
    decoder = msgspec.msgpack.Decoder(p.ForwardBatch)
    while parent_alive(spec):
        frame = relay.receive()
        if not frame:
            continue
        batch = decoder.decode(frame)
        try:
            runner.execute(batch)
        except Exception:  # the same step fails on rank 0, which tells the scheduler
            logger.exception("step %d failed", batch.step_id)


def run_worker_rank(spec: ChildSpec) -> None:
    """Entry of a rank other than 0 (role "worker-rank<r>"): join the group, load the rank's slices, report
    ProcessReady, then follow rank 0's steps. Reports ProcessFailed when it cannot start."""
    ctx = zmq.Context()
    reports = ctx.socket(zmq.PUSH)
    reports.connect(spec.endpoints.launcher)
    try:
        runner, relay, group = start_runner(spec.server_args, rank_of(spec.role))
    except Exception as exc:
        report_failure(ctx, reports, spec.role, exc)
        return
    assert isinstance(relay, StepRelay) and group is not None
    report(reports, p.ProcessReady(spec.role, os.getpid()))
    logger.info("%s ready", spec.role)
    try:
        run_rank_loop(lambda: follow_steps(runner, relay, spec))
    finally:
        group.close()
