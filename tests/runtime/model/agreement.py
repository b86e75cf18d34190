"""Test helpers: top-1 agreement of a reduced-precision path with float32, judged against a reference measured in
the same test run on the same machine (transformers at the same precision), never against a constant.

A path that computes at lower precision than float32 (bfloat16 activations, quantized weights) flips float32's argmax
where float32's top two logits lie closer than the path's error moves them. How far that error reaches depends on the
CPU (torch picks other kernels on AVX2, AVX-512 and AVX512-BF16, which round differently), so the bounds come from
transformers' own forward at the same precision, measured beside ours:

1. Flips only at near-ties: ours may flip only where float32's top-2 gap is below the largest shift the reference's
   error gave any position's top-1 minus top-2 logit (Agreement.max_pair_shift). A flip at a wider gap is more than
   this machine's rounding at that precision (a kernel reading a wrong slot, layout or dtype).
2. No more flips than chance allows: at equal precision, flips at near-ties are chance events; two paths' counts of
   such events (Poisson, mean estimated by the reference's count n) differ by a standard deviation of sqrt(2 n), so
   ours may flip at most n + 3 sqrt(2 max(n, 1)) times (allowed_flips).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from runtime.model import quant


class Agreement(NamedTuple):
    """A path's logits against float32's on the same positions.

    positions: rows compared. flips: rows where the argmax differ. agreement: 1 - flips / positions.
    flip_gaps: float32's top-1 minus top-2 logit at each flip, ascending. max_pair_shift: the largest |change| of
    float32's top-1 minus top-2 logit (the same two vocabulary entries) over all positions. max_abs_diff: the
    largest |logit difference| over every position and vocabulary entry.
    """

    positions: int
    flips: int
    agreement: float
    flip_gaps: list[float]
    max_pair_shift: float
    max_abs_diff: float


def compare(ref: torch.Tensor, low: torch.Tensor) -> Agreement:
    """Agreement of logits low against float32 logits ref (both float32 [positions, vocab])."""
    differ = ref.argmax(-1) != low.argmax(-1)
    top2 = ref.topk(2, dim=-1)
    gaps = top2.values[:, 0] - top2.values[:, 1]
    low_pair = low.gather(1, top2.indices)
    low_gaps = low_pair[:, 0] - low_pair[:, 1]
    flips = int(differ.sum())
    return Agreement(
        positions=int(ref.shape[0]),
        flips=flips,
        agreement=1.0 - flips / int(ref.shape[0]),
        flip_gaps=sorted(gaps[differ].tolist()),
        max_pair_shift=float((low_gaps - gaps).abs().max()),
        max_abs_diff=float((ref - low).abs().max()),
    )


def allowed_flips(reference_flips: int) -> int:
    """The most flips a path may show when a reference of the same precision shows reference_flips (rule 2 of the
    module docstring): n + 3 sqrt(2 max(n, 1)), rounded down."""
    return reference_flips + math.floor(3 * math.sqrt(2 * max(reference_flips, 1)))


def describe(name: str, c: Agreement) -> str:
    """One line of c's figures, for the test output."""
    return (
        f"{name}: top-1 agreement {c.agreement:.4f} ({c.positions - c.flips}/{c.positions}), float32 top-2 gaps at "
        f"the flips {[round(g, 3) for g in c.flip_gaps]}, largest top-2 shift {c.max_pair_shift:.3f}, largest "
        f"logit difference {c.max_abs_diff:.3f}"
    )


def assert_flips_at_near_ties(mine: Agreement, reference: Agreement) -> None:
    """Rule 1 of the module docstring: mine flips only where float32's top-2 gap is below reference.max_pair_shift.
    Raises AssertionError naming the gaps."""
    wide = [g for g in mine.flip_gaps if g >= reference.max_pair_shift]
    assert not wide, f"flips at float32 top-2 gaps {wide} >= the reference's largest shift {reference.max_pair_shift}"


def assert_flip_count(mine: Agreement, reference: Agreement) -> None:
    """Rule 2 of the module docstring: mine flips at most allowed_flips(reference.flips) times, on as many
    positions. Raises AssertionError naming the counts."""
    assert mine.positions == reference.positions, (mine.positions, reference.positions)
    limit = allowed_flips(reference.flips)
    assert mine.flips <= limit, f"{mine.flips} flips; the reference has {reference.flips}, so at most {limit}"


def assert_within_reference(mine: Agreement, reference: Agreement) -> None:
    """Rules 1 and 2 of the module docstring (assert_flips_at_near_ties, assert_flip_count)."""
    assert_flips_at_near_ties(mine, reference)
    assert_flip_count(mine, reference)


def _as_quantized(weight: torch.Tensor, scheme: str, rows: int = 1) -> torch.Tensor:
    """What runtime.model.quant.Linear(weight, quantization=scheme) multiplies for steps of `rows` rows, float32
    [N, K]: the dequantized copy that serves them (the qgemv op's groups, or torch's int8 / int4 copy above the op's
    row limit or where the op is off), or weight itself where no kernel takes them (Linear keeps it dense)."""
    return quant.Linear(weight.detach(), quantization=scheme).dequantized(rows)


@torch.inference_mode()
def transformers_logits(
    sequences: list[list[int]],
    dtype: torch.dtype,
    quantization: str = "none",
    weight_dtype: torch.dtype | None = None,
    rows: int = 1,
) -> list[torch.Tensor]:
    """transformers' SmolLM2 in dtype, one forward per sequence: float32 logits [len(seq), vocab] at every position.

    quantization "int8" / "int4" first replaces each linear weight, loaded in weight_dtype (the ModelRunner's model
    dtype; default dtype), by what our quantized linears multiply for steps of `rows` rows (_as_quantized; under
    "int4" the head is int8, as runtime.model.models.decoder builds it), untying the head from the embedding table,
    then casts the model to dtype: the same quantized model at the reference's precision.
    """
    from transformers import AutoModelForCausalLM

    from runtime.model.loader import resolve_model

    load_dtype = weight_dtype or dtype
    model = AutoModelForCausalLM.from_pretrained(str(resolve_model("smollm2")), dtype=load_dtype).eval()
    if quantization != "none":
        for layer in model.model.layers:
            projections = [layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj]
            projections += [layer.self_attn.o_proj, layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj]
            for linear in projections:
                weight = _as_quantized(linear.weight, quantization, rows)
                linear.weight = torch.nn.Parameter(weight, requires_grad=False)
        head = _as_quantized(model.lm_head.weight, "int8", rows)
        model.lm_head.weight = torch.nn.Parameter(head, requires_grad=False)
    model = model.to(dtype)
    return [model(torch.tensor([ids])).logits[0].float() for ids in sequences]
