"""Test helpers: the logits a step's sequences sample from, which ModelRunner.execute draws from but does not return,
for one step or for whole token sequences fed one token per step."""

from __future__ import annotations

from typing import NamedTuple

import torch

from radix.blocks import cdiv
from runtime.model.runner import ModelRunner
from runtime.protocol import ForwardBatch, ScheduledSeq
from runtime.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0)


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


def teacher_forced_logits(runner: ModelRunner, segments: list[list[int]]) -> list[torch.Tensor]:
    """Feed every segment one token per step, all segments in one batch (len(segments) rows a step, the regime of
    single-stream decode), and return per segment the float32 logits [len - 1, vocab] after each token but the last."""
    bs = runner.block_size
    tables: list[list[int]] = []
    next_block = 1
    for seg in segments:
        need = cdiv(len(seg), bs)
        tables.append(list(range(next_block, next_block + need)))
        next_block += need
    out: list[list[torch.Tensor]] = [[] for _ in segments]
    for pos in range(max(len(s) for s in segments) - 1):
        live = [i for i, s in enumerate(segments) if pos < len(s) - 1]
        seqs = [
            ScheduledSeq(
                i,
                [segments[i][pos]],
                pos,
                tables[i] if pos == 0 else [],
                True,
                GREEDY if pos == 0 else None,
                len(segments[i]),
            )
            for i in live
        ]
        logits = step_logits(runner, ForwardBatch(step_id=pos, seqs=seqs)).logits
        for row, i in enumerate(live):
            out[i].append(logits[row])
    return [torch.stack(rows) for rows in out]
