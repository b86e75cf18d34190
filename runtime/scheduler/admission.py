"""Admission: waiting sequences start running while slots, blocks and the step's prefill budget last, in the
WaitingQueue's order (fcfs, or lpm with a starvation guard). A newcomer whose next uncached prompt block another
running sequence is computing now waits a step for it (inflight_chain_ids) instead of computing it twice. Host tier:
a sequence admitted onto blocks still loading is planned from the next step (its loads run in this one), so attention
never reads a block before its copy lands. A request asking for prompt logprobs takes nothing from the cache (cached
blocks have no logits; vLLM does the same) and waits for no one: it computes its whole prompt, and its full blocks
are cached after it as anyone's. Pure Python (no torch)."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from radix.blocks import cdiv
from radix.manager import KVCacheManager
from runtime.config import ServerArgs
from runtime.scheduler.chunk_planner import ChunkPlanner
from runtime.scheduler.request import SchedulerSeq, SeqStatus
from runtime.scheduler.stats import SchedulerCounters
from runtime.scheduler.step_plan import StepPlan
from runtime.scheduler.waiting_queue import WaitingQueue


def inflight_chain_ids(running: Iterable[SchedulerSeq], manager: KVCacheManager) -> set[int]:
    """Chain ids (radix/keys.py) of the full prompt blocks that running sequences have not finished computing yet
    (empty without prefix caching: such keys have no chain ids). O(running + those blocks)."""
    keys: set[int] = set()
    for seq in running:
        done = manager.num_computed_tokens(seq.seq_id) // manager.block_size
        if done < len(seq.req.block_keys):
            keys.update(seq.req.block_keys.chain_ids[done:])
    return keys


class Admission:
    """Moves waiting sequences to running, each onto its cached prefix, and plans their first chunk.

    Args:
        manager: the KV block manager (match_prefix, add_sequence).
        args: ServerArgs (max_running_requests, schedule_policy, chunked_prefill_size).
        waiting, running: the Scheduler's queues.
        planner: plans an admitted sequence's first chunk.
        counters: the Scheduler's counters (prompt, cached and recomputed tokens).
        clock: seconds, monotonic (a request's admitted_time).
        lpm_starvation_steps: under lpm, a sequence that has waited this many steps is admitted in fcfs order first.
    """

    def __init__(
        self,
        manager: KVCacheManager,
        args: ServerArgs,
        waiting: WaitingQueue,
        running: list[SchedulerSeq],
        planner: ChunkPlanner,
        counters: SchedulerCounters,
        clock: Callable[[], float],
        lpm_starvation_steps: int,
    ) -> None:
        self._manager = manager
        self.args = args
        self._waiting = waiting
        self._running = running
        self._planner = planner
        self._counters = counters
        self._clock = clock
        self._lpm_starvation_steps = lpm_starvation_steps
        self._next_admitted_at = 0  # admission order: preemption picks the latest

    def admit(self, step: StepPlan) -> None:
        """Admit waiting sequences (fcfs, or lpm with a starvation guard) while running slots, blocks and step's
        prefill budget last; each is planned into step unless it waits for host-tier loads. A request's first
        admission fixes its cached_tokens, host_cached_tokens and admitted_time. Mutates the queues, the manager's
        tables and step. O(waiting) (O(waiting * prompt blocks) under lpm) plus the admitted prompts' blocks."""
        inflight = inflight_chain_ids(self._running, self._manager)
        block_size = self._manager.block_size
        lpm = self.args.schedule_policy == "lpm"
        order = self._waiting.admission_order(step.step_id, lpm, self._lpm_starvation_steps, self._manager)
        for seq, match in order:
            if len(self._running) >= self.args.max_running_requests or step.prefill_budget <= 0:
                return
            req = seq.req
            if match is None or not self._manager.is_current(match):
                match = self._manager.match_prefix(req.block_keys.extended(seq.token_ids))  # + output if preempted
            if req.params.prompt_logprobs is not None:  # cached blocks have no logits: compute the whole prompt
                match = match._replace(block_ids=[], num_tokens=0, last_node=None, host_nodes=[])
            matched_blocks = match.num_tokens // block_size
            hits = req.params.prompt_logprobs is None
            if (
                hits
                and inflight
                and matched_blocks < len(match.keys)
                and match.keys.chain_ids[matched_blocks] in inflight
            ):
                continue  # another sequence computes this block now: wait a step, then hit it
            first_time = req.cached_tokens is None
            need = cdiv(seq.target, block_size) - len(match.block_ids)  # host-only blocks need device blocks
            if not self._manager.can_allocate(need):
                return
            chunk = min(seq.target - match.num_tokens, self.args.chunked_prefill_size, step.prefill_budget)
            cached = self._manager.add_sequence(seq.seq_id, match, num_new_tokens=chunk, count_stats=first_time)
            if cached is None:
                return
            self._waiting.remove(seq)
            seq.status = SeqStatus.RUNNING
            seq.admitted_at = self._next_admitted_at
            self._next_admitted_at += 1
            self._running.append(seq)
            if first_time:
                req.cached_tokens = cached
                req.host_cached_tokens = match.num_host_tokens
                req.admitted_time = self._clock()
                self._counters.admitted(len(req.prompt_ids), cached, match.num_host_tokens)
            elif seq.preempted:
                self._counters.recomputed_tokens += len(seq.token_ids) - cached
            if not self._manager.waits_for_loads(seq.seq_id):  # else planned from the next step (module docstring)
                self._planner.plan(seq, step)  # a prefill-only parent whose prompt is all cached forks there
            if not (seq.prefill_only and cached == seq.target):
                inflight.update(req.block_keys.chain_ids[matched_blocks:])
