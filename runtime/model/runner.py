"""ModelRunner: the worker's model, KV cache tensors, per-sequence block tables and sampler.

It executes ForwardBatch messages (runtime/protocol/worker.py, the delta format of ARCHITECTURE.md): drop, swap_out,
swap_in, copies, then one forward over every scheduled sequence's tokens as a flat varlen batch, then one sampled token
per sequence with sample=True. A sequence that cannot run fails alone (ModelRunner.execute); the other sequences of its
step get their results. The process loop around it is runtime/serve/worker_process.py.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import NamedTuple

import torch

import kernels
from radix.blocks import cdiv
from runtime.config import MIN_USABLE_BLOCKS, InvalidConfig, ServerArgs
from runtime.model.cpu_features import resolve_dtype, usable_cores
from runtime.model.host_kv import HostCopies, host_cache_blocks
from runtime.model.loader import load_config, load_weights, resolve_model
from runtime.model.models import AttentionMetadata, build_model
from runtime.model.models.batch import BlockTableRows, step_metadata
from runtime.model.penalties import PenaltyState
from runtime.model.sampler import Sampler, SampleRequest
from runtime.protocol import ForwardBatch, ForwardResult, Ready, ScheduledSeq, TokenLogprobs
from runtime.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class WorkerError(Exception):
    """A ForwardBatch the worker cannot execute (unknown sequence, block table too short or naming a block outside
    the pool, context too long)."""


@dataclass
class WorkerSeq:
    """The worker's copy of one live sequence: its block table (also row `row` of block_tables), sampling state."""

    block_table: list[int]
    params: SamplingParams
    prompt_len: int
    sample_index: int
    row: int


class StepSeqs(NamedTuple):
    """A batch after its structure was applied: the sequences that run (batch order) and, per sequence whose own
    delta is invalid, why (seq_id -> message)."""

    runnable: list[ScheduledSeq]
    invalid: dict[int, str]


class StepInputs(NamedTuple):
    """ModelRunner.prepare's result: input_ids int64 [num_tokens], their AttentionMetadata, and the sequences that
    sample (batch order: row i of the logits is sample_seqs[i]'s)."""

    input_ids: torch.Tensor
    meta: AttentionMetadata
    sample_seqs: list[ScheduledSeq]


Sampled = tuple[int, TokenLogprobs | None]  # one sequence's sampled token id and its logprobs (None: not asked)


class StepLogits(NamedTuple):
    """ModelRunner.forward's result: logits float32 [len(sample_seqs), vocab] and the tokens run (num_tokens)."""

    logits: torch.Tensor
    sample_seqs: list[ScheduledSeq]
    num_tokens: int


