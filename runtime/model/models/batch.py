"""AttentionMetadata: what one forward over a flat varlen batch needs besides the token ids."""

from __future__ import annotations

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
    """

    positions: torch.Tensor
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    max_query_len: int
    max_seq_len: int
    logits_indices: torch.Tensor | None = None
