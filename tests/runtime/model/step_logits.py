"""Test helper: the logits a step's sequences sample from, which ModelRunner.execute draws from but does not return."""

from __future__ import annotations

from typing import NamedTuple

import torch

from runtime.model.runner import ModelRunner
from runtime.protocol import ForwardBatch, ScheduledSeq


class StepLogits(NamedTuple):
    """logits float32 [len(sample_seqs), vocab]: row i is sample_seqs[i]'s last token's; num_tokens: tokens run."""

    logits: torch.Tensor
    sample_seqs: list[ScheduledSeq]
    num_tokens: int


@torch.inference_mode()
def step_logits(runner: ModelRunner, batch: ForwardBatch) -> StepLogits:
    """Apply batch's structure (runner.apply_structure) and run the model over all its sequences, as execute does
    but without sampling or failure isolation. Mutates the runner's KV caches and per-sequence state.
    Raises AssertionError when a sequence's delta is invalid (the runner's reason in the message)."""
    step = runner.apply_structure(batch)
    assert not step.invalid, step.invalid
    if not step.runnable:
        return StepLogits(torch.empty(0, runner.config.vocab_size), [], 0)
    inputs = runner.prepare(step.runnable)
    logits = runner.model(inputs.input_ids, inputs.meta, runner.k_cache, runner.v_cache)
    return StepLogits(logits, inputs.sample_seqs, int(inputs.input_ids.shape[0]))
