"""SequenceRegistry: the live requests by rid and the sequence ids of their completions. Pure Python (no torch)."""

from __future__ import annotations

from runtime.scheduler.request import RequestState, SchedulerSeq, UnknownRequestError


class SequenceRegistry:
    """Live requests by rid, and the maker of their sequences (seq ids count up from 1, never reused).

    A request is live from add() until forget() (its last completion finished). O(1) per call.
    """

    def __init__(self) -> None:
        self.requests: dict[str, RequestState] = {}
        self._next_seq_id = 1

    def add(self, req: RequestState) -> None:
        """Make req live. The caller checks first that its rid is not live (add_request raises ValueError)."""
        self.requests[req.rid] = req

    def get(self, rid: str) -> RequestState:
        """The live request rid. Raises UnknownRequestError (finished, aborted or never added)."""
        req = self.requests.get(rid)
        if req is None:
            raise UnknownRequestError(rid)
        return req

    def new_seq(self, req: RequestState, index: int, prefill_only: bool = False) -> SchedulerSeq:
        """A new WAITING sequence of req (completion `index`, tokens: a copy of the prompt) under the next seq id;
        appended to req.seqs and counted in req.live."""
        seq = SchedulerSeq(self._next_seq_id, req, index, list(req.prompt_ids), prefill_only)
        self._next_seq_id += 1
        req.seqs.append(seq)
        req.live += 1
        return seq

    def forget(self, req: RequestState) -> None:
        """req's last completion finished: it is no longer live, and req.seqs is emptied (RequestState's docstring:
        the req <-> seq cycle is broken so refcounting frees the request now, not a rare full gc pass)."""
        self.requests.pop(req.rid, None)
        req.seqs.clear()
