"""Speculation: the scheduler's side of speculative decoding (Leviathan et al. 2023, "Fast Inference from
Transformers via Speculative Decoding"; Chen et al. 2023, "Accelerating Large Language Model Decoding with
Speculative Sampling"). Pure Python (no torch).

A decode step of a sequence with a draft d_1..d_k runs k + 1 tokens (its last sampled token, then the draft) as one
extend over its own paged blocks; the worker verifies the draft (runtime/model/spec_verify.py) and returns the
accepted prefix d_1..d_a and one more token. Here those tokens are appended one by one exactly as plain decoding
appends its one token (EOS, stop ids, max_tokens and max_model_len cut inside the run), each accepted token's KV is
committed (full blocks enter the radix tree), and the blocks past the computed tokens go back to the pool (the worker
truncates its table copy by the same rule: cdiv(computed, block_size) blocks).

With a draft model the proposal is k placeholders (draft_slots.py): the worker's draft model fills them and returns
the draft with the result, which the Scheduler passes to on_verified in their place.

Multi-step decoding (num_scheduler_steps = N > 1, vLLM's multi-step scheduling) takes the same path with N - 1
placeholders: the worker runs N one-token decode steps, each fed the token the previous one sampled
(runtime/model/multi_step.py), and returns the first N - 1 tokens as a draft that is accepted whole. It runs only in
steps where every running sequence decodes and no request waits (begin_step's may_multi_step), so it never delays a
prefill; it keeps no speculation counters.

Speculation is off per sequence for beam search (the proposal is empty) and per step when verification cannot pay
(SpeculationGate, spec_gate.py: the measured cost of a verify step against the running acceptance, or vLLM's fixed
disable_by_batch_size when given). Penalties, logit_bias, min_tokens, structured outputs and logprobs speculate:
the worker applies them to each draft row as plain decoding would.
"""

from __future__ import annotations

from radix.manager import KVCacheManager
from runtime.protocol import TokenLogprobs
from runtime.scheduler.draft_slots import DraftSlots
from runtime.scheduler.finish import Finisher
from runtime.scheduler.ngram import NgramProposer, NoProposer
from runtime.scheduler.request import SchedulerSeq, SeqStatus
from runtime.scheduler.spec_gate import SpeculationGate
from runtime.scheduler.stats import SpecCounters
from runtime.speculative import SpeculativeConfig


def may_speculate(seq: SchedulerSeq) -> bool:
    """Whether the worker verifies a draft of seq: not for beam search (its candidates are not one draw per row) or
    a prefill-only sequence. Penalties, structured outputs and logprobs do speculate (each draft row gets the
    penalties and the grammar mask of the draft tokens before it; each emitted token carries its row's logprobs)."""
    return not (seq.req.params.use_beam_search or seq.prefill_only)


