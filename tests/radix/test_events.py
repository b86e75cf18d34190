from __future__ import annotations

import msgspec

from radix.events import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent, KvEventLog, KvSnapshot, find_gap


def test_log_numbers_events_and_drains():
    log = KvEventLog()
    assert log.last_seq == -1
    log.stored([b"a" * 16, b"b" * 16], None, 4)
    log.stored([], None, 4)  # empty: no event, no number
    log.removed([b"b" * 16])
    log.cleared()
    events = log.drain()
    assert events == [
        BlockStored(0, [b"a" * 16, b"b" * 16], None, 4),
        BlockRemoved(1, [b"b" * 16]),
        AllBlocksCleared(2),
    ]
    assert log.drain() == []
    assert log.last_seq == 2


def test_disabled_log_records_nothing():
    log = KvEventLog(enabled=False)
    log.stored([b"a"], None, 4)
    log.cleared()
    assert log.drain() == []
    assert log.last_seq == -1


def test_events_roundtrip_msgpack_tagged():
    events = [BlockStored(0, [b"\x01" * 16], b"\x02" * 16, 16), BlockRemoved(1, [b"\x01" * 16]), AllBlocksCleared(2)]
    data = msgspec.msgpack.encode(events)
    assert msgspec.msgpack.decode(data, type=list[KvEvent]) == events
    snap = KvSnapshot(2, [b"\x03" * 16])
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(snap), type=KvSnapshot) == snap


def test_find_gap():
    events = [BlockRemoved(3, []), BlockRemoved(4, [])]
    assert find_gap(2, events) is None
    assert find_gap(1, events) == 2
    assert find_gap(3, [BlockRemoved(5, [])]) == 4
