"""vLLM's KV event wire format (vllm/distributed/kv_events.py), and radixserve's events (radix/events.py) in it.

A message is three frames: the topic, the batch's sequence number (8 bytes, big endian, 0, 1, 2, ... per publisher),
and the msgpack of an EventBatch: an array ``[ts, events, data_parallel_rank]`` (ts: seconds since the epoch, a
float). Each event is a map tagged by ``"type"``: ``"BlockStored"`` (block_hashes, parent_block_hash, token_ids,
block_size, lora_id, medium, lora_name, group_idx), ``"BlockRemoved"`` (block_hashes, medium, group_idx),
``"AllBlocksCleared"``. The Structs below encode to exactly those bytes, so vLLM's own classes (KVEventBatch) decode
them; fields vLLM leaves at their default are omitted, as vLLM omits them.

What radixserve sends in them:
- block hashes: ours (radix/hashing.py, BLAKE2b-128 of the chained block content), as vLLM's ExternalBlockHash: by
  default the int of their last 8 bytes read big endian (vLLM's ``maybe_convert_block_hash`` with its default
  VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1); the 16 bytes themselves with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0. The
  values differ from vLLM's own hashes of the same tokens (a consumer that hashes prompts itself uses token_ids).
- medium: "GPU" for the device pool (vLLM's MEDIUM_GPU, whatever the device is), "CPU" for the host tier.
- token_ids: the stored blocks' tokens, block_size per block, in block_hashes order. A device BlockStored is one
  chain under parent_block_hash (None: it starts at the root). Blocks written back to the host tier are not one chain
  (radix/events.py), so each goes out as its own BlockStored with its own parent, as vLLM's offloading events do.
- extra_keys: one entry per block, as vLLM's: ``(cache_salt,)`` for a block hashed with a request's cache_salt (the
  first block of a salted prompt), else None.
- lora_id, lora_name: None (no adapters).
- group_idx: the event's KV cache group (radix/events.py ``group``): 0, the full-attention group (every event of a
  single-group replica), or 1, the sliding-window group of a hybrid one (radix/hybrid_manager.py), whose blocks hang
  on group 0's under the same hashes. Group 1's BlockStored goes out one per block with its own parent (its blocks
  are not one chain) and carries, as vLLM's cache-spec metadata, kv_cache_spec_kind "sliding_window" and
  kv_cache_spec_sliding_window W; vLLM's BlockRemoved carries group_idx alone, as ours.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence
from typing import Any

import msgspec

from radix.events import HOST, AllBlocksCleared, BlockRemoved, KvEvent
from radix.hashing import BlockHash

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
SLIDING_WINDOW_KIND = "sliding_window"  # vLLM's KVCacheSpecKind.SLIDING_WINDOW
ExternalBlockHash = bytes | int
_LOW_64 = (1 << 64) - 1


class VllmBlockStored(msgspec.Struct, tag="BlockStored", omit_defaults=True, gc=False):
    """vLLM's BlockStored, field for field, in its order (msgspec sizes the map header by the field count, so the
    optional fields radixserve never sets are declared too: the bytes are vLLM's own)."""

    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class VllmBlockRemoved(msgspec.Struct, tag="BlockRemoved", omit_defaults=True, gc=False):
    """vLLM's BlockRemoved, field for field."""

    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class VllmAllBlocksCleared(msgspec.Struct, tag="AllBlocksCleared", omit_defaults=True, gc=False):
    """vLLM's AllBlocksCleared."""


VllmEvent = VllmBlockStored | VllmBlockRemoved | VllmAllBlocksCleared


class VllmEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """vLLM's KVEventBatch: ts (seconds since the epoch), the events in order, the publisher's data-parallel rank."""

    ts: float
    events: list[VllmEvent]
    data_parallel_rank: int | None = None


