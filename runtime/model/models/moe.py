"""The sparse mixture-of-experts MLP (Shazeer et al. 2017, "Outrageously Large Neural Networks"; Mixtral: Jiang et
al. 2024, "Mixtral of Experts", section 2.1): a router picks top_k of E gated-MLP experts per token and the block
returns the routing-weighted sum of their outputs.

Routing, as transformers 5.x computes it (models/qwen3_moe/modeling_qwen3_moe.py, Qwen3MoeTopKRouter.forward;
models/mixtral/modeling_mixtral.py, MixtralTopKRouter.forward):

    router_logits = F.linear(hidden_states, self.weight)  # (seq_len, num_experts)
    router_probs = torch.nn.functional.softmax(router_logits, dtype=torch.float, dim=-1)
    router_top_value, router_indices = torch.topk(router_probs, self.top_k, dim=-1)  # (seq_len, top_k)
    if self.norm_topk_prob:  # Mixtral: always
        router_top_value /= router_top_value.sum(dim=-1, keepdim=True)
    router_top_value = router_top_value.to(router_logits.dtype)  # Qwen3-MoE only; Mixtral keeps float32

and each expert's output is multiplied by its weight before it is cast back to the model dtype and summed
(Qwen3MoeExperts.forward / MixtralExperts.forward: `current_hidden_states * top_k_weights[token_idx, top_k_pos,
None]`, then `index_add_`). Neither family has a shared expert (Qwen2-MoE's shared_expert is not in Qwen3-MoE).

Execution: the (token, expert) pairs are sorted by expert, the rows gathered once, and each active expert runs one
gate_up and one down matmul over its contiguous slice (vLLM's and SGLang's fused-MoE kernels group the same way);
the outputs are put back in (token, rank) order, weighted, and summed over each token's top_k ranks (transformers
index_adds them in expert order: the sums agree to float rounding). The Python loop is over active experts (at most
E per layer), never over tokens. Experts are GatedMLP modules, so quantization "int8" / "int4" gives each its
weight-only copies (runtime.model.quant.Linear); the router stays dense.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from runtime.model.models.mlp import GatedMLP


class RouterRule(NamedTuple):
    """How a family turns router logits into weights: renormalize divides the top-k probabilities by their sum;
    weights_in_model_dtype casts them to the logits' dtype (Qwen3-MoE) instead of keeping float32 (Mixtral)."""

    renormalize: bool
    weights_in_model_dtype: bool


class Routing(NamedTuple):
    """A step's routing: weights [T, top_k] (float32 or the model dtype, per RouterRule), ids int64 [T, top_k]
    (expert indices, most probable first)."""

    weights: torch.Tensor
    ids: torch.Tensor


def softmax_top_k(logits: torch.Tensor, top_k: int, rule: RouterRule) -> Routing:
    """Route by router logits [T, E]: softmax in float32, the top_k probabilities, renormalised per `rule`.

    Formula and dtypes: the module docstring (transformers' routers). Raises RuntimeError (torch) when top_k > E.
    """
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if rule.renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if rule.weights_in_model_dtype:
        weights = weights.to(logits.dtype)
    return Routing(weights, ids)


class SparseMoeBlock(torch.nn.Module):
    """The MoE MLP of one layer: router weight [E, hidden] (the `gate` of the checkpoints), E GatedMLP experts.

    forward(x [T, hidden]) -> [T, hidden] in x's dtype. Each step routes every token (softmax_top_k), then runs each
    expert that received tokens once on all of them (the module docstring).
    """

    def __init__(self, router_weight: torch.Tensor, experts: list[GatedMLP], top_k: int, rule: RouterRule) -> None:
        super().__init__()
        if router_weight.shape[0] != len(experts) or not 1 <= top_k <= len(experts):
            raise ValueError(f"a router over {router_weight.shape[0]} experts, {len(experts)} experts, top_k {top_k}")
        self.gate = torch.nn.Parameter(router_weight, requires_grad=False)
        self.experts = torch.nn.ModuleList(experts)
        self.top_k = top_k
        self.rule = rule

    @property
    def num_experts(self) -> int:
        """E, the experts of this layer."""
        return len(self.experts)

    def route(self, x: torch.Tensor) -> Routing:
        """x [T, hidden] -> this layer's Routing (weights [T, top_k], ids int64 [T, top_k])."""
        return softmax_top_k(F.linear(x, self.gate), self.top_k, self.rule)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> sum over each token's top_k experts of weight * expert(x), [T, hidden] in x.dtype."""
        return self.run_experts(x, self.route(x))

    def run_experts(self, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        """x [T, hidden] through the experts `routing` picks, grouped by expert: [T, hidden] in x.dtype.

        Cost: two argsorts of T * top_k ids, two gathers of T * top_k rows and one gate_up and one down matmul per
        expert with at least one row. The expert outputs are put back in (token, rank) order by the inverse
        permutation and summed over the top_k ranks (torch's CPU index_add_ / scatter_add_ took ~100 ms for a few
        rows under load, so no scatter is used).
        """
        tokens = x.shape[0]
        if tokens == 0:
            return torch.zeros_like(x)
        flat_ids = routing.ids.reshape(-1)
        order = torch.argsort(flat_ids, stable=True)
        rows = x.index_select(0, torch.div(order, self.top_k, rounding_mode="floor"))
        counts = torch.bincount(flat_ids, minlength=self.num_experts).tolist()
        outputs = []
        start = 0
        for expert, count in enumerate(counts):
            if count:
                outputs.append(self.experts[expert](rows[start : start + count]))
                start += count
        per_rank = torch.cat(outputs).index_select(0, torch.argsort(order)).view(tokens, self.top_k, -1)
        return (per_rank * routing.weights[..., None]).to(x.dtype).sum(dim=1)
