"""Scheduler: continuous batching over the radix KV cache. Pure Python (no torch); owns all request state.

Each step is `schedule() -> ForwardBatch | None`, the worker runs it, then `process_result(ForwardResult)` returns the
new tokens as TokenOutput deltas. Requests enter with `add_request` and leave by finishing, by `abort`, by `stop`
(a stop string found by the tokenizer side), or by failing (the worker could not run one of their sequences:
`drain_failures`). The Engine drives these calls in one process; the scheduler process drives the same calls from
ZeroMQ messages.

A step = running sequences (oldest admitted first: decodes and continuing prefill chunks), then swapped-out sequences
coming back, then admissions from the waiting queue while the prefill token budget (max_prefill_tokens) lasts. Host
tier: a step's write-backs and load-backs ride in its batch (StepPlan.add_tier_copies).

The Scheduler coordinates a step; its parts do the work, each given what it needs in its constructor:
  registry.py         SequenceRegistry: live requests by rid, seq ids, new sequences
  chunk_planner.py    ChunkPlanner: a sequence's next chunk (blocks, copy-on-write, table delta; chunked prefill)
  preemption.py       Preemption: recompute or swap out when no block can be freed; swap back in
  admission.py        Admission: waiting -> running onto the cached prefix (waiting_queue.py: fcfs / lpm order)
  finish.py           Finisher: sampled tokens, finishing, the TokenOutput deltas and RequestFailures
  parallel_samples.py ParallelSamples: n > 1 completions forked from one prefill
  beam_search.py      BeamSearch: beam steps and forks (beam_scores.py: candidates, scores, final outputs)
  speculation.py      Speculation: speculative decoding's drafts (ngram.py) and the verified tokens
The queues (running, waiting, swapped), the drops list and the counters are the Scheduler's; the parts share them.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from operator import attrgetter

from radix.manager import KVCacheManager
from runtime.config import ServerArgs
from runtime.prompt_check import PromptProblem, check_pool_fit, check_prompt
from runtime.protocol import ERR_INVALID, ForwardBatch, ForwardResult, ServerStats, TokenOutput
from runtime.sampling_params import SamplingParams
from runtime.scheduler.admission import Admission
from runtime.scheduler.beam_search import BeamSearch
from runtime.scheduler.chunk_planner import ChunkPlanner
from runtime.scheduler.finish import Finisher
from runtime.scheduler.kv_groups import take_window_copies, window_stats
from runtime.scheduler.parallel_samples import ParallelSamples
from runtime.scheduler.preemption import Preemption
from runtime.scheduler.registry import SequenceRegistry
from runtime.scheduler.request import RequestFailure, RequestRejected, RequestState, SchedulerSeq, SeqStatus
from runtime.scheduler.speculation import Speculation
from runtime.scheduler.stats import SchedulerCounters, scheduler_stats
from runtime.scheduler.step_plan import InflightChunk, StepPlan
from runtime.scheduler.waiting_queue import WaitingQueue
from runtime.speculative import parse_speculative_config
from runtime.structured_outputs import GRAMMAR_PENDING

_ADMISSION_ORDER = attrgetter("admitted_at")


class Scheduler:
    """Continuous batching over a KVCacheManager.

    Args:
        manager: the KV block manager (sized from the worker's Ready).
        args: ServerArgs (max_running_requests, max_prefill_tokens, chunked_prefill_size, schedule_policy,
            preemption_mode, enable_prefix_caching, speculative_config).
        max_model_len: context limit in tokens.
        eos_token_ids: ids that end a completion unless ignore_eos.
        lpm_starvation_steps: under lpm, a sequence that has waited this many steps is admitted in fcfs order first.
        clock: seconds, monotonic (tests may pass a fake).
        vocab_size: token ids must be below it (None: unchecked).
    max_model_len, eos_token_ids, lpm_starvation_steps and clock are read-only: the parts hold them.
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
        self._multi_step = args.scheduler_steps() > 1  # whether a step may run multi-step (speculation.py)
        self.block_size = manager.block_size
        self._max_model_len = max_model_len
        self._eos_token_ids = frozenset(eos_token_ids)
        self._lpm_starvation_steps = lpm_starvation_steps
        self._clock = clock
        self.waiting = WaitingQueue()
        self.running: list[SchedulerSeq] = []
        self.swapped: deque[SchedulerSeq] = deque()
        self.counters = SchedulerCounters()
        self._step_id = 0
        self._drops: list[int] = []  # seq ids the next batch drops from the worker (finished, preempted, re-sent)
        self._inflight: list[InflightChunk] = []  # the step in flight, until its ForwardResult
        self._registry = SequenceRegistry()
        self.requests: dict[str, RequestState] = self._registry.requests
        self._finisher = Finisher(
            manager,
            self._registry,
            self.running,
            self.waiting,
            self.swapped,
            self._drops,
            self.counters,
            self._eos_token_ids,
            max_model_len,
            clock,
        )
        self._samples = ParallelSamples(manager, self._registry, self._finisher, self.running)
        self.beam = BeamSearch(
            manager, self._registry, self._finisher, self.running, self.waiting, self._eos_token_ids, max_model_len
        )
        self._preemption = Preemption(
            manager,
            args.preemption_mode,
            self.running,
            self.waiting,
            self.swapped,
            self._drops,
            self.counters,
            self._finisher,
        )
        self.speculation = Speculation(
            parse_speculative_config(args.speculative_config),
            manager,
            self._finisher,
            max_model_len,
            args.scheduler_steps(),
        )
        self._planner = ChunkPlanner(
            manager,
            args.chunked_prefill_size,
            self._preemption,
            self._samples,
            self._drops,
            self.counters,
            self.speculation,
        )
        self._admission = Admission(
            manager, args, self.waiting, self.running, self._planner, self.counters, clock, lpm_starvation_steps
        )

    @property
    def max_model_len(self) -> int:
        """Context limit in tokens."""
        return self._max_model_len

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """Ids that end a completion unless ignore_eos."""
        return self._eos_token_ids

    @property
    def lpm_starvation_steps(self) -> int:
        """Under lpm, a sequence that has waited this many steps is admitted in fcfs order first."""
        return self._lpm_starvation_steps

    @property
    def clock(self) -> Callable[[], float]:
        """Seconds, monotonic: arrival, admission and first-token times."""
        return self._clock

    # ------------------------------------------------------------------ requests in and out
    def add_request(
        self, rid: str, prompt_ids: Sequence[int], params: SamplingParams, cache_salt: str | None = None
    ) -> None:
        """Queue a request (O(len(prompt))). Raises RequestRejected when it can never run (nothing is queued): the
        prompt check, or a max_tokens the whole KV pool cannot hold (check_pool_fit); ValueError for a duplicate
        rid."""
        if rid in self.requests:
            raise ValueError(f"duplicate request id {rid!r}")
        prompt = [int(t) for t in prompt_ids]
        problem = check_prompt(prompt, self._max_model_len, self.vocab_size, self.block_size, self.manager.num_blocks)
        if problem is None and self.vocab_size is not None:
            bias_problem = params.vocab_problem(self.vocab_size)
            problem = None if bias_problem is None else PromptProblem(ERR_INVALID, bias_problem)
        if problem is None:
            problem = check_pool_fit(
                len(prompt), params.max_tokens, self._max_model_len, self.block_size, self.manager.num_blocks
            )
        if problem is not None:
            self.counters.num_rejected += 1
            raise RequestRejected(*problem)
        keys = self.manager.block_keys(prompt, cache_salt)  # once: every match and the in-flight dedup reuse it
        req = RequestState(rid, prompt, params, cache_salt, self._clock(), self._step_id, keys)
        self._registry.add(req)
        if params.use_beam_search:  # one sequence prefills the prompt; then BeamSearch forks the beams
            self.waiting.append(self.beam.start(req))
        elif params.n > 1 and len(prompt) >= 2:  # one sequence prefills prompt[:-1]; then the n samples fork
            self.waiting.append(self._samples.start(req))
        else:
            self.waiting.extend(self._registry.new_seq(req, i) for i in range(params.n))

    def abort(self, rid: str) -> None:
        """Finish every completion of rid with "abort" at once, waiting or running; its blocks are released (full
        blocks whose KV finished stay cached). The deltas come out of the next process_result / drain_outputs.
        Raises UnknownRequestError."""
        self._finisher.finish_request(self._registry.get(rid), "abort")

    def stop(self, rid: str, keep_tokens: int, index: int = 0) -> None:
        """A stop string ended completion `index` of rid: keep its first keep_tokens completion tokens, finish it
        with "stop", and cache no block past prompt + keep_tokens. No-op when that completion already finished.
        Raises UnknownRequestError."""
        req = self._registry.get(rid)
        for seq in list(req.seqs):
            if seq.index == index and not seq.prefill_only and seq.status != SeqStatus.FINISHED:
                keep = max(0, min(keep_tokens, seq.num_output))
                del seq.token_ids[len(req.prompt_ids) + keep :]
                self._finisher.finish(seq, "stop", keep_tokens=len(seq.token_ids))

    def has_unfinished(self) -> bool:
        """True while any request is waiting, running or swapped."""
        return bool(self.waiting or self.running or self.swapped)

    def drain_outputs(self) -> list[TokenOutput]:
        """TokenOutput deltas produced outside process_result (aborts, stops, length finishes at admission)."""
        return self._finisher.drain_outputs()

    def drain_failures(self) -> list[RequestFailure]:
        """The requests process_result failed (the worker could not run one of their sequences) since the last
        call, one each, in order. Their "abort" deltas come out of process_result as usual. The caller drains
        after each process_result (the Engine and the scheduler process do)."""
        return self._finisher.drain_failures()

    # ------------------------------------------------------------------ one step
    def schedule(self) -> ForwardBatch | None:
        """Build the next step's ForwardBatch, or None when the worker has nothing to do. A batch may carry no
        sequence: then it only delivers drops (finished or aborted sequences) and swaps, so the worker's copy of
        the live sequences never outlasts them. Mutates: block tables (allocate, copy-on-write, preemption),
        queues, the in-flight record."""
        self._step_id += 1
        step = StepPlan(self._step_id, self.args.max_prefill_tokens)
        forks = self.beam.take_forks()
        preempted_before = self.counters.num_preemptions
        self.speculation.begin_step(len(self.running), self._multi_step and self._all_decoding())
        for seq in sorted(self.running, key=_ADMISSION_ORDER):
            if seq.status == SeqStatus.RUNNING:
                self._planner.plan(seq, step, may_preempt=True)
        if self.counters.num_preemptions == preempted_before or not step.seqs:
            while len(self.running) < self.args.max_running_requests:
                resumed = self._preemption.swap_in_next(step)
                if resumed is None:
                    break
                self._planner.plan(resumed, step)
            if not self.swapped:
                self._admission.admit(step)
        step.add_tier_copies(self.manager.take_tier_copies())  # after the step's last allocation (its evictions)
        step.window_copies.extend(take_window_copies(self.manager))  # beam forks' copies of the window group
        if not (step.seqs or step.swap_out or step.swap_in or step.copies or self._drops or forks.forks):
            self._inflight = []
            return None
        self._inflight = step.inflight
        drops = list(self._drops)
        self._drops.clear()  # the parts share this list: emptied in place
        if step.seqs:
            self.counters.num_steps += 1
        return step.batch(drops, forks)

    def _all_decoding(self) -> bool:
        """Whether every running sequence decodes (a token sampled, all tokens but the last computed) and no request
        waits or is swapped out: the steps multi-step decoding may run in (speculation.py). O(running)."""
        if self.waiting or self.swapped:
            return False
        for seq in self.running:
            computed = self.manager.num_computed_tokens(seq.seq_id)
            if seq.status == SeqStatus.RUNNING and not (seq.num_output > 0 and seq.target - computed == 1):
                return False
        return True

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
        self._requeue_pending_grammars(failed, result.step_id)
        if failed:
            self._finisher.fail_requests(self._inflight, result.step_id, failed)
        sampled = dict(zip(result.seq_ids, result.token_ids, strict=True))
        logprobs = dict(zip(result.seq_ids, result.logprobs, strict=True)) if result.logprobs else {}
        self.counters.forward_tokens += result.num_forward_tokens
        accepted = result.accepted_token_ids or {}
        drafted = result.draft_token_ids or {}  # a draft model's drafts, in place of their slots (draft_slots.py)
        for seq, start, num_tokens, sample, draft in self._inflight:
            if seq.status != SeqStatus.RUNNING:
                continue  # aborted or stopped while the step ran
            if draft:  # a verified speculative decode (it samples, never a beam)
                draft = drafted.get(seq.seq_id, draft)
                run_lps = (result.accepted_logprobs or {}).get(seq.seq_id)
                lps = None if run_lps is None else [*run_lps, logprobs.get(seq.seq_id)]
                run = accepted.get(seq.seq_id, [])
                self.speculation.on_verified(seq, start, draft, run, sampled[seq.seq_id], lps)
                continue
            self.manager.commit_computed(seq.seq_id, start + num_tokens)
            if result.prompt_logprobs and seq.seq_id in result.prompt_logprobs:
                self._finisher.on_prompt_logprobs(seq, result.prompt_logprobs[seq.seq_id])
            if sample and seq.req.beam is not None:
                self.beam.offer(seq, logprobs.get(seq.seq_id), self._step_id)
            elif sample:
                self._finisher.on_token(seq, sampled[seq.seq_id], logprobs.get(seq.seq_id))
            elif seq.prefill_only and start + num_tokens == seq.target:
                self._samples.fork(seq)
        self._inflight = []
        return self.drain_outputs()

    def _requeue_pending_grammars(self, failed: dict[int, str], step_id: int) -> None:
        """Requeue, instead of failing, each sequence the worker did not sample because its grammar still compiles
        (GRAMMAR_PENDING, runtime/model/grammar/state.py): it goes back to the front of waiting, its full computed
        blocks cached, and samples once its compile is done. Mutates failed (those entries leave it)."""
        pending = [seq_id for seq_id, error in failed.items() if error.startswith(GRAMMAR_PENDING)]
        for chunk in self._inflight:
            if chunk.seq.seq_id in pending and chunk.seq.status == SeqStatus.RUNNING:
                self._preemption.requeue(chunk.seq, step_id)
        for seq_id in pending:
            del failed[seq_id]

    # ------------------------------------------------------------------ stats
    def stats(self) -> ServerStats:
        """A ServerStats snapshot (see its fields): the queues, the manager's block counts and the counters.
        tokens_per_s is 0.0 (no interval here; the scheduler process fills it in). O(sequences)."""
        manager = self.manager
        queues = (len(self.running), len(self.waiting), len(self.swapped))
        return scheduler_stats(
            self.counters, manager.stats(), *queues, window_stats(manager), self.speculation.counters
        )