def external_hash(block_hash: BlockHash, int_hashes: bool) -> ExternalBlockHash:
    """A block hash as vLLM publishes one: the int of its last 8 bytes, big endian (int_hashes; vLLM's
    maybe_convert_block_hash), else the bytes unchanged. Pure."""
    if int_hashes:
        return int.from_bytes(block_hash, "big") & _LOW_64
    return block_hash


def unpack_tokens(packed: bytes) -> list[int]:
    """Token ids from radix.hashing.pack_tokens's bytes (uint32 little endian). Pure, O(len) in C."""
    tokens = array("I" if array("I").itemsize == 4 else "L")
    tokens.frombytes(packed)
    if sys.byteorder == "big":
        tokens.byteswap()
    return tokens.tolist()


def _stored(
    hashes: list[BlockHash],
    parent: BlockHash | None,
    tokens: list[int],
    salts: list[str | None],
    size: int,
    medium: str,
    ints: bool,
    group: int = 0,
    window: int = 0,
) -> VllmBlockStored:
    """One vLLM BlockStored of a chain of blocks under parent (extra_keys: a salted block's (cache_salt,)); group,
    window: the KV cache group and, for the sliding-window one, its window (the spec kind and window fields)."""
    parent_hash = None if parent is None else external_hash(parent, ints)
    stored = [external_hash(h, ints) for h in hashes]
    extra_keys: list[tuple[Any, ...] | None] = [None if s is None else (s,) for s in salts]
    event = VllmBlockStored(stored, parent_hash, tokens, size, None, medium, None, extra_keys, group_idx=group)
    if window:
        event.kv_cache_spec_kind = SLIDING_WINDOW_KIND
        event.kv_cache_spec_sliding_window = window
    return event


def to_vllm(event: KvEvent, int_hashes: bool) -> list[VllmEvent]:
    """One radixserve KV event in vLLM's form: one event, or for a host-tier BlockStored one per block (the module
    docstring says what each field carries). A BlockStored must carry its tokens and salts (and, on the host tier,
    its parents): a KvEventLog made with token_ids=True. Pure.

    Raises:
        ValueError: a BlockStored without token ids or (host tier) parents.
    """
    if isinstance(event, BlockRemoved):
        medium = MEDIUM_CPU if event.medium == HOST else MEDIUM_GPU
        hashes_out = [external_hash(h, int_hashes) for h in event.block_hashes]
        return [VllmBlockRemoved(hashes_out, medium, group_idx=event.group)]
    if isinstance(event, AllBlocksCleared):
        return [VllmAllBlocksCleared()]
    size = event.block_size
    hashes = event.block_hashes
    if len(event.token_ids) != 4 * size * len(hashes) or len(event.salts) != len(hashes):
        raise ValueError(f"BlockStored seq {event.seq} has no token ids: record them (event_token_ids=True)")
    tokens = unpack_tokens(event.token_ids)
    medium = MEDIUM_CPU if event.medium == HOST else MEDIUM_GPU
    if event.medium != HOST and not event.group:
        return [_stored(hashes, event.parent_block_hash, tokens, event.salts, size, medium, int_hashes)]
    if len(event.block_parents) != len(hashes):
        raise ValueError(f"BlockStored seq {event.seq} (host tier or group 1) has no parents: record them")
    out: list[VllmEvent] = []
    window = event.sliding_window
    for i, (h, parent, salt) in enumerate(zip(hashes, event.block_parents, event.salts, strict=True)):
        block_tokens = tokens[i * size : (i + 1) * size]
        out.append(_stored([h], parent, block_tokens, [salt], size, medium, int_hashes, event.group, window))
    return out


def to_vllm_batch(events: Sequence[KvEvent], ts: float, data_parallel_rank: int, int_hashes: bool) -> VllmEventBatch:
    """One step's events as a vLLM EventBatch, in order. Pure; O(events + blocks + tokens).

    Raises:
        ValueError: from to_vllm.
    """
    return VllmEventBatch(ts, [v for e in events for v in to_vllm(e, int_hashes)], data_parallel_rank)
