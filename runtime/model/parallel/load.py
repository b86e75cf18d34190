"""One rank's model and KV pool under tensor parallelism: its slices loaded (shard.py), the dense model built from
them and wrapped (layers.py), its KV heads' pool sized with the same block count on every rank (with KV cache
groups, both groups' pools: runtime/model/hybrid_kv.py)."""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path
from typing import NamedTuple

import torch

from runtime.config import ServerArgs
from runtime.model.hf_config import ModelConfig
from runtime.model.hybrid_kv import HybridKVCache, hybrid_block_bytes, hybrid_layout
from runtime.model.kv_cache import KVCache, kv_block_bytes, kv_pool_blocks
from runtime.model.models import CausalLM, build_model
from runtime.model.parallel.group import TPGroup
from runtime.model.parallel.layers import install_tensor_parallel
from runtime.model.parallel.shard import ShardPlan, load_shard
from runtime.model.quant_plan import QuantPlan
from runtime.model.threads import THREADS_ENV

logger = logging.getLogger(__name__)


class RankModel(NamedTuple):
    """A rank's sharded model (called as the dense CausalLM is) and its KV pool (its KV heads, the shared block ids)."""

    model: CausalLM
    kv: KVCache | HybridKVCache


def load_rank_model(
    args: ServerArgs,
    folder: Path,
    cfg: ModelConfig,
    group: TPGroup,
    dtype: torch.dtype,
    max_positions: int,
    backend: str | None,
    quantization: QuantPlan,
) -> RankModel:
    """Load rank group.rank's slices of the model in folder onto group.device, build and wrap its model, and allocate
    its KV pool: num_blocks is the smallest count any rank's budget allows (args.num_blocks when set), so every rank
    holds the same block ids and the scheduler sees one pool (with kv_groups "auto" on a model with sliding layers,
    a HybridKVCache: the window pool's size follows from num_blocks, the same on every rank). On CPU each rank takes
    1 / (ranks on this node) of the torch threads unless $RADIXSERVE_THREADS sets them.

    Collective: every rank calls it with the same args, folder and cfg. Raises UnsupportedModelError (ShardPlan),
    ModelLoadError subclasses (load_shard), InvalidConfig (a KV pool too small), RankFailure (a rank failed).
    """
    plan = ShardPlan(cfg, group.rank, group.size)
    if group.device.type == "cpu" and not os.environ.get(THREADS_ENV):
        local_ranks = group.size // args.nnodes
        torch.set_num_threads(max(1, torch.get_num_threads() // local_ranks))
    weights = load_shard(folder, plan, dtype, group.device)
    model = build_model(plan.local_config, weights, max_positions, backend, quantization=quantization)
    install_tensor_parallel(model, plan, group)
    local = plan.local_config
    window = hybrid_layout(args, local)
    if window is None:
        block_bytes = kv_block_bytes(
            local.num_hidden_layers, args.block_size, local.num_key_value_heads, local.head_dim, dtype
        )
    else:  # two KV cache groups: a full block and its share of window blocks
        block_bytes = hybrid_block_bytes(args, local, args.block_size, dtype)
    num_blocks = group.min_int(kv_pool_blocks(args, block_bytes, group.device))
    rank_args = dataclasses.replace(args, num_blocks=num_blocks)
    kv: KVCache | HybridKVCache
    if window is None:
        kv = KVCache(rank_args, local, args.block_size, dtype, group.device)
    else:
        kv = HybridKVCache(rank_args, local, window, args.block_size, dtype, group.device)
    logger.info(
        "rank %d of %d: q heads %d..%d, KV heads %d..%d, vocabulary rows %d..%d, %d KV blocks, %d threads",
        group.rank,
        group.size,
        plan.q_head,
        plan.q_head + plan.num_q_heads - 1,
        plan.kv_head,
        plan.kv_head + plan.num_kv_heads - 1,
        plan.vocab_start,
        plan.vocab_stop - 1,
        num_blocks,
        torch.get_num_threads(),
    )
    return RankModel(model, kv)
