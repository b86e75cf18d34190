"""AttentionMetadata: what one forward over a flat varlen batch needs besides the token ids; how a step builds it.

BlockTableRows keeps the worker's block tables as rows of one int32 tensor, updated from each step's appended block
ids, so a step's block_tables tensor is one gather (O(batch) Python) instead of padded Python lists (O(batch x blocks)
Python per step). step_metadata takes a fast path for steps of one token per sequence (every decode step).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """Per-step layout of a flat batch of num_tokens tokens from num_seqs sequences (prefill, extend, decode mixed).

    positions: int64 [num_tokens], position of each token in its sequence.
    slot_mapping: int64 [num_tokens], KV slot (block * block_size + offset) each token's K/V is written to; -1 skips.
    block_tables: int32 [num_seqs, max_blocks_per_seq], padded with the null block 0.
    seq_lens: int32 [num_seqs], context of each sequence including this step's tokens.
    query_start_loc: int32 [num_seqs + 1], cumulative query lengths starting at 0.
    max_query_len, max_seq_len: host-side maxima of the query lengths and seq_lens (tokens), so no device sync.
    logits_indices: int64 [num_rows], the token rows whose logits the model returns (each sequence's last token, or
        all tokens); None returns every row.
    window: with a sliding-window KV cache group, the metadata the sliding layers read instead (the same tokens, that
        group's block_tables and slot_mapping); None with one group.
    """

    positions: torch.Tensor
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    max_query_len: int
    max_seq_len: int
    logits_indices: torch.Tensor | None = None
    window: AttentionMetadata | None = None  # the sliding layers' (their KV cache group's tables and slots), or None


_MIN_ROWS = 8  # rows of the first allocation; rows and columns double when full


class BlockTableRows:
    """Block tables as rows of one int32 host tensor [capacity, width], padded with the null block 0.

    The owner (ModelRunner) takes a row when it registers a sequence (add), appends the block ids each step brings
    (extend), and frees the row when the sequence leaves (free); a freed row is reused. The tensor grows (rows and
    columns double) and never shrinks: 4 bytes x capacity x width. Rows are valid only while their sequence is live.
    """

    def __init__(self, width: int = 64) -> None:
        self.table = torch.zeros(0, max(1, width), dtype=torch.int32)
        self._lens: list[int] = []  # blocks in each row
        self._free: list[int] = []

    def add(self, block_ids: Sequence[int]) -> int:
        """A new row holding block_ids; returns its index. O(len(block_ids)) (amortised over growth)."""
        if not self._free:
            self._grow_rows()
        row = self._free.pop()
        self._lens[row] = 0
        self.extend(row, block_ids)
        return row

    def extend(self, row: int, block_ids: Sequence[int]) -> None:
        """Append block_ids to row (a live row). O(len(block_ids)); nothing when empty."""
        if not block_ids:
            return
        start = self._lens[row]
        end = start + len(block_ids)
        if end > self.table.shape[1]:
            self._grow_columns(end)
        self.table[row, start:end] = torch.tensor(block_ids, dtype=torch.int32)
        self._lens[row] = end

    def truncate(self, row: int, num_blocks: int) -> None:
        """Keep the first num_blocks entries of row (a live row), the rest back to the null block. O(width)."""
        if num_blocks < self._lens[row]:
            self.table[row, num_blocks:].zero_()
            self._lens[row] = num_blocks

    def free(self, row: int) -> None:
        """Release row for reuse: zeroed, so its padding stays the null block. O(width)."""
        self.table[row].zero_()
        self._lens[row] = 0
        self._free.append(row)

    def gather(self, rows: Sequence[int], max_blocks: int) -> torch.Tensor:
        """int32 [len(rows), max_blocks]: the first max_blocks entries of each row (0 past a row's end), a new
        tensor. max_blocks must be >= 1. One index_select."""
        index = torch.tensor(rows, dtype=torch.int64)
        return self.table[:, :max_blocks].index_select(0, index)

    def _grow_rows(self) -> None:
        old = self.table.shape[0]
        new = max(_MIN_ROWS, 2 * old)
        grown = torch.zeros(new, self.table.shape[1], dtype=torch.int32)
        grown[:old] = self.table
        self.table = grown
        self._lens.extend([0] * (new - old))
        self._free.extend(range(new - 1, old - 1, -1))  # pop() hands out the lowest row first

    def _grow_columns(self, need: int) -> None:
        grown = torch.zeros(self.table.shape[0], max(need, 2 * self.table.shape[1]), dtype=torch.int32)
        grown[:, : self.table.shape[1]] = self.table
        self.table = grown


def decode_metadata(
    positions: list[int], slots: list[int], block_tables: torch.Tensor, sample_rows: list[int], device: torch.device
) -> AttentionMetadata:
    """The metadata of a step whose every sequence runs one token: token i is sequence i's, at positions[i], written
    to slots[i]; block_tables int32 [num_seqs, max_blocks]; sample_rows the rows whose logits are returned.
    Five small host tensors, no per-token tensor arithmetic."""
    n = len(positions)
    pos = torch.tensor(positions, dtype=torch.int64)
    return AttentionMetadata(
        positions=pos.to(device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        block_tables=block_tables.to(device),
        seq_lens=(pos + 1).to(device=device, dtype=torch.int32),
        query_start_loc=torch.arange(n + 1, dtype=torch.int32, device=device),
        max_query_len=1,
        max_seq_len=max(positions) + 1,
        logits_indices=torch.tensor(sample_rows, dtype=torch.int64, device=device),
    )


def varlen_metadata(
    starts: list[int],
    q_lens: list[int],
    block_tables: torch.Tensor,
    sample_rows: list[int],
    block_size: int,
    device: torch.device,
) -> AttentionMetadata:
    """The metadata of any mix of prefill chunks and decodes: sequence i runs q_lens[i] >= 1 tokens from position
    starts[i]; its tokens are consecutive in the flat batch. block_tables int32 [num_seqs, max_blocks] must cover
    every position run; slot = block_tables[i, pos // block_size] * block_size + pos % block_size. O(num_seqs)
    Python, O(num_tokens) tensor work."""
    start_t = torch.tensor(starts, dtype=torch.int64)
    qlen_t = torch.tensor(q_lens, dtype=torch.int64)
    qsl = torch.zeros(len(starts) + 1, dtype=torch.int32)
    torch.cumsum(qlen_t, dim=0, out=qsl[1:])
    num_tokens = int(qsl[-1])
    seq_of_token = torch.repeat_interleave(torch.arange(len(starts)), qlen_t)
    positions = start_t[seq_of_token] + torch.arange(num_tokens) - qsl[:-1].long()[seq_of_token]
    slots = block_tables[seq_of_token, positions // block_size].long() * block_size + positions % block_size
    return AttentionMetadata(
        positions=positions.to(device),
        slot_mapping=slots.to(device),
        block_tables=block_tables.to(device),
        seq_lens=(start_t + qlen_t).to(device=device, dtype=torch.int32),
        query_start_loc=qsl.to(device),
        max_query_len=max(q_lens),
        max_seq_len=max(s + q for s, q in zip(starts, q_lens, strict=True)),
        logits_indices=torch.tensor(sample_rows, dtype=torch.int64, device=device),
    )


def step_metadata(
    starts: list[int],
    q_lens: list[int],
    samples: list[bool],
    tables: Sequence[Sequence[int]],
    block_tables: torch.Tensor,
    block_size: int,
    device: torch.device,
) -> AttentionMetadata:
    """The metadata of a step whose sequence i runs q_lens[i] >= 1 consecutive tokens of the flat batch from position
    starts[i], returns its last token's logits where samples[i], and has block table tables[i] (also row i of
    block_tables int32 [num_seqs, max_blocks], padded with 0). A step of one token per sequence (every decode step)
    takes decode_metadata, slots computed in Python from tables (O(1) each); any other varlen_metadata."""
    if all(q == 1 for q in q_lens):
        slots = [t[p // block_size] * block_size + p % block_size for t, p in zip(tables, starts, strict=True)]
        return decode_metadata(starts, slots, block_tables, [i for i, s in enumerate(samples) if s], device)
    ends = itertools.accumulate(q_lens)
    rows = [end - 1 for end, s in zip(ends, samples, strict=True) if s]
    return varlen_metadata(starts, q_lens, block_tables, rows, block_size, device)
