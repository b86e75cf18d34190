"""Test helpers: tokens run per sequence, counted from the ForwardBatches a runner was given (the runner itself keeps
no per-sequence history)."""

from __future__ import annotations

from collections.abc import Iterable

from runtime.protocol import ForwardBatch


def forward_tokens_by_seq(batches: Iterable[ForwardBatch]) -> dict[int, int]:
    """seq_id -> input tokens scheduled for it over batches (prefill chunks + decode tokens), in first-seen order."""
    counts: dict[int, int] = {}
    for batch in batches:
        for s in batch.seqs:
            counts[s.seq_id] = counts.get(s.seq_id, 0) + len(s.token_ids)
    return counts


def record_batches(runner) -> list[ForwardBatch]:
    """Wrap runner.execute and runner.forward (instance attributes) so every ForwardBatch either is given is appended
    to the returned list, in call order."""
    batches: list[ForwardBatch] = []
    for name in ("execute", "forward"):
        method = getattr(runner, name, None)
        if method is None:
            continue

        def spy(batch: ForwardBatch, _method=method):
            batches.append(batch)
            return _method(batch)

        setattr(runner, name, spy)
    return batches
