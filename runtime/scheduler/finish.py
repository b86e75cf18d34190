"""Finisher: what a sampled token does to its sequence, how a sequence finishes, and the TokenOutput deltas and
RequestFailures that come out of both. Pure Python (no torch)."""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable

from radix.manager import KVCacheManager
from runtime.protocol import ERR_INVALID, PromptLogprobs, TokenLogprobs, TokenOutput
from runtime.scheduler.beam_scores import PRUNED, beam_outputs
from runtime.scheduler.registry import SequenceRegistry
from runtime.scheduler.request import RequestFailure, RequestState, SchedulerSeq, SeqStatus
from runtime.scheduler.stats import SchedulerCounters
from runtime.scheduler.step_plan import InflightChunk
from runtime.scheduler.waiting_queue import WaitingQueue
from runtime.structured_outputs import NO_TOKEN

logger = logging.getLogger(__name__)


class Finisher:
    """Appends sampled tokens and finishes sequences for the Scheduler; keeps the deltas until they are drained.

    Args:
        manager: the KV block manager (a finished sequence's blocks are freed there).
        registry: the live requests (a request leaves it with its last completion).
        running, waiting, swapped: the Scheduler's queues (a finished sequence leaves whichever holds it).
        drops: the seq ids the next ForwardBatch drops from the worker (a finished sequence it holds joins them).
        counters: the Scheduler's counters (generated_tokens).
        eos_token_ids: ids that end a completion unless ignore_eos.
        max_model_len: context limit in tokens.
        clock: seconds, monotonic (first_token_time).
    """

    def __init__(
        self,
        manager: KVCacheManager,
        registry: SequenceRegistry,
        running: list[SchedulerSeq],
        waiting: WaitingQueue,
        swapped: deque[SchedulerSeq],
        drops: list[int],
        counters: SchedulerCounters,
        eos_token_ids: frozenset[int],
        max_model_len: int,
        clock: Callable[[], float],
    ) -> None:
        self._manager = manager
        self._registry = registry
        self._running = running
        self._waiting = waiting
        self._swapped = swapped
        self._drops = drops
        self._counters = counters
        self._eos_token_ids = eos_token_ids
        self._max_model_len = max_model_len
        self._clock = clock
        self._outputs: list[TokenOutput] = []
        self._failures: list[RequestFailure] = []

    # ------------------------------------------------------------------ tokens
    def count_tokens(self, req: RequestState, num_tokens: int) -> None:
        """num_tokens completion tokens of req were generated now: counted, and req's first_token_time is set at the
        first."""
        self._counters.generated_tokens += num_tokens
        if req.first_token_time is None:
            req.first_token_time = self._clock()

    def on_token(self, seq: SchedulerSeq, token: int, logprobs: TokenLogprobs | None) -> None:
        """Append the token the worker sampled for seq (to its tokens and its block table's token count) and emit
        its delta (the first carries seq's usage); finish seq "stop" on EOS (unless ignore_eos) or a
        stop_token_ids id past min_tokens, else "length" at max_tokens or max_model_len. O(1) plus finish."""
        req = seq.req
        params = req.params
        if params.prompt_logprobs is not None and req.prompt_logprobs_sent == 0:  # a 1-token prompt scores nothing
            self.on_prompt_logprobs(seq, PromptLogprobs(1, [], [], []))
        if params.max_tokens == 0:  # scoring (prompt_logprobs): the prompt ran, no token is generated
            self.finish(seq, "length")
            return
        seq.token_ids.append(token)
        self._manager.append_tokens(seq.seq_id, [token])
        self.count_tokens(req, 1)
        ending = (token in self._eos_token_ids and not params.ignore_eos) or token in params.stop_token_ids
        stop = ending and seq.num_output > params.min_tokens  # the sampler masks them before (runtime/model/logit_bias)
        length = seq.num_output >= params.max_tokens or len(seq.token_ids) >= self._max_model_len
        out = TokenOutput(req.rid, seq.index, [token], logprobs=[logprobs] if params.logprobs is not None else None)
        if not seq.usage_sent:
            out.usage = seq.usage()
            seq.usage_sent = True
        self._outputs.append(out)
        if stop:
            self.finish(seq, "stop")
        elif length:
            self.finish(seq, "length")

    def on_prompt_logprobs(self, seq: SchedulerSeq, computed: PromptLogprobs) -> None:
        """Emit the prompt logprobs the worker computed for seq this step (on completion 0), each prompt position once
        and in order: position 0 (None) goes first, positions already sent (run again after a recompute) are
        skipped. O(len(computed.token_ids))."""
        req = seq.req
        sent = req.prompt_logprobs_sent
        skip = max(0, sent - computed.start)
        out = PromptLogprobs(
            computed.start + skip, computed.token_ids[skip:], computed.logprobs[skip:], computed.ranks[skip:]
        )
        if sent == 0 and out.start == 1:  # position 0 first, also when nothing else comes (a 1-token prompt)
            out = PromptLogprobs(0, [req.prompt_ids[0], *out.token_ids], [None, *out.logprobs], [0, *out.ranks])
        if not out.token_ids or out.start != sent:
            return  # nothing new, or not the next positions (a recompute resumed past them: never the case)
        req.prompt_logprobs_sent = out.start + len(out.token_ids)
        self._outputs.append(TokenOutput(req.rid, 0, [], prompt_logprobs=out))

    def emit(self, outputs: list[TokenOutput]) -> None:
        """Queue deltas made elsewhere (a beam request's final outputs) behind those already queued."""
        self._outputs.extend(outputs)

    # ------------------------------------------------------------------ finishing
    def finish(self, seq: SchedulerSeq, reason: str, keep_tokens: int | None = None) -> None:
        """Finish seq with reason: release its blocks (caching none past keep_tokens tokens), take it out of its
        queue, drop it from the worker, and emit its last delta: a completion's (no tokens, reason, usage); the n
        completions' of a prefill-only parent (none when it "forked"); a beam request's K outputs when this beam ends
        the request (_beam_end). The request leaves the registry with its last live sequence.
        O(queue lengths + its blocks)."""
        if seq.status in (SeqStatus.RUNNING, SeqStatus.SWAPPED):
            self._manager.free(seq.seq_id, keep_tokens=keep_tokens)
        for queue in (self._running, self._waiting, self._swapped):
            if seq in queue:
                queue.remove(seq)
        if seq.in_worker:
            self._drops.append(seq.seq_id)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        seq.in_worker = False
        req = seq.req
        req.live -= 1
        if req.beam is not None:
            self._beam_end(seq, reason)
        elif not seq.prefill_only:
            self._outputs.append(TokenOutput(req.rid, seq.index, [], reason, seq.usage()))
        elif reason != "forked":
            for i in range(req.params.n):
                self._outputs.append(TokenOutput(req.rid, i, [], reason, seq.usage()))
        if req.live == 0:
            self._registry.forget(req)

    def finish_request(self, req: RequestState, reason: str) -> None:
        """Finish every completion of req that has not finished yet, with reason."""
        for seq in list(req.seqs):
            if seq.status != SeqStatus.FINISHED:
                self.finish(seq, reason)

    def _beam_end(self, seq: SchedulerSeq, reason: str) -> None:
        """A beam of seq's request finished with reason. PRUNED (or a request already done): nothing. Any other
        reason (abort, a failure, "length" from a full pool) ends the whole request: its other beams are freed and
        its K outputs (finished hypotheses, then running beams by score) come out with that reason."""
        st = seq.req.beam
        assert st is not None
        if reason == PRUNED or st.done:
            return
        st.done = True
        outputs = beam_outputs(seq.req, st, reason)
        for other in list(st.running):
            if other is not seq and other.status != SeqStatus.FINISHED:
                self.finish(other, PRUNED)
        self._outputs.extend(outputs)

    def fail_requests(self, inflight: list[InflightChunk], step_id: int, failed: dict[int, str]) -> None:
        """End the request of each failed sequence of the step in flight (inflight; failed: seq_id -> error): every
        live completion finishes "abort" and one RequestFailure is queued per request (logged).
        O(step + those requests' sequences)."""
        for chunk in inflight:
            seq = chunk.seq
            error = failed.get(seq.seq_id)
            if error is None or seq.status != SeqStatus.RUNNING:
                continue  # not failed, or aborted / stopped / failed with a sibling while the step ran
            req = seq.req
            logger.error(
                "request %s fails: the worker could not run seq %d in step %d: %s",
                req.rid,
                seq.seq_id,
                step_id,
                error,
            )
            self.finish_request(req, "abort")
            if error.startswith(NO_TOKEN):  # the client's constraint, not the server, failed
                self._failures.append(RequestFailure(req.rid, error, ERR_INVALID))
            else:
                self._failures.append(RequestFailure(req.rid, f"the worker failed step {step_id}: {error}"))

    # ------------------------------------------------------------------ draining
    def drain_outputs(self) -> list[TokenOutput]:
        """The deltas queued since the last call, in order; the queue is emptied."""
        outputs = self._outputs
        self._outputs = []
        return outputs

    def drain_failures(self) -> list[RequestFailure]:
        """The RequestFailures queued since the last call, in order; the queue is emptied."""
        failures = self._failures
        self._failures = []
        return failures