class Speculation:
    """Proposes drafts for decode steps and applies the worker's verification.

    Args:
        config: the parsed --speculative-config (None: off; every draft is empty).
        manager: the KV block manager (commits and the rollback of rejected slots).
        finisher: appends each token as plain decoding does (and finishes sequences).
        max_model_len: context limit in tokens (a draft never runs past it).
    Public state: counters (SpecCounters).
    """

    def __init__(
        self,
        config: SpeculativeConfig | None,
        manager: KVCacheManager,
        finisher: Finisher,
        max_model_len: int,
        num_scheduler_steps: int = 1,
    ) -> None:
        self._manager = manager
        self._finisher = finisher
        self._max_model_len = max_model_len
        self._proposer: NgramProposer | NoProposer | DraftSlots = NoProposer()
        self._k = 0
        self._gate = SpeculationGate(1, None)
        if config is not None:
            self._proposer = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
            if config.method == "draft_model":  # the worker's draft model fills the slots (draft_slots.py)
                self._proposer = DraftSlots()
            self._k = config.num_speculative_tokens
            self._gate = SpeculationGate(self._k, config.disable_by_batch_size)
        self._multi_step = config is None and num_scheduler_steps > 1
        if self._multi_step:  # the worker fills the slots with its own decode steps (module docstring)
            self._proposer = DraftSlots()
            self._k = num_scheduler_steps - 1
        self._active = False
        self._probe = False  # a closed step in which one sequence drafts (SpeculationGate.probe)
        self._drafting: dict[int, SchedulerSeq] = {}  # the sequences the proposer holds an index for
        self.counters = SpecCounters(accepted_per_pos=[0] * self._k)

    def begin_step(self, num_running: int, may_multi_step: bool = False) -> None:
        """Decide for the step about to be planned (SpeculationGate.open: drafts only where verifying them can pay
        at num_running sequences; a closed step may let one sequence draft: SpeculationGate.probe; multi-step
        decoding: may_multi_step, every running sequence decodes and none waits). Releases the proposer's index of
        every sequence that finished, O(sequences indexed)."""
        for seq_id, seq in list(self._drafting.items()):
            if seq.status == SeqStatus.FINISHED:
                self._proposer.release(seq_id)
                del self._drafting[seq_id]
        if self._multi_step:
            self._active = may_multi_step
            self._probe = False
            return
        self._active = self._k > 0 and self._gate.open(num_running)
        self._probe = self._k > 0 and not self._active and self._gate.probe()

    def propose(self, seq: SchedulerSeq) -> list[int]:
        """The draft of a decode step of seq (maybe []): at most num_speculative_tokens, never past max_tokens
        (plain decoding samples max_tokens - num_output more tokens, the last one unverified) nor max_model_len.
        O(proposer): for ngram, O(k) look-ups plus indexing the tokens appended since seq's previous proposal."""
        if not (self._active or self._probe) or not may_speculate(seq):
            return []
        room = min(self._k, seq.req.params.max_tokens - seq.num_output - 1, self._max_model_len - len(seq.token_ids))
        if not self._multi_step:  # its slots hold no proposer state to release
            self._drafting[seq.seq_id] = seq
        draft = self._proposer.propose(seq.seq_id, seq.token_ids, room)
        if draft and not self._active:
            self._probe = False  # the probe step's one draft
        return draft

    def on_verified(
        self,
        seq: SchedulerSeq,
        start: int,
        draft: list[int],
        accepted: list[int],
        token: int,
        logprobs: list[TokenLogprobs | None] | None = None,
    ) -> None:
        """Apply the verification of seq's step that ran tokens [start, start + 1 + len(draft)): accepted (a prefix
        of draft) and then token are appended in order, each as plain decoding's one token with its logprobs
        (logprobs: one per accepted token then token's, or None: not asked; a finish inside the run drops the rest);
        KV is committed through the last accepted token; if seq still runs, the blocks past its computed tokens are
        released (manager.release_uncomputed) and seq.sent_blocks follows the table.
        Raises ValueError when accepted is not a prefix of draft, or logprobs not one per token (a worker bug).
        O(len(draft) + blocks)."""
        if accepted != draft[: len(accepted)]:
            raise ValueError(f"seq {seq.seq_id}: accepted {accepted} is not a prefix of the draft {draft}")
        lps = logprobs if logprobs is not None else [None] * (len(accepted) + 1)
        if len(lps) != len(accepted) + 1:
            raise ValueError(f"seq {seq.seq_id}: {len(lps)} logprobs for {len(accepted) + 1} tokens")
        if not self._multi_step:
            self._count(len(draft), len(accepted))
        self._manager.commit_computed(seq.seq_id, start + 1)
        for i, tok in enumerate(accepted):
            self._finisher.on_token(seq, tok, lps[i])
            if seq.status != SeqStatus.RUNNING:
                return
            self._manager.commit_computed(seq.seq_id, start + 2 + i)
        self._finisher.on_token(seq, token, lps[-1])
        if seq.status == SeqStatus.RUNNING:
            self._manager.release_uncomputed(seq.seq_id)
            seq.sent_blocks = len(self._manager.block_table(seq.seq_id))

    def _count(self, proposed: int, accepted: int) -> None:
        """Fold one verified draft into the gate's estimate and the counters. O(accepted)."""
        self._gate.on_verified(proposed, accepted)
        c = self.counters
        c.num_drafts += 1
        c.num_draft_tokens += proposed
        c.num_accepted_tokens += accepted
        for i in range(accepted):
            c.accepted_per_pos[i] += 1
