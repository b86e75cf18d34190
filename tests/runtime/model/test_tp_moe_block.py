"""The mixture-of-experts block under tensor parallelism (runtime/model/parallel/layers.py, ReducedMoe), in one
process: the ranks' blocks, built from their ShardPlan slices, give partial outputs whose sum is the TP = 1 block's
output, with one all-reduce per block per step (not one per expert). The collective is stood in for by a group
that counts its calls and returns its input (the sum over the ranks is taken by the test)."""

from __future__ import annotations

import pytest
import torch

from runtime.model.loader import load_config, load_weights
from runtime.model.models import build_model
from runtime.model.models.moe import SparseMoeBlock
from runtime.model.parallel.layers import ReducedMoe, install_tensor_parallel
from runtime.model.parallel.shard import ShardPlan, load_shard
from tests.runtime.model.tiny_moe import MOE_FAMILIES, save_tiny_moe


class CountingGroup:
    """The TPGroup methods install_tensor_parallel's modules call at rank `rank`: all_reduce counts and returns t."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank = rank
        self.size = size
        self.all_reduces = 0

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        self.all_reduces += 1
        return t


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_the_ranks_partial_moe_outputs_sum_to_the_tp1_output(family, tmp_path, smollm2_tokenizer):
    folder = save_tiny_moe(family, tmp_path, smollm2_tokenizer)
    cfg = load_config(folder)
    full = build_model(cfg, load_weights(folder, torch.float32), 64)
    groups = [CountingGroup(rank, 2) for rank in range(2)]
    ranks = []
    for group in groups:
        plan = ShardPlan(cfg, group.rank, 2)
        model = build_model(plan.local_config, load_shard(folder, plan, torch.float32, "cpu"), 64)
        ranks.append(install_tensor_parallel(model, plan, group))  # type: ignore[arg-type]
    x = torch.randn(7, cfg.hidden_size, generator=torch.Generator().manual_seed(3))
    sparse = [i for i, layer in enumerate(full.layers) if isinstance(layer.get_submodule("mlp"), SparseMoeBlock)]
    assert len(sparse) == cfg.num_hidden_layers - (1 if family == "qwen3_moe" else 0)
    for i in sparse:
        blocks = [m.layers[i].get_submodule("mlp") for m in ranks]
        assert all(isinstance(b, ReducedMoe) for b in blocks)
        assert blocks[0].inner.experts[0].down_proj.weight.shape == (cfg.hidden_size, 16)  # half of the width 32
        before = [g.all_reduces for g in groups]
        partial = [b(x) for b in blocks]
        assert [g.all_reduces - n for g, n in zip(groups, before, strict=True)] == [1, 1]
        expected = full.layers[i].get_submodule("mlp")(x)
        assert not torch.allclose(partial[0], expected, atol=1e-3)  # one rank's share is not the whole
        torch.testing.assert_close(partial[0] + partial[1], expected, rtol=1e-5, atol=1e-5)
