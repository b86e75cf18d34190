"""RouterArgs: the router's settings (its flags come from here, and it crosses to the router process as JSON)."""

from __future__ import annotations

from dataclasses import dataclass, field

from router.policy import POLICIES


class InvalidRouterConfig(ValueError):
    """A RouterArgs field is out of range; the message names the field."""


@dataclass
class RouterArgs:
    """Every setting of a router. backends: the replicas' public endpoints (tcp://HOST:PORT); each replica must
    publish its KV events on TCP (ServerArgs.events_port), which the router learns from its KvSnapshotResponse.

    Raises:
        InvalidRouterConfig: from validate() (called at construction).
    """

    backends: list[str] = field(default_factory=list)
    model: str = "smollm2"  # the tokenizer and chat template the replicas use
    host: str = "127.0.0.1"
    port: int = 5557
    policy: str = "cache_aware"
    load_metric: str = "requests"  # "requests" (in flight) or "tokens" (prompt tokens of requests not yet started)
    balance_threshold: int = 4  # cache_aware: load difference (in load_metric units) that overrides the prefix
    health_interval_s: float = 0.5  # seconds between health probes of a replica
    # a replica that leaves a probe unanswered this long is taken for dead: longer than a replica's own worker-probe
    # timeout (5 s), so a replica's "worker unresponsive" answer comes first (it suspends the replica, fails nothing)
    health_timeout_s: float = 10.0
    pending_timeout_s: float = 30.0  # a request that finds no replica in rotation for this long fails
    max_message_bytes: int = 8 * 2**20
    startup_timeout_s: float = 300.0  # seconds to wait for every backend before reporting ready anyway

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check ranges; raises InvalidRouterConfig naming the field."""
        checks = [
            (
                "backends",
                bool(self.backends) and all(b.startswith("tcp://") for b in self.backends),
                "a non-empty list of tcp:// endpoints",
            ),
            ("port", 0 <= self.port < 65536, "in [0, 65536)"),
            ("policy", self.policy in POLICIES, f"one of {list(POLICIES)}"),
            ("load_metric", self.load_metric in ("requests", "tokens"), "'requests' or 'tokens'"),
            ("balance_threshold", self.balance_threshold >= 0, ">= 0"),
            ("health_interval_s", self.health_interval_s > 0, "> 0"),
            ("health_timeout_s", self.health_timeout_s > self.health_interval_s, "> health_interval_s"),
            ("pending_timeout_s", self.pending_timeout_s > 0, "> 0"),
            ("max_message_bytes", self.max_message_bytes >= 1024, ">= 1024"),
        ]
        for name, ok, rule in checks:
            if not ok:
                raise InvalidRouterConfig(f"{name} must be {rule}, got {getattr(self, name)!r}")
