"""Scheduler: continuous batching over the radix KV cache. Pure Python (no torch); owns all request state.

Each step is `schedule() -> ForwardBatch | None`, the worker runs it, then `process_result(ForwardResult)` returns the
new tokens as TokenOutput deltas. Requests enter with `add_request` and leave by finishing, by `abort`, by `stop`
(a stop string found by the tokenizer side), or by failing (the worker could not run one of their sequences:
`drain_failures`). The Engine drives these calls in one process; the scheduler process drives the same calls from
ZeroMQ messages.

A step = running sequences (oldest admitted first: decodes and continuing prefill chunks), then swapped-out sequences
coming back, then admissions from the waiting queue while the prefill token budget (max_prefill_tokens) lasts. A prompt
longer than chunked_prefill_size is split into chunks (chunked prefill, Agrawal et al. 2023, "SARATHI"). When no block
can be freed the most recently admitted sequence is preempted (vLLM, Kwon et al. 2023, section 4.5). Host tier: a
step's write-backs and load-backs ride in its batch (StepPlan.add_tier_copies); a sequence admitted onto blocks still
loading waits one step (its loads run in this one), so attention never reads a block before its copy lands.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Sequence

from radix.block_pool import NoFreeBlocksError
from radix.blocks import cdiv
from radix.manager import KVCacheManager
from runtime.config import ServerArgs
from runtime.prompt_check import check_prompt
from runtime.protocol import ForwardBatch, ForwardResult, ServerStats, TokenLogprobs, TokenOutput
from runtime.sampling_params import SamplingParams
from runtime.scheduler.admission import WaitingQueue, inflight_chain_ids
from runtime.scheduler.beam_search import BeamSearch
from runtime.scheduler.request import (
    RequestFailure,
    RequestRejected,
    RequestState,
    SchedulerSeq,
    SeqStatus,
    UnknownRequestError,
)
from runtime.scheduler.stats import SchedulerCounters, scheduler_stats
from runtime.scheduler.step_plan import InflightChunk, StepPlan

logger = logging.getLogger(__name__)


class Scheduler:
    """Continuous batching over a KVCacheManager.

    Args:
        manager: the KV block manager (sized from the worker's Ready).
        args: ServerArgs (max_running_requests, max_prefill_tokens, chunked_prefill_size, schedule_policy,
            preemption_mode, enable_prefix_caching).
        max_model_len: context limit in tokens.
        eos_token_ids: ids that end a completion unless ignore_eos.
        lpm_starvation_steps: under lpm, a sequence that has waited this many steps is admitted in fcfs order first.
        clock: seconds, monotonic (tests may pass a fake).
    Complexity per step: O(running + admitted + waiting under lpm) Python work plus the manager's O(blocks touched).
    """

    def __init__(
        self,
        manager: KVCacheManager,
        args: ServerArgs,
        max_model_len: int,
        eos_token_ids: Sequence[int] = (),
        lpm_starvation_steps: int = 16,
        clock: Callable[[], float] = time.monotonic,
        vocab_size: int | None = None,
    ) -> None:
        self.manager = manager
        self.vocab_size = vocab_size
        self.args = args
        self.block_size = manager.block_size
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.lpm_starvation_steps = lpm_starvation_steps
        self.clock = clock
        self.requests: dict[str, RequestState] = {}
        self.waiting = WaitingQueue()
        self.running: list[SchedulerSeq] = []
        self.swapped: deque[SchedulerSeq] = deque()
        self._next_seq_id = 1
        self._admit_counter = 0
        self._step_id = 0
        self._drops: list[int] = []
        self._outputs: list[TokenOutput] = []
        self._inflight: list[InflightChunk] = []  # the step in flight, until its ForwardResult
        self._failures: list[RequestFailure] = []
        self.counters = SchedulerCounters()
        self.beam = BeamSearch(self, self.eos_token_ids)

    # ------------------------------------------------------------------ requests in and out
    def add_request(
        self, rid: str, prompt_ids: Sequence[int], params: SamplingParams, cache_salt: str | None = None
    ) -> None:
        """Queue a request (O(len(prompt))). Raises RequestRejected when it can never run (nothing is queued), and
        ValueError for a duplicate rid."""
        if rid in self.requests:
            raise ValueError(f"duplicate request id {rid!r}")
        prompt = [int(t) for t in prompt_ids]
        problem = check_prompt(prompt, self.max_model_len, self.vocab_size, self.block_size, self.manager.num_blocks)
        if problem is not None:
            self.counters.num_rejected += 1
            raise RequestRejected(*problem)
        keys = self.manager.block_keys(prompt, cache_salt)  # once: every match and the in-flight dedup reuse it
        req = RequestState(rid, prompt, params, cache_salt, self.clock(), self._step_id, keys)
        self.requests[rid] = req
        if params.use_beam_search:  # one sequence prefills the prompt; runtime/scheduler/beam_search.py forks the beams
            self.waiting.append(self.beam.start(req, self._new_seq(req, 0)))
        elif params.n > 1 and len(prompt) >= 2:
            self.waiting.append(self._new_seq(req, 0, prefill_only=True))
        else:
            self.waiting.extend(self._new_seq(req, i) for i in range(params.n))

    def abort(self, rid: str) -> None:
        """Finish every completion of rid with "abort" at once, waiting or running; its blocks are released (full
        blocks whose KV finished stay cached). The deltas come out of the next process_result / drain_outputs.
        Raises UnknownRequestError."""
        req = self._get(rid)
        for seq in list(req.seqs):
            if seq.status != SeqStatus.FINISHED:
                self._finish(seq, "abort")

    def stop(self, rid: str, keep_tokens: int, index: int = 0) -> None:
        """A stop string ended completion `index` of rid: keep its first keep_tokens completion tokens, finish it
        with "stop", and cache no block past prompt + keep_tokens. No-op when that completion already finished.
        Raises UnknownRequestError."""
        req = self._get(rid)
        for seq in list(req.seqs):
            if seq.index == index and not seq.prefill_only and seq.status != SeqStatus.FINISHED:
                keep = max(0, min(keep_tokens, seq.num_output))
                del seq.token_ids[len(req.prompt_ids) + keep :]
                self._finish(seq, "stop", keep_tokens=len(seq.token_ids))

    def has_unfinished(self) -> bool:
        """True while any request is waiting, running or swapped."""
        return bool(self.waiting or self.running or self.swapped)

    def drain_outputs(self) -> list[TokenOutput]:
        """TokenOutput deltas produced outside process_result (aborts, stops, length finishes at admission)."""
        out, self._outputs = self._outputs, []
        return out

    def drain_failures(self) -> list[RequestFailure]:
        """The requests process_result failed (the worker could not run one of their sequences) since the last
        call, one each, in order. Their "abort" deltas come out of process_result as usual. The caller drains
        after each process_result (the Engine and the scheduler process do)."""
        out, self._failures = self._failures, []
        return out

    # ------------------------------------------------------------------ one step
    def schedule(self) -> ForwardBatch | None:
        """Build the next step's ForwardBatch, or None when the worker has nothing to do. A batch may carry no
        sequence: then it only delivers drops (finished or aborted sequences) and swaps, so the worker's copy of
        the live sequences never outlasts them. Mutates: block tables (allocate, copy-on-write, preemption),
        queues, the in-flight record."""
        self._step_id += 1
        step = StepPlan(self.args.max_prefill_tokens)
        forks = self.beam.take_forks()
        preempted_before = self.counters.num_preemptions
        for seq in sorted(self.running, key=lambda s: s.admitted_at):
            if seq.status == SeqStatus.RUNNING:
                self._plan(seq, step, may_preempt=True)
        if self.counters.num_preemptions == preempted_before or not step.seqs:
            while self.swapped and len(self.running) < self.args.max_running_requests:
                seq = self.swapped[0]
                need = cdiv(self.manager.num_computed_tokens(seq.seq_id), self.block_size) + 1
                if not self.manager.can_allocate(need):  # +1 to grow into, else it is swapped straight out again
                    break
                if (pairs := self.manager.swap_in(seq.seq_id)) is None:
                    break
                self.swapped.popleft()
                step.swap_in.extend(pairs)
                seq.status, seq.in_worker = SeqStatus.RUNNING, False
                self.running.append(seq)
                self._plan(seq, step)
            if not self.swapped:
                self._admit(step)
        step.add_tier_copies(self.manager.take_tier_copies())  # after the step's last allocation (its evictions)
        if not (step.seqs or step.swap_out or step.swap_in or step.copies or self._drops or forks.forks):
            self._inflight = []
            return None
        self._inflight = step.inflight
        drops, self._drops = self._drops, []
        self.counters.num_steps += 1 if step.seqs else 0
        return step.batch(self._step_id, drops, forks)

    def process_result(self, result: ForwardResult) -> list[TokenOutput]:
        """Apply a finished step: mark KV as computed (full blocks enter the radix tree now), append sampled tokens,
        finish sequences on EOS / stop_token_ids / max_tokens / max_model_len, fork n > 1 children after the prompt.
        Returns every TokenOutput delta since the previous call. A sequence in result.failed_seq_ids (every one of
        the step when result.error is set) fails its whole request: every completion ends with "abort", nothing of
        this step is committed for it, one RequestFailure goes to drain_failures (logged); the step's other
        sequences proceed exactly as if it had not been there."""
        self.manager.tier_copies_done()  # the worker applied this step's tier copies before its forward
        failed = dict(zip(result.failed_seq_ids, result.failed_errors, strict=True))
        if result.error is not None:
            failed = {chunk.seq.seq_id: result.error for chunk in self._inflight}
        if failed:
            self._fail_requests(result.step_id, failed)
        sampled = dict(zip(result.seq_ids, result.token_ids, strict=True))
        logprobs = dict(zip(result.seq_ids, result.logprobs, strict=True)) if result.logprobs else {}
        self.counters.forward_tokens += result.num_forward_tokens
        for seq, start, num_tokens, sample in self._inflight:
            if seq.status != SeqStatus.RUNNING:
                continue  # aborted or stopped while the step ran
            self.manager.commit_computed(seq.seq_id, start + num_tokens)
            if sample and seq.req.beam is not None:
                self.beam.offer(seq, logprobs.get(seq.seq_id))
            elif sample:
                self._on_token(seq, sampled[seq.seq_id], logprobs.get(seq.seq_id))
            elif seq.prefill_only and start + num_tokens == seq.target:
                self._fork(seq)
        self._inflight = []
        return self.drain_outputs()

    # ------------------------------------------------------------------ planning
    def _plan(self, seq: SchedulerSeq, step: StepPlan, may_preempt: bool = False) -> None:
        """Reserve blocks for seq's next chunk (decode: 1 token; else up to chunked_prefill_size and the step's
        prefill budget) and add it to step. Nothing is added when seq was preempted or finished, or (may_preempt
        False) could not get its blocks this step. Preemption is only allowed in the running phase, so a step never
        swaps a sequence out after swapping one in (the worker copies swap_out before swap_in)."""
        computed = self.manager.num_computed_tokens(seq.seq_id)
        if seq.prefill_only and computed == seq.target:  # its whole prompt[:-1] is cached (or loaded): fork
            for child in self._fork(seq):
                self._plan(child, step, may_preempt)
            return
        remaining = seq.target - computed
        is_decode = remaining == 1 and seq.num_output > 0
        chunk = 1 if is_decode else min(remaining, self.args.chunked_prefill_size, step.prefill_budget)
        if chunk <= 0:
            return
        while True:
            if self.manager.allocate(seq.seq_id, chunk) is not None:
                try:
                    pairs = self.manager.prepare_write(seq.seq_id, computed, computed + chunk)
                    break
                except NoFreeBlocksError:
                    pass
            if not may_preempt or not self._preempt_for(seq, step):
                return
        if pairs and seq.in_worker:  # the worker's table copy cannot express a replaced entry: re-register seq
            self._drops.append(seq.seq_id)
            seq.in_worker = False
        step.copies.extend(pairs)
        table = self.manager.block_table(seq.seq_id)
        new_blocks = table if not seq.in_worker else table[seq.sent_blocks :]
        sample = not seq.prefill_only and computed + chunk == len(seq.token_ids)
        step.add(seq, computed, chunk, list(new_blocks), sample, first=not seq.in_worker, is_decode=is_decode)
        seq.in_worker, seq.sent_blocks = True, len(table)
        self.counters.prefill_tokens_computed += 0 if is_decode else chunk

    def _preempt_for(self, seq: SchedulerSeq, step: StepPlan) -> bool:
        """Free blocks for seq by preempting the most recently admitted running sequence not yet planned this step
        (seq itself wins ties). Returns False when seq was the victim, or when seq alone holds blocks and so
        finished "length" (it can never grow further)."""
        planned = {id(c.seq) for c in step.inflight}
        others = [s for s in self.running if s is not seq and id(s) not in planned]
        if len(self.running) == 1:
            usable = self.manager.num_blocks - 1
            logger.warning(
                'request %s finishes "length" at %d of max_tokens %d completion tokens: alone, it fills '
                "the KV pool (%d usable blocks of %d = %d tokens)",
                seq.req.rid,
                max(0, seq.num_output),
                seq.req.params.max_tokens,
                usable,
                self.block_size,
                usable * self.block_size,
            )
            self._finish(seq, "length")
            return False
        victim = max([seq, *others], key=lambda s: s.admitted_at)
        self._preempt(victim, step.swap_out)
        return victim is not seq

    def _preempt(self, seq: SchedulerSeq, swap_out: list[tuple[int, int]]) -> None:
        """Recompute: free seq (full computed blocks stay cached) and requeue it at the front. Swap: move its blocks
        to the host pool (falls back to recompute when the host pool is full); the (device, host) pairs go to
        swap_out."""
        self.counters.num_preemptions += 1
        self.running.remove(seq)
        if seq.in_worker:
            self._drops.append(seq.seq_id)
        seq.in_worker, seq.sent_blocks = False, 0
        if self.args.preemption_mode == "swap":
            pairs = self.manager.swap_out(seq.seq_id)
            if pairs is not None:
                swap_out.extend(pairs)
                seq.status = SeqStatus.SWAPPED
                self.swapped.append(seq)
                self.counters.num_swaps += 1
                return
        self.manager.free(seq.seq_id)
        seq.status, seq.preempted = SeqStatus.WAITING, True
        self.waiting.requeue_front(seq, self._step_id)
        logger.debug("preempted seq %d of %s (recompute)", seq.seq_id, seq.req.rid)

    # ------------------------------------------------------------------ admission
    def _admit(self, step: StepPlan) -> None:
        """Admit waiting sequences (fcfs, or lpm with a starvation guard) while blocks, slots and the budget last."""
        inflight = inflight_chain_ids(self.running, self.manager)
        lpm = self.args.schedule_policy == "lpm"
        for seq, match in self.waiting.admission_order(self._step_id, lpm, self.lpm_starvation_steps, self.manager):
            if len(self.running) >= self.args.max_running_requests or step.prefill_budget <= 0:
                return
            req = seq.req
            if match is None or not self.manager.is_current(match):
                match = self.manager.match_prefix(req.block_keys.extended(seq.token_ids))  # + output if preempted
            m = match.num_tokens // self.block_size
            if inflight and m < len(match.keys) and match.keys.chain_ids[m] in inflight:
                continue  # another sequence computes this block now: wait a step, then hit it
            first_time = req.cached_tokens is None
            need = cdiv(seq.target, self.block_size) - len(match.block_ids)  # host-only blocks need device blocks
            if not self.manager.can_allocate(need):
                return
            chunk = min(seq.target - match.num_tokens, self.args.chunked_prefill_size, step.prefill_budget)
            cached = self.manager.add_sequence(seq.seq_id, match, num_new_tokens=chunk, count_stats=first_time)
            if cached is None:
                return
            self.waiting.remove(seq)
            seq.status, seq.admitted_at = SeqStatus.RUNNING, self._admit_counter
            self._admit_counter += 1
            self.running.append(seq)
            if first_time:
                req.cached_tokens, req.host_cached_tokens = cached, match.num_host_tokens
                req.admitted_time = self.clock()
                self.counters.admitted(len(req.prompt_ids), cached, match.num_host_tokens)
            elif seq.preempted:
                self.counters.recomputed_tokens += len(seq.token_ids) - cached
            if not self.manager.waits_for_loads(seq.seq_id):  # else planned from the next step (module docstring)
                self._plan(seq, step)  # a prefill-only parent whose prompt is all cached forks there
            if not (seq.prefill_only and cached == seq.target):
                inflight.update(req.block_keys.chain_ids[m:])

    # ------------------------------------------------------------------ tokens, finishing, forking
    def _on_token(self, seq: SchedulerSeq, token: int, logprobs: TokenLogprobs | None) -> None:
        req, params = seq.req, seq.req.params
        seq.token_ids.append(token)
        self.manager.append_tokens(seq.seq_id, [token])
        self.counters.generated_tokens += 1
        if req.first_token_time is None:
            req.first_token_time = self.clock()
        stop = (token in self.eos_token_ids and not params.ignore_eos) or token in params.stop_token_ids
        length = seq.num_output >= params.max_tokens or len(seq.token_ids) >= self.max_model_len
        reason = "stop" if stop else "length" if length else None
        out = TokenOutput(req.rid, seq.index, [token], logprobs=[logprobs] if params.logprobs is not None else None)
        if not seq.usage_sent:
            out.usage, seq.usage_sent = seq.usage(), True
        self._outputs.append(out)
        if reason is not None:
            self._finish(seq, reason)

    def _finish(self, seq: SchedulerSeq, reason: str, keep_tokens: int | None = None) -> None:
        """Release seq's blocks (caching none past keep_tokens), drop it from the worker, emit its last delta."""
        if seq.status in (SeqStatus.RUNNING, SeqStatus.SWAPPED):
            self.manager.free(seq.seq_id, keep_tokens=keep_tokens)
        for queue in (self.running, self.waiting, self.swapped):
            if seq in queue:
                queue.remove(seq)
        if seq.in_worker:
            self._drops.append(seq.seq_id)
        seq.status, seq.finish_reason, seq.in_worker = SeqStatus.FINISHED, reason, False
        req = seq.req
        req.live -= 1
        if req.beam is not None:
            self._outputs.extend(self.beam.on_finish(seq, reason))
        elif not seq.prefill_only:
            self._outputs.append(TokenOutput(req.rid, seq.index, [], reason, seq.usage()))
        elif reason != "forked":
            for i in range(req.params.n):
                self._outputs.append(TokenOutput(req.rid, i, [], reason, seq.usage()))
        if req.live == 0:
            self.requests.pop(req.rid, None)
            req.seqs.clear()  # break req <-> seq: refcounting frees the request now, not a rare full gc pass

    def _fail_requests(self, step_id: int, failed: dict[int, str]) -> None:
        """End the request of each failed sequence of the step in flight (seq_id -> error): every live completion
        finishes "abort" and one RequestFailure is queued per request. O(step + those requests' sequences)."""
        for chunk in self._inflight:
            error, req = failed.get(chunk.seq.seq_id), chunk.seq.req
            if error is None or chunk.seq.status != SeqStatus.RUNNING:
                continue  # not failed, or aborted / stopped / failed with a sibling while the step ran
            logger.error(
                "request %s fails: the worker could not run seq %d in step %d: %s",
                req.rid,
                chunk.seq.seq_id,
                step_id,
                error,
            )
            for seq in list(req.seqs):
                if seq.status != SeqStatus.FINISHED:
                    self._finish(seq, "abort")
            self._failures.append(RequestFailure(req.rid, f"the worker failed step {step_id}: {error}"))

    def _fork(self, parent: SchedulerSeq) -> list[SchedulerSeq]:
        """The parent's prompt[:-1] has KV: fork n children sharing its blocks; each runs the last prompt token."""
        children = []
        for i in range(parent.req.params.n):
            child = self._new_seq(parent.req, i)
            self.manager.fork(parent.seq_id, child.seq_id)
            child.status, child.admitted_at = SeqStatus.RUNNING, parent.admitted_at
            self.running.append(child)
            children.append(child)
        self._finish(parent, "forked")
        return children

    def _new_seq(self, req: RequestState, index: int, prefill_only: bool = False) -> SchedulerSeq:
        seq = SchedulerSeq(self._next_seq_id, req, index, list(req.prompt_ids), prefill_only)
        self._next_seq_id += 1
        req.seqs.append(seq)
        req.live += 1
        return seq

    def _get(self, rid: str) -> RequestState:
        if (req := self.requests.get(rid)) is None:
            raise UnknownRequestError(rid)
        return req

    # ------------------------------------------------------------------ stats
    def stats(self) -> ServerStats:
        """A ServerStats snapshot (see its fields): the queues, the manager's block counts and the counters.
        tokens_per_s is 0.0 (no interval here; the scheduler process fills it in). O(sequences)."""
        return scheduler_stats(
            self.counters, self.manager.stats(), len(self.running), len(self.waiting), len(self.swapped)
        )
