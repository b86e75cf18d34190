"""BeamSearch: the beam steps of beam search requests over forked block tables. Pure Python (no torch).

The candidates, scores and final outputs are transformers' beam search (runtime/scheduler/beam_scores.py documents
the semantics). Memory (the PagedAttention paper, Kwon et al. 2023, sec. 4.4): beams are SchedulerSeqs; a beam chosen
by several candidates continues in place once and is forked for the others (KVCacheManager.fork: its table's blocks
gain one reference each; the copy of the shared partial last block is made at once, so each beam writes only its own
block); a beam no candidate chose is freed at once, its private blocks returned to the free queue (taken out of the
tree), while blocks another beam still holds stay shared. A fork reaches the worker as (parent, child, shared blocks)
in ForwardBatch.forks, the child's own blocks after them as its new_block_ids. Beam scores and candidates live in the
request's BeamState; the worker keeps only tables. A step waits until every live beam of the request has offered its
candidates (a preempted beam offers again once recomputed or swapped back), and emits nothing until the request
ends: then its K outputs, best first, each with all its tokens and its score (TokenOutput.score).
"""

from __future__ import annotations

from collections.abc import Iterable

from radix.block_pool import NoFreeBlocksError
from radix.manager import KVCacheManager
from runtime.protocol import TokenLogprobs
from runtime.scheduler.beam_scores import PRUNED, Candidate, beam_outputs, best_candidates, penalised
from runtime.scheduler.finish import Finisher
from runtime.scheduler.registry import SequenceRegistry
from runtime.scheduler.request import BeamState, Hypothesis, RequestState, SchedulerSeq, SeqStatus
from runtime.scheduler.step_plan import ForkDeltas
from runtime.scheduler.waiting_queue import WaitingQueue


