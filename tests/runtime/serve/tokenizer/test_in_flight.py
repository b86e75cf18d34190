"""The tokenizer process's table of what is in flight (runtime/serve/tokenizer/in_flight.py): two clients may share a
rid, forgetting a request forgets both keys, and control requests expire in deadline order, each once."""

from __future__ import annotations

from runtime.serve.tokenizer.in_flight import ClientRef, ControlRequests, InFlight


def test_requests_are_keyed_by_client_and_rid_and_forgotten_under_both_keys():
    table = InFlight()
    table.add("1", b"A", "r", stream=True)
    table.add("2", b"B", "r", stream=False)
    table.add("3", b"A", "s", stream=False)
    assert (table.internal_of(b"A", "r"), table.internal_of(b"B", "r"), table.internal_of(b"B", "s")) == (
        "1",
        "2",
        None,
    )
    assert table.of_client(b"A") == ["1", "3"]
    assert table.identities() == [b"A", b"B", b"A"]
    req = table.pop("1")
    assert req is not None and (req.identity, req.rid, req.stream, req.forwarded) == (b"A", "r", True, False)
    assert table.pop("1") is None
    assert table.internal_of(b"A", "r") is None
    assert sorted(table.requests) == ["2", "3"]
    assert table.by_client == {(b"B", "r"): "2", (b"A", "s"): "3"}


def test_control_requests_expire_in_deadline_order_and_an_answered_one_never_expires():
    control = ControlRequests(timeout_s=10.0)
    control.add("1", ClientRef(b"A", "h1"), now=0.0)
    control.add("2", ClientRef(b"B", "h2"), now=1.0)
    control.add("3", ClientRef(b"A", "h3"), now=2.0)
    assert control.pop("2") == ClientRef(b"B", "h2")  # answered
    assert control.expire(9.9) == []
    assert control.expire(11.0) == [ClientRef(b"A", "h1")]  # "2" was answered: its deadline passes silently
    assert control.pop("1") is None  # a late answer finds nobody
    assert control.clear() == [ClientRef(b"A", "h3")]
    assert control.clients == {} and control.expire(100.0) == []
