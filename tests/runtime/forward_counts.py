"""Test helpers: tokens run per sequence, counted from the ForwardBatches a runner was given (the runner itself keeps
no per-sequence history)."""

from __future__ import annotations

from collections.abc import Iterable

from runtime.protocol import ForwardBatch


def forward_tokens_by_seq(batches: Iterable[ForwardBatch]) -> dict[int, int]:
    """seq_id -> input tokens scheduled for it over batches (prefill chunks + decode tokens + the slots reserved
    after a decode: a multi-step run's later tokens or a draft model's draft), in first-seen order. A run that stops
    early in the worker (an EOS inside it) runs fewer than its slots."""
    counts: dict[int, int] = {}
    for batch in batches:
        for s in batch.seqs:
            counts[s.seq_id] = counts.get(s.seq_id, 0) + len(s.token_ids) + s.num_draft_slots
    return counts


def record_batches(runner) -> list[ForwardBatch]:
    """Wrap runner.execute (an instance attribute) so every ForwardBatch it is given is appended to the returned
    list, in call order."""
    batches: list[ForwardBatch] = []
    execute = runner.execute

    def spy(batch: ForwardBatch):
        batches.append(batch)
        return execute(batch)

    runner.execute = spy
    return batches
