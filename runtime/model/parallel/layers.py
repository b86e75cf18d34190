"""The modules a sharded CausalLM adds around its per-rank layers, and install_tensor_parallel, which puts them in.

The layers themselves are the dense ones, built from a ShardPlan's local_config and slices (runtime/model/parallel/
shard.py); what tensor parallelism adds is where the ranks' partial results meet: an all-reduce after each
row-parallel projection (o_proj, down_proj) and after each mixture-of-experts block (one for all its experts: each
expert's down is row-parallel, and the routing-weighted sum of partial outputs is linear), a masked lookup and an
all-reduce for the vocab-parallel embedding (vLLM's VocabParallelEmbedding does the same), and an all-gather of the
vocab-parallel head's logits so every rank samples from the whole vocabulary, as TP = 1 does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from runtime.model.models.decoder import CausalLM
from runtime.model.models.mlp import GatedMLP
from runtime.model.models.moe import SparseMoeBlock
from runtime.model.parallel.group import TPGroup
from runtime.model.parallel.shard import ShardPlan


class RowParallel(torch.nn.Module):
    """inner(x) summed over the ranks: inner is a projection over this rank's input columns and has no bias."""

    def __init__(self, inner: torch.nn.Module, group: TPGroup) -> None:
        super().__init__()
        assert getattr(inner, "bias", None) is None, "a row-parallel bias would be added once per rank"
        self.inner = inner
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in / N] -> [T, out], the same on every rank."""
        return self.group.all_reduce(self.inner(x))


class ReducedMoe(torch.nn.Module):
    """A SparseMoeBlock whose experts hold this rank's part of their width, its output summed over the ranks.

    The router is replicated and every rank sees the same x, so all ranks route alike; each expert's output on a
    rank is its down_proj over this rank's columns, and the weighted sum over experts of those partial outputs,
    summed over the ranks, is the block's output at TP = 1 (to float rounding). One all-reduce per layer."""

    def __init__(self, inner: SparseMoeBlock, group: TPGroup) -> None:
        super().__init__()
        self.inner = inner
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] (the same on every rank) -> [T, hidden], the same on every rank."""
        return self.group.all_reduce(self.inner(x))


class VocabParallelEmbedding(torch.nn.Module):
    """The embedding lookup of token ids over this rank's rows [start, stop) of the table: ids outside give zero rows,
    and the sum over the ranks is the full lookup (each id is found on exactly one rank, so the sum adds zeros to it:
    the same values as TP = 1)."""

    def __init__(self, weight: torch.Tensor, start: int, stop: int, group: TPGroup) -> None:
        super().__init__()
        self.weight = weight
        self.start = start
        self.stop = stop
        self.group = group

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids int64 [T] -> [T, hidden] in the table's dtype."""
        inside = (input_ids >= self.start) & (input_ids < self.stop)
        local = torch.where(inside, input_ids - self.start, 0)
        x = F.embedding(local, self.weight)
        x = x.masked_fill(~inside.unsqueeze(-1), 0.0)
        return self.group.all_reduce(x)


class VocabParallelHead(torch.nn.Module):
    """The head over this rank's vocabulary rows (padded to ShardPlan.vocab_rows), all-gathered into the logits of the
    whole vocabulary [T, vocab_size] on every rank."""

    def __init__(self, inner: torch.nn.Module, vocab_size: int, group: TPGroup) -> None:
        super().__init__()
        self.inner = inner
        self.vocab_size = vocab_size
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> logits [T, vocab_size]."""
        return self.group.all_gather_last(self.inner(x))[..., : self.vocab_size]


def install_tensor_parallel(model: CausalLM, plan: ShardPlan, group: TPGroup) -> CausalLM:
    """Wrap a CausalLM built from plan's local_config and slices: each layer's o_proj and dense down_proj in
    RowParallel, each mixture-of-experts block in ReducedMoe, the embedding in VocabParallelEmbedding, the head in
    VocabParallelHead. Mutates and returns model.

    Raises TypeError when a layer's MLP is neither a GatedMLP nor a SparseMoeBlock."""
    for layer in model.layers:
        attn = layer.get_submodule("self_attn")
        attn.register_module("o_proj", RowParallel(attn.get_submodule("o_proj"), group))
        mlp = layer.get_submodule("mlp")
        if isinstance(mlp, SparseMoeBlock):
            layer.register_module("mlp", ReducedMoe(mlp, group))
        elif isinstance(mlp, GatedMLP):
            mlp.register_module("down_proj", RowParallel(mlp.down_proj, group))
        else:
            raise TypeError(f"tensor parallelism shards GatedMLP and SparseMoeBlock, not {type(mlp).__name__}")
    model.register_module(
        "embed_tokens", VocabParallelEmbedding(model.embed_weight, plan.vocab_start, plan.vocab_stop, group)
    )
    model.register_module("lm_head", VocabParallelHead(model.lm_head, plan.cfg.vocab_size, group))
    return model
