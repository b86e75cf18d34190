"""Accuracy of the qgemv op (kernels/cpu_qgemv.cpp) on SmolLM2 int4: per layer, and as teacher-forced top-1 agreement.

Per layer (`layers`): transformers' float32 SmolLM2 runs the passages once; the input x of every linear is kept (its
first `rows` positions: few rows, as in decode). For each linear, the relative error ||y - x @ W.T|| / ||x @ W.T||
(Frobenius, float64), W the weight the path multiplies dequantized:
- op: the op on runtime.model.quant_groups' copy (the projections int4, the head int8, as Linear builds them);
- torch: torch's int4pack / int8pack kernel on its own copy (x rounded to bfloat16 in and out, as Linear's torch path);
- int8_x: x rounded to int8 per group of 32, a = max |x| / 127, times the op's W in float64: llama.cpp's Q8_0 / Q8_1
  activations (ggml-cpu quants.c), the op's scheme before int16;
- bf16_x: x rounded to bfloat16 times the op's W (torch's activation rounding alone, without its output rounding);
- outlier: the mean over positions of max |x| / rms(x) (how far one channel stands above the rest).
Reported per projection kind (q_proj ... lm_head): the mean and worst over layers.

Agreement (`agreement`): the runner (ModelRunner, quantization int4, dtype bfloat16 and float32) fed the passages of
tests/runtime/model/test_quant_agreement.py one token per step, one passage at a time (1 row a step: the op serves
every linear when on), against transformers' float32 on the same passages: top-1 agreement, the op off (torch's
kernels) and on, built side by side in this process (kernels.cpu_qgemv.ENABLED while each is built).

    .venv/bin/python -m benchmarks.qgemv_accuracy            # -> results/qgemv_accuracy.json
    .venv/bin/python -m benchmarks.qgemv_accuracy --smoke    # seconds: one passage's first 12 tokens, 2 layers
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from benchmarks.cli import write_result
from kernels import cpu_qgemv
from runtime.config import ServerArgs
from runtime.model import quant, quant_int4
from runtime.model.cpu_features import machine_facts
from runtime.model.quant_groups import group_linear
from runtime.model.runner import ModelRunner

RESULTS = Path(__file__).parent / "results" / "qgemv_accuracy.json"
KINDS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head")


def _rel(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.double() - ref).norm() / ref.norm())


def _rounded(x: torch.Tensor, levels: int) -> torch.Tensor:
    """x [M, K] rounded per group of 32 to integers times a = max |x| / levels (float64)."""
    m, k = x.shape
    g = x.double().reshape(m, k // 32, 32)
    a = g.abs().amax(-1, keepdim=True) / levels
    return (torch.round(g / torch.where(a > 0, a, torch.ones_like(a))) * a).reshape(m, k)


def layer_errors(weight: torch.Tensor, x: torch.Tensor, scheme: str) -> dict[str, float]:
    """The relative errors of one linear (module docstring) for weight [N, K] float32 and inputs x [M, K]."""
    op = quant.Linear(weight, quantization=scheme)
    groups = op.groups
    assert groups is not None, "the op must serve this weight"
    deq = op.dequantized(1).double()
    ref = x.double() @ deq.T
    if scheme == "int4":
        int4 = quant_int4.quantize_int4(weight)
        torch_y = quant_int4.int4_linear(x, quant_int4.pack_int4(int4))
        torch_ref = x.double() @ quant_int4.dequantize_int4(int4).double().T
    else:
        w8 = quant.quantize_int8(weight)
        torch_y = quant.int8_linear(x, w8)
        torch_ref = x.double() @ quant.dequantize_int8(w8.qweight, w8.scales).double().T
    return {
        "op": _rel(group_linear(x, groups, op.isa), ref),  # the op itself, whatever Linear's row limit
        "torch": _rel(torch_y, torch_ref),
        "int8_x": _rel(_rounded(x, 127) @ deq.T, ref),
        "bf16_x": _rel(x.bfloat16().double() @ deq.T, ref),
        "outlier": float((x.abs().amax(-1) / x.pow(2).mean(-1).sqrt()).mean()),
    }


@torch.inference_mode()
def measure_layers(ids: list[int], rows: int, layers: int | None) -> dict[str, dict[str, float]]:
    """{kind: {method_mean, method_worst, ...}} over the first `layers` decoder layers (all when None) and the head."""
    from transformers import AutoModelForCausalLM

    from runtime.model.loader import resolve_model

    model = AutoModelForCausalLM.from_pretrained(str(resolve_model("smollm2")), dtype=torch.float32).eval()
    inputs: dict[str, torch.Tensor] = {}
    hooks = []
    for name, module in model.named_modules():
        keep = layers is None or name == "lm_head" or any(name.startswith(f"model.layers.{i}.") for i in range(layers))
        if isinstance(module, torch.nn.Linear) and keep:
            hooks.append(module.register_forward_hook(lambda m, a, o, name=name: inputs.__setitem__(name, a[0][0])))
    model(torch.tensor([ids]))
    for hook in hooks:
        hook.remove()
    per_kind: dict[str, list[dict[str, float]]] = {kind: [] for kind in KINDS}
    for name, x in inputs.items():
        weight = model.get_submodule(name).weight.detach().float()
        scheme = "int8" if name == "lm_head" else "int4"  # Linear's head is int8 under int4 (models/decoder.py)
        per_kind[name.rsplit(".", 1)[-1]].append(layer_errors(weight, x[:rows].float().contiguous(), scheme))
    out = {}
    for kind, errs in per_kind.items():
        summary = {f"{key}_mean": statistics.mean(e[key] for e in errs) for key in errs[0]}
        summary |= {f"{key}_worst": max(e[key] for e in errs) for key in ("op", "torch", "int8_x")}
        out[kind] = {k: float(f"{v:.3g}") for k, v in summary.items()}
    return out


def measure_agreement(passages: list[list[int]], dtypes: list[str]) -> dict[str, dict[str, float]]:
    """{dtype: {torch_kernels, qgemv: top-1 agreement with transformers' float32, positions}} (module docstring)."""
    from tests.runtime.model.agreement import compare, transformers_logits
    from tests.runtime.model.step_logits import teacher_forced_logits

    float32 = torch.cat([logits[:-1] for logits in transformers_logits(passages, torch.float32)])
    blocks = 8 + sum(len(p) // 16 + 1 for p in passages)
    enabled = cpu_qgemv.ENABLED
    out: dict[str, dict[str, float]] = {}
    try:
        for dtype in dtypes:
            out[dtype] = {"positions": int(float32.shape[0])}
            for label, on in (("torch_kernels", False), ("qgemv", True)):
                cpu_qgemv.ENABLED = on
                runner = ModelRunner(ServerArgs(model="smollm2", num_blocks=blocks, dtype=dtype, quantization="int4"))
                assert (runner.model.lm_head.kernel == "qgemv") == on, "the op must be on exactly when asked"
                mine = torch.cat([teacher_forced_logits(runner, [p])[0] for p in passages])
                out[dtype][label] = round(compare(float32, mine).agreement, 4)
                print(f"{dtype} {label}: top-1 agreement {out[dtype][label]}", flush=True)
                del runner
    finally:
        cpu_qgemv.ENABLED = enabled
    return out


def main(argv: list[str] | None = None) -> dict:
    """Measure (module docstring), print and write the JSON; returns it."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--rows", type=int, default=4, help="positions per linear in the per-layer errors")
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"], choices=["bfloat16", "float32"])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    from transformers import AutoTokenizer

    from runtime.model.loader import resolve_model
    from tests.runtime.model.test_quant_agreement import PASSAGES

    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model("smollm2")))
    passages = [list(tokenizer(p)["input_ids"]) for p in PASSAGES]
    if args.smoke:
        passages = [passages[0][:12]]
    cpu_qgemv.ENABLED = True
    if cpu_qgemv.load_op() is None:
        raise SystemExit("the qgemv op could not be built (see the warning above)")
    result = {"machine": machine_facts()}
    result["layers"] = measure_layers(passages[0], args.rows, 2 if args.smoke else None)
    print(json.dumps(result["layers"]), flush=True)
    result["agreement"] = measure_agreement(passages, args.dtypes[:1] if args.smoke else args.dtypes)
    write_result(result, args.out, args.smoke, RESULTS)
    print(json.dumps(result["agreement"]))
    return result


if __name__ == "__main__":
    main()
