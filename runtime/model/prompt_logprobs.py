"""Prompt logprobs in the worker (SamplingParams.prompt_logprobs, vLLM's prompt_logprobs): the log-softmax of the
raw logits at each prompt position a step runs, read at the next prompt token, with its rank and the top-k.

A chunk of a sequence runs positions [start_pos, start_pos + len(token_ids)); position p < prompt_len - 1 predicts
prompt token p + 1, which the worker knows from the prompt the sequence registered with (ScheduledSeq.
prompt_token_ids), so a chunk boundary loses nothing. The model returns the logits of those rows after the rows that
sample (PromptRows.rows is appended to AttentionMetadata.logits_indices), so only sequences that ask pay: their
chunk's rows x vocab float32 logits, and one log-softmax over them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, NamedTuple

import torch

from runtime.protocol import PromptLogprobs, ScheduledSeq, TokenLogprobs

if TYPE_CHECKING:
    from runtime.model.worker_seqs import WorkerSeq


class PromptSlice(NamedTuple):
    """One sequence's prompt positions in a step: rows [first_row, first_row + count) of the prompt logits are
    positions start - 1 .. start + count - 2, predicting prompt tokens start .. start + count - 1 (target_ids);
    top: alternatives wanted per position."""

    seq_id: int
    first_row: int
    start: int
    target_ids: list[int]
    top: int


class PromptRows(NamedTuple):
    """rows: int64 [R], the flat-batch token rows whose logits the prompt logprobs need, slice after slice."""

    rows: torch.Tensor
    slices: list[PromptSlice]


def prompt_rows(seqs: Sequence[ScheduledSeq], states: Mapping[int, WorkerSeq]) -> PromptRows | None:
    """The rows of seqs (a step, in batch order; each registered) whose logits their prompt logprobs need, or None
    when no sequence of the step asks. O(len(seqs)) plus O(rows) for the sequences that ask."""
    rows: list[int] = []
    slices: list[PromptSlice] = []
    offset = 0  # flat row of the sequence's first token
    for s in seqs:
        state = states[s.seq_id]
        k = state.params.prompt_logprobs
        prompt = state.prompt_token_ids
        end = min(s.start_pos + len(s.token_ids), state.prompt_len - 1)
        if k is not None and prompt is not None and end > s.start_pos:
            first = offset
            count = end - s.start_pos
            slices.append(PromptSlice(s.seq_id, len(rows), s.start_pos + 1, prompt[s.start_pos + 1 : end + 1], k))
            rows.extend(range(first, first + count))
        offset += len(s.token_ids)
    if not slices:
        return None
    return PromptRows(torch.tensor(rows, dtype=torch.int64), slices)


def prompt_logprobs(logits: torch.Tensor, plan: PromptRows) -> dict[int, PromptLogprobs]:
    """seq_id -> PromptLogprobs of each slice of plan, from logits float32 [len(plan.rows), vocab] (the model's
    output for plan.rows, in order): the float32 log-softmax of each row read at the next prompt token, its rank
    (1 + tokens with a strictly higher logprob) and the slice's top alternatives, best first. O(rows x vocab)."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    targets = torch.tensor([t for sl in plan.slices for t in sl.target_ids], dtype=torch.int64, device=lp.device)
    chosen = lp.gather(1, targets[:, None])
    ranks = ((lp > chosen).sum(dim=-1) + 1).tolist()
    values = chosen.squeeze(1).tolist()
    k = min(max(sl.top for sl in plan.slices), lp.shape[-1])
    top_ids: list[list[int]] = [[] for _ in values]
    top_values: list[list[float]] = [[] for _ in values]
    if k:
        top = torch.topk(lp, k, dim=-1)
        top_ids = top.indices.tolist()
        top_values = top.values.tolist()
    out = {}
    for sl in plan.slices:
        entries: list[TokenLogprobs | None] = []
        for j in range(sl.first_row, sl.first_row + len(sl.target_ids)):
            entries.append(TokenLogprobs(values[j], top_ids[j][: sl.top], top_values[j][: sl.top]))
        out[sl.seq_id] = PromptLogprobs(
            sl.start, sl.target_ids, entries, ranks[sl.first_row : sl.first_row + len(sl.target_ids)]
        )
    return out
