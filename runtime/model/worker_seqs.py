"""The worker's copy of each live sequence (docs/ARCHITECTURE.md, "Processes and sockets"): its block table, kept from
each ForwardBatch's deltas, its sampling state, and the model inputs a step gathers from them.

A new sequence (or one resumed after preemption by recompute) arrives with its whole block table and SamplingParams;
each later step brings only the block ids appended since. The tables are also rows of one int32 tensor
(runtime.model.models.batch.BlockTableRows), so a step's block_tables tensor is one gather.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from radix.blocks import cdiv
from runtime.model.grammar import GrammarState
from runtime.model.models import AttentionMetadata
from runtime.model.models.batch import BlockTableRows, step_metadata
from runtime.model.penalties import PenaltyState
from runtime.model.spec_verify import Sampled, draft_problem
from runtime.protocol import ScheduledSeq
from runtime.sampling_params import SamplingParams


@dataclass
class WorkerSeq:
    """The worker's copy of one live sequence: its block table (also row `row` of WorkerSeqs.block_tables) and its
    sampling state (params, prompt_len, sample_index)."""

    block_table: list[int]
    params: SamplingParams
    prompt_len: int
    sample_index: int
    row: int
    prompt_token_ids: list[int] | None = None  # with params.prompt_logprobs: the prompt (runtime/model/prompt_logprobs)
    window_table: list[int] | None = None  # with a sliding-window KV cache group: that group's table
    window_row: int = -1  # and its row of WorkerSeqs.window_tables


class StepInputs(NamedTuple):
    """A step's model inputs (WorkerSeqs.prepare): input_ids int64 [num_tokens], their AttentionMetadata, and the
    sequences that sample (batch order: row i of the logits is sample_seqs[i]'s)."""

    input_ids: torch.Tensor
    meta: AttentionMetadata
    sample_seqs: list[ScheduledSeq]


class WorkerSeqs:
    """seq_id -> WorkerSeq of the live sequences, their block-table rows, their penalty state and grammar matchers.

    Args:
        num_blocks: blocks of the device pool; a block id outside [1, num_blocks) is refused.
        block_size: tokens per block.
        max_model_len: the longest context (tokens) a sequence may reach.
        penalties: the PenaltyState of the runner; register starts a sequence's entry there, forget removes it (the
            runner's sampling reads and counts it).
        grammars: the GrammarState of the runner, kept the same way for sequences with structured_outputs (their
            matcher replays the output tokens the sequence carries when it registers).
        device: where the step's inputs go.
        num_window_blocks: blocks of the sliding-window KV cache group's pool (0: one group). With one, each
            sequence also keeps that group's table (ScheduledSeq.new_window_block_ids; 0, the null block, before its
            window) in window_tables, and a step's metadata gets its window part (AttentionMetadata.window).

    Public state: seqs (live sequences only: an entry leaves with forget), block_tables (BlockTableRows; a row is
    valid while its sequence is in seqs).
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        max_model_len: int,
        penalties: PenaltyState,
        grammars: GrammarState,
        device: torch.device,
        num_window_blocks: int = 0,
    ) -> None:
        self.num_blocks = num_blocks
        self.num_window_blocks = num_window_blocks
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.penalties = penalties
        self.grammars = grammars
        self.device = device
        self.seqs: dict[int, WorkerSeq] = {}
        self.block_tables = BlockTableRows(cdiv(max_model_len, block_size) + 1)
        self.window_tables = BlockTableRows(cdiv(max_model_len, block_size) + 1) if num_window_blocks else None

    def fork(self, parent_id: int, child_id: int, shared: int) -> None:
        """Start child_id (replacing any entry it had) with the first `shared` blocks of parent_id's table and the
        parent's sampling state; nothing when parent_id is not live. The child has no penalty state. O(shared)."""
        parent = self.seqs.get(parent_id)
        if parent is None:
            return
        self.forget(child_id)
        table = parent.block_table[:shared]
        row = self.block_tables.add(table)
        self.seqs[child_id] = WorkerSeq(
            table, parent.params, parent.prompt_len, parent.sample_index, row, parent.prompt_token_ids
        )
        if parent.window_table is not None and self.window_tables is not None:
            child = self.seqs[child_id]
            child.window_table = parent.window_table[:shared]
            child.window_row = self.window_tables.add(child.window_table)

    def forget(self, seq_id: int) -> None:
        """Drop seq_id's entry in seqs, its block-table row, its penalty state and its grammar matcher (each a no-op
        when absent)."""
        state = self.seqs.pop(seq_id, None)
        if state is not None:
            self.block_tables.free(state.row)
            if self.window_tables is not None and state.window_row >= 0:
                self.window_tables.free(state.window_row)
        self.penalties.remove(seq_id)
        self.grammars.remove(seq_id)

    def register(self, s: ScheduledSeq) -> str | None:
        """Record s's new block ids in its table (a sequence carrying sampling_params starts over with them as its
        whole table, and its penalty state and grammar matcher from its penalty_token_ids). Returns the problem, if
        any: a block id outside [1, num_blocks), a sequence unknown here without sampling_params, or
        penalty_token_ids missing or outside the vocabulary. O(len(new_block_ids) + len(penalty_token_ids))."""
        bad = [b for b in s.new_block_ids if not 0 < b < self.num_blocks]
        if bad:
            return f"seq {s.seq_id}: block ids {bad[:4]} outside the pool [1, {self.num_blocks})"
        problem = self._check_window_ids(s)
        if problem is not None:
            return problem
        if s.sampling_params is not None:
            self.forget(s.seq_id)
            row = self.block_tables.add(s.new_block_ids)
            table = list(s.new_block_ids)
            self.seqs[s.seq_id] = WorkerSeq(
                table, s.sampling_params, s.prompt_len, s.sample_index, row, s.prompt_token_ids
            )
            self._extend_window(self.seqs[s.seq_id], s)
            return self._register_penalties(s, s.sampling_params) or self._check_prompt_ids(s, s.sampling_params)
        state = self.seqs.get(s.seq_id)
        if state is None:
            return f"seq {s.seq_id} is not known to the worker and carries no sampling_params"
        if s.new_block_ids:
            state.block_table.extend(s.new_block_ids)
            self.block_tables.extend(state.row, s.new_block_ids)
            self._extend_window(state, s)
        return None

    def _check_window_ids(self, s: ScheduledSeq) -> str | None:
        """The problem of s's window block ids, if any: present exactly when there is a window group, aligned with
        new_block_ids, inside [0, num_window_blocks) (0: released before the window). O(len(new_block_ids))."""
        ids = s.new_window_block_ids
        if not self.num_window_blocks:
            return None if ids is None else f"seq {s.seq_id}: window block ids without a sliding-window group"
        if ids is None or len(ids) != len(s.new_block_ids):
            return f"seq {s.seq_id}: window block ids not aligned with its {len(s.new_block_ids)} new blocks"
        bad = [b for b in ids if not 0 <= b < self.num_window_blocks]
        if bad:
            return f"seq {s.seq_id}: window block ids {bad[:4]} outside the pool [0, {self.num_window_blocks})"
        return None

    def _extend_window(self, state: WorkerSeq, s: ScheduledSeq) -> None:
        """Append s's window block ids (checked) to state's window table and row; nothing with one group."""
        ids = s.new_window_block_ids
        if ids is None or self.window_tables is None:
            return
        if state.window_table is None:
            state.window_table = list(ids)
            state.window_row = self.window_tables.add(ids)
        else:
            state.window_table.extend(ids)
            self.window_tables.extend(state.window_row, ids)

    def _check_prompt_ids(self, s: ScheduledSeq, params: SamplingParams) -> str | None:
        """The problem of s's prompt_token_ids, if any: missing or not prompt_len long while params ask for prompt
        logprobs, or an id outside the vocabulary. O(prompt_len)."""
        if params.prompt_logprobs is None:
            return None
        ids = s.prompt_token_ids
        if ids is None or len(ids) != s.prompt_len:
            return f"seq {s.seq_id} asks for prompt_logprobs without its {s.prompt_len} prompt_token_ids"
        vocab = self.penalties.vocab_size
        if ids and not (0 <= min(ids) and max(ids) < vocab):
            return f"seq {s.seq_id}: prompt_token_ids outside the vocabulary [0, {vocab})"
        return None

    def _register_penalties(self, s: ScheduledSeq, params: SamplingParams) -> str | None:
        """(Re)start s's penalty state and grammar matcher from its penalty_token_ids (prompt + output with
        repetition_penalty on, else the output), or nothing when its params have neither; the problem, if any.
        O(len(penalty_token_ids))."""
        if not params.has_penalties and params.structured_outputs is None:
            return None
        ids = s.penalty_token_ids
        if ids is None:
            return f"seq {s.seq_id} has penalties or structured_outputs but carries no penalty_token_ids"
        vocab = self.penalties.vocab_size
        if ids and not (0 <= min(ids) and max(ids) < vocab):
            return f"seq {s.seq_id}: penalty_token_ids outside the vocabulary [0, {vocab})"
        split = 0
        if params.repetition_penalty != 1.0:
            split = s.prompt_len
        if params.has_penalties:
            self.penalties.add(s.seq_id, params, ids[:split], ids[split:])
        if params.structured_outputs is not None:
            self.grammars.add(s.seq_id, params.structured_outputs, ids[split:])
        return None

    def check(self, s: ScheduledSeq) -> str | None:
        """The problem of running s's tokens (s registered), if any: a context beyond max_model_len, a block
        table too short for it, or a draft it may not run (spec_verify.draft_problem). O(1)."""
        end = s.start_pos + len(s.token_ids)
        if end > self.max_model_len:
            return f"seq {s.seq_id}: context {end} exceeds max_model_len {self.max_model_len}"
        state = self.seqs[s.seq_id]
        table = state.block_table
        if len(table) * self.block_size < end:
            return f"seq {s.seq_id}: {len(table)} blocks of {self.block_size} cannot hold {end} tokens"
        return draft_problem(s, state.params)

    def roll_back_drafts(
        self, runnable: list[ScheduledSeq], sampled: dict[int, Sampled], failed: dict[int, str]
    ) -> dict[int, list[int]]:
        """seq_id -> accepted draft tokens of each of runnable that ran a draft and did not fail; each one's block
        table is cut to the blocks of its computed tokens (start + 1 + accepted), as the scheduler cuts its own.
        O(drafts)."""
        accepted: dict[int, list[int]] = {}
        for s in runnable:
            if s.num_draft_tokens and s.seq_id in sampled and s.seq_id not in failed:
                kept = sampled[s.seq_id].accepted or []
                accepted[s.seq_id] = kept
                self.truncate(s.seq_id, cdiv(s.start_pos + 1 + len(kept), self.block_size))
        return accepted

    def truncate(self, seq_id: int, num_blocks: int) -> None:
        """Cut seq_id's block table (and its row) to its first num_blocks entries: speculative decoding's rollback,
        the scheduler's KVCacheManager.release_uncomputed by the same rule; the window table too (its entries are
        aligned with the block table's: radix/hybrid_manager.py). O(width)."""
        state = self.seqs[seq_id]
        del state.block_table[num_blocks:]
        self.block_tables.truncate(state.row, num_blocks)
        if state.window_table is not None and self.window_tables is not None:
            del state.window_table[num_blocks:]
            self.window_tables.truncate(state.window_row, num_blocks)

    def prepare(self, seqs: list[ScheduledSeq]) -> StepInputs:
        """Flatten seqs (each registered and checked, none empty) into the model's inputs.

        The block tables are one gather from block_tables, the metadata step_metadata's (a fast path for decode
        steps). The model returns logits for the last token of each sequence that samples. Reads state only, so a
        re-run builds the same inputs. O(len(seqs) + tokens) Python."""
        states = [self.seqs[s.seq_id] for s in seqs]
        width = max(len(st.block_table) for st in states)
        tables = self.block_tables.gather([st.row for st in states], width)
        meta = step_metadata(
            [s.start_pos for s in seqs],
            [len(s.token_ids) for s in seqs],
            [s.sample for s in seqs],
            [st.block_table for st in states],
            tables,
            self.block_size,
            self.device,
        )
        if self.window_tables is not None:
            window = [st.window_table or [] for st in states]
            meta.window = step_metadata(
                [s.start_pos for s in seqs],
                [len(s.token_ids) for s in seqs],
                [s.sample for s in seqs],
                window,
                self.window_tables.gather([st.window_row for st in states], width),
                self.block_size,
                self.device,
            )
        tokens = [t for s in seqs for t in s.token_ids]
        sample_seqs = [s for s in seqs if s.sample]
        return StepInputs(torch.tensor(tokens, dtype=torch.int64, device=self.device), meta, sample_seqs)
