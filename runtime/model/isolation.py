"""Failure isolation of a step's forward: when running a batch raises, bisect it down to the sequences that raise
alone, so one bad sequence fails only its own request (issue 12, class 2).

Re-running part of a step is safe: each sequence writes KV only into its own slots of this step (copy-on-write makes
every block written this step private to one sequence) and reads only slots written before them, so a re-run
rewrites the same slots from the same inputs. Cost: nothing when no sequence fails; otherwise about
2 * log2(len(seqs)) extra runs (of shrinking halves) per failing sequence, and 2 * len(seqs) - 1 runs when every
sequence fails.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TypeVar

from runtime.protocol import ScheduledSeq

logger = logging.getLogger(__name__)

T = TypeVar("T")


def run_isolated(
    seqs: list[ScheduledSeq],
    run: Callable[[list[ScheduledSeq]], dict[int, T]],
    results: dict[int, T],
    failed: dict[int, str],
) -> None:
    """Call run(seqs) (seqs non-empty) and add what it returns (seq_id -> result) to results; when it raises, run
    each half again, recursively, down to single sequences, and record each sequence that raises alone in failed
    (seq_id -> "ExceptionType: message", logged with its traceback).

    Mutates results and failed, and whatever run mutates. Raises nothing that run raises.
    """
    try:
        results.update(run(seqs))
        return
    except Exception as exc:
        if len(seqs) == 1:
            logger.exception("seq %d failed in the forward or the draw; its request fails", seqs[0].seq_id)
            failed[seqs[0].seq_id] = f"{type(exc).__name__}: {exc}"
            return
    mid = len(seqs) // 2
    run_isolated(seqs[:mid], run, results, failed)
    run_isolated(seqs[mid:], run, results, failed)