class BeamSearch:
    """Runs the beam steps of the Scheduler's beam search requests and keeps the forks the next batch carries.

    Args:
        manager: the KV block manager (fork, prepare_write, append_tokens).
        registry: makes the forked beams' sequences.
        finisher: finishes pruned beams, counts generated tokens and takes a finished request's outputs.
        running, waiting: the Scheduler's queues (a fork of a running beam runs at once; of another, it waits).
        eos_token_ids: ids that end a beam unless ignore_eos.
        max_model_len: context limit in tokens.

    Per step O(K * C log(K * C)) Python work per request plus the manager's fork / free (O(blocks) each).
    """

    def __init__(
        self,
        manager: KVCacheManager,
        registry: SequenceRegistry,
        finisher: Finisher,
        running: list[SchedulerSeq],
        waiting: WaitingQueue,
        eos_token_ids: frozenset[int],
        max_model_len: int,
    ) -> None:
        self._manager = manager
        self._registry = registry
        self._finisher = finisher
        self._running = running
        self._waiting = waiting
        self._eos_token_ids = eos_token_ids
        self._max_model_len = max_model_len
        self.forks: list[tuple[int, int, int]] = []  # next batch's ForwardBatch.forks
        self.copies: list[tuple[int, int]] = []  # next batch's copy-on-write of forked partial blocks

    def start(self, req: RequestState) -> SchedulerSeq:
        """Make req a beam request; returns its only beam so far (a new WAITING sequence that prefills the prompt
        once), for the caller to queue."""
        first = self._registry.new_seq(req, 0)
        req.beam = BeamState(req.params.n, [first], {first.seq_id: 0.0})
        return first

    def take_forks(self) -> ForkDeltas:
        """The forks and their copies made since the last call (the next ForwardBatch.forks / fork_copies), emptied."""
        out = ForkDeltas(self.forks, self.copies)
        self.forks = []
        self.copies = []
        return out

    def offer(self, seq: SchedulerSeq, offered: TokenLogprobs | None, step_id: int) -> None:
        """seq's candidates arrived in step step_id; once every running beam of its request has offered, run the beam
        step. A beam without candidates (a worker that returned none) ends the request with "abort"."""
        st = seq.req.beam
        assert st is not None
        if offered is None:
            self._finisher.finish(seq, "abort")
            return
        st.offers[seq.seq_id] = offered
        if all(b.seq_id in st.offers for b in st.running):
            self._step(seq.req, st, step_id)

    # ------------------------------------------------------------------ the step
    def _step(self, req: RequestState, st: BeamState, step_id: int) -> None:
        params = req.params
        prompt_len = len(req.prompt_ids)
        beams = st.running
        keep = max(2, 1 + len(self._eos_token_ids)) * st.width
        cands = best_candidates([st.scores[b.seq_id] for b in beams], [st.offers[b.seq_id] for b in beams], keep)
        st.offers.clear()
        length = beams[0].num_output + 1  # completion tokens once the candidate's token is appended
        at_limit = length >= min(params.max_tokens, self._max_model_len - prompt_len)

        def is_eos(c: Candidate) -> bool:
            return c.token in self._eos_token_ids and not params.ignore_eos

        cached_sources: set[int] = set()
        new: list[Hypothesis] = []
        for c in cands[: st.width]:
            if at_limit or is_eos(c):
                tokens = beams[c.beam].token_ids[prompt_len:] + [c.token]
                reason = "stop" if is_eos(c) else "length"
                new.append(Hypothesis(penalised(c.score, length, params.length_penalty), tokens, reason))
                cached_sources.add(c.beam)
        if len(st.finished) < st.width and new:
            st.finished = sorted(st.finished + new, key=lambda h: -h.score)[: st.width]  # stable: older first
        nxt = [c for c in cands if not (at_limit or is_eos(c))][: st.width]
        self._finisher.count_tokens(req, len(nxt) + len(new))
        if len(st.finished) >= st.width or not nxt:
            st.done = True
            self._finisher.emit(beam_outputs(req, st, None))
            self._prune(beams, range(len(beams)), cached_sources, prompt_len)
            return
        chosen = {c.beam for c in nxt}
        self._prune(beams, set(range(len(beams))) - chosen, cached_sources, prompt_len)
        running: list[SchedulerSeq] = []
        used: set[int] = set()
        for c in nxt:  # forks before any append: a child copies its parent's tokens as they were
            parent = beams[c.beam]
            if c.beam in used:
                running.append(self._fork(parent, len(running), step_id))
            else:
                running.append(parent)
            used.add(c.beam)
        for seq, c in zip(running, nxt, strict=True):
            seq.token_ids.append(c.token)
            if seq.status in (SeqStatus.RUNNING, SeqStatus.SWAPPED):
                self._manager.append_tokens(seq.seq_id, [c.token])
        st.running = running
        st.scores = {seq.seq_id: c.score for seq, c in zip(running, nxt, strict=True)}

    def _prune(self, beams: list[SchedulerSeq], ranks: Iterable[int], cached: set[int], prompt_len: int) -> None:
        """Finish the beams of these ranks (PRUNED). A beam that became a hypothesis (in cached) keeps its full blocks
        in the tree; another caches its prompt only. The uncached ones go first, while the winners still hold (so
        keep in the tree) the blocks they share with them."""
        for i in sorted(ranks, key=lambda i: i in cached):
            if i in cached:
                self._finisher.finish(beams[i], PRUNED)
            else:
                self._finisher.finish(beams[i], PRUNED, keep_tokens=prompt_len)

    def _fork(self, parent: SchedulerSeq, index: int, step_id: int) -> SchedulerSeq:
        """A new beam with parent's tokens and blocks. A running parent is forked in the manager (the partial last
        block copied at once, so the parent keeps writing its own); one that is waiting or swapped out gets a child
        that waits to be recomputed (its full blocks hit the prefix cache), at the front of waiting from step_id."""
        child = self._registry.new_seq(parent.req, index)
        child.token_ids = list(parent.token_ids)
        if parent.status != SeqStatus.RUNNING:
            child.preempted = True
            self._waiting.requeue_front(child, step_id)
            return child
        self._manager.fork(parent.seq_id, child.seq_id)
        child.status = SeqStatus.RUNNING
        child.admitted_at = parent.admitted_at
        self._running.append(child)
        computed = self._manager.num_computed_tokens(child.seq_id)
        block_size = self._manager.block_size
        if computed % block_size and parent.in_worker and self._manager.num_free_blocks() > 0:
            try:  # the shared partial block: the child takes a free block (no eviction) and the copy, now
                self.copies.extend(self._manager.prepare_write(child.seq_id, computed, computed + 1))
            except NoFreeBlocksError:  # not expected with a free block; copied when planned then
                pass
        if parent.in_worker:
            shared = min(parent.sent_blocks, computed // block_size)
            self.forks.append((parent.seq_id, child.seq_id, shared))
            child.in_worker = True
            child.sent_blocks = shared
        return child
