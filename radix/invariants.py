"""check_manager() and check_tree(): recount every reference and block state of a KVCacheManager / RadixTree from
scratch (tests call them after every operation, through KVCacheManager.check_invariants; too slow for the serving
loop: O(blocks + sequences * table length)). They take the parts as plain arguments, so this module does not import
radix/manager.py (no import circle)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping

from radix.block_pool import BlockPool
from radix.sequence import SeqBlocks
from radix.tree import Node, RadixTree, _Root


def check_manager(
    pool: BlockPool, tree: RadixTree, host: BlockPool, seqs: Mapping[int, SeqBlocks], block_size: int
) -> None:
    """Raise AssertionError (naming the sequence or block) if any KVCacheManager invariant is broken:
    exact ref counts, free + evictable + in_use == total with each block counted once, live block tables only
    reference allocated blocks, the cached prefix of each sequence is its resident path, host blocks have one owner.
    Mutates nothing."""
    pool.check_invariants()
    check_tree(tree)
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
            assert tree.resident_block(node.block_hash) == node.block_id, f"seq {seq_id}: block {i} is not resident"
            assert node.key == seq.blocks[i], f"seq {seq_id}: cached block {i} holds other tokens"
            assert node.block_id == seq.block_table[i] or node.block_id in seq.shadow, (
                f"seq {seq_id}: block {i} resident as {node.block_id} but neither in its table nor its shadow"
            )
            node = node.parent
        assert n == 0 or (node is not None and node.block_hash is None), f"seq {seq_id}: path longer than {n} blocks"
    for h in tree.hashes():
        resident = tree.resident_block(h)
        assert resident is not None
        expected[resident] += 1
    for b in range(pool.first_block_id, pool.num_blocks):
        assert pool.ref_counts[b] == expected[b], f"block {b}: ref count {pool.ref_counts[b]}, holders {expected[b]}"
    assert 0 not in expected, "the null block 0 is referenced"
    free = set(pool.free_block_ids())
    evictable = {b for b in map(tree.resident_block, tree.hashes()) if b is not None and pool.ref_counts[b] == 1}
    in_use = {b for b in range(pool.first_block_id, pool.num_blocks) if pool.ref_counts[b] >= 1} - evictable
    assert not (free & evictable or free & in_use), "a block is both free and held"
    assert len(free) + len(evictable) + len(in_use) == pool.num_usable, (
        f"free {len(free)} + evictable {len(evictable)} + in_use {len(in_use)} != total {pool.num_usable}"
    )
    assert len(evictable) == tree.num_evictable, f"evictable count {tree.num_evictable}, real {len(evictable)}"
    for b in range(host.num_blocks):
        assert host.ref_counts[b] == host_owner[b], f"host block {b}: ref {host.ref_counts[b]}, owners {host_owner[b]}"


def check_tree(tree: RadixTree) -> None:
    """Nodes, children, roots, evictable count, LRU set and the path property are consistent. O(num_cached).

    Raises:
        AssertionError: naming the offending block.
    """
    rc = tree.pool.ref_counts
    evictable = 0
    reached = 0
    stack: list[Node] = list(tree._roots.values())
    for salt, root in tree._roots.items():
        assert root.salt == salt and root.parent is None, f"root of salt {salt!r} misfiled"
        assert salt is None or root.children, f"empty root kept for salt {salt!r}"
    while stack:
        parent = stack.pop()
        for key, node in (parent.children or {}).items():
            b = node.block_id
            reached += 1
            assert node.key == key and node.parent is parent, f"block {b} filed under the wrong key or parent"
            assert len(key) == 4 * tree.block_size, f"block {b}: key of {len(key)} bytes"
            assert node.block_hash is not None and tree._nodes.get(node.block_hash) is node, f"{b} not indexed"
            assert tree._by_block[b] is node, f"block {b} not indexed by id"
            assert rc[b] >= 1, f"cached block {b} has ref count {rc[b]}"
            assert node.children is None or node.children, f"block {b} keeps an empty children dict"
            evictable += rc[b] == 1
            if type(parent) is not _Root:
                assert rc[b] == 1 or rc[parent.block_id] >= 2, f"block {b} in use but its parent is only cached"
            stack.append(node)
    assert reached == len(tree._nodes), f"{reached} nodes reachable, {len(tree._nodes)} indexed by hash"
    indexed = sum(node is not None for node in tree._by_block)
    assert indexed == len(tree._nodes), f"{indexed} blocks indexed, {len(tree._nodes)} nodes"
    assert evictable == tree._num_evictable, f"evictable count {tree._num_evictable}, real {evictable}"
    want = sorted(n.lru_key for n in tree._nodes.values() if n.children is None and rc[n.block_id] == 1)
    assert list(tree._lru) == want, f"LRU set {tree.lru_order()} != evictable leaves {want}"
