"""Routing policies: which replica serves a request.

round_robin: replicas in turn. least_load: the smallest load (in-flight requests, or queued prompt tokens).
cache_aware (default): the replica with the longest cached prefix of the prompt's block hashes (from its KV events),
on the device and on its host tier together, more of it on the device breaking a tie (a host block costs a copy back,
a device block nothing; both spare the recompute), unless its load exceeds the smallest load by more than
`balance_threshold`, then the least loaded one.
This is the policy of SGLang's cache-aware router and of Preble (Srivatsa et al., "Preble: Efficient Distributed
Prompt Scheduling for LLM Serving", ICLR 2025, section 4): prefix locality first, load balance as a guard.
Ties are broken by load, then in turn (a rotating start), so equal replicas share the work.
"""

from __future__ import annotations

from typing import Literal

import msgspec

PolicyName = Literal["round_robin", "least_load", "cache_aware"]
POLICIES: tuple[str, ...] = ("round_robin", "least_load", "cache_aware")


# Structs, not NamedTuples: a NamedTuple's `index` field would shadow tuple.index.
class Candidate(msgspec.Struct, frozen=True):
    """A replica in rotation: its position in the router's list, its load (requests or tokens) and its cached
    prefix of the prompt (blocks): prefix_blocks on the device, then host_prefix_blocks on its host tier."""

    index: int
    load: int
    prefix_blocks: int
    host_prefix_blocks: int = 0

    @property
    def cached_blocks(self) -> int:
        """The prompt's blocks this replica need not compute (either tier)."""
        return self.prefix_blocks + self.host_prefix_blocks


class Decision(msgspec.Struct, frozen=True):
    """The chosen replica's index and why: "prefix" (longest resident prefix), "load" (least loaded / imbalance),
    "turn" (round robin)."""

    index: int
    reason: str


class Policy:
    """Chooses among candidates. Mutates only its rotation counter.

    Raises ValueError for an unknown policy name or a negative threshold.
    """

    def __init__(self, name: str, balance_threshold: int = 4) -> None:
        if name not in POLICIES:
            raise ValueError(f"unknown policy {name!r}; known: {list(POLICIES)}")
        if balance_threshold < 0:
            raise ValueError(f"balance_threshold must be >= 0, got {balance_threshold}")
        self.name = name
        self.balance_threshold = balance_threshold
        self._turn = 0

    def choose(self, candidates: list[Candidate], num_replicas: int) -> Decision:
        """The replica for one request. candidates: non-empty, the replicas in rotation; num_replicas: the size of
        the router's list (for the rotation). O(len(candidates))."""
        if not candidates:
            raise ValueError("no candidate replica")
        start = self._turn % max(1, num_replicas)
        self._turn += 1

        def turn(c: Candidate) -> int:
            return (c.index - start) % max(1, num_replicas)

        if self.name == "round_robin":
            return Decision(min(candidates, key=turn).index, "turn")
        least = min(candidates, key=lambda c: (c.load, -c.prefix_blocks, turn(c)))
        if self.name == "least_load":
            return Decision(least.index, "load")
        best = min(candidates, key=lambda c: (-c.cached_blocks, -c.prefix_blocks, c.load, turn(c)))
        if best.cached_blocks == 0 or best.load - least.load > self.balance_threshold:
            return Decision(least.index, "load")
        return Decision(best.index, "prefix")
