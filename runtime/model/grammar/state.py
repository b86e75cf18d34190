"""GrammarState: one xgrammar matcher per live constrained sequence in the worker, and each step's token bitmask.

Why the worker: the matcher's state is a function of the sequence's output tokens, which the worker samples itself,
so it advances in place with no message (the scheduler-side alternative, vLLM's, sends ceil(V / 32) int32 words per
constrained row per step: 6 KiB a row for a 49k vocabulary). It follows the sequence like the penalty state does:
made when the worker registers the sequence, replayed from the output tokens the sequence carries when it
re-registers (after preemption by recompute or swap, or a copy-on-write re-send), freed when the sequence is dropped,
aborted or fails. A sequence whose grammar still compiles when it would sample is not sampled: the runner fails it
with GRAMMAR_PENDING and the scheduler requeues it (recompute from its cached prefix), so the batch never waits for a
compile beyond GRAMMAR_WAIT_S (runtime/structured_outputs.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from concurrent.futures import Future, wait
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import xgrammar as xgr

from runtime.model.grammar.bitmask import GrammarRows
from runtime.model.grammar.compiler import GrammarCache
from runtime.structured_outputs import GRAMMAR_PENDING, GRAMMAR_WAIT_S, NO_TOKEN, StructuredOutputs

if TYPE_CHECKING:
    from runtime.model.parallel.group import TPGroup
    from runtime.protocol import ScheduledSeq

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class _Entry:
    """A sequence's grammar: the compile it waits for, its matcher once compiled, and the output tokens the matcher
    must accept when it is made (the sequence's output when it registered)."""

    compiled: Future[xgr.CompiledGrammar]
    replay: list[int] = field(default_factory=list)
    matcher: xgr.GrammarMatcher | None = None


class GrammarState:
    """seq_id -> matcher of the live sequences with SamplingParams.structured_outputs.

    Args:
        make_cache: builds the GrammarCache on first use (loading the tokenizer and its vocabulary costs a second,
            which a worker that never sees a constraint does not pay).
        vocab_size: the logits' width V (bitmask words: ceil(V / 32)).
        device: where the step's bitmask goes.

    The owner (ModelRunner) adds a sequence when the worker registers it, asks for the rows of each step's sampling
    sequences, records the tokens it samples, and removes the sequence when it is dropped or fails.
    """

    def __init__(self, make_cache: Callable[[], GrammarCache], vocab_size: int, device: torch.device) -> None:
        self._make_cache = make_cache
        self._cache: GrammarCache | None = None
        self.vocab_size = vocab_size
        self.device = device
        self._entries: dict[int, _Entry] = {}
        self._batch = xgr.BatchGrammarMatcher()

    def __contains__(self, seq_id: object) -> bool:
        return seq_id in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def cache(self) -> GrammarCache:
        """The GrammarCache, built on first use."""
        if self._cache is None:
            self._cache = self._make_cache()
        return self._cache

    def add(self, seq_id: int, so: StructuredOutputs, output_ids: Sequence[int]) -> None:
        """Start (or restart) seq_id's grammar: its compile starts now (or is found cached); the matcher is made, and
        output_ids replayed into it, when the sequence first samples. O(1) plus the cache lookup."""
        self._entries[seq_id] = _Entry(self.cache.get(so), list(output_ids))

    def remove(self, seq_id: int) -> None:
        """Forget seq_id's matcher (no-op when it has none). O(1)."""
        self._entries.pop(seq_id, None)

    def pending(self, seq_ids: Sequence[int], wait_s: float) -> list[int]:
        """The constrained seq_ids whose compile has not finished after waiting up to wait_s seconds (in all) for
        them: the runner requeues these instead of sampling them, so a slow compile (a big schema seen for the first
        time) never holds up the batch for more than wait_s. O(len(seq_ids))."""
        waiting = {s: self._entries[s].compiled for s in seq_ids if s in self._entries}
        running = [f for f in waiting.values() if not f.done()]
        if running:
            wait(running, timeout=wait_s)
        return [s for s, f in waiting.items() if not f.done()]

    def hold_pending(self, runnable: list[ScheduledSeq], failed: dict[int, str], group: TPGroup | None) -> None:
        """Take out of runnable the sampling sequences whose grammar is still compiling after GRAMMAR_WAIT_S, each
        failed with GRAMMAR_PENDING (the scheduler requeues them, runtime/scheduler/scheduler.py), so a slow compile
        never holds up the other sequences; with a tensor-parallel group, the union of every rank's (a compile's
        finish is timing: the ranks must hold the same sequences back). Mutates runnable and failed.
        O(len(runnable))."""
        sampling = [s.seq_id for s in runnable if s.sample]
        if not sampling or not self._entries:
            return
        pending = set(self.pending(sampling, GRAMMAR_WAIT_S))
        if group is not None:
            pending = group.union(pending)
        if not pending:
            return
        for seq_id in pending:
            failed[seq_id] = f"{GRAMMAR_PENDING}: its grammar is still compiling"
        runnable[:] = [s for s in runnable if s.seq_id not in pending]

    def rows(self, seq_ids: Sequence[int], prior: Sequence[Sequence[int]] | None = None) -> GrammarRows | None:
        """The GrammarRows of a step whose logits rows belong to seq_ids (in order), or None when none of them is
        constrained (the step then does no grammar work at all).

        prior (aligned with seq_ids; None: all empty): the draft tokens before each row (spec_verify.row_priors): a
        sequence verifying a draft d_1..d_k has k + 1 consecutive rows, the first with [] and each next with one
        more draft token; row j's mask is the matcher's state after d_1..d_j-1 (the matcher advances through the
        draft and is rolled back). A draft token the grammar rejects, or one after the grammar ended, leaves the
        rows after it with the mask of the row before: that row cannot draw the token, so the draft ends there.
        A multi-step sub-step (runtime/model/multi_step.py) has one row per sequence, its prior the tokens the
        sequence drew earlier in the step: its mask is the matcher's state after them.

        Expects every compile done (the runner first takes the pending() sequences out of the step; a compile still
        running is waited for). Makes each new matcher and replays its output tokens. Fills one bitmask row per
        constrained row (xgrammar's batch fill, on its threads; row by row with drafts) and copies it to the device.
        Leaves the matchers as they were, so a re-run of the step gets the same rows.

        Raises:
            InvalidStructuredOutputs: a constraint that does not compile (the runner's isolation fails that sequence
                alone).
            ValueError: a replayed token the grammar does not accept.
        """
        if not self._entries:
            return None
        picked = [(i, s) for i, s in enumerate(seq_ids) if s in self._entries]
        if not picked:
            return None
        matchers = [self._matcher(s) for _, s in picked]
        bitmask = xgr.allocate_token_bitmask(len(picked), self.vocab_size)
        if prior is None or not any(prior[i] for i, _ in picked):
            self._batch.batch_fill_next_token_bitmask(matchers, bitmask)
        else:
            _fill_with_drafts(picked, matchers, [prior[i] for i, _ in picked], bitmask)
        index = torch.tensor([i for i, _ in picked], dtype=torch.int64)
        return GrammarRows(
            index.to(self.device), bitmask.to(self.device, non_blocking=True), len(picked) == len(seq_ids)
        )

    def record(self, seq_ids: Sequence[int], token_ids: Sequence[int]) -> dict[int, str]:
        """Advance the matcher of each constrained seq_ids[i] by token_ids[i] (aligned, in order: a sequence repeats
        for a verified draft's accepted tokens and then its token; others skipped). Returns the sequences whose token
        the grammar rejected (seq_id -> why: starting with NO_TOKEN when the grammar allowed no token at all, so the
        row's scores were all -inf); their matchers are left as they were and their later tokens skipped. Tokens
        after one that ended the grammar (its stop token: the sequence finishes there) are skipped. O(len), plus a
        bitmask fill per rejection."""
        rejected: dict[int, str] = {}
        if not self._entries:
            return rejected
        ended: set[int] = set()
        for seq_id, token_id in zip(seq_ids, token_ids, strict=True):
            entry = self._entries.get(seq_id)
            if entry is None or entry.matcher is None or seq_id in rejected or seq_id in ended:
                continue
            if not entry.matcher.accept_token(token_id):
                rejected[seq_id] = self._rejection(entry.matcher, token_id)
            elif entry.matcher.is_terminated():
                ended.add(seq_id)
        return rejected

    def _rejection(self, matcher: xgr.GrammarMatcher, token_id: int) -> str:
        bitmask = xgr.allocate_token_bitmask(1, self.vocab_size)
        matcher.fill_next_token_bitmask(bitmask)
        if not bool(bitmask.any()):
            return f"{NO_TOKEN} here: it matches no text that continues the output so far (a regex of no string?)"
        return f"GrammarError: the grammar rejects sampled token {token_id}"

    def _matcher(self, seq_id: int) -> xgr.GrammarMatcher:
        entry = self._entries[seq_id]
        if entry.matcher is None:
            matcher = xgr.GrammarMatcher(entry.compiled.result())
            for token_id in entry.replay:
                if not matcher.accept_token(token_id):
                    raise ValueError(f"seq {seq_id}: the grammar rejects replayed output token {token_id}")
            entry.matcher = matcher
            entry.replay = []
        return entry.matcher


def _fill_with_drafts(
    picked: list[tuple[int, int]],
    matchers: list[xgr.GrammarMatcher],
    priors: list[Sequence[int]],
    bitmask: torch.Tensor,
) -> None:
    """Fill bitmask's rows (picked: (logits row, seq_id) each, matchers and priors aligned) for a step with drafts
    or multi-step sub-steps: each run of one sequence's rows whose priors grow by one token a row (row_priors'
    shape: _fill_draft_run), or a multi-step sub-step's one row after the tokens drawn before it (_fill_after).
    Mutates bitmask only (the matchers end as they began). O(rows + prior tokens)."""
    m = 0
    while m < len(picked):
        end = m + 1
        while end < len(picked) and picked[end][1] == picked[m][1] and len(priors[end]) == len(priors[end - 1]) + 1:
            end += 1
        if priors[m]:  # a multi-step sub-step's one row
            _fill_after(matchers[m], priors[m], bitmask, m)
        else:
            _fill_draft_run(matchers[m], priors[end - 1], bitmask, range(m, end))
        m = end


def _fill_after(matcher: xgr.GrammarMatcher, tokens: Sequence[int], bitmask: torch.Tensor, row: int) -> None:
    """Fill row with matcher's mask after tokens (a multi-step sub-step: the tokens its sequence drew earlier in
    the step, runtime/model/multi_step.py), or after the longest prefix of them the grammar takes before it ends.
    Rolls the matcher back to where it began. O(len(tokens))."""
    accepted = 0
    for token in tokens:
        if matcher.is_terminated() or not matcher.accept_token(token):
            break
        accepted += 1
    matcher.fill_next_token_bitmask(bitmask, row)
    matcher.rollback(accepted)


def _fill_draft_run(matcher: xgr.GrammarMatcher, draft: Sequence[int], bitmask: torch.Tensor, rows: range) -> None:
    """Fill rows (one sequence's, consecutive) with matcher's masks after draft[:0], draft[:1], ...; from a draft
    token the grammar rejects (or one after it ended) on, each row repeats the row before. Rolls the matcher back
    to where it began. O(len(rows)) fills."""
    accepted = 0
    ok = True
    for j, row in enumerate(rows):
        if j > 0 and ok:
            ok = matcher.accept_token(draft[j - 1])
            accepted += int(ok)
            ok = ok and not matcher.is_terminated()  # past its stop token the grammar has no next mask
        if ok:
            matcher.fill_next_token_bitmask(bitmask, row)
        else:
            bitmask[row] = bitmask[row - 1]
    matcher.rollback(accepted)
