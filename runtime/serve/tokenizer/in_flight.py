"""The tokenizer process's table of what is in flight: generate requests (InFlight) and control requests
(ControlRequests), each under an internal rid the scheduler knows them by. State only: no socket, no tokenizer.

A client names its requests by its own rid, unique among its requests in flight; two clients may use the same rid, so
the server keys them by (identity, client rid) and gives each an internal rid, unique in the process
(runtime.serve.tokenizer.server.TokenizerServer assigns them).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import NamedTuple

from runtime.text.completion_stream import CompletionStream


class ClientRef(NamedTuple):
    """Where an answer goes: the client's ROUTER identity and its rid for the request."""

    identity: bytes
    rid: str


@dataclass
class ClientRequest:
    """One generate request in flight: its client, whether it streams, and one CompletionStream per completion (empty
    until its prompt is prepared). forwarded: False while its prompt is tokenized on the PromptWorker (the scheduler
    does not know it yet, so an abort sends nothing)."""

    identity: bytes
    rid: str  # the client's rid
    stream: bool
    completions: list[CompletionStream] = field(default_factory=list)
    forwarded: bool = False


class InFlight:
    """Generate requests in flight: requests (internal rid -> ClientRequest) and by_client ((identity, client rid) ->
    internal rid), kept in step. Every method is O(1) but of_client (O(requests))."""

    def __init__(self) -> None:
        self.requests: dict[str, ClientRequest] = {}
        self.by_client: dict[tuple[bytes, str], str] = {}

    def add(self, internal: str, identity: bytes, rid: str, stream: bool) -> ClientRequest:
        """Records a new request under internal; the caller checked that (identity, rid) is not in flight."""
        req = ClientRequest(identity, rid, stream)
        self.requests[internal] = req
        self.by_client[(identity, rid)] = internal
        return req

    def internal_of(self, identity: bytes, rid: str) -> str | None:
        """The internal rid of the client's request rid, None when it is not in flight."""
        return self.by_client.get((identity, rid))

    def get(self, internal: str) -> ClientRequest | None:
        return self.requests.get(internal)

    def pop(self, internal: str) -> ClientRequest | None:
        """Forgets a request; returns it (None when it was not in flight)."""
        req = self.requests.pop(internal, None)
        if req is not None:
            self.by_client.pop((req.identity, req.rid), None)
        return req

    def of_client(self, identity: bytes) -> list[str]:
        """The internal rids of every request of one client."""
        return [internal for (ident, _rid), internal in self.by_client.items() if ident == identity]

    def identities(self) -> list[bytes]:
        """The identity of each request in flight (a client once per request)."""
        return [req.identity for req in self.requests.values()]


class ControlRequests:
    """Health / stats / KV snapshot requests forwarded to the scheduler and not answered yet, each with a deadline
    timeout_s seconds after it was sent (a frozen scheduler must not leave a client waiting forever).

    clients: internal rid -> ClientRef. Deadlines are kept in a deque in send order, so expiry is O(expired)."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.clients: dict[str, ClientRef] = {}
        self._deadlines: deque[tuple[float, str]] = deque()  # (deadline, internal rid), in deadline order

    def add(self, internal: str, client: ClientRef, now: float) -> None:
        """Records a control request sent to the scheduler at now (monotonic seconds)."""
        self.clients[internal] = client
        self._deadlines.append((now + self.timeout_s, internal))

    def pop(self, internal: str) -> ClientRef | None:
        """The client of an answered control request (None: unknown, or expired already)."""
        return self.clients.pop(internal, None)

    def expire(self, now: float) -> list[ClientRef]:
        """Forgets and returns the clients whose deadline passed (a late answer is then dropped). O(expired)."""
        expired = []
        while self._deadlines and self._deadlines[0][0] <= now:
            _deadline, internal = self._deadlines.popleft()
            client = self.clients.pop(internal, None)
            if client is not None:
                expired.append(client)
        return expired

    def clear(self) -> list[ClientRef]:
        """Forgets and returns every client waiting."""
        waiting = list(self.clients.values())
        self.clients.clear()
        self._deadlines.clear()
        return waiting
