"""ModelRunner: the worker's model, KV cache tensors, per-sequence block tables and sampler.

It executes ForwardBatch messages (runtime/protocol/worker.py, the delta format of ARCHITECTURE.md): drop, swap_out,
swap_in, copies, then one forward over every scheduled sequence's tokens as a flat varlen batch, then one sampled token
per sequence with sample=True. The process loop around it is runtime/serve/worker_process.py.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import NamedTuple

import torch

import kernels
from runtime.config import ServerArgs
from runtime.model.loader import load_config, load_weights, resolve_model
from runtime.model.models import AttentionMetadata, build_model
from runtime.model.sampler import Sampler, SampleRequest
from runtime.protocol import ForwardBatch, ForwardResult, Ready, ScheduledSeq
from runtime.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class WorkerError(Exception):
    """A ForwardBatch the worker cannot execute (unknown sequence, block table too short, context too long)."""


@dataclass
class WorkerSeq:
    """The worker's copy of one live sequence: its block table and sampling state."""

    block_table: list[int]
    params: SamplingParams
    prompt_len: int
    sample_index: int


class StepLogits(NamedTuple):
    """ModelRunner.forward's result: logits float32 [len(sample_seqs), vocab] and the tokens run (num_tokens)."""

    logits: torch.Tensor
    sample_seqs: list[ScheduledSeq]
    num_tokens: int


