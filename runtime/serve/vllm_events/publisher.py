"""The scheduler process's publisher of KV events in vLLM's format (``--kv-events-config``), beside its own PUB.

vLLM's ZmqEventPublisher (vllm/distributed/kv_events.py) is the contract: one message per scheduler step that changed
the cache, three frames (topic, sequence number as 8 bytes big endian, the msgpack EventBatch of runtime/serve/
vllm_events/wire.py); the sequence number counts batches from 0. With a replay endpoint, a ROUTER socket answers a
request ``[identity, b"", start_seq (8 bytes, big endian)]`` with every buffered batch from start_seq on, each as
``[identity, b"", topic, seq, payload]``, then the end marker ``[identity, b"", b"", -1 (8 bytes, signed), b""]``.

Where vLLM runs a publisher thread with a queue, radixserve sends from the scheduler's loop right after the step (a
send on a PUB socket does not block: past ``hwm`` queued messages a slow subscriber loses messages, which it sees as a
gap in the sequence numbers, as in vLLM) and serves replay requests when the loop's poller says one is waiting.
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from collections.abc import Sequence

import msgspec
import zmq

from radix.events import KvEvent
from runtime.serve.process import StartupError, bind
from runtime.serve.vllm_events.config import (
    KvEventsConfig,
    bind_address,
    is_bind_endpoint,
    parse_kv_events_config,
    rank_endpoint,
)
from runtime.serve.vllm_events.wire import to_vllm_batch

logger = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
INT_HASHES_ENV = "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES"  # vLLM's own switch, read the same way (default 1)


class NullEventPublisher:
    """No vLLM-format events (no --kv-events-config, or it disables them): publish does nothing."""

    replay: zmq.Socket | None = None
    records_token_ids = False

    def publish(self, events: Sequence[KvEvent]) -> None:
        """Does nothing."""

    def serve_replay(self) -> None:
        """Does nothing (no replay socket)."""

    def close(self) -> None:
        """Does nothing."""


class VllmEventPublisher:
    """Publishes radixserve's KV events in vLLM's wire format on a PUB socket (and answers replays on a ROUTER one).

    Args:
        ctx: the process's ZeroMQ context.
        config: an enabled KvEventsConfig.
        host: what the ``*`` of a wildcard tcp endpoint binds (the server's --host).
        data_parallel_rank: this replica's rank: offsets the endpoints' ports (vLLM's rule, config.rank_endpoint) and
            is each batch's data_parallel_rank.
    Raises:
        StartupError: an endpoint cannot be bound or connected ("cannot bind kv_events endpoint tcp://...: ...").
    The events given to publish must carry token ids (KVCacheManager(event_token_ids=True)); records_token_ids says so.
    """

    records_token_ids = True

    def __init__(self, ctx: zmq.Context, config: KvEventsConfig, host: str, data_parallel_rank: int = 0) -> None:
        self.data_parallel_rank = data_parallel_rank
        self.topic = config.topic.encode()
        self.int_hashes = bool(int(os.environ.get(INT_HASHES_ENV, "1")))
        self.next_seq = 0
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._encoder = msgspec.msgpack.Encoder()
        self.pub = ctx.socket(zmq.PUB)
        self.pub.set_hwm(config.hwm)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.endpoint = self._open(self.pub, rank_endpoint(config.endpoint, data_parallel_rank), host, "endpoint")
        self.replay: zmq.Socket | None = None
        self.replay_endpoint: str | None = None
        if config.replay_endpoint is not None:
            self.replay = ctx.socket(zmq.ROUTER)
            self.replay.setsockopt(zmq.SNDHWM, 2 * (config.buffer_steps + 1))  # a whole replay and its end marker
            self.replay.setsockopt(zmq.LINGER, 0)
            endpoint = rank_endpoint(config.replay_endpoint, data_parallel_rank)
            self.replay_endpoint = self._open(self.replay, endpoint, host, "replay_endpoint", always_bind=True)
        logger.info("publishing KV events in vLLM's format on %s (replay: %s)", self.endpoint, self.replay_endpoint)

    @staticmethod
    def _open(sock: zmq.Socket, endpoint: str, host: str, what: str, always_bind: bool = False) -> str:
        """Binds (a wildcard or ipc endpoint, or always_bind) or connects sock; returns the endpoint it is on (a bound
        port 0 resolved)."""
        if always_bind or is_bind_endpoint(endpoint):
            bind(sock, bind_address(endpoint, host), f"kv_events {what}")
            return sock.getsockopt_string(zmq.LAST_ENDPOINT)
        try:
            sock.connect(endpoint)
        except zmq.ZMQError as exc:
            raise StartupError(f"cannot connect kv_events {what} {endpoint}: {exc}") from None
        return endpoint

    def publish(self, events: Sequence[KvEvent]) -> None:
        """Sends one EventBatch of ``events`` (none: nothing is sent) with the next sequence number and keeps it for
        replay. O(events + tokens).

        Raises:
            ValueError: a BlockStored without token ids (wire.to_vllm).
        """
        if not events:
            return
        batch = to_vllm_batch(events, time.time(), self.data_parallel_rank, self.int_hashes)
        payload = self._encoder.encode(batch)
        seq = self.next_seq
        self.next_seq += 1
        self.pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload))
        self.buffer.append((seq, payload))

    def serve_replay(self) -> None:
        """Answers every replay request waiting on the replay socket (never blocks). A malformed request is logged
        and dropped. O(buffered batches) per request."""
        if self.replay is None:
            return
        while True:
            try:
                frames = self.replay.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 3 or len(frames[2]) != 8:
                logger.warning("dropping a malformed KV event replay request (%d frames)", len(frames))
                continue
            identity = frames[0]
            start = int.from_bytes(frames[2], "big")
            for seq, payload in self.buffer:
                if seq >= start:
                    self.replay.send_multipart((identity, b"", self.topic, seq.to_bytes(8, "big"), payload))
            self.replay.send_multipart((identity, b"", b"", END_SEQ, b""))

    def close(self) -> None:
        """Closes the sockets (unsent messages are dropped)."""
        self.pub.close(linger=0)
        if self.replay is not None:
            self.replay.close(linger=0)


def make_publisher(
    ctx: zmq.Context, config_json: str | None, host: str, data_parallel_rank: int
) -> NullEventPublisher | VllmEventPublisher:
    """A VllmEventPublisher when config_json (ServerArgs.kv_events_config) enables events, else a
    NullEventPublisher. Raises StartupError (as VllmEventPublisher), ValueError (parse_kv_events_config)."""
    if config_json is None:
        return NullEventPublisher()
    config = parse_kv_events_config(config_json)
    if not config.enabled:
        return NullEventPublisher()
    return VllmEventPublisher(ctx, config, host, data_parallel_rank)
