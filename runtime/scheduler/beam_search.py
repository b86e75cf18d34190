"""Beam search over forked block tables: the scheduler's beam state and one beam step. Pure Python (no torch).

The semantics are transformers' `GenerationMixin._beam_search` (the vectorised one of v4.50+, as in v5) under
do_sample=False, early_stopping=True and num_return_sequences = num_beams = K:
  - every running beam b, with cumulative logprob s_b, offers candidates (t, s_b + logprob_b(t)), the sum rounded to
    float32 as transformers' float32 tensors do; the best C = max(2, 1 + num_eos) * K over all beams are kept, best
    first (ties: lower beam rank, then lower token id: the order of torch.topk over the flattened [beam, vocab]
    scores where it is stable). Logprobs are the float32 log-softmax over the whole vocabulary; under ignore_eos the
    EOS ids are then masked (transformers' min_new_tokens), so EOS is never a candidate.
  - a candidate ends when its token is EOS (not under ignore_eos) or its completion reaches the length limit
    (max_tokens, capped by max_model_len). Each of the first K candidates that ends becomes a finished hypothesis of
    score s / length ** length_penalty (length: completion tokens, its last one included); the request keeps the K
    best hypotheses.
  - the next running beams are the first K candidates that do not end; the request is done when it holds K
    hypotheses (early_stopping=True) or no candidate continues.

Memory (the PagedAttention paper, Kwon et al. 2023, sec. 4.4): beams are SchedulerSeqs; a beam chosen by several
candidates continues in place once and is forked for the others (KVCacheManager.fork: its table's blocks gain one
reference each; the copy of the shared partial last block is made at once, so each beam writes only its own block);
a beam no candidate chose is freed at once, its private blocks returned to the free queue (taken out of the tree),
while blocks another beam still holds stay shared. A fork reaches the worker as (parent, child, shared blocks) in
ForwardBatch.forks, the child's own blocks after them as its new_block_ids. Beam scores and candidates live here; the
worker keeps only tables. A step waits until every live beam of the request has offered its candidates (a preempted
beam offers again once recomputed or swapped back), and emits nothing until the request ends: then its K outputs,
best first, each with all its tokens and its score (TokenOutput.score).
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable
from typing import NamedTuple, Protocol

import msgspec

from radix.block_pool import NoFreeBlocksError
from radix.manager import KVCacheManager
from runtime.protocol import TokenLogprobs, TokenOutput
from runtime.scheduler.admission import WaitingQueue
from runtime.scheduler.request import BeamState, Hypothesis, RequestState, SchedulerSeq, SeqStatus
from runtime.scheduler.stats import SchedulerCounters
from runtime.scheduler.step_plan import ForkDeltas

PRUNED = "pruned"  # the internal finish reason of a beam that leaves (no output of its own)


_F32_MAX = 3.4028234663852886e38


def f32(x: float) -> float:
    """x rounded to the nearest float32 (the precision of transformers' beam scores); beyond float32's range: +-inf,
    as a float32 tensor overflows."""
    if abs(x) > _F32_MAX and x == x:
        return math.copysign(math.inf, x)
    return float(struct.unpack("f", struct.pack("f", x))[0])


class Candidate(NamedTuple):
    """A continuation: cumulative logprob (float32) after appending token to the beam of rank `beam`."""

    score: float
    beam: int
    token: int


class BeamHost(Protocol):
    """What BeamSearch uses of its Scheduler (runtime/scheduler/scheduler.py): the manager, the queues, the step's
    outputs and counters, and its sequence-making and finishing methods."""

    manager: KVCacheManager
    block_size: int
    max_model_len: int
    counters: SchedulerCounters
    clock: Callable[[], float]
    running: list[SchedulerSeq]
    waiting: WaitingQueue
    _step_id: int
    _outputs: list[TokenOutput]

    def _finish(self, seq: SchedulerSeq, reason: str, keep_tokens: int | None = None) -> None: ...

    def _new_seq(self, req: RequestState, index: int, prefill_only: bool = False) -> SchedulerSeq: ...


def best_candidates(scores: list[float], offers: list[TokenLogprobs], keep: int) -> list[Candidate]:
    """The `keep` best continuations of beams with cumulative logprobs `scores` and offered (token, logprob) pairs,
    best first (ties: lower beam rank, then lower token id); -inf candidates (masked EOS) are never kept.
    O(sum of offers * log)."""
    cands = [
        Candidate(f32(s + lp), b, t)
        for b, (s, o) in enumerate(zip(scores, offers, strict=True))
        for t, lp in zip(o.top_token_ids, o.top_logprobs, strict=True)
        if lp != float("-inf")
    ]
    cands.sort(key=lambda c: (-c.score, c.beam, c.token))
    return cands[:keep]


def penalised(logprob: float, length: int, length_penalty: float) -> float:
    """transformers' hypothesis score: logprob / length ** length_penalty, in float32."""
    return f32(logprob / f32(float(length) ** length_penalty))


class BeamSearch:
    """The beam steps of a Scheduler (it owns the sequences, the queues and the manager; this drives them).

    Per step O(K * C log(K * C)) Python work per request plus the manager's fork / free (O(blocks) each)."""

    def __init__(self, scheduler: BeamHost, eos_token_ids: frozenset[int]) -> None:
        self.s = scheduler
        self.eos = eos_token_ids
        self.forks: list[tuple[int, int, int]] = []  # next batch's ForwardBatch.forks
        self.copies: list[tuple[int, int]] = []  # next batch's copy-on-write of forked partial blocks

    def start(self, req: RequestState, first: SchedulerSeq) -> SchedulerSeq:
        """Make req a beam request whose only beam so far is `first` (the prompt, prefilled once); returns first."""
        req.beam = BeamState(req.params.n, [first], {first.seq_id: 0.0})
        return first

    def take_forks(self) -> ForkDeltas:
        """The forks and their copies made since the last call (the next ForwardBatch.forks / fork_copies), emptied."""
        out = ForkDeltas(self.forks, self.copies)
        self.forks, self.copies = [], []
        return out

    def offer(self, seq: SchedulerSeq, offered: TokenLogprobs | None) -> None:
        """seq's candidates arrived; once every running beam of its request has offered, run the beam step. A beam
        without candidates (a worker that returned none) ends the request with "abort"."""
        st = seq.req.beam
        assert st is not None
        if offered is None:
            self.s._finish(seq, "abort")
            return
        st.offers[seq.seq_id] = offered
        if all(b.seq_id in st.offers for b in st.running):
            self._step(seq.req, st)

    def on_finish(self, seq: SchedulerSeq, reason: str) -> list[TokenOutput]:
        """A beam of seq's request finished with `reason`. PRUNED (or a request already done): nothing. Any other
        reason (abort, a failure, "length" from a full pool) ends the whole request: its other beams are freed and
        its K outputs (finished hypotheses, then running beams by score) come back with that reason."""
        st = seq.req.beam
        assert st is not None
        if reason == PRUNED or st.done:
            return []
        st.done = True
        outputs = self._outputs(seq.req, st, reason)
        for other in list(st.running):
            if other is not seq and other.status != SeqStatus.FINISHED:
                self.s._finish(other, PRUNED)
        return outputs

    # ------------------------------------------------------------------ the step
    def _step(self, req: RequestState, st: BeamState) -> None:
        params, plen = req.params, len(req.prompt_ids)
        beams = st.running
        keep = max(2, 1 + len(self.eos)) * st.width
        cands = best_candidates([st.scores[b.seq_id] for b in beams], [st.offers[b.seq_id] for b in beams], keep)
        st.offers.clear()
        length = beams[0].num_output + 1  # completion tokens once the candidate's token is appended
        at_limit = length >= min(params.max_tokens, self.s.max_model_len - plen)

        def is_eos(c: Candidate) -> bool:
            return c.token in self.eos and not params.ignore_eos

        cached_sources: set[int] = set()
        new: list[Hypothesis] = []
        for c in cands[: st.width]:
            if at_limit or is_eos(c):
                tokens = beams[c.beam].token_ids[plen:] + [c.token]
                new.append(
                    Hypothesis(
                        penalised(c.score, length, params.length_penalty), tokens, "stop" if is_eos(c) else "length"
                    )
                )
                cached_sources.add(c.beam)
        if len(st.finished) < st.width and new:
            st.finished = sorted(st.finished + new, key=lambda h: -h.score)[: st.width]  # stable: older first
        nxt = [c for c in cands if not (at_limit or is_eos(c))][: st.width]
        self.s.counters.generated_tokens += len(nxt) + len(new)
        if req.first_token_time is None:
            req.first_token_time = self.s.clock()
        if len(st.finished) >= st.width or not nxt:
            st.done = True
            self.s._outputs.extend(self._outputs(req, st, None))
            order = sorted(range(len(beams)), key=lambda i: i in cached_sources)  # the uncached ones first, while
            for i in order:  # the winners still hold (so keep in the tree) the blocks they share with them
                self.s._finish(beams[i], PRUNED, keep_tokens=None if i in cached_sources else plen)
            return
        chosen = {c.beam for c in nxt}
        for i in sorted(set(range(len(beams))) - chosen, key=lambda i: i in cached_sources):  # as above
            self.s._finish(beams[i], PRUNED, keep_tokens=None if i in cached_sources else plen)
        running: list[SchedulerSeq] = []
        used: set[int] = set()
        for c in nxt:  # forks before any append: a child copies its parent's tokens as they were
            parent = beams[c.beam]
            running.append(parent if c.beam not in used else self._fork(parent, len(running)))
            used.add(c.beam)
        for seq, c in zip(running, nxt, strict=True):
            seq.token_ids.append(c.token)
            if seq.status in (SeqStatus.RUNNING, SeqStatus.SWAPPED):
                self.s.manager.append_tokens(seq.seq_id, [c.token])
        st.running = running
        st.scores = {seq.seq_id: c.score for seq, c in zip(running, nxt, strict=True)}

    def _fork(self, parent: SchedulerSeq, index: int) -> SchedulerSeq:
        """A new beam with parent's tokens and blocks. A running parent is forked in the manager (the partial last
        block copied at once, so the parent keeps writing its own); one that is waiting or swapped out gets a child
        that waits to be recomputed (its full blocks hit the prefix cache)."""
        s = self.s
        child = s._new_seq(parent.req, index)
        child.token_ids = list(parent.token_ids)
        if parent.status != SeqStatus.RUNNING:
            child.preempted = True
            s.waiting.requeue_front(child, s._step_id)
            return child
        s.manager.fork(parent.seq_id, child.seq_id)
        child.status, child.admitted_at = SeqStatus.RUNNING, parent.admitted_at
        s.running.append(child)
        computed = s.manager.num_computed_tokens(child.seq_id)
        if computed % s.block_size and parent.in_worker and s.manager.num_free_blocks() > 0:
            try:  # the shared partial block: the child takes a free block (no eviction) and the copy, now
                self.copies.extend(s.manager.prepare_write(child.seq_id, computed, computed + 1))
            except NoFreeBlocksError:  # not expected with a free block; copied when planned then
                pass
        if parent.in_worker:
            shared = min(parent.sent_blocks, computed // s.block_size)
            self.forks.append((parent.seq_id, child.seq_id, shared))
            child.in_worker, child.sent_blocks = True, shared
        return child

    def _outputs(self, req: RequestState, st: BeamState, reason: str | None) -> list[TokenOutput]:
        """The request's K final outputs, best first: its hypotheses, then (fewer than K) its running beams by score.
        reason None: each hypothesis's own; else every output ends with it."""
        plen, params = len(req.prompt_ids), req.params
        ranked = list(st.finished)
        live = sorted(st.running, key=lambda b: -st.scores.get(b.seq_id, 0.0))
        for b in live[: max(0, st.width - len(ranked))]:
            n = max(1, b.num_output)
            ranked.append(
                Hypothesis(
                    penalised(st.scores.get(b.seq_id, 0.0), n, params.length_penalty), b.token_ids[plen:], "length"
                )
            )
        usage = st.running[0].usage()
        outs = [
            TokenOutput(
                req.rid,
                i,
                h.token_ids,
                reason or h.reason,
                msgspec.structs.replace(usage, completion_tokens=len(h.token_ids)),
                score=h.score,
            )
            for i, h in enumerate(ranked[: st.width])
        ]
        for i in range(len(outs), st.width):  # ended before it had K beams (an abort on the prompt): empty ones
            outs.append(
                TokenOutput(req.rid, i, [], reason or "abort", msgspec.structs.replace(usage, completion_tokens=0))
            )
        return outs
