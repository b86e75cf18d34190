"""The sampler's grammar stage (stage 4 of the sampler contract): a step's token bitmask, disallowed tokens -> -inf.

The bitmask is xgrammar's layout: int32 [M, ceil(V / 32)], bit j of word w allows token 32 * w + j (1: allowed).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import xgrammar as xgr


class GrammarRows(NamedTuple):
    """The constrained rows of one step's logits: batch_index int64 [M] (rows of the logits, on their device) and
    bitmask int32 [M, ceil(V / 32)] (row i is batch_index[i]'s, xgrammar's layout, on the logits' device), and
    whether the M rows are every row of the logits in order (every_row)."""

    batch_index: torch.Tensor
    bitmask: torch.Tensor
    every_row: bool = False


def apply_token_bitmask(scores: torch.Tensor, rows: GrammarRows | None, owned: bool = False) -> torch.Tensor:
    """scores float32 [N, V] with every disallowed token of the rows in `rows` set to -inf; None returns scores
    itself (the step pays nothing).

    owned: scores is a tensor this step made (the penalties' output), so it is changed in place; otherwise (the raw
    logits, which logprobs still read) the constrained rows are masked in a copy. The mask itself is xgrammar's
    kernel (apply_token_bitmask_inplace: a CPU loop or a CUDA / Triton kernel), bits past V ignored.
    O(M * V) elementwise work.
    """
    if rows is None:
        return scores
    vocab = scores.shape[-1]
    if rows.every_row:
        out = scores if owned else scores.clone()
        xgr.apply_token_bitmask_inplace(out, rows.bitmask, vocab_size=vocab)
        return out
    picked = scores.index_select(0, rows.batch_index)
    xgr.apply_token_bitmask_inplace(picked, rows.bitmask, vocab_size=vocab)
    if owned:
        return scores.index_copy_(0, rows.batch_index, picked)
    return scores.index_copy(0, rows.batch_index, picked)