def kv_block_bytes(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes of one KV block across all layers, K and V: 2 * layers * block_size * kv_heads * head_dim * elem."""
    return 2 * num_layers * block_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def set_cpu_threads() -> int:
    """Set torch's intra-op threads to the cores this process may use minus one (at least 1); returns the count.

    The spare core serves the scheduler and tokenizer processes (or the Engine's own Python between steps): with as
    many threads as cores, a descheduled OpenMP thread stalls every parallel op of the forward. Mutates torch's
    process-wide setting.
    """
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = max(1, min(torch.get_num_threads(), cores - 1))
    torch.set_num_threads(threads)
    return threads


class ModelRunner:
    """Loads the model, allocates the KV cache and executes ForwardBatches.

    KV cache: k_cache, v_cache [num_layers, num_blocks, block_size, num_kv_heads, head_dim] on the device (block 0 is
    the null block), and host_k_cache, host_v_cache with num_host_blocks blocks on the CPU for swapping.
    num_blocks = args.num_blocks, else the budget (kv_cache_memory bytes on CPU; on CUDA gpu_memory_utilization x
    free memory after loading the weights) divided by kv_block_bytes. max_model_len = args.max_model_len capped at the
    model's max_position_embeddings (the rotary tables cover it).

    Public state: ready (the Ready handshake), seqs (seq_id -> WorkerSeq of live sequences), forward_tokens_by_seq
    (seq_id -> tokens run through the model, cumulative, kept after the sequence is dropped).

    Raises (at construction): runtime.model.loader.ModelLoadError subclasses; runtime.config.InvalidConfig.
    """

    def __init__(self, args: ServerArgs) -> None:
        self.args = args
        self.device = torch.device(args.device)
        if self.device.type == "cpu":
            set_cpu_threads()
        self.dtype = _DTYPES[args.dtype]
        folder = resolve_model(args.model)
        self.config = cfg = load_config(folder)
        self.max_model_len = min(args.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
        backend = None if args.attention_backend == "auto" else args.attention_backend
        self.model = build_model(cfg, load_weights(folder, self.dtype, self.device), self.max_model_len, backend)
        self.block_size = args.block_size
        self.num_blocks = self._num_blocks()
        shape = (cfg.num_hidden_layers, self.num_blocks, self.block_size, cfg.num_key_value_heads, cfg.head_dim)
        self.k_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.v_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        host_shape = (shape[0], args.num_host_blocks, *shape[2:])
        pin = self.device.type == "cuda"
        self.host_k_cache = torch.zeros(host_shape, dtype=self.dtype, pin_memory=pin)
        self.host_v_cache = torch.zeros(host_shape, dtype=self.dtype, pin_memory=pin)
        self.sampler = Sampler(args.seed)
        self.seqs: dict[int, WorkerSeq] = {}
        self.forward_tokens_by_seq: dict[int, int] = {}
        self.ready = Ready(num_blocks=self.num_blocks, block_size=self.block_size, max_model_len=self.max_model_len,
                           num_host_blocks=args.num_host_blocks, vocab_size=cfg.vocab_size,
                           eos_token_ids=list(cfg.eos_token_ids))
        logger.info("model %s loaded from %s: %d KV blocks of %d tokens, max_model_len %d", args.model, folder,
                    self.num_blocks, self.block_size, self.max_model_len)

    def _num_blocks(self) -> int:
        if self.args.num_blocks is not None:
            return self.args.num_blocks
        cfg = self.config
        per_block = kv_block_bytes(cfg.num_hidden_layers, self.block_size, cfg.num_key_value_heads, cfg.head_dim,
                                   self.dtype)
        budget = self.args.kv_cache_memory
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = int(free * self.args.gpu_memory_utilization)
        return max(2, budget // per_block)

    @torch.inference_mode()
    def execute(self, batch: ForwardBatch) -> ForwardResult:
        """Apply batch's drops, swaps and copies, run one forward over its sequences and sample.

        Mutates: the KV caches, the per-sequence block tables, forward_tokens_by_seq, the sampler's generator.
        Returns one token id per sequence with sample=True, in batch order (logprobs where asked).
        Raises:
            WorkerError: as forward().
        """
        step = self.forward(batch)
        rows = [SampleRequest(st.params, st.sample_index, s.start_pos + len(s.token_ids) - st.prompt_len)
                for s in step.sample_seqs for st in (self.seqs[s.seq_id],)]
        out = self.sampler(step.logits, rows) if rows else None
        return ForwardResult(
            step_id=batch.step_id,
            seq_ids=[s.seq_id for s in step.sample_seqs],
            token_ids=out.token_ids if out else [],
            logprobs=out.logprobs if out else None,
            num_forward_tokens=step.num_tokens,
        )

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> StepLogits:
        """Apply batch's drops, swaps and copies (in that order), register/extend block tables, run the model.

        Mutates: the KV caches, the per-sequence block tables, forward_tokens_by_seq.
        Returns the float32 logits [num sampling seqs, vocab] of each sample=True sequence's last token.
        Raises:
            WorkerError: a sequence unknown to the worker without sampling_params, a block table too short for its
                tokens, or a context beyond max_model_len.
        """
        for seq_id in batch.drop_seq_ids:
            self.seqs.pop(seq_id, None)
        if batch.swap_out:
            kernels.swap_blocks(self.k_cache, self.host_k_cache, batch.swap_out)
            kernels.swap_blocks(self.v_cache, self.host_v_cache, batch.swap_out)
        if batch.swap_in:
            kernels.swap_blocks(self.host_k_cache, self.k_cache, batch.swap_in)
            kernels.swap_blocks(self.host_v_cache, self.v_cache, batch.swap_in)
        if batch.copies:
            kernels.copy_blocks(self.k_cache, self.v_cache, batch.copies)
        for s in batch.seqs:
            self._register(s)
        scheduled = [s for s in batch.seqs if s.token_ids]
        if not scheduled:
            return StepLogits(torch.empty(0, self.config.vocab_size), [], 0)
        input_ids, meta, sample_seqs = self._prepare(scheduled)
        logits = self.model(input_ids, meta, self.k_cache, self.v_cache)
        return StepLogits(logits, sample_seqs, int(input_ids.shape[0]))

    def _register(self, s: ScheduledSeq) -> None:
        if s.sampling_params is not None:
            self.seqs[s.seq_id] = WorkerSeq(list(s.new_block_ids), s.sampling_params, s.prompt_len, s.sample_index)
            return
        state = self.seqs.get(s.seq_id)
        if state is None:
            raise WorkerError(f"seq {s.seq_id} is not known to the worker and carries no sampling_params")
        state.block_table.extend(s.new_block_ids)

    def _prepare(self, seqs: list[ScheduledSeq]) -> tuple[torch.Tensor, AttentionMetadata, list[ScheduledSeq]]:
        """Flatten the scheduled sequences into input ids and AttentionMetadata (tensor ops, a few list ops per seq).

        The model returns logits only for the last token of each sequence that samples.
        """
        bs = self.block_size
        tokens: list[int] = []
        starts: list[int] = []
        q_lens: list[int] = []
        tables: list[list[int]] = []
        last_rows: list[int] = []
        sample_seqs: list[ScheduledSeq] = []
        for s in seqs:
            table = self.seqs[s.seq_id].block_table
            n, end = len(s.token_ids), s.start_pos + len(s.token_ids)
            if end > self.max_model_len:
                raise WorkerError(f"seq {s.seq_id}: context {end} exceeds max_model_len {self.max_model_len}")
            if len(table) * bs < end:
                raise WorkerError(f"seq {s.seq_id}: {len(table)} blocks of {bs} cannot hold {end} tokens")
            tokens.extend(s.token_ids)
            starts.append(s.start_pos)
            q_lens.append(n)
            tables.append(table)
            self.forward_tokens_by_seq[s.seq_id] = self.forward_tokens_by_seq.get(s.seq_id, 0) + n
            if s.sample:
                last_rows.append(len(tokens) - 1)
                sample_seqs.append(s)
        dev = self.device
        max_blocks = max(len(t) for t in tables)
        table_t = torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables], dtype=torch.int32)
        start_t = torch.tensor(starts, dtype=torch.int64)
        qlen_t = torch.tensor(q_lens, dtype=torch.int64)
        qsl = torch.zeros(len(seqs) + 1, dtype=torch.int32)
        torch.cumsum(qlen_t, dim=0, out=qsl[1:])
        seq_of_token = torch.repeat_interleave(torch.arange(len(seqs)), qlen_t)
        positions = start_t[seq_of_token] + torch.arange(len(tokens)) - qsl[:-1].long()[seq_of_token]
        slots = table_t[seq_of_token, positions // bs].long() * bs + positions % bs
        seq_lens = (start_t + qlen_t).to(torch.int32)
        meta = AttentionMetadata(
            positions=positions.to(dev),
            slot_mapping=slots.to(dev),
            block_tables=table_t.to(dev),
            seq_lens=seq_lens.to(dev),
            query_start_loc=qsl.to(dev),
            max_query_len=max(q_lens),
            max_seq_len=max(st + q for st, q in zip(starts, q_lens, strict=True)),
            logits_indices=torch.tensor(last_rows, dtype=torch.int64, device=dev),
        )
        return torch.tensor(tokens, dtype=torch.int64, device=dev), meta, sample_seqs
