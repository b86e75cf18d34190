from __future__ import annotations

import msgspec
import pytest

from radix.events import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent, KvEventLog, KvSnapshot, find_gap
from radix.manager import KVCacheManager


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


def test_full_ring_drops_oldest_first_and_the_gap_is_found():
    log = KvEventLog(capacity=3)
    for i in range(5):
        log.removed([bytes([i]) * 16])
    assert len(log) == 3 and log.num_dropped == 2 and log.last_seq == 4
    events = log.drain()
    assert events == [BlockRemoved(2, [b"\x02" * 16]), BlockRemoved(3, [b"\x03" * 16]), BlockRemoved(4, [b"\x04" * 16])]
    assert find_gap(-1, events) == 0  # the consumer saw nothing yet: seq 0 and 1 are missing
    log.cleared()  # after a drain the ring has room again: consecutive, nothing more dropped
    assert log.drain() == [AllBlocksCleared(5)] and log.num_dropped == 2
    assert find_gap(4, [AllBlocksCleared(5)]) is None


def test_ring_capacity_must_be_positive():
    with pytest.raises(ValueError, match="capacity must be >= 1, got 0"):
        KvEventLog(capacity=0)


def _serve(m: KVCacheManager, num_requests: int) -> None:
    """Distinct 9-token prompts (3 blocks, 2 of them full) admitted, computed and freed: every request stores its
    2 full blocks; from the 5th on, the 10-block pool is short and evicts LRU leaves first."""
    for i in range(num_requests):
        tokens = [i % 50_000 + 1, i // 50_000 + 1, *range(1, 8)]
        assert m.add_sequence(i, m.match_prefix(m.block_keys(tokens))) == 0
        m.commit_computed(i, 9)
        m.free(i)


def test_manager_without_record_events_holds_no_events():
    m = KVCacheManager(11, block_size=4)
    _serve(m, 10_000)
    assert m.stats().cached_blocks == 9
    assert m.drain_events() == []
    assert m.kv_snapshot().last_seq == -1 and m.tree.events.num_dropped == 0
    assert m.tree.events.enabled is False


def test_manager_with_record_events_numbers_every_event():
    m = KVCacheManager(11, block_size=4, record_events=True)
    _serve(m, 7)  # 4 requests leave 8 cached + 2 free blocks; requests 4, 5, 6 each evict before storing
    events = m.drain_events()
    assert [type(e).__name__ for e in events] == ["BlockStored"] * 4 + ["BlockRemoved", "BlockStored"] * 3
    assert [len(e.block_hashes) for e in events if isinstance(e, BlockRemoved)] == [1, 2, 2]
    assert [e.seq for e in events] == list(range(10)) and find_gap(-1, events) is None
    assert m.kv_snapshot().last_seq == 9 and m.tree.events.num_dropped == 0
