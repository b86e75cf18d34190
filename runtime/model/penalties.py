"""Frequency, presence and repetition penalties: the worker's per-sequence token state and the batched apply.

Semantics are vLLM's (its apply_penalties; frequency and presence as the OpenAI API defines them). Per sequence, with
count[v] the occurrences of token v in the completion's output so far and seen[v] = v occurs in the prompt or the
output, repetition first, then the two additive penalties:

    logit[v] = logit[v] / r if logit[v] > 0 else logit[v] * r      where seen[v] (r = repetition_penalty, CTRL:
                                                                    Keskar et al. 2019)
    logit[v] -= frequency_penalty * count[v] + presence_penalty * (count[v] > 0)

The sampler applies them to the raw logits before temperature and the filters; logprobs stay those of the raw logits.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from runtime.sampling_params import SamplingParams

_MIN_ROWS = 8  # rows allocated by the first sequence with penalties; the capacity doubles when full


def apply_penalties(
    logits: torch.Tensor,
    counts: torch.Tensor,
    prompt_mask: torch.Tensor,
    penalties: torch.Tensor,
    repetition: bool = True,
    additive: bool = True,
) -> torch.Tensor:
    """The penalised logits of M rows (a new tensor; the inputs are not changed).

    logits float32 [M, V]; counts float32 [M, V] (output occurrences of each token); prompt_mask bool [M, V] (the
    token occurs in the prompt; all False where repetition_penalty is 1); penalties float32 [M, 3] = (frequency,
    presence, repetition) per row. repetition / additive False skip the repetition or the frequency + presence part
    (the caller knows no row uses it). Elementwise over [M, V]: no Python loop over rows or the vocabulary.
    """
    return _penalise(logits.clone(), counts, prompt_mask, penalties, repetition, additive, additive)


def _penalise(
    rows: torch.Tensor,
    counts: torch.Tensor,
    prompt_mask: torch.Tensor | None,
    penalties: torch.Tensor,
    repetition: bool,
    frequency: bool,
    presence: bool,
) -> torch.Tensor:
    """apply_penalties on rows, a tensor the caller owns: changed in place and returned (a new tensor when
    repetition is on). The arithmetic is the same whichever parts run: a part skipped is one that would add -0.0
    times its penalty to every logit (x + -0.0 == x), so the result does not depend on the other rows of the step.
    Passes over [M, V]: 2 for frequency (addcmul_), 3 for presence (clamp, addcmul_), 5 for repetition."""
    if repetition:
        assert prompt_mask is not None
        r = penalties[:, 2:3]
        rows = torch.where((counts > 0) | prompt_mask, torch.where(rows > 0, rows / r, rows * r), rows)
    if frequency:
        rows.addcmul_(counts, penalties[:, 0:1], value=-1.0)
    if presence:  # counts are whole numbers >= 0: clamp(max=1) is (count > 0) as 1.0 / 0.0, with no bool temporary
        rows.addcmul_(counts.clamp(max=1.0), penalties[:, 1:2], value=-1.0)
    return rows


class PenaltyRows(NamedTuple):
    """The rows of one step's logits that have penalties: batch_index int64 [M] (rows of the logits), state_index
    int64 [M] (their rows in the PenaltyState), that state's tensors (read only), whether any of the M rows has a
    repetition_penalty != 1 (repetition), a frequency_penalty != 0 (frequency), a presence_penalty != 0 (presence),
    whether the M rows are every row of the logits, in order (every_row), and the draft tokens each row counts on
    top of its sequence's output (draft_pairs int64 [2, E]: (row among the M, token id) per draft token; None: none).
    A speculative draft's row j sees the output so far plus draft tokens d_1..d_j-1, as plain decoding would have.
    """

    batch_index: torch.Tensor
    state_index: torch.Tensor
    counts: torch.Tensor
    prompt_mask: torch.Tensor
    penalties: torch.Tensor
    repetition: bool
    frequency: bool
    presence: bool
    every_row: bool = False
    draft_pairs: torch.Tensor | None = None

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """logits float32 [N, V] with the penalties applied to the M rows of batch_index (a new tensor; the other rows
        are copied unchanged and logits itself is not changed). Gathers the M rows of logits and of the state, then
        the passes of _penalise; a step whose every row has penalties skips the copy back into the other rows. The
        draft tokens of draft_pairs are added to the gathered counts (one index_put_), never to the state."""
        rows = logits.index_select(0, self.batch_index)
        mask = self.prompt_mask.index_select(0, self.state_index) if self.repetition else None
        counts = self.counts.index_select(0, self.state_index)
        if self.draft_pairs is not None:
            ones = torch.ones(self.draft_pairs.shape[1], device=counts.device)
            counts.index_put_((self.draft_pairs[0], self.draft_pairs[1]), ones, accumulate=True)
        rows = _penalise(
            rows,
            counts,
            mask,
            self.penalties.index_select(0, self.state_index),
            self.repetition,
            self.frequency,
            self.presence,
        )
        return rows if self.every_row else logits.index_copy(0, self.batch_index, rows)


class PenaltyState:
    """The token state of the live sequences whose penalties are on, one row of device tensors each.

    counts float32 [capacity, vocab_size]: occurrences of each token in the output so far (exact up to 2**24).
    prompt_mask bool [capacity, vocab_size]: the token occurs in the prompt (filled only with repetition_penalty on).
    penalties float32 [capacity, 3]: (frequency, presence, repetition) of the row's sequence.
    Nothing is allocated until the first sequence with penalties arrives (8 rows); the capacity doubles when full and
    never shrinks: 5 * vocab_size bytes per row (240 KiB for a 49152-token vocabulary). A row is reused after its
    sequence is removed. The owner (ModelRunner) adds a sequence when the worker registers it, records the tokens it
    samples for it, and removes it when the sequence is dropped or fails.
    """

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self._rows: dict[int, int] = {}  # seq_id -> row
        self._kinds: dict[int, tuple[bool, bool, bool]] = {}  # seq_id -> (repetition, frequency, presence) on
        self._free: list[int] = []
        self.counts = torch.zeros(0, vocab_size, device=device)
        self.prompt_mask = torch.zeros(0, vocab_size, dtype=torch.bool, device=device)
        self.penalties = torch.zeros(0, 3, device=device)

    def __contains__(self, seq_id: object) -> bool:
        return seq_id in self._rows

    def __len__(self) -> int:
        return len(self._rows)

    def add(self, seq_id: int, params: SamplingParams, prompt_ids: Sequence[int], output_ids: Sequence[int]) -> None:
        """Start (or restart) seq_id's state from its prompt and its output so far; every id must be in
        [0, vocab_size) (the caller checks: an id outside raises IndexError on CPU). Mutates a row of each tensor
        (grows them when full). O(vocab_size + len(prompt_ids) + len(output_ids)) device work."""
        self.remove(seq_id)
        if not self._free:
            self._grow()
        row = self._free.pop()
        self._rows[seq_id] = row
        self._kinds[seq_id] = (
            params.repetition_penalty != 1.0,
            params.frequency_penalty != 0.0,
            params.presence_penalty != 0.0,
        )
        self.counts[row].zero_()
        self.prompt_mask[row].zero_()
        if output_ids:
            ids = torch.tensor(output_ids, dtype=torch.int64, device=self.device)
            self.counts[row].index_add_(0, ids, torch.ones(len(output_ids), device=self.device))
        if prompt_ids and params.repetition_penalty != 1.0:
            self.prompt_mask[row, torch.tensor(prompt_ids, dtype=torch.int64, device=self.device)] = True
        self.penalties[row] = torch.tensor(
            [params.frequency_penalty, params.presence_penalty, params.repetition_penalty]
        )

    def remove(self, seq_id: int) -> None:
        """Forget seq_id (no-op when it has no state); its row is free for the next add. O(1)."""
        row = self._rows.pop(seq_id, None)
        if row is not None:
            self._free.append(row)
            del self._kinds[seq_id]

    def rows(self, seq_ids: Sequence[int], prior: Sequence[Sequence[int]] | None = None) -> PenaltyRows | None:
        """The PenaltyRows of a step whose logits rows belong to seq_ids (in order; a sequence verifying a draft has
        one row per draft position), or None when none of them has state (the step then does no penalty work at
        all). prior (aligned with seq_ids, or None: all empty): the tokens each row counts as output on top of its
        sequence's state (a draft's row j: d_1..d_j-1). O(len(seq_ids) + prior tokens) Python, one host-to-device
        copy (two with prior tokens)."""
        if not self._rows:
            return None
        pairs = [(i, self._rows[s]) for i, s in enumerate(seq_ids) if s in self._rows]
        if not pairs:
            return None
        kinds = [self._kinds[s] for s in seq_ids if s in self._kinds]
        index = torch.tensor(pairs, dtype=torch.int64).T.to(self.device)
        draft_pairs = None
        if prior is not None:
            extra = [(m, t) for m, (i, _) in enumerate(pairs) for t in prior[i]]
            if extra:
                draft_pairs = torch.tensor(extra, dtype=torch.int64).T.to(self.device)
        return PenaltyRows(
            index[0],
            index[1],
            self.counts,
            self.prompt_mask,
            self.penalties,
            any(k[0] for k in kinds),
            any(k[1] for k in kinds),
            any(k[2] for k in kinds),
            len(pairs) == len(seq_ids),
            draft_pairs,
        )

    def record(self, seq_ids: Sequence[int], token_ids: Sequence[int]) -> None:
        """Count token_ids[i] as a new output token of seq_ids[i] (aligned, a sequence may repeat: a verified draft's
        accepted tokens and then its token; sequences without state are skipped).
        One tensor op for the whole step; nothing when no sequence has state."""
        if not self._rows:
            return
        pairs = [(self._rows[s], t) for s, t in zip(seq_ids, token_ids, strict=True) if s in self._rows]
        if not pairs:
            return
        index = torch.tensor(pairs, dtype=torch.int64).T.to(self.device)
        self.counts.index_put_((index[0], index[1]), torch.ones(len(pairs), device=self.device), accumulate=True)

    def _grow(self) -> None:
        old = self.counts.shape[0]
        new = max(_MIN_ROWS, 2 * old)
        for name in ("counts", "prompt_mask", "penalties"):
            tensor = getattr(self, name)
            grown = torch.zeros(new, *tensor.shape[1:], dtype=tensor.dtype, device=self.device)
            grown[:old] = tensor
            setattr(self, name, grown)
        self._free.extend(range(new - 1, old - 1, -1))  # pop() hands out the lowest row first
