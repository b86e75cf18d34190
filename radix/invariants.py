"""check_manager(), check_tree() and check_host_tier(): recount every reference and block state of a KVCacheManager,
a RadixTree's nodes and a host tier from scratch (tests call them after every operation, through
KVCacheManager.check_invariants; too slow for the serving loop: O(blocks + sequences * table length)). They take the
parts as plain arguments (a tree's TreeNodes, not the tree), so this module imports neither radix/manager.py nor
radix/tree.py (no import circle: RadixTree.check_invariants calls check_tree)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence

from radix.block_pool import BlockPool
from radix.host_tier import HostTier
from radix.node import ID_MASK, Node, Root
from radix.prefix_cache import PrefixCache
from radix.sequence import SeqBlocks
from radix.tree_nodes import TreeNodes


def check_manager(
    pool: BlockPool,
    cache: PrefixCache,
    host: BlockPool,
    seqs: Mapping[int, SeqBlocks],
    block_size: int,
    device_pins: Sequence[int] = (),
) -> None:
    """Raise AssertionError (naming the sequence or block) if any KVCacheManager invariant is broken:
    exact ref counts (tables + shadows + tree + the pending loads' device_pins), free + evictable + in_use == total
    with each block counted once, live block tables only reference allocated blocks, the cached prefix of each
    sequence is its resident path, swap pool blocks have one owner; and the prefix cache's own check (check_tree and
    check_host_tier for a RadixTree). Mutates nothing."""
    pool.check_invariants()
    cache.check_invariants()
    host.check_invariants()
    bs = block_size
    expected: Counter[int] = Counter()
    host_owner: Counter[int] = Counter()
    for seq_id, seq in seqs.items():
        assert seq.num_tokens == len(seq.blocks) * bs + len(seq.tail) and len(seq.tail) < bs, f"seq {seq_id}: tokens"
        assert seq.num_computed <= seq.num_tokens, f"seq {seq_id}: computed {seq.num_computed} > known tokens"
        if seq.host_table is not None:
            assert not seq.block_table and not seq.shadow, f"seq {seq_id} swapped out but holds device blocks"
            assert seq.num_cached_blocks == 0 and seq.cached_node is None, f"seq {seq_id} swapped out but cached"
            host_owner.update(seq.host_table)
            continue
        assert seq.num_computed <= len(seq.block_table) * bs, f"seq {seq_id}: computed tokens exceed its table"
        assert len(set(seq.block_table)) == len(seq.block_table), f"seq {seq_id} lists a block twice"
        expected.update(seq.block_table)
        expected.update(seq.shadow)
        n = seq.num_cached_blocks
        assert n <= min(len(seq.block_table), seq.num_computed // bs), f"seq {seq_id}: {n} cached blocks too many"
        assert (seq.cached_node is None) == (n == 0), f"seq {seq_id}: cached node and {n} cached blocks disagree"
        node = seq.cached_node
        for i in range(n - 1, -1, -1):  # the cached prefix is the resident path ending at cached_node
            assert node is not None and node.block_hash is not None, f"seq {seq_id}: cached path shorter than {n}"
            assert cache.resident_block(node.block_hash) == node.block_id, f"seq {seq_id}: block {i} is not resident"
            assert node.key == seq.blocks[i], f"seq {seq_id}: cached block {i} holds other tokens"
            assert node.block_id == seq.block_table[i] or node.block_id in seq.shadow, (
                f"seq {seq_id}: block {i} resident as {node.block_id} but neither in its table nor its shadow"
            )
            node = node.parent
        assert n == 0 or (node is not None and node.block_hash is None), f"seq {seq_id}: path longer than {n} blocks"
    for h in cache.hashes():
        resident = cache.resident_block(h)
        assert resident is not None
        expected[resident] += 1
    expected.update(device_pins)
    for b in range(pool.first_block_id, pool.num_blocks):
        assert pool.ref_counts[b] == expected[b], f"block {b}: ref count {pool.ref_counts[b]}, holders {expected[b]}"
    assert 0 not in expected, "the null block 0 is referenced"
    free = set(pool.free_block_ids())
    evictable = {b for b in map(cache.resident_block, cache.hashes()) if b is not None and pool.ref_counts[b] == 1}
    in_use = {b for b in range(pool.first_block_id, pool.num_blocks) if pool.ref_counts[b] >= 1} - evictable
    assert not (free & evictable or free & in_use), "a block is both free and held"
    assert len(free) + len(evictable) + len(in_use) == pool.num_usable, (
        f"free {len(free)} + evictable {len(evictable)} + in_use {len(in_use)} != total {pool.num_usable}"
    )
    assert len(evictable) == cache.num_evictable, f"evictable count {cache.num_evictable}, real {len(evictable)}"
    for b in range(host.num_blocks):
        assert host.ref_counts[b] == host_owner[b], f"host block {b}: ref {host.ref_counts[b]}, owners {host_owner[b]}"


def check_tree(tree: TreeNodes) -> None:
    """Nodes, children, roots, tiers (device residency prefix-closed, device-child counts), evictable count, device
    LRU set and the path property are consistent. O(nodes).

    Raises:
        AssertionError: naming the offending block.
    """
    rc = tree.pool.ref_counts
    evictable = 0
    reached = 0
    on_device = 0
    stack: list[Node] = list(tree.roots.values())
    for salt, root in tree.roots.items():
        assert root.salt == salt and root.parent is None, f"root of salt {salt!r} misfiled"
        assert salt is None or root.children, f"empty root kept for salt {salt!r}"
    while stack:
        parent = stack.pop()
        device_children = 0
        for key, node in (parent.children or {}).items():
            b = node.block_id
            reached += 1
            assert node.key == key and node.parent is parent, f"block {b} filed under the wrong key or parent"
            assert len(key) == 4 * tree.block_size, f"block {b}: key of {len(key)} bytes"
            assert node.block_hash is not None and tree.by_hash.get(node.block_hash) is node, f"{b} not indexed"
            assert node.children is None or node.children, f"block {b} keeps an empty children dict"
            assert b >= 0 or (node.host_block >= 0 and tree.host is not None), "a node on no tier"
            if b >= 0:
                device_children += 1
                on_device += 1
                assert type(parent) is Root or parent.block_id >= 0, f"device block {b} under a host-only parent"
                assert tree.by_block[b] is node, f"block {b} not indexed by id"
                assert rc[b] >= 1, f"cached block {b} has ref count {rc[b]}"
                evictable += rc[b] == 1
                if type(parent) is not Root:
                    assert rc[b] == 1 or rc[parent.block_id] >= 2, f"block {b} in use but its parent is only cached"
            stack.append(node)
        assert parent.num_device_children == device_children, f"block {parent.block_id}: device children miscounted"
    assert reached == len(tree.by_hash), f"{reached} nodes reachable, {len(tree.by_hash)} indexed by hash"
    indexed = sum(node is not None for node in tree.by_block)
    assert indexed == on_device == tree.num_device, f"{indexed} blocks indexed, {on_device} on the device"
    assert evictable == tree.num_evictable, f"evictable count {tree.num_evictable}, real {evictable}"
    want = sorted(
        n.lru_key
        for n in tree.by_hash.values()
        if n.block_id >= 0 and n.num_device_children == 0 and rc[n.block_id] == 1
    )
    lru = [key & ID_MASK for key in tree.lru]
    assert list(tree.lru) == want, f"LRU set {lru} != evictable device leaves {[key & ID_MASK for key in want]}"


def check_host_tier(tier: HostTier, tree: TreeNodes) -> None:
    """The host tier's own invariant: exact ref counts (1 per node holding a copy, + 1 per pin), free + evictable +
    in_use == total with each block counted once, the host LRU is exactly the droppable copies, loading blocks are
    device copies of host-resident nodes. O(nodes + host blocks). Mutates nothing.

    Raises:
        AssertionError: naming the offending host block.
    """
    pool = tier.pool
    pool.check_invariants()
    pin_counts = tier.pins()
    pins = set(pin_counts)
    assert all(c >= 1 for c in pin_counts.values()), f"a pin count below 1: {pin_counts}"
    held = {n.host_block: n for n in tree.by_hash.values() if n.host_block >= 0}
    for hb, node in held.items():
        assert tier.by_block[hb] is node, f"host block {hb} not indexed"
        assert node.host_lru_key & ID_MASK == hb, f"host block {hb}: LRU key names another block"
        assert node.host_listed == tier.is_candidate(node), f"host block {hb}: listed {node.host_listed}"
    assert sum(n is not None for n in tier.by_block) == len(held) == tier.num_cached, "host index miscounted"
    for hb in range(pool.num_blocks):
        want = (hb in held) + pin_counts.get(hb, 0)
        assert pool.ref_counts[hb] == want, f"host block {hb}: ref count {pool.ref_counts[hb]}, holders {want}"
    free = set(pool.free_block_ids())
    evictable = set(held) - pins
    assert not (free & pins or free & evictable), "a host block is both free and held"
    assert len(free) + len(evictable) + len(pins) == pool.num_blocks, (
        f"host free {len(free)} + evictable {len(evictable)} + in_use {len(pins)} != total {pool.num_blocks}"
    )
    assert tier.num_evictable == len(evictable), f"host evictable count {tier.num_evictable}, real {len(evictable)}"
    want_lru = sorted(n.host_lru_key for n in held.values() if tier.is_candidate(n))
    assert list(tier.lru) == want_lru, f"host LRU {[k & ID_MASK for k in tier.lru]} != droppable copies"
    assert tier.loading <= set(tier.device_pins), f"loading blocks {tier.loading} without a device pin"
