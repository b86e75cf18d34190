"""DraftRunner: the worker's side of speculative decoding with a draft model (method "draft_model"; Leviathan et al.
2023, "Fast Inference from Transformers via Speculative Decoding", sec. 2; Chen et al. 2023, "Accelerating Large
Language Model Decoding with Speculative Sampling", alg. 2).

The draft model runs beside the target (runtime/model/draft_model.py). Its KV lives in a parallel pool indexed by the
SAME block ids (same block_size, same num_blocks: the memory budget is split by the two models' KV bytes per block,
KVCache's extra_block_bytes), and every copy-on-write copy, fork copy, swap and host-tier transfer of a step is applied
to both pools alike, so a prefix-cache hit, a swapped-in sequence and a host-tier load are hits for both.

Each step, before the target's forward:
- the draft model runs once over every scheduled sequence's tokens with the same positions and slot_mapping as the
  target (prefill chunks and plain decodes alike: the draft's KV stays in step with the target's), preceded per
  sequence by its catch-up tokens (below);
- a sequence with num_draft_slots = k > 0 (a decode: the one token sampled last step) then takes the argmax of that
  pass's last row as d_1 and runs k - 1 one-token decodes for d_2..d_k; its ScheduledSeq is filled in place
  (token_ids gets the draft, num_draft_tokens = k), so the target verifies it as any draft (runtime/model/
  spec_verify.py).

The proposal is greedy (argmax), a point mass q = 1[x = d_j]: the existing verification rule is then exactly the
rejection sampling of the papers (accept d_j with probability p_j(d_j)), lossless, and a seeded request draws exactly
plain decoding's tokens. The cost: under temperature the acceptance is p_j(d_j), not the sum of min(p_j, q_j) a
sampled draft distribution would reach, so a flat target accepts less than with a sampled draft.

Catch-up. The draft writes KV for the positions it reads (t, d_1..d_{k-1}); when the target accepts all k drafts,
d_k has no draft KV, so that sequence's next step runs d_k before its token (pending, one token). That slot may lie
in a block already cached and shared; catch-up writes there what every sharer's draft wants (the same token after
the same prefix). A sequence new to the worker or re-registered (after recompute, or swapped back in: its draft KV
moved with the target's, by the same swap pairs) trusts the draft KV of its blocks and loses a pending d_k. Stale
draft KV anywhere (a rejected position not yet overwritten is never read; d_k of a sequence that finished, then
cached) lowers acceptance only: correctness never depends on the draft's KV, the target verifies every token.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import msgspec
import torch

from radix.blocks import cdiv
from runtime.config import ServerArgs
from runtime.model.draft_model import DraftModel, load_draft_model
from runtime.model.hf_config import ModelConfig
from runtime.model.hybrid_kv import HybridKVCache
from runtime.model.isolation import run_isolated
from runtime.model.kv_cache import KVCache, kv_block_bytes
from runtime.model.models.batch import step_metadata
from runtime.model.worker_seqs import WorkerSeqs
from runtime.protocol import ForwardBatch, ScheduledSeq
from runtime.speculative import parse_speculative_config


class DraftSlotsError(ValueError):
    """A sequence's num_draft_slots cannot be drafted (no sampling, a table too short, max_model_len, or params the
    verification does not cover); the sequence fails alone."""


@dataclass
class DraftSeq:
    """The draft model's state of one live sequence: computed (positions [0, computed) have draft KV) and pending
    (the tokens at positions computed.. known here without draft KV: d_k after an all-accepted step)."""

    computed: int
    pending: list[int]


class NoDraft:
    """No draft model (speculation off or by n-gram): every method does nothing."""

    block_bytes = 0

    def allocate(self, args: ServerArgs, target_kv: KVCache | HybridKVCache) -> None:
        """Nothing to allocate."""

    def apply_structure(self, batch: ForwardBatch) -> None:
        """Nothing to copy."""

    def propose(self, seqs: list[ScheduledSeq], live: WorkerSeqs, failed: dict[int, str]) -> None:
        """Nothing to draft (a sequence with num_draft_slots runs a plain decode)."""

    def finish(
        self, runnable: list[ScheduledSeq], accepted: dict[int, list[int]], live: WorkerSeqs
    ) -> dict[int, list[int]]:
        """{} (no drafts)."""
        return {}


class DraftRunner:
    """The draft model, its KV pool and its per-sequence state (see the module docstring).

    Args:
        draft: the loaded draft model.
        block_size: tokens per block (the target's).
        dtype / device: of the draft's KV (the target's).
    Public state: model, config, kv (the draft's KVCache, after allocate), seqs (seq_id -> DraftSeq of the
    sequences that ran here; an entry leaves with the sequence), block_bytes (the draft's KV bytes per block).
    """

    def __init__(self, draft: DraftModel, block_size: int, dtype: torch.dtype, device: torch.device) -> None:
        self.model = draft.model
        self.config = draft.config
        self.block_size = block_size
        self.dtype = dtype
        self.device = device
        cfg = draft.config
        self.block_bytes = kv_block_bytes(
            cfg.num_hidden_layers, block_size, cfg.num_key_value_heads, cfg.head_dim, dtype
        )
        self.kv: KVCache | None = None
        self.seqs: dict[int, DraftSeq] = {}

    def allocate(self, args: ServerArgs, target_kv: KVCache | HybridKVCache) -> None:
        """Allocate the draft's KV pool: target_kv's num_blocks device blocks and its host blocks (swap pool and
        host tier), so every block id of the target names a block here too. Raises InvalidConfig as KVCache."""
        same = dataclasses.replace(
            args, num_blocks=target_kv.num_blocks, num_host_cache_blocks=target_kv.num_host_cache_blocks
        )
        self.kv = KVCache(same, self.config, self.block_size, self.dtype, self.device)

    def apply_structure(self, batch: ForwardBatch) -> None:
        """Apply batch's KV copies to the draft's pool as the runner applies them to the target's (fork copies,
        swap_out then swap_in, copy-on-write copies) and forget the dropped sequences and those that (re)register
        (they trust their cached blocks' draft KV). Raises what KVCache.copy / swap raise."""
        assert self.kv is not None
        for seq_id in batch.drop_seq_ids:
            self.seqs.pop(seq_id, None)
        for _, child_id, _ in batch.forks:
            self.seqs.pop(child_id, None)
        for s in batch.seqs:
            if s.sampling_params is not None:
                self.seqs.pop(s.seq_id, None)
        self.kv.copy(batch.fork_copies)
        self.kv.swap(batch.swap_out, batch.swap_in)
        self.kv.copy(batch.copies)

    def propose(self, seqs: list[ScheduledSeq], live: WorkerSeqs, failed: dict[int, str]) -> None:
        """Run the draft model over seqs (registered and checked, batch order) and fill each sequence with
        num_draft_slots k > 0 in place: token_ids gets its k draft tokens, num_draft_tokens = k. A sequence whose
        draft cannot run (DraftSlotsError, or a forward that raises with it alone) is recorded in failed
        ("ExceptionType: message") and taken out of seqs. Mutates seqs, failed and the draft's KV (not self.seqs:
        finish does, so a re-run of the step writes the same slots)."""
        drafts: dict[int, list[int]] = {}
        run_isolated(seqs, lambda part: self._draft(part, live), drafts, failed)
        seqs[:] = [s for s in seqs if s.seq_id not in failed]
        for s in seqs:
            if s.num_draft_slots:
                s.token_ids = s.token_ids + drafts[s.seq_id]
                s.num_draft_tokens = s.num_draft_slots

    def finish(
        self, runnable: list[ScheduledSeq], accepted: dict[int, list[int]], live: WorkerSeqs
    ) -> dict[int, list[int]]:
        """Advance the draft state of the sequences of runnable still live (those of a drafted step by accepted:
        seq_id -> the accepted prefix of its draft) and forget the rest. Returns seq_id -> the draft each drafted
        sequence ran (ForwardResult.draft_token_ids). O(len(runnable) + len(self.seqs))."""
        for seq_id in [seq_id for seq_id in self.seqs if seq_id not in live.seqs]:
            del self.seqs[seq_id]  # failed or forgotten
        drafts: dict[int, list[int]] = {}
        for s in runnable:
            if s.seq_id not in live.seqs:
                continue
            if not s.num_draft_slots:
                self.seqs[s.seq_id] = DraftSeq(s.start_pos + len(s.token_ids), [])
                continue
            k = s.num_draft_tokens
            draft = s.token_ids[len(s.token_ids) - k :]
            drafts[s.seq_id] = draft
            kept = len(accepted.get(s.seq_id, []))
            # the draft wrote t, d_1..d_{k-1}; all k accepted leaves d_k to catch up
            self.seqs[s.seq_id] = DraftSeq(s.start_pos + 1 + min(kept, k - 1), draft[k - 1 :] if kept == k else [])
        return drafts

    def _catch_up(self, s: ScheduledSeq) -> list[int]:
        """The tokens s's draft KV lacks right before s.start_pos (known here), else []."""
        state = self.seqs.get(s.seq_id)
        if state is None or state.computed + len(state.pending) != s.start_pos:
            return []
        return state.pending

    def _check(self, s: ScheduledSeq, live: WorkerSeqs) -> None:
        """Raise DraftSlotsError when s's num_draft_slots cannot be drafted and verified (live.check of s with its
        slots filled: a table too short, max_model_len, spec_verify.draft_problem)."""
        filled = msgspec.structs.replace(
            s, token_ids=s.token_ids + [0] * s.num_draft_slots, num_draft_tokens=s.num_draft_slots
        )
        problem = live.check(filled)
        if problem is None and len(s.token_ids) != 1:
            problem = f"seq {s.seq_id}: {s.num_draft_slots} draft slots after {len(s.token_ids)} tokens (not 1)"
        if problem is not None:
            raise DraftSlotsError(problem)

    def _draft(self, seqs: list[ScheduledSeq], live: WorkerSeqs) -> dict[int, list[int]]:
        """One draft pass over seqs (catch-up tokens first) and k - 1 decodes of each drafted sequence: seq_id ->
        its k greedy draft tokens. Raises DraftSlotsError (before any forward) for a sequence it cannot draft."""
        for s in seqs:
            if s.num_draft_slots:
                self._check(s, live)
        catch = [self._catch_up(s) for s in seqs]
        tokens = [t for s, c in zip(seqs, catch, strict=True) for t in c + s.token_ids]
        starts = [s.start_pos - len(c) for s, c in zip(seqs, catch, strict=True)]
        lens = [len(c) + len(s.token_ids) for s, c in zip(seqs, catch, strict=True)]
        drafted = [s for s in seqs if s.num_draft_slots]
        drafts: dict[int, list[int]] = {s.seq_id: [] for s in drafted}
        last = self._forward(seqs, tokens, starts, lens, [bool(s.num_draft_slots) for s in seqs], live)
        for j in range(max((s.num_draft_slots for s in drafted), default=0)):
            for s, token in zip(drafted, last, strict=True):
                drafts[s.seq_id].append(token)
            drafted = [s for s in drafted if s.num_draft_slots > j + 1]
            if not drafted:
                break
            tokens = [drafts[s.seq_id][-1] for s in drafted]
            starts = [s.start_pos + 1 + j for s in drafted]
            last = self._forward(drafted, tokens, starts, [1] * len(drafted), [True] * len(drafted), live)
        return drafts

    def _forward(
        self,
        seqs: list[ScheduledSeq],
        tokens: list[int],
        starts: list[int],
        lens: list[int],
        samples: list[bool],
        live: WorkerSeqs,
    ) -> list[int]:
        """Run the draft model over tokens (seqs[i] runs lens[i] of them from position starts[i], on its own block
        table) and return the argmax of the last row of each sequence with samples[i]."""
        assert self.kv is not None
        states = [live.seqs[s.seq_id] for s in seqs]
        width = max(cdiv(st + n, self.block_size) for st, n in zip(starts, lens, strict=True))
        tables = live.block_tables.gather([st.row for st in states], width)
        meta = step_metadata(
            starts, lens, samples, [st.block_table for st in states], tables, self.block_size, self.device
        )
        ids = torch.tensor(tokens, dtype=torch.int64, device=self.device)
        logits = self.model(ids, meta, self.kv.layer_k, self.kv.layer_v)
        return logits.argmax(dim=-1).tolist()


def build_draft(
    args: ServerArgs,
    target: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    max_model_len: int,
    backend: str | None,
) -> DraftRunner | NoDraft:
    """The draft part of a runner for args: a DraftRunner with its model loaded when args.speculative_config's method
    is "draft_model" (allocate it once the target's KV exists), else NoDraft. Raises what load_draft_model raises
    (DraftVocabMismatch naming both vocabulary sizes, ModelLoadError, InvalidConfig)."""
    config = parse_speculative_config(args.speculative_config)
    if config is None or config.method != "draft_model" or config.model is None:
        return NoDraft()
    draft = load_draft_model(config.model, args, target, dtype, device, max_model_len, backend)
    return DraftRunner(draft, args.block_size, dtype, device)
