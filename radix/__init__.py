"""KV memory manager: block keys and hashing, block pool, the prefix cache (a radix tree of cached prefixes, or none),
KVCacheManager, KV events.

Pure Python (no torch): it knows block ids, never tensors. See radix/manager.py for the scheduler-facing API.
"""

from radix.block_pool import BlockPool, NoFreeBlocksError
from radix.events import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent, KvEventLog, KvSnapshot
from radix.hashing import hash_block_tokens
from radix.keys import BlockKeys
from radix.manager import KVCacheManager, PrefixMatch, StaleMatchError, UnknownSequenceError
from radix.no_cache import NoPrefixCache
from radix.prefix_cache import PrefixCache
from radix.stats import KVStats
from radix.tree import RadixTree

__all__ = [
    "AllBlocksCleared",
    "BlockKeys",
    "BlockPool",
    "BlockRemoved",
    "BlockStored",
    "KVCacheManager",
    "KVStats",
    "KvEvent",
    "KvEventLog",
    "KvSnapshot",
    "NoFreeBlocksError",
    "NoPrefixCache",
    "PrefixCache",
    "PrefixMatch",
    "RadixTree",
    "StaleMatchError",
    "UnknownSequenceError",
    "hash_block_tokens",
]
