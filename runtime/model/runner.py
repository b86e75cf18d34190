"""ModelRunner: the worker's model, its KV cache, its copy of the live sequences, and the sampler.

It executes ForwardBatch messages (runtime/protocol/worker.py, the delta format of docs/ARCHITECTURE.md): forks, drops,
swaps, copies, then one forward over every scheduled sequence's tokens as a flat varlen batch, then one sampled token
per sequence with sample=True. A sequence that cannot run fails alone (runtime/model/isolation.py); the other
sequences of its step get their results. Its parts: runtime/model/kv_cache.py (the KV tensors and block copies),
runtime/model/worker_seqs.py (block tables from the deltas, the step's inputs), runtime/model/sampler.py and
penalties.py. The process loop around it is runtime/serve/worker_process.py.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, NamedTuple

import torch

from runtime.config import ServerArgs
from runtime.model import spec_verify
from runtime.model.cpu_features import resolve_dtype
from runtime.model.draft_runner import build_draft
from runtime.model.grammar import GrammarCache, GrammarState
from runtime.model.hybrid_kv import HybridKVCache, hybrid_layout
from runtime.model.isolation import run_isolated
from runtime.model.kv_cache import KVCache
from runtime.model.loader import load_config, load_tokenizer, load_weights, resolve_model
from runtime.model.models import build_model
from runtime.model.multi_step import MultiStep
from runtime.model.penalties import PenaltyState
from runtime.model.prompt_logprobs import prompt_logprobs, prompt_rows
from runtime.model.quant_plan import QuantPlan
from runtime.model.sampler import Sampler, SampleRequest
from runtime.model.spec_verify import Sampled
from runtime.model.threads import thread_tuner
from runtime.model.worker_seqs import StepInputs, WorkerSeq, WorkerSeqs
from runtime.protocol import ForwardBatch, ForwardResult, PromptLogprobs, Ready, ScheduledSeq, TokenLogprobs

if TYPE_CHECKING:
    from runtime.model.hf_config import ModelConfig
    from runtime.model.parallel.group import TPGroup

logger = logging.getLogger(__name__)

INVALID_DELTA = "WorkerError"  # the error type named in ForwardResult.failed_errors for a sequence's invalid delta


class StepSeqs(NamedTuple):
    """A batch after its structure was applied: the sequences that run (batch order) and, per sequence whose own
    delta is invalid, why (seq_id -> message)."""

    runnable: list[ScheduledSeq]
    invalid: dict[int, str]


class ModelRunner:
    """Loads the model, allocates the KV cache and executes ForwardBatches.

    dtype: resolve_dtype(args.dtype) ("auto": bfloat16 on CUDA and on CPUs with native bfloat16, else float32).
    max_model_len = args.max_model_len capped at the model's max_position_embeddings (the rotary tables cover it; a
    cap logs one warning naming both values). The KV pool (kv: runtime.model.kv_cache.KVCache) holds args.num_blocks
    blocks, else as many as its memory budget allows.

    Public state: ready (the Ready handshake), seqs (seq_id -> WorkerSeq of live sequences only: an entry leaves
    with the sequence's drop, or when the sequence fails), penalties (the PenaltyState of the live sequences whose
    penalties are on: their output token counts, kept up to date from the tokens sampled here, and prompt tokens;
    it leaves with the sequence's entry in seqs), grammars (the GrammarState: one xgrammar matcher per live
    sequence with structured_outputs, advanced by the tokens sampled here; runtime/model/grammar/), k_cache /
    v_cache / host_k_cache / host_v_cache (kv's tensors),
    model (called as model(input_ids, meta, k_cache, v_cache) at each run, so a wrapper assigned here is used),
    threads (the ThreadTuner that sets torch's CPU threads before each step's forward: runtime/model/threads.py),
    draft (speculative decoding's draft model and its KV pool, DraftRunner, else NoDraft: draft_runner.py).

    group: this rank's tensor-parallel group (runtime/model/parallel/): the runner then holds the rank's slices of the
    model and its KV heads, with the block count every rank agreed on; every rank executes every batch alike and
    samples the same tokens. None: the whole model (tensor_parallel_size 1). shares_cores: a server's worker beside the
    frontend processes (decode steps may run on fewer threads: threads.py decode_threads).

    Raises (at construction): runtime.model.loader.ModelLoadError subclasses; runtime.config.InvalidConfig (also for
    a KV pool of fewer than MIN_USABLE_BLOCKS usable blocks). Logs one warning when the pool holds fewer tokens than
    max_model_len.
    """

    def __init__(self, args: ServerArgs, group: TPGroup | None = None, shares_cores: bool = False) -> None:
        self.args = args
        self.group = group
        self.device = torch.device(args.device)
        self.threads = thread_tuner(self.device.type, shares_cores)  # torch's CPU threads per step (threads.py)
        self.dtype = resolve_dtype(args.dtype, self.device)
        folder = resolve_model(args.model)
        cfg = load_config(folder)
        self.config = cfg
        self.max_model_len = min(args.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
        if args.max_model_len is not None and args.max_model_len > cfg.max_position_embeddings:
            logger.warning(
                "max_model_len %d exceeds the model's max_position_embeddings %d: capped at %d",
                args.max_model_len,
                cfg.max_position_embeddings,
                self.max_model_len,
            )
        backend = None
        if args.attention_backend != "auto":
            backend = args.attention_backend
        self.quantization = QuantPlan.for_folder(args.quantization, folder, self.device.type)
        logger.info("weight quantization: %s", self.quantization.describe())
        self.block_size = args.block_size
        self.kv: KVCache | HybridKVCache
        self.draft = build_draft(args, cfg, self.dtype, self.device, self.max_model_len, backend)  # before the KV
        if group is None:
            weights = load_weights(folder, self.dtype, self.device)
            self.model = build_model(cfg, weights, self.max_model_len, backend, quantization=self.quantization)
            self.kv = self._device_kv(args, cfg)
            self.draft.allocate(args, self.kv)  # the same block ids (draft_runner.py)
        else:  # this rank's slices and KV heads (runtime/model/parallel/)
            from runtime.model.parallel.load import load_rank_model

            rank = load_rank_model(args, folder, cfg, group, self.dtype, self.max_model_len, backend, self.quantization)
            self.model = rank.model
            self.kv = rank.kv
        self.num_blocks = self.kv.num_blocks
        self._warn_if_pool_below_max_model_len()
        self.sampler = Sampler(args.seed, cfg.eos_token_ids)
        self.penalties = PenaltyState(cfg.vocab_size, self.device)
        self.grammars = GrammarState(
            lambda: GrammarCache(load_tokenizer(str(folder)), cfg.vocab_size, cfg.eos_token_ids),
            cfg.vocab_size,
            self.device,
        )
        self.step_prompt_logprobs: dict[int, PromptLogprobs] = {}  # this step's, until finish_step takes them
        self.step_priors: dict[int, list[int]] = {}  # a multi-step sub-step's earlier tokens per sequence
        self.live = WorkerSeqs(
            self.num_blocks,
            self.block_size,
            self.max_model_len,
            self.penalties,
            self.grammars,
            self.device,
            self.kv.num_window_blocks,
        )
        self.multi_step = (
            MultiStep(self.live, cfg.eos_token_ids, self.step_priors) if args.scheduler_steps() > 1 else None
        )
        self.ready = Ready(
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            max_model_len=self.max_model_len,
            num_host_blocks=args.num_host_blocks,
            vocab_size=cfg.vocab_size,
            eos_token_ids=list(cfg.eos_token_ids),
            num_host_cache_blocks=self.kv.num_host_cache_blocks,
            num_window_blocks=self.kv.num_window_blocks,
            sliding_window=self.kv.window,
        )
        logger.info(
            "model %s loaded from %s (%s): %d KV blocks of %d tokens, max_model_len %d",
            args.model,
            folder,
            str(self.dtype).removeprefix("torch."),
            self.num_blocks,
            self.block_size,
            self.max_model_len,
        )

    def _device_kv(self, args: ServerArgs, cfg: ModelConfig) -> KVCache | HybridKVCache:
        """The KV tensors: one group (KVCache), or two when args asks for KV cache groups and the model has sliding
        layers (HybridKVCache). Raises InvalidConfig for a pool too small."""
        window = hybrid_layout(args, cfg)
        if window is None:
            return KVCache(args, cfg, self.block_size, self.dtype, self.device, self.draft.block_bytes)
        return HybridKVCache(args, cfg, window, self.block_size, self.dtype, self.device)

    def _warn_if_pool_below_max_model_len(self) -> None:
        pool_tokens = (self.num_blocks - 1) * self.block_size
        if pool_tokens < self.max_model_len:
            logger.warning(
                "KV pool of %d tokens (%d usable blocks of %d) is below max_model_len %d: the longest "
                "request it can hold is %d tokens (prompt + completion)",
                pool_tokens,
                self.num_blocks - 1,
                self.block_size,
                self.max_model_len,
                pool_tokens,
            )

    @property
    def seqs(self) -> dict[int, WorkerSeq]:
        """seq_id -> WorkerSeq of the live sequences (the dict of runtime.model.worker_seqs.WorkerSeqs)."""
        return self.live.seqs

    @property
    def k_cache(self) -> torch.Tensor:
        """The device K cache [num_layers, num_blocks, block_size, num_kv_heads, head_dim]."""
        return self.kv.k_cache

    @property
    def v_cache(self) -> torch.Tensor:
        """The device V cache, shaped as k_cache."""
        return self.kv.v_cache

    @property
    def host_k_cache(self) -> torch.Tensor:
        """The host K cache [num_layers, num_host_blocks + num_host_cache_blocks, block_size, kv_heads, head_dim]."""
        return self.kv.host_k_cache

    @property
    def host_v_cache(self) -> torch.Tensor:
        """The host V cache, shaped as host_k_cache."""
        return self.kv.host_v_cache

    @torch.inference_mode()
    def execute(self, batch: ForwardBatch) -> ForwardResult:
        """Apply batch's structure once, run one forward over its sequences and sample; a failure fails only the
        sequences that cause it.

        Structure (forks, drops, swaps, copies, registering / extending block tables) is applied once; a sequence
        whose own delta is invalid (unknown without sampling_params, a block id outside the pool, a block table too
        short for its tokens, a context beyond max_model_len) fails by itself. When the forward + sampling of the
        rest raises, the sequences are bisected (runtime/model/isolation.py) down to the single sequences that raise
        alone; every other sequence returns its token. Draws of re-run sequences without a seed are drawn again from
        the sampler's generator (seeded and greedy draws are unchanged: they depend only on the seed, sample index
        and token index).

        Mutates: the KV caches, the per-sequence block tables and penalty state (a failed sequence's entries are
        removed; each sampled token is counted once for a sequence with penalties), the sampler's generator.
        Returns one token id per sequence with sample=True that did not fail, in batch order (logprobs where
        asked), the prompt logprobs of the positions run for the sequences that ask (prompt_logprobs), and the failed
        sequences with their errors ("ExceptionType: message"; INVALID_DELTA for a delta).
        Raises: whatever applying the drops, swaps or copies raises (the step failed as a whole).
        """
        step = self.apply_structure(batch)
        failed = {seq_id: f"{INVALID_DELTA}: {problem}" for seq_id, problem in step.invalid.items()}
        self.grammars.hold_pending(step.runnable, failed, self.group)  # a compile still running: requeued
        self.step_prompt_logprobs = {}
        sampled: dict[int, Sampled] = {}
        extra = 0
        runnable = step.runnable
        if runnable:
            self.threads.before_step(all(len(s.token_ids) - s.num_draft_tokens == 1 for s in runnable))
            start = time.perf_counter()
            tokens = sum(len(s.token_ids) for s in runnable)
            if self.multi_step is not None:  # the slots are decode steps of its own (multi_step.py)
                runnable, extra = self.multi_step.run(runnable, self._run, sampled, failed)
            else:
                self.draft.propose(runnable, self.live, failed)  # fills num_draft_slots (draft_runner.py)
                run_isolated(runnable, self._run, sampled, failed)
            self.threads.after_step(time.perf_counter() - start, tokens + extra)
        return self.finish_step(batch.step_id, runnable, sampled, failed, extra)

    def _run(self, seqs: list[ScheduledSeq]) -> dict[int, Sampled]:
        """Forward + sample seqs: seq_id -> Sampled of each sequence that samples. The prompt logprobs of the
        sequences that ask go to self.step_prompt_logprobs (a re-run writes the same entries again)."""
        inputs = self.prepare(seqs)
        verify = spec_verify.logits_rows(seqs)
        if verify is not None:  # every row of each draft: the verification draws one token per row
            inputs.meta.logits_indices = torch.tensor(verify, dtype=torch.int64, device=self.device)
        plan = prompt_rows(seqs, self.seqs)
        if plan is not None:  # their rows' logits come after the sampled rows'
            meta = inputs.meta
            assert meta.logits_indices is not None
            meta.logits_indices = torch.cat([meta.logits_indices, plan.rows.to(meta.logits_indices.device)])
        logits = self.model(inputs.input_ids, inputs.meta, self.kv.layer_k, self.kv.layer_v)
        if plan is not None:
            num_sampled = len(inputs.sample_seqs) if verify is None else len(verify)
            self.step_prompt_logprobs.update(prompt_logprobs(logits[num_sampled:], plan))
            logits = logits[:num_sampled]
        return self.sample(logits, inputs.sample_seqs)

    def finish_step(
        self,
        step_id: int,
        runnable: list[ScheduledSeq],
        sampled: dict[int, Sampled],
        failed: dict[int, str],
        extra_tokens: int = 0,
    ) -> ForwardResult:
        """The ForwardResult of a step whose runnable sequences ran: sampled (seq_id -> Sampled) in batch order,
        failed (seq_id -> "ExceptionType: message") apart, the tokens of the runnable sequences that did not fail
        counted once. Mutates: advances each constrained sequence's grammar matcher by its tokens (a verified draft's
        accepted tokens, then its token; a token the grammar rejects fails its sequence); forgets each failed
        sequence; counts each such token once in the penalty state. A multi-step sequence's earlier tokens go back
        as a draft accepted whole (multi_step.py); extra_tokens: the tokens its later sub-steps ran.
        O(len(runnable) + len(failed) + accepted)."""
        order = [s.seq_id for s in runnable if s.seq_id in sampled and s.seq_id not in failed]
        emitted = [(seq_id, t) for seq_id in order for t in sampled[seq_id].emitted]
        failed.update(self.grammars.record([e[0] for e in emitted], [e[1] for e in emitted]))
        for seq_id in failed:
            self.live.forget(seq_id)
        order = [seq_id for seq_id in order if seq_id not in failed]
        accepted = self.live.roll_back_drafts(runnable, sampled, failed)
        drafts = self.draft.finish(runnable, accepted, self.live)
        if self.multi_step is not None:
            self.multi_step.finish(runnable, sampled, accepted, drafts)
        token_ids = [sampled[seq_id].token_id for seq_id in order]
        emitted = [e for e in emitted if e[0] not in failed]
        self.penalties.record([e[0] for e in emitted], [e[1] for e in emitted])  # once, whatever the isolation re-ran
        logprobs = [sampled[seq_id].logprobs for seq_id in order]
        accepted_logprobs: dict[int, list[TokenLogprobs]] = {}
        for seq_id in order:
            lps = sampled[seq_id].accepted_logprobs
            if lps is not None:
                accepted_logprobs[seq_id] = lps
        prompt = {seq_id: lp for seq_id, lp in self.step_prompt_logprobs.items() if seq_id not in failed}
        self.step_prompt_logprobs = {}
        return ForwardResult(
            step_id=step_id,
            seq_ids=order,
            token_ids=token_ids,
            logprobs=logprobs if any(lp is not None for lp in logprobs) else None,
            num_forward_tokens=sum(len(s.token_ids) for s in runnable if s.seq_id not in failed) + extra_tokens,
            failed_seq_ids=list(failed),
            failed_errors=list(failed.values()),
            prompt_logprobs=prompt or None,
            accepted_token_ids=accepted or None,
            draft_token_ids=drafts or None,
            accepted_logprobs=accepted_logprobs or None,
        )

    @torch.inference_mode()
    def apply_structure(self, batch: ForwardBatch) -> StepSeqs:
        """Apply batch's forks, drops, swaps and copies, then register / extend each sequence's block table.

        The forks come before the drops (a dropped parent still lends its table); the KV copies run in the order
        fork_copies, swap_out, swap_in, copies. Mutates: the KV caches (swaps, copies), seqs, penalties. Returns the
        sequences with tokens to run and, apart, each sequence whose own delta is invalid (WorkerSeqs.register and
        check: unknown to the worker without sampling_params, a block id outside [1, num_blocks), penalties without
        penalty_token_ids or with an id outside the vocabulary, a block table too short for its tokens, or a context
        beyond max_model_len). O(batch + new block ids + penalty_token_ids).
        Raises: whatever kernels.swap_blocks / copy_blocks raise (e.g. IndexError for a bad block id).
        """
        for parent_id, child_id, shared in batch.forks:
            self.live.fork(parent_id, child_id, shared)
        self.kv.copy(batch.fork_copies)
        for seq_id in batch.drop_seq_ids:
            self.live.forget(seq_id)
        self.kv.swap(batch.swap_out, batch.swap_in)
        self.kv.swap_window(batch.window_swap_out, batch.window_swap_in)
        self.kv.copy(batch.copies)
        self.kv.copy_window(batch.window_copies)
        self.draft.apply_structure(batch)
        step = StepSeqs([], {})
        for s in batch.seqs:
            problem = self.live.register(s)
            if problem is None and s.token_ids:
                problem = self.live.check(s)
            if problem is not None:
                step.invalid[s.seq_id] = problem
            elif s.token_ids:
                step.runnable.append(s)
        return step

    @torch.inference_mode()
    def prepare(self, seqs: list[ScheduledSeq]) -> StepInputs:
        """The model inputs of seqs (each registered and checked by apply_structure, none empty):
        runtime.model.worker_seqs.WorkerSeqs.prepare. Reads state only."""
        return self.live.prepare(seqs)

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, sample_seqs: list[ScheduledSeq]) -> dict[int, Sampled]:
        """One draw per row of logits float32 [len(sample_seqs), vocab] (the model's output for prepare's
        sample_seqs): seq_id -> Sampled. Penalties and grammar masks apply to the rows whose sequences have them
        (GrammarState.rows waits for a grammar still compiling and raises for one that does not compile).
        A draft's row j sees the draft tokens before it (spec_verify.row_priors) in its penalties and grammar mask;
        a multi-step sub-step's row the tokens its sequence drew earlier in the step (step_priors).
        Mutates the sampler's generator (unseeded draws); the penalty counts are updated by finish_step."""
        if not sample_seqs:
            return {}
        rows = []
        seq_ids = []  # the sequence of each row (a draft's sequence has 1 + num_draft_tokens rows)
        priors: list[list[int]] = []  # the draft tokens before each row
        for s in sample_seqs:
            state = self.seqs[s.seq_id]
            for token_index in spec_verify.row_token_indexes(s, state.prompt_len):
                rows.append(SampleRequest(state.params, state.sample_index, token_index))
                seq_ids.append(s.seq_id)
            priors.extend(spec_verify.row_priors(s) if s.num_draft_tokens else [self.step_priors.get(s.seq_id, [])])
        prior = priors if any(priors) else None  # None: no draft and no multi-step sub-step
        penalties = self.penalties.rows(seq_ids, prior)
        out = self.sampler(logits, rows, penalties, token_bitmask=self.grammars.rows(seq_ids, prior))
        logprobs = out.logprobs or [None] * len(rows)
        result = {}
        row = 0
        for s in sample_seqs:
            n = s.num_draft_tokens + 1
            asked = self.seqs[s.seq_id].params.logprobs is not None
            result[s.seq_id] = spec_verify.sampled(s, out.token_ids[row : row + n], logprobs[row : row + n], asked)
            row += n
        return result
