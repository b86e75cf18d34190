"""The MoE block (runtime/model/models/moe.py) against transformers' own sparse MoE modules (Qwen3MoeSparseMoeBlock,
MixtralSparseMoeBlock) on random inputs, float32: routing (top-k ids exactly, weights), the block output, a batch
whose tokens all pick one expert and one that uses every expert (each active expert runs once, on all its rows),
and the fused 3-D and per-expert checkpoint layouts."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch

from runtime.model.hf_config import load_config
from runtime.model.models.mixtral import MIXTRAL_RULE, mixtral_moe
from runtime.model.models.moe import RouterRule, SparseMoeBlock
from runtime.model.models.moe_weights import MIXTRAL_EXPERT_NAMES, QWEN_EXPERT_NAMES, sparse_moe_block
from runtime.model.models.weights import WeightSource
from tests.runtime.model.tiny_moe import NUM_EXPERTS, tiny_moe_config

HIDDEN = 64
# (family, norm_topk_prob): Qwen3-MoE renormalises only with norm_topk_prob; Mixtral always does
CASES = [("qwen3_moe", False), ("qwen3_moe", True), ("mixtral", True)]


def hf_block(family: str, norm_topk_prob: bool = True, top_k: int = 2, seed: int = 0) -> torch.nn.Module:
    """transformers' sparse MoE block of the tiny config, random weights (std 0.25: routing far from uniform)."""
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    overrides = {"num_experts_per_tok": top_k}
    if family == "qwen3_moe":
        overrides["norm_topk_prob"] = norm_topk_prob
    config = tiny_moe_config(family, **overrides)
    torch.manual_seed(seed)
    block = (Qwen3MoeSparseMoeBlock if family == "qwen3_moe" else MixtralSparseMoeBlock)(config)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, 0.25)
    return block.eval()


def rule_of(family: str, norm_topk_prob: bool) -> RouterRule:
    return MIXTRAL_RULE if family == "mixtral" else RouterRule(norm_topk_prob, weights_in_model_dtype=True)


def our_block(hf: torch.nn.Module, family: str, norm_topk_prob: bool, fused: bool = True) -> SparseMoeBlock:
    """Our block from hf's weights, taken through moe_weights in the fused layout (transformers' parameters) or split
    into the per-expert tensors save_pretrained writes."""
    gate_up = hf.experts.gate_up_proj.detach().clone()
    down = hf.experts.down_proj.detach().clone()
    weights = {"m.gate.weight": hf.gate.weight.detach().clone()}
    names = QWEN_EXPERT_NAMES if family == "qwen3_moe" else MIXTRAL_EXPERT_NAMES
    if fused:
        weights |= {"m.experts.gate_up_proj": gate_up, "m.experts.down_proj": down}
    else:
        for e in range(gate_up.shape[0]):
            gate, up = gate_up[e].chunk(2)
            weights |= {f"m.experts.{e}.{names.gate}.weight": gate, f"m.experts.{e}.{names.up}.weight": up}
            weights[f"m.experts.{e}.{names.down}.weight"] = down[e]
    cfg = load_config_of(family, hf)
    src = WeightSource(weights)
    block = sparse_moe_block(cfg, src, "m", names, rule_of(family, norm_topk_prob), "none")
    assert not src.weights  # every tensor taken
    return block


def load_config_of(family: str, hf: torch.nn.Module):
    """Our ModelConfig for the tiny config with hf's top-k (written to a folder and read back as the loader does)."""
    config = tiny_moe_config(family, num_experts_per_tok=hf.gate.top_k)
    folder = Path(tempfile.mkdtemp())
    config.save_pretrained(folder)
    return load_config(folder)


def calls_per_expert(block: SparseMoeBlock) -> tuple[list[list[int]], list]:
    """Rows of each call to each expert, recorded by forward hooks (the hooks' handles, to remove)."""
    calls: list[list[int]] = [[] for _ in range(block.num_experts)]
    handles = [
        expert.register_forward_hook(lambda _m, args, _out, e=e: calls[e].append(int(args[0].shape[0])))
        for e, expert in enumerate(block.experts)
    ]
    return calls, handles


@pytest.mark.parametrize("family,norm", CASES)
@torch.inference_mode()
def test_routing_equals_transformers_router(family, norm):
    hf = hf_block(family, norm)
    ours = our_block(hf, family, norm)
    x = torch.randn(37, HIDDEN, generator=torch.Generator().manual_seed(1))
    _logits, hf_weights, hf_ids = hf.gate(x)
    routing = ours.route(x)
    assert torch.equal(routing.ids, hf_ids)
    torch.testing.assert_close(routing.weights, hf_weights)
    sums = routing.weights.sum(-1)
    if norm:
        torch.testing.assert_close(sums, torch.ones(37))
    else:
        assert float(sums.max()) < 1.0


