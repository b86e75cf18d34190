"""WaitingQueue: the waiting sequences and their admission order (fcfs, or lpm with a starvation guard), which
runtime/scheduler/admission.py walks. Pure Python (no torch)."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator
from typing import NamedTuple

from radix.manager import KVCacheManager, PrefixMatch
from runtime.scheduler.request import SchedulerSeq

LPM_QUEUE_LIMIT = 128  # above this many waiting sequences lpm falls back to fcfs (matching each costs O(prompt))


class AdmissionCandidate(NamedTuple):
    """A waiting sequence in admission order, with the prefix match lpm sorted it by (None: not matched yet)."""

    seq: SchedulerSeq
    match: PrefixMatch | None


class WaitingQueue:
    """Waiting sequences in arrival order; a preempted sequence re-enters at the front.

    Keeps, per sequence preempted back into the queue, the step it re-entered (lpm's starvation guard counts from
    it; a sequence never preempted counts from its request's arrival_step). That entry lives exactly as long as the
    sequence is in the queue: remove() drops it, whatever takes the sequence out (admission, abort, any finish).
    Membership and removal are O(len) (deque), append / requeue O(1).
    """

    def __init__(self) -> None:
        self._seqs: deque[SchedulerSeq] = deque()
        self._entered_step: dict[int, int] = {}

    def append(self, seq: SchedulerSeq) -> None:
        self._seqs.append(seq)

    def extend(self, seqs: Iterable[SchedulerSeq]) -> None:
        self._seqs.extend(seqs)

    def requeue_front(self, seq: SchedulerSeq, step_id: int) -> None:
        """A preempted sequence goes back to the front; its starvation count restarts at step_id."""
        self._entered_step[seq.seq_id] = step_id
        self._seqs.appendleft(seq)

    def remove(self, seq: SchedulerSeq) -> None:
        """Take seq out (raises ValueError when it is not queued) and forget its entry step."""
        self._seqs.remove(seq)
        self._entered_step.pop(seq.seq_id, None)

    def __len__(self) -> int:
        return len(self._seqs)

    def __bool__(self) -> bool:
        return bool(self._seqs)

    def __iter__(self) -> Iterator[SchedulerSeq]:
        return iter(self._seqs)

    def __contains__(self, seq: object) -> bool:
        return seq in self._seqs

    def waiting_since(self, seq: SchedulerSeq) -> int:
        """The step seq entered the queue (its last preemption, else its request's arrival)."""
        return self._entered_step.get(seq.seq_id, seq.req.arrival_step)

    def admission_order(
        self, step_id: int, lpm: bool, starvation_steps: int, manager: KVCacheManager
    ) -> list[AdmissionCandidate]:
        """Waiting sequences in admission order, each with the match lpm sorted it by (None: not matched here).

        fcfs (lpm False, or more than LPM_QUEUE_LIMIT waiting): queue order. lpm: the sequences that have waited
        starvation_steps steps or more first, in queue order, then the rest by longest cached prefix in manager
        (prompt + output so far; ties keep queue order). O(len) for fcfs; O(len * tokens / block_size) for lpm.
        Reads manager only.
        """
        seqs = list(self._seqs)
        if not lpm or len(seqs) > LPM_QUEUE_LIMIT:
            return [AdmissionCandidate(s, None) for s in seqs]
        starved = [(s, step_id - self.waiting_since(s) >= starvation_steps) for s in seqs]
        order = [AdmissionCandidate(s, None) for s, old in starved if old]
        rest = [
            AdmissionCandidate(s, manager.match_prefix(s.req.block_keys.extended(s.token_ids)))
            for s, old in starved
            if not old
        ]
        rest.sort(key=_matched_tokens)  # stable: ties keep arrival order
        return order + rest


def _matched_tokens(candidate: AdmissionCandidate) -> int:
    """Sort key: longest match first (a candidate lpm matched always has its match)."""
    assert candidate.match is not None
    return -candidate.match.num_tokens
