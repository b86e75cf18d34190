"""Which weight-only scheme each linear runs: `--quantization` (ServerArgs.quantization) resolved per linear.

"none", "int8" and "int4" give every linear that scheme (runtime.model.quant.Linear; the head never goes below int8:
an int4 head loses top-1 agreement, runtime/model/models/llama.py). "auto", the default, keeps at least the precision
the checkpoint stored each weight in, on the fast path of steps of few rows: a GGUF tensor stored in 4 bits (Q4_0,
Q4_1, Q4_K) runs int4, one stored in 5 to 8 bits (Q5_0, Q5_1, Q5_K, Q6_K, Q8_0) int8 (Q4_K too where the qgemv op
is not built: see GGUF_TYPE_SCHEME), a float one (F32, F16, BF16) and every weight of a float checkpoint
(safetensors) none. A fused linear (q/k/v, gate/up) takes the most precise
scheme of its parts. The GGUF types come from the converted folder (runtime.model.gguf_convert.GGUF_TYPES_FILE). On a
device other than the CPU (no weight-only kernel there) "auto" is "none".
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path

import torch

from runtime.model.gguf_convert import GGUF_TYPES_FILE
from runtime.model.quant import QUANTIZATIONS, Linear

logger = logging.getLogger(__name__)

AUTO = "auto"
CHOICES: tuple[str, ...] = (AUTO, *QUANTIZATIONS)
# The scheme that keeps a GGUF type's precision: 4-bit types int4, 5-8-bit types int8, float types none. Q4_K runs
# int8 (FALLBACK_SCHEME): the qgemv op would store its groups on their own grid (runtime.model.quant_groups), but the op
# serves only steps of few rows (QGEMV_MAX_ROWS) and above them torch's int4 path re-quantizes each group by its min
# and max, which lands on Q4_K's grid only when the group's codes reach 0 and 15: measured agreement said int8 (README,
# "GGUF types").
GGUF_TYPE_SCHEME: dict[str, str] = {
    "Q4_0": "int4",
    "Q4_1": "int4",
    "Q4_K": "int4",
    "Q5_0": "int8",
    "Q5_1": "int8",
    "Q5_K": "int8",
    "Q6_K": "int8",
    "Q8_0": "int8",
    "F32": "none",
    "F16": "none",
    "BF16": "none",
}
FALLBACK_SCHEME: dict[str, str] = {"Q4_K": "int8"}  # GGUF types run at more bits than they store
_PRECISION = {"int4": 0, "int8": 1, "none": 2}
# The weights a fused linear of runtime.model.models.decoder is built from, by its module name (Phi-3's checkpoint
# stores them fused already).
FUSED_PARTS = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj", "qkv_proj"),
    "gate_up_proj": ("gate_proj", "up_proj", "gate_up_proj"),
}
HEAD_WEIGHTS = ("lm_head.weight", "model.embed_tokens.weight")  # the head's weight: its own, or (tied) the embedding


class QuantPlan:
    """The scheme of each linear, by the Hugging Face names of the weights it is built from.

    quantization: one of CHOICES; source_types: {weight name: GGUF type name} (used by "auto"; a name absent from it
    was stored in floating point). Raises ValueError for a quantization outside CHOICES or a type outside
    GGUF_TYPE_SCHEME.
    """

    def __init__(self, quantization: str, source_types: Mapping[str, str] | None = None) -> None:
        if quantization not in CHOICES:
            raise ValueError(f"quantization {quantization!r}; supported: {list(CHOICES)}")
        unknown = sorted(set((source_types or {}).values()) - set(GGUF_TYPE_SCHEME))
        if unknown:
            raise ValueError(f"GGUF type(s) {unknown} have no scheme; known: {sorted(GGUF_TYPE_SCHEME)}")
        self.quantization = quantization
        self.source_types = dict(source_types or {})

    @classmethod
    def for_folder(cls, quantization: str, folder: Path, device_type: str = "cpu") -> QuantPlan:
        """The plan for a model folder: "auto" reads the folder's GGUF types (none for a float checkpoint) and is
        "none" on a device other than the CPU. Raises ValueError as the constructor."""
        if quantization != AUTO:
            return cls(quantization)
        if device_type != "cpu":
            return cls("none")
        path = Path(folder) / GGUF_TYPES_FILE
        types = json.loads(path.read_text()) if path.is_file() else {}
        return cls(AUTO, types)

    @property
    def uses_kernels(self) -> bool:
        """True when some linear may run a quantized kernel (CPU only)."""
        if self.quantization == AUTO:
            return any(GGUF_TYPE_SCHEME[t] != "none" for t in self.source_types.values())
        return self.quantization != "none"

    def scheme(self, *names: str) -> str:
        """The scheme ("none", "int8" or "int4") of the linear built from weights `names` (several when fused)."""
        if self.quantization != AUTO:
            return self.quantization
        schemes = [_type_scheme(self.source_types.get(n, "F32")) for n in names]
        return max(schemes, key=_PRECISION.__getitem__)

    def head_scheme(self, name: str) -> str:
        """The scheme of the output head built from weight `name` (the embedding's when tied): scheme(name), int8
        where that is int4."""
        scheme = self.scheme(name)
        return "int8" if scheme == "int4" else scheme

    def sources(self, module_name: str) -> list[str]:
        """The Hugging Face names of the stored weights the decoder's linear `module_name` (e.g.
        "layers.3.self_attn.qkv_proj") is built from: its fused parts, or itself."""
        prefix, _, leaf = f"model.{module_name}".rpartition(".")
        parts = FUSED_PARTS.get(leaf, (leaf,))
        return [n for n in (f"{prefix}.{p}.weight" for p in parts) if n in self.source_types]

    def apply(self, model: torch.nn.Module) -> None:
        """Give each Linear of a runtime.model.models.decoder.CausalLM built with "none" its scheme (Linear.set_scheme):
        the head by head_scheme of its own weight or, tied, the embedding's, every other by scheme of its sources (a
        linear without a stored GGUF type stays dense). Mutates the model's Linear modules."""
        for name, module in model.named_modules():
            if not isinstance(module, Linear):
                continue
            if name == "lm_head":
                head = HEAD_WEIGHTS[module.weight is getattr(model, "embed_weight", None)]
                scheme = self.head_scheme(head)
            else:
                stored = self.sources(name)
                scheme = self.scheme(*stored) if stored else "none"
            if scheme != module.scheme:
                module.set_scheme(scheme)

    def describe(self) -> str:
        """One line for the log: the choice and, under "auto", how many stored tensors map to each scheme."""
        if self.quantization != AUTO:
            return self.quantization
        counts: dict[str, int] = {}
        for t in self.source_types.values():
            counts[GGUF_TYPE_SCHEME[t]] = counts.get(GGUF_TYPE_SCHEME[t], 0) + 1
        return f"auto ({', '.join(f'{k}: {v} tensors' for k, v in sorted(counts.items())) or 'float checkpoint: none'})"


def _type_scheme(gguf_type: str) -> str:
    """FALLBACK_SCHEME[gguf_type] where it has one, else GGUF_TYPE_SCHEME[gguf_type]."""
    return FALLBACK_SCHEME.get(gguf_type, GGUF_TYPE_SCHEME[gguf_type])


NO_QUANTIZATION = QuantPlan("none")  # every linear dense (never mutated)