@pytest.mark.parametrize("family,norm", CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@torch.inference_mode()
def test_routing_weights_keep_each_familys_dtype(family, norm, dtype):
    hf = hf_block(family, norm).to(dtype)
    ours = our_block(hf, family, norm)
    x = torch.randn(11, HIDDEN, generator=torch.Generator().manual_seed(2)).to(dtype)
    _logits, hf_weights, hf_ids = hf.gate(x)
    routing = ours.route(x)
    assert routing.weights.dtype == hf_weights.dtype  # Qwen3-MoE: the model dtype; Mixtral: float32
    assert torch.equal(routing.ids, hf_ids)
    assert torch.equal(routing.weights, hf_weights)


@pytest.mark.parametrize("family,norm", CASES)
@pytest.mark.parametrize("fused", [True, False])
@torch.inference_mode()
def test_block_equals_transformers_block(family, norm, fused):
    hf = hf_block(family, norm)
    ours = our_block(hf, family, norm, fused=fused)
    x = torch.randn(3, 29, HIDDEN, generator=torch.Generator().manual_seed(3))
    expected = hf(x).reshape(-1, HIDDEN)
    got = ours(x.reshape(-1, HIDDEN))
    torch.testing.assert_close(got, expected)
    assert float(expected.abs().mean()) > 0.1  # the experts' outputs are not negligible


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
@torch.inference_mode()
def test_tokens_that_all_pick_one_expert_run_it_once(family):
    hf = hf_block(family, top_k=1)
    with torch.no_grad():
        hf.gate.weight.zero_()
        hf.gate.weight[5, 0] = 4.0  # x[:, 0] > 0 for every token: expert 5 wins everywhere
    ours = our_block(hf, family, True)
    x = torch.randn(23, HIDDEN, generator=torch.Generator().manual_seed(4))
    x[:, 0] = x[:, 0].abs() + 1.0
    routing = ours.route(x)
    assert routing.ids.flatten().tolist() == [5] * 23
    torch.testing.assert_close(routing.weights, torch.ones(23, 1))
    calls, handles = calls_per_expert(ours)
    got = ours(x)
    for h in handles:
        h.remove()
    assert calls == [[23] if e == 5 else [] for e in range(NUM_EXPERTS)]
    torch.testing.assert_close(got, hf(x[None])[0])


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
@torch.inference_mode()
def test_a_batch_that_uses_every_expert_runs_each_once(family):
    hf = hf_block(family)
    with torch.no_grad():
        hf.gate.weight.copy_(torch.eye(NUM_EXPERTS, HIDDEN) * 3.0)  # expert e scores x[:, e]
    ours = our_block(hf, family, True)
    tokens = 4 * NUM_EXPERTS
    x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(5)) * 0.1
    first = torch.arange(tokens) % NUM_EXPERTS
    second = (first + 1 + torch.arange(tokens) // NUM_EXPERTS) % NUM_EXPERTS
    x[torch.arange(tokens), first] = 2.0
    x[torch.arange(tokens), second] = 1.0
    routing = ours.route(x)
    assert routing.ids.tolist() == torch.stack([first, second], dim=1).tolist()
    calls, handles = calls_per_expert(ours)
    got = ours(x)
    for h in handles:
        h.remove()
    counts = torch.bincount(routing.ids.flatten(), minlength=NUM_EXPERTS).tolist()
    assert calls == [[c] for c in counts] and min(counts) > 0 and sum(counts) == 2 * tokens
    torch.testing.assert_close(got, hf(x[None])[0])


def test_a_router_and_experts_that_disagree_raise():
    with pytest.raises(ValueError, match="router over 3 experts"):
        SparseMoeBlock(torch.zeros(3, HIDDEN), [], 1, MIXTRAL_RULE)


@pytest.mark.parametrize("layout", ["hub", "transformers"])
@torch.inference_mode()
def test_mixtral_builder_reads_the_hub_and_the_transformers_names(layout):
    hf = hf_block("mixtral")
    gate_up = hf.experts.gate_up_proj.detach().clone()
    down = hf.experts.down_proj.detach().clone()
    if layout == "hub":  # block_sparse_moe.experts.E.{w1,w3,w2}
        prefix = "model.layers.0.block_sparse_moe"
        weights = {f"{prefix}.gate.weight": hf.gate.weight.detach().clone()}
        for e in range(NUM_EXPERTS):
            gate, up = gate_up[e].chunk(2)
            weights |= {f"{prefix}.experts.{e}.w1.weight": gate, f"{prefix}.experts.{e}.w3.weight": up}
            weights[f"{prefix}.experts.{e}.w2.weight"] = down[e]
    else:  # transformers 5.x's in-memory names: mlp.gate, fused mlp.experts.*
        prefix = "model.layers.0.mlp"
        weights = {f"{prefix}.gate.weight": hf.gate.weight.detach().clone()}
        weights |= {f"{prefix}.experts.gate_up_proj": gate_up, f"{prefix}.experts.down_proj": down}
    src = WeightSource(weights)
    block = mixtral_moe(load_config_of("mixtral", hf), src, "model.layers.0.mlp", 0, "none")
    assert not src.weights
    x = torch.randn(9, HIDDEN, generator=torch.Generator().manual_seed(6))
    torch.testing.assert_close(block(x), hf(x[None])[0])