def kv_block_bytes(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes of one KV block across all layers, K and V: 2 * layers * block_size * kv_heads * head_dim * elem."""
    return 2 * num_layers * block_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


THREADS_ENV = "RADIXSERVE_THREADS"  # overrides the worker's torch intra-op threads: an integer >= 1


def cpu_threads(cores: int, torch_threads: int, env: str | None) -> int:
    """The worker's torch intra-op threads: the integer in env ($RADIXSERVE_THREADS) when set, else
    min(torch_threads, cores) (torch_threads: torch's default, the physical cores or OMP_NUM_THREADS).

    Every core: the scheduler and tokenizer processes sleep in poll while the worker computes. Measured side by side on
    2 cores (AMD EPYC, AVX-512 + AVX512-BF16, a quiet machine, bfloat16): the decode step at 2 threads took 35.5 / 56.8
    / 99.2 ms against 48.5 / 73.4 / 154.0 ms at 1 (batch 1 / 8 / 32; benchmarks/step_breakdown.py, threads
    alternating per step), and the server (benchmarks.multi_turn_chat --quick, RADIXSERVE_THREADS=1 vs 2, alternating
    runs) made 40.6 and 48.7 output tok/s against 30.4 and 32.3, TTFT p50 0.53 and 0.44 s against 0.79 and 0.77 s.
    On a machine whose cores other jobs keep busy, the same runs went the other way (2 threads 2-10x slower: a
    descheduled thread stalls every parallel op of the forward); set RADIXSERVE_THREADS there. Raises InvalidConfig
    when env is not an integer >= 1.
    """
    if env is None or not env.strip():
        return max(1, min(torch_threads, cores))
    threads = int(env) if env.strip().isdecimal() else 0
    if threads < 1:
        raise InvalidConfig(f"{THREADS_ENV}={env!r}: expected an integer >= 1")
    return threads


def set_cpu_threads() -> int:
    """Set torch's intra-op threads to cpu_threads(usable cores, torch's count, $RADIXSERVE_THREADS); returns the
    count. Mutates torch's process-wide setting. Raises InvalidConfig for a malformed RADIXSERVE_THREADS."""
    threads = cpu_threads(usable_cores(), torch.get_num_threads(), os.environ.get(THREADS_ENV))
    torch.set_num_threads(threads)
    return threads


class ModelRunner:
    """Loads the model, allocates the KV cache and executes ForwardBatches.

    KV cache: k_cache, v_cache [num_layers, num_blocks, block_size, num_kv_heads, head_dim] on the device (block 0 is
    the null block), and host_k_cache, host_v_cache on the CPU: num_host_blocks for swapping, then
    num_host_cache_blocks of the prefix cache's host tier (runtime/model/host_kv.py).
    num_blocks = args.num_blocks, else the budget (kv_cache_memory bytes on CPU; on CUDA gpu_memory_utilization x
    free memory after loading the weights) divided by kv_block_bytes. max_model_len = args.max_model_len capped at the
    model's max_position_embeddings (the rotary tables cover it; a cap logs one warning naming both values).

    Public state: ready (the Ready handshake), seqs (seq_id -> WorkerSeq of live sequences only: an entry leaves
    with the sequence's drop, or when the sequence fails), penalties (the PenaltyState of the live sequences whose
    penalties are on: their output token counts, kept up to date from the tokens sampled here, and prompt tokens;
    it leaves with the sequence's entry in seqs).

    Raises (at construction): runtime.model.loader.ModelLoadError subclasses; runtime.config.InvalidConfig (also for
    a KV pool of fewer than MIN_USABLE_BLOCKS usable blocks). Logs one warning when the pool holds fewer tokens than
    max_model_len.
    """

    def __init__(self, args: ServerArgs) -> None:
        self.args = args
        self.device = torch.device(args.device)
        if self.device.type == "cpu":
            set_cpu_threads()
        self.dtype = resolve_dtype(args.dtype, self.device)
        folder = resolve_model(args.model)
        self.config = cfg = load_config(folder)
        self.max_model_len = min(args.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
        if args.max_model_len is not None and args.max_model_len > cfg.max_position_embeddings:
            logger.warning(
                "max_model_len %d exceeds the model's max_position_embeddings %d: capped at %d",
                args.max_model_len,
                cfg.max_position_embeddings,
                self.max_model_len,
            )
        backend = None if args.attention_backend == "auto" else args.attention_backend
        self.model = build_model(
            cfg,
            load_weights(folder, self.dtype, self.device),
            self.max_model_len,
            backend,
            quantization=args.quantization,
        )
        self.block_size = args.block_size
        self.num_blocks = self._num_blocks()
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
        shape = (cfg.num_hidden_layers, self.num_blocks, self.block_size, cfg.num_key_value_heads, cfg.head_dim)
        self.k_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.v_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.num_host_cache_blocks = host_cache_blocks(
            args,
            kv_block_bytes(cfg.num_hidden_layers, self.block_size, cfg.num_key_value_heads, cfg.head_dim, self.dtype),
        )
        self.host_copies = HostCopies(self.device)
        host_shape = (shape[0], args.num_host_blocks + self.num_host_cache_blocks, *shape[2:])
        pin = self.device.type == "cuda"
        self.host_k_cache = torch.zeros(host_shape, dtype=self.dtype, pin_memory=pin)
        self.host_v_cache = torch.zeros(host_shape, dtype=self.dtype, pin_memory=pin)
        self.sampler = Sampler(args.seed, cfg.eos_token_ids)
        self.seqs: dict[int, WorkerSeq] = {}
        self.block_tables = BlockTableRows(cdiv(self.max_model_len, self.block_size) + 1)
        self.penalties = PenaltyState(cfg.vocab_size, self.device)
        self.ready = Ready(
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            max_model_len=self.max_model_len,
            num_host_blocks=args.num_host_blocks,
            vocab_size=cfg.vocab_size,
            eos_token_ids=list(cfg.eos_token_ids),
            num_host_cache_blocks=self.num_host_cache_blocks,
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

    def _num_blocks(self) -> int:
        """Blocks of the device pool (the null block included). Raises InvalidConfig, naming the budget and the
        fix in one line, when fewer than MIN_USABLE_BLOCKS would be usable."""
        if self.args.num_blocks is not None:
            num_blocks, source = self.args.num_blocks, f"num_blocks {self.args.num_blocks}"
        else:
            cfg = self.config
            per_block = kv_block_bytes(
                cfg.num_hidden_layers, self.block_size, cfg.num_key_value_heads, cfg.head_dim, self.dtype
            )
            budget, source = self.args.kv_cache_memory, f"kv_cache_memory {self.args.kv_cache_memory} bytes"
            fix = f"raise kv_cache_memory to >= {(MIN_USABLE_BLOCKS + 1) * per_block} bytes or set num_blocks"
            if self.device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(self.device)
                budget = int(free * self.args.gpu_memory_utilization)
                source = f"gpu_memory_utilization {self.args.gpu_memory_utilization} of {free} free bytes"
                fix = "raise gpu_memory_utilization, free GPU memory or set num_blocks"
            num_blocks = budget // per_block
            source += f", {per_block} bytes per block"
        usable = max(0, num_blocks - 1)
        if usable < MIN_USABLE_BLOCKS:
            plural = "" if usable == 1 else "s"
            raise InvalidConfig(
                f"KV pool of {usable} usable block{plural} ({source}); needs >= {MIN_USABLE_BLOCKS}"
                + ("" if self.args.num_blocks is not None else f": {fix}")
            )
        return num_blocks

    @torch.inference_mode()
    def execute(self, batch: ForwardBatch) -> ForwardResult:
        """Apply batch's structure once, run one forward over its sequences and sample; a failure fails only the
        sequences that cause it.

        Structure (drops, swap_out, swap_in, copies, registering / extending block tables) is applied once; a
        sequence whose own delta is invalid (unknown without sampling_params, a block id outside the pool, a block
        table too short for its tokens, a context beyond max_model_len) fails by itself. When the forward + sampling
        of the rest raises, the sequences are bisected (each half run again) down to the single sequences that raise
        alone; every other sequence returns its token. Re-running is safe: each sequence writes KV only into its own
        slots of this step (copy-on-write makes every block written this step private to one sequence) and only
        reads slots written before them, so a re-run rewrites the same slots from the same inputs. Cost: nothing
        when no sequence fails; otherwise about 2 * log2(len(batch)) extra forwards (of shrinking halves) per failing
        sequence, and 2 * len(batch) - 1 when every sequence fails. Draws of re-run sequences without a seed are
        drawn again from the sampler's generator (seeded and greedy draws are unchanged: they depend only on the
        seed, sample index and token index).

        Mutates: the KV caches, the per-sequence block tables and penalty state (a failed sequence's entries are
        removed; each sampled token is counted once for a sequence with penalties), the sampler's generator.
        Returns one token id per sequence with sample=True that did not fail, in batch order (logprobs where
        asked), and the failed sequences with their errors ("ExceptionType: message").
        Raises: whatever applying the drops, swaps or copies raises (the step failed as a whole).
        """
        step = self.apply_structure(batch)
        failed = {seq_id: f"WorkerError: {problem}" for seq_id, problem in step.invalid.items()}
        sampled: dict[int, Sampled] = {}
        if step.runnable:
            self._run_isolated(step.runnable, sampled, failed)
        return self.finish_step(batch.step_id, step.runnable, sampled, failed)

    def finish_step(
        self, step_id: int, runnable: list[ScheduledSeq], sampled: dict[int, Sampled], failed: dict[int, str]
    ) -> ForwardResult:
        """The ForwardResult of a step whose runnable sequences ran: sampled (seq_id -> token, logprobs) in batch
        order, failed (seq_id -> "ExceptionType: message") apart, the tokens of the runnable sequences that did not
        fail counted once. Mutates: forgets each failed sequence; counts each sampled token once in the penalty
        state. O(len(runnable) + len(failed))."""
        for seq_id in failed:
            self._forget(seq_id)
        order = [s.seq_id for s in runnable if s.seq_id in sampled]
        token_ids = [sampled[seq_id][0] for seq_id in order]
        self.penalties.record(order, token_ids)  # each sampled token once, whatever the isolation re-ran
        logprobs = [sampled[seq_id][1] for seq_id in order]
        return ForwardResult(
            step_id=step_id,
            seq_ids=order,
            token_ids=token_ids,
            logprobs=logprobs if any(lp is not None for lp in logprobs) else None,
            num_forward_tokens=sum(len(s.token_ids) for s in runnable if s.seq_id not in failed),
            failed_seq_ids=list(failed),
            failed_errors=list(failed.values()),
        )

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> StepLogits:
        """Apply batch's structure (apply_structure) and run the model over all its sequences (no isolation).

        Mutates: the KV caches, the per-sequence block tables.
        Returns the float32 logits [num sampling seqs, vocab] of each sample=True sequence's last token.
        Raises:
            WorkerError: the first sequence whose delta is invalid (see apply_structure).
        """
        step = self.apply_structure(batch)
        if step.invalid:
            raise WorkerError(next(iter(step.invalid.values())))
        if not step.runnable:
            return StepLogits(torch.empty(0, self.config.vocab_size), [], 0)
        inputs = self.prepare(step.runnable)
        logits = self.model(inputs.input_ids, inputs.meta, self.k_cache, self.v_cache)
        return StepLogits(logits, inputs.sample_seqs, int(inputs.input_ids.shape[0]))

    @torch.inference_mode()
    def apply_structure(self, batch: ForwardBatch) -> StepSeqs:
        """Apply batch's forks, drops, swaps and copies (in that order), then register / extend each sequence's block
        table.

        Mutates: the KV caches (swaps, copies), seqs, penalties. Returns the sequences with tokens to run and, apart,
        each sequence whose own delta is invalid: unknown to the worker without sampling_params, a block id outside
        [1, num_blocks), penalties without penalty_token_ids or with an id outside the vocabulary, a block table too
        short for its tokens, or a context beyond max_model_len. O(batch + new block ids + penalty_token_ids).
        Raises: whatever kernels.swap_blocks / copy_blocks raise (e.g. IndexError for a bad block id).
        """
        for parent_id, child_id, shared in batch.forks:  # before the drops: a dropped parent still lends its table
            if (parent := self.seqs.get(parent_id)) is not None:
                self._forget(child_id)
                table = parent.block_table[:shared]
                self.seqs[child_id] = WorkerSeq(
                    table, parent.params, parent.prompt_len, parent.sample_index, self.block_tables.add(table)
                )
        if batch.fork_copies:
            kernels.copy_blocks(self.k_cache, self.v_cache, batch.fork_copies)
        for seq_id in batch.drop_seq_ids:
            self._forget(seq_id)
        self.host_copies.apply(
            (self.k_cache, self.v_cache), (self.host_k_cache, self.host_v_cache), batch.swap_out, batch.swap_in
        )
        if batch.copies:
            kernels.copy_blocks(self.k_cache, self.v_cache, batch.copies)
        step = StepSeqs([], {})
        for s in batch.seqs:
            problem = self._register(s)
            if problem is None and s.token_ids:
                problem = self._check(s)
            if problem is not None:
                step.invalid[s.seq_id] = problem
            elif s.token_ids:
                step.runnable.append(s)
        return step

    def _register(self, s: ScheduledSeq) -> str | None:
        """Record s's new block ids in its table (a new sequence: the whole table); the problem, if any."""
        bad = [b for b in s.new_block_ids if not 0 < b < self.num_blocks]
        if bad:
            return f"seq {s.seq_id}: block ids {bad[:4]} outside the pool [1, {self.num_blocks})"
        if s.sampling_params is not None:
            self._forget(s.seq_id)
            row = self.block_tables.add(s.new_block_ids)
            self.seqs[s.seq_id] = WorkerSeq(list(s.new_block_ids), s.sampling_params, s.prompt_len, s.sample_index, row)
            return self._register_penalties(s, s.sampling_params)
        state = self.seqs.get(s.seq_id)
        if state is None:
            return f"seq {s.seq_id} is not known to the worker and carries no sampling_params"
        if s.new_block_ids:
            state.block_table.extend(s.new_block_ids)
            self.block_tables.extend(state.row, s.new_block_ids)
        return None

    def _forget(self, seq_id: int) -> None:
        """Drop seq_id's entry in seqs, its block-table row and its penalty state (each a no-op when absent)."""
        state = self.seqs.pop(seq_id, None)
        if state is not None:
            self.block_tables.free(state.row)
        self.penalties.remove(seq_id)

    def _register_penalties(self, s: ScheduledSeq, params: SamplingParams) -> str | None:
        """(Re)start s's penalty state from its penalty_token_ids (prompt + output with repetition_penalty on, else
        the output), or clear it when its params have no penalties; the problem, if any. O(len(penalty_token_ids))."""
        if not params.has_penalties:
            return None
        ids = s.penalty_token_ids
        if ids is None:
            return f"seq {s.seq_id} has penalties but carries no penalty_token_ids"
        vocab = self.config.vocab_size
        if ids and not (0 <= min(ids) and max(ids) < vocab):
            return f"seq {s.seq_id}: penalty_token_ids outside the vocabulary [0, {vocab})"
        split = s.prompt_len if params.repetition_penalty != 1.0 else 0
        self.penalties.add(s.seq_id, params, ids[:split], ids[split:])
        return None

    def _check(self, s: ScheduledSeq) -> str | None:
        end = s.start_pos + len(s.token_ids)
        if end > self.max_model_len:
            return f"seq {s.seq_id}: context {end} exceeds max_model_len {self.max_model_len}"
        table = self.seqs[s.seq_id].block_table
        if len(table) * self.block_size < end:
            return f"seq {s.seq_id}: {len(table)} blocks of {self.block_size} cannot hold {end} tokens"
        return None

    def _run_isolated(self, seqs: list[ScheduledSeq], sampled: dict[int, Sampled], failed: dict[int, str]) -> None:
        """Forward + sample seqs into sampled; on an exception, bisect (see execute) and record each sequence that
        fails alone in failed."""
        try:
            inputs = self.prepare(seqs)
            logits = self.model(inputs.input_ids, inputs.meta, self.k_cache, self.v_cache)
            sampled.update(self.sample(logits, inputs.sample_seqs))
            return
        except Exception as exc:
            if len(seqs) == 1:
                logger.exception("seq %d failed in the forward or the draw; its request fails", seqs[0].seq_id)
                failed[seqs[0].seq_id] = f"{type(exc).__name__}: {exc}"
                return
        mid = len(seqs) // 2
        self._run_isolated(seqs[:mid], sampled, failed)
        self._run_isolated(seqs[mid:], sampled, failed)

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, sample_seqs: list[ScheduledSeq]) -> dict[int, Sampled]:
        """One draw per row of logits float32 [len(sample_seqs), vocab] (the model's output for prepare's
        sample_seqs): seq_id -> (token id, logprobs). Penalties apply to the rows whose sequences have them.
        Mutates the sampler's generator (unseeded draws); the penalty counts are updated by finish_step."""
        if not sample_seqs:
            return {}
        rows = [
            SampleRequest(st.params, st.sample_index, s.start_pos + len(s.token_ids) - st.prompt_len)
            for s in sample_seqs
            for st in (self.seqs[s.seq_id],)
        ]
        out = self.sampler(logits, rows, self.penalties.rows([s.seq_id for s in sample_seqs]))
        logprobs = out.logprobs or [None] * len(rows)
        return {s.seq_id: (t, lp) for s, t, lp in zip(sample_seqs, out.token_ids, logprobs, strict=True)}

    @torch.inference_mode()
    def prepare(self, seqs: list[ScheduledSeq]) -> StepInputs:
        """Flatten seqs (each registered and checked by apply_structure, none empty) into the model's inputs.

        The block tables are one gather from block_tables, the metadata step_metadata's (a fast path for decode
        steps). The model returns logits for the last token of each sequence that samples. Reads state only, so a
        re-run builds the same inputs. O(len(seqs) + tokens) Python."""
        states = [self.seqs[s.seq_id] for s in seqs]
        tables = self.block_tables.gather([st.row for st in states], max(len(st.block_table) for st in states))
        meta = step_metadata(
            [s.start_pos for s in seqs],
            [len(s.token_ids) for s in seqs],
            [s.sample for s in seqs],
            [st.block_table for st in states],
            tables,
            self.block_size,
            self.device,
        )
        tokens = [t for s in seqs for t in s.token_ids]
        sample_seqs = [s for s in seqs if s.sample]
        return StepInputs(torch.tensor(tokens, dtype=torch.int64, device=self.device), meta, sample_seqs)
