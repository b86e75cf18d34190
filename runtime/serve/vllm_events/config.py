"""``--kv-events-config``: vLLM's KVEventsConfig (vllm/config/kv_events.py), read from the same JSON.

The fields, names and defaults are vLLM's, so a deployment's existing flag value works unchanged, e.g.
``{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", "topic": "kv-events"}``. Two
rules differ, both stated where they apply: the ``*`` of a wildcard endpoint binds the server's ``--host`` (127.0.0.1
unless told otherwise, as every socket radixserve binds), not every interface; and ``max_queue_size`` is accepted but
unused (radixserve publishes from the scheduler's loop, with no queue in between; the PUB socket's ``hwm`` bounds what
waits for a slow subscriber). An unknown field or a wrong type is refused with the field named.
"""

from __future__ import annotations

from typing import Literal

import msgspec

DEFAULT_ENDPOINT = "tcp://*:5557"


class KvEventsConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """vLLM's KVEventsConfig. publisher None means "zmq" when enable_kv_cache_events, else "null" (vLLM's rule).

    endpoint: the PUB socket's address: a wildcard (``*`` or ``::``) or an ipc:// / inproc:// endpoint is bound,
    any other address is connected to (a collector that binds), as in vLLM. replay_endpoint: a ROUTER socket (always
    bound) that answers replay requests from the last ``buffer_steps`` batches (None: no replay). hwm: the PUB
    socket's send high-water mark in messages. topic: the first frame of every message.
    """

    enable_kv_cache_events: bool = False
    publisher: Literal["null", "zmq"] | None = None
    endpoint: str = DEFAULT_ENDPOINT
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    @property
    def enabled(self) -> bool:
        """Events are published: enable_kv_cache_events and the publisher is (or defaults to) "zmq"."""
        return self.enable_kv_cache_events and self.publisher != "null"


def parse_kv_events_config(text: str) -> KvEventsConfig:
    """The KvEventsConfig of a JSON object (vLLM's ``--kv-events-config`` value).

    Raises:
        ValueError: not a JSON object, an unknown field, a wrong type, a buffer_steps / hwm below 1, or an endpoint
            that is not tcp://HOST:PORT, ipc:// or inproc:// (the message names the field).
    """
    try:
        config = msgspec.json.decode(text, type=KvEventsConfig)
    except msgspec.ValidationError as exc:  # a DecodeError too: first
        raise ValueError(f"kv_events_config: {exc}") from None
    except msgspec.DecodeError as exc:
        raise ValueError(f"kv_events_config is not valid JSON: {exc}") from None
    if config.buffer_steps < 1 or config.hwm < 1:
        raise ValueError(
            f"kv_events_config: buffer_steps and hwm must be >= 1, got {config.buffer_steps}, {config.hwm}"
        )
    for name in ("endpoint", "replay_endpoint"):
        endpoint = getattr(config, name)
        if endpoint is not None and not endpoint.startswith(("tcp://", "ipc://", "inproc://")):
            raise ValueError(
                f"kv_events_config: {name} must be a tcp://, ipc:// or inproc:// endpoint, got {endpoint!r}"
            )
        if endpoint is not None and endpoint.startswith("tcp://") and not endpoint.rsplit(":", 1)[1].isdigit():
            raise ValueError(f"kv_events_config: {name} must end in :PORT, got {endpoint!r}")
    return config


def rank_endpoint(endpoint: str, data_parallel_rank: int) -> str:
    """The endpoint of data-parallel rank ``data_parallel_rank``, by vLLM's rule (ZmqEventPublisher.
    offset_endpoint_port): a tcp port is offset by the rank (port 0 is left to the OS), an inproc name gets
    ``_dp<rank>``, and so does an ipc one (vLLM refuses ipc beyond rank 0); rank 0 keeps the endpoint as given.
    Pure."""
    if data_parallel_rank == 0:
        return endpoint
    if not endpoint.startswith("tcp://"):
        return f"{endpoint}_dp{data_parallel_rank}"
    base, port = endpoint.rsplit(":", 1)
    if int(port) == 0:
        return endpoint
    return f"{base}:{int(port) + data_parallel_rank}"


def is_bind_endpoint(endpoint: str) -> bool:
    """vLLM's rule: a wildcard tcp address (``*`` or ``::``) or an ipc / inproc endpoint is bound; any other is
    connected to. Pure."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def bind_address(endpoint: str, host: str) -> str:
    """What to bind for an endpoint is_bind_endpoint accepts: the ``*`` of a tcp wildcard becomes ``host`` (the
    server's --host), so by default the events stay on 127.0.0.1; other endpoints are unchanged. Pure."""
    if endpoint.startswith("tcp://*:"):
        return f"tcp://{host}:{endpoint.removeprefix('tcp://*:')}"
    return endpoint
