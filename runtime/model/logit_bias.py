"""Stage 3 of the sampler (runtime/model/sampler.py): logit_bias and min_tokens, on the rows that ask for them.

logit_bias adds each listed token's bias to its logit (the OpenAI API's logit_bias, applied after the penalties as in
vLLM); min_tokens masks the ids that would end the completion (EOS unless ignore_eos, and stop_token_ids) to -inf
while fewer than min_tokens completion tokens exist (vLLM's MinTokensLogitsProcessor rule), so a greedy or sampled
row cannot pick them. The mask comes after the bias: a +100 bias on EOS does not beat min_tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from runtime.sampling_params import SamplingParams


class BiasRow(Protocol):
    """What this stage reads of a row (runtime.model.sampler.SampleRequest): its params and the index of the
    completion token it samples."""

    @property
    def params(self) -> SamplingParams: ...

    @property
    def token_index(self) -> int: ...


def needs_stage(row: BiasRow) -> bool:
    """True when row has a logit_bias or is still under its min_tokens (token_index < min_tokens). O(1)."""
    p = row.params
    return bool(p.logit_bias) or row.token_index < p.min_tokens


def apply_logit_bias(scores: torch.Tensor, rows: Sequence[BiasRow], eos_token_ids: Sequence[int]) -> torch.Tensor:
    """scores float32 [N, V] (N == len(rows)) with each row's logit_bias added and, for a row still under
    min_tokens, its ending ids (eos_token_ids unless ignore_eos, and stop_token_ids) set to -inf.

    Returns scores itself when no row asks (nothing is copied), else a new tensor: scores is never changed (it may
    be the raw logits the logprobs are read from). Ids outside [0, V) are skipped (SamplingParams.vocab_problem
    rejects such a logit_bias before it gets here; a stop id past the vocabulary can never be sampled anyway).
    Cost: O(N) Python to find the rows, then O(entries) Python and one copy of scores when any row asks.
    """
    asked = [i for i, row in enumerate(rows) if needs_stage(row)]
    if not asked:
        return scores
    vocab = scores.shape[-1]
    bias_rows: list[int] = []
    bias_ids: list[int] = []
    bias_values: list[float] = []
    mask_rows: list[int] = []
    mask_ids: list[int] = []
    for i in asked:
        row = rows[i]
        p = row.params
        for token, value in (p.logit_bias or {}).items():
            if token < vocab:
                bias_rows.append(i)
                bias_ids.append(token)
                bias_values.append(value)
        if row.token_index < p.min_tokens:
            ending = set(p.stop_token_ids) if p.ignore_eos else set(p.stop_token_ids).union(eos_token_ids)
            kept = [t for t in ending if t < vocab]
            mask_rows.extend([i] * len(kept))
            mask_ids.extend(kept)
    out = scores.clone()
    dev = scores.device
    if bias_rows:
        index = (torch.tensor(bias_rows, device=dev), torch.tensor(bias_ids, device=dev))
        out.index_put_(index, torch.tensor(bias_values, dtype=out.dtype, device=dev), accumulate=True)
    if mask_rows:
        out[torch.tensor(mask_rows, device=dev), torch.tensor(mask_ids, device=dev)] = float("-inf")
    return out
