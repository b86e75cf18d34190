"""Test helpers over radix/: the one-call conveniences tests use and production code does not (so they live here,
not in KVCacheManager / RadixTree). They go through the public API where there is one, else through the parts the
manager owns (its pool, tree and sequence states)."""

from __future__ import annotations

from collections.abc import Sequence

from radix.keys import pack_blocks
from radix.manager import KVCacheManager, UnknownSequenceError
from radix.tree import InsertResult, RadixTree


def toks(a: int, b: int) -> list[int]:
    """The tokens a, a + 1, ..., b."""
    return list(range(a, b + 1))


def finished(m: KVCacheManager, seq_id: int, tokens: list[int]) -> None:
    """Admit, compute everything, free: the tokens end up cached. Checks every invariant after."""
    assert admit(m, seq_id, tokens) is not None
    m.commit_computed(seq_id, len(tokens))
    m.free(seq_id)
    m.check_invariants()


def admit(
    m: KVCacheManager,
    seq_id: int,
    tokens: Sequence[int],
    cache_salt: str | None = None,
    num_new_tokens: int | None = None,
    *,
    count_stats: bool = True,
) -> int | None:
    """What the scheduler does at admission: keys once, match, add_sequence with that match."""
    match = m.match_prefix(m.block_keys(tokens, cache_salt))
    return m.add_sequence(seq_id, match, num_new_tokens, count_stats=count_stats)


def match(m: KVCacheManager, tokens: Sequence[int], cache_salt: str | None = None) -> tuple[list[int], int]:
    """(block_ids, num_tokens) of the manager's match of tokens."""
    found = m.match_prefix(m.block_keys(tokens, cache_salt))
    return found.block_ids, found.num_tokens


def ref_count(m: KVCacheManager, block_id: int) -> int:
    return m._pool.ref_count(block_id)


def has_sequence(m: KVCacheManager, seq_id: int) -> bool:
    return seq_id in m._seqs


def is_swapped(m: KVCacheManager, seq_id: int) -> bool:
    if seq_id not in m._seqs:
        raise UnknownSequenceError(seq_id)
    return m._seqs[seq_id].host_table is not None


def num_tokens(m: KVCacheManager, seq_id: int) -> int:
    """Known tokens of the sequence (prompt + appended)."""
    return m._get(seq_id).num_tokens


def slot_mapping(m: KVCacheManager, seq_id: int, start: int, end: int) -> list[int]:
    """The slots of positions [start, end) in the sequence's block table, table[p // B] * B + p % B (what the worker
    derives; the oracle for where a sequence writes)."""
    table = m.block_table(seq_id)
    bs = m.block_size
    assert 0 <= start <= end <= len(table) * bs, f"positions [{start}, {end}) outside the block table"
    return [table[p // bs] * bs + p % bs for p in range(start, end)]


def snapshot(m: KVCacheManager) -> list[bytes]:
    return m.kv_snapshot().block_hashes


def cache_computed_blocks(m: KVCacheManager, seq_id: int, num_tokens: int) -> None:
    """Insert the full blocks among the first num_tokens (computed) tokens without moving num_computed_tokens, as
    commit_computed does itself. Raises ValueError when num_tokens exceeds the computed tokens."""
    seq = m._live(seq_id)
    if not 0 <= num_tokens <= seq.num_computed:
        raise ValueError(f"cannot cache {num_tokens} tokens: only {seq.num_computed} are computed")
    m.tree.cache_full_blocks(seq, num_tokens // m.block_size)


def is_cached(tree: RadixTree, block_id: int) -> bool:
    return tree.block_hash(block_id) is not None


def tree_insert(
    tree: RadixTree, tokens: Sequence[int], block_ids: Sequence[int], salt: str | None = None
) -> InsertResult:
    """Insert the full blocks of tokens held in block_ids (block i holds tokens [i*B, (i+1)*B)) from salt's root."""
    blocks = pack_blocks(tokens, tree.block_size)
    n = min(len(blocks), len(block_ids))
    return tree.insert_chain(None, salt, blocks[:n], list(block_ids[:n]))


def tree_match(
    tree: RadixTree, tokens: Sequence[int], salt: str | None = None, max_blocks: int | None = None
) -> list[int]:
    """Block ids of the tree's longest cached prefix of tokens' full blocks."""
    blocks = pack_blocks(tokens, tree.block_size)
    return tree.match(blocks, salt, len(blocks) if max_blocks is None else max_blocks).block_ids
