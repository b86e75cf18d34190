"""GGUF files read into Hugging Face tensors: every supported quant type dequantized by gguf-py, names mapped per
architecture, and the folder the loader caches (runtime.model.loader.convert_gguf calls write_hf_folder once per file,
given the architectures it serves).

The reading follows transformers' own GGUF loading (transformers/modeling_gguf_pytorch_utils.py, load_gguf_checkpoint)
and reuses its parts: the config comes from transformers' GGUF metadata mapping (AutoConfig with gguf_file), tensor
names from gguf-py's per-architecture tensor maps through transformers' get_gguf_hf_weights_map (run on a model built
on the meta device, so no weight is allocated), and transformers' per-architecture tensor processors undo what
llama.cpp's converter changed (Llama's q/k row permutation for rotary halves, Gemma's norm weights stored as 1 + w).
What it adds: a tensor's values come from gguf.quants.dequantize once, without building the transformers model, and
each tensor's GGUF type is kept (GGUF_TYPES_FILE), from which `--quantization auto` picks each linear's scheme
(runtime.model.quant_plan).

torch and transformers are imported inside the functions: the loader imports this module only to convert.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Collection
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from runtime.model.errors import CorruptModelError, UnsupportedModelError

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig

logger = logging.getLogger(__name__)

# GGML tensor types read here (gguf-py's GGMLQuantizationType names): the float types and the block quantizations
# llama.cpp's usual files use (a "Q4_K_M" file mixes Q4_K, Q5_0, Q6_K and Q8_0 with F32 norms).
SUPPORTED_GGUF_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
GGUF_TYPES_FILE = "gguf_types.json"  # {Hugging Face tensor name: GGUF type name} beside the converted weights
# gguf-py names Gemma 3's architecture "gemma3"; transformers' text-only config is "gemma3_text" (as in
# get_gguf_hf_weights_map, which maps the other names this way too).
_GGUF_ARCH_OF_MODEL_TYPE = {"gemma3_text": "gemma3", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe"}


class GGUFCheckpoint(NamedTuple):
    """A GGUF file read as Hugging Face tensors.

    config: transformers' config for the file; architecture: the transformers causal-LM class name (e.g.
    "Gemma3ForCausalLM"); tensors: float32 tensors keyed by Hugging Face names (a tied head is absent);
    types: the GGUF type name each of those tensors was stored in.
    """

    config: PretrainedConfig
    architecture: str
    tensors: dict[str, torch.Tensor]
    types: dict[str, str]


def _reader(gguf_path: Path) -> Any:
    from gguf import GGUFReader

    try:
        return GGUFReader(gguf_path)
    except Exception as e:  # gguf-py raises ValueError, struct / numpy errors on truncated or foreign files
        raise CorruptModelError(f"{gguf_path} cannot be read as GGUF: {type(e).__name__}: {e}") from e


def check_types(gguf_path: Path, reader: Any) -> None:
    """Raise UnsupportedModelError naming the file's tensor types outside SUPPORTED_GGUF_TYPES (and listing those)."""
    unsupported = sorted({t.tensor_type.name for t in reader.tensors} - set(SUPPORTED_GGUF_TYPES))
    if unsupported:
        raise UnsupportedModelError(
            f"{gguf_path}: GGUF tensor type(s) {unsupported} are not supported; supported: {list(SUPPORTED_GGUF_TYPES)}"
        )


def _config(gguf_path: Path) -> PretrainedConfig:
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    except Exception as e:  # transformers raises ValueError, KeyError... on files it cannot map
        if "not supported" in str(e) or "architecture" in str(e).lower():
            raise UnsupportedModelError(f"{gguf_path}: transformers cannot read it: {e}") from e
        raise CorruptModelError(f"{gguf_path} cannot be read as GGUF: {type(e).__name__}: {e}") from e


def causal_lm_class(config: PretrainedConfig, gguf_path: Path) -> str:
    """transformers' causal-LM class name for config's model_type; UnsupportedModelError when it has none."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type)
    if name is None:
        raise UnsupportedModelError(f"{gguf_path}: model type {config.model_type!r} is not a causal LM")
    return name


def read_gguf(gguf_path: Path, architectures: Collection[str] | None = None) -> GGUFCheckpoint:
    """Read every tensor of a GGUF file, dequantized to float32, under its Hugging Face name.

    architectures: when given, the causal-LM class names accepted (checked before any tensor is dequantized).
    Raises:
        CorruptModelError: the file cannot be parsed, or a tensor the architecture needs is missing.
        UnsupportedModelError: a tensor type outside SUPPORTED_GGUF_TYPES, an architecture transformers cannot read
            from GGUF, or one outside `architectures`.
    """
    import numpy as np
    import torch
    from gguf import dequantize
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS,
        TensorProcessor,
        get_gguf_hf_weights_map,
    )

    gguf_path = Path(gguf_path)
    reader = _reader(gguf_path)
    check_types(gguf_path, reader)
    config = _config(gguf_path)
    architecture = causal_lm_class(config, gguf_path)
    if architectures is not None and architecture not in architectures:
        raise UnsupportedModelError(
            f"{gguf_path}: architecture {architecture!r} is not supported; supported: {sorted(architectures)}"
        )
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    config_dict = config.to_dict()
    gguf_arch = _GGUF_ARCH_OF_MODEL_TYPE.get(config.model_type, config.model_type)
    processor = TENSOR_PROCESSORS.get(gguf_arch, TensorProcessor)(config=config_dict)
    names = get_gguf_hf_weights_map(skeleton, processor)
    parsed: dict[str, Any] = {"config": config_dict, "tensors": {}}
    types: dict[str, str] = {}
    for tensor in reader.tensors:
        values = dequantize(tensor.data, tensor.tensor_type)
        result = processor.process(weights=values, name=tensor.name, tensor_key_mapping=names, parsed_parameters=parsed)
        if tensor.name in names:
            types[names[tensor.name]] = tensor.tensor_type.name
        if result.name not in names:
            continue  # a tensor the model does not use (e.g. rope frequencies), or one the processor placed itself
        parsed["tensors"][names[result.name]] = torch.from_numpy(np.array(result.weights, dtype=np.float32))
    tensors: dict[str, torch.Tensor] = parsed["tensors"]
    tied = bool(getattr(config, "tie_word_embeddings", False))
    missing = sorted(set(skeleton.state_dict()) - set(tensors) - ({"lm_head.weight"} if tied else set()))
    if missing:
        raise CorruptModelError(f"{gguf_path}: no GGUF tensor for {missing[:8]} ({len(missing)} missing)")
    return GGUFCheckpoint(config, architecture, tensors, types)


def write_hf_folder(gguf_path: Path, out: Path, architectures: Collection[str]) -> None:
    """Write gguf_path as a Hugging Face folder into out: model.safetensors (float32), config.json, the tokenizer
    files, GGUF_TYPES_FILE and source.json.

    Raises:
        CorruptModelError / UnsupportedModelError: as read_gguf with architectures; CorruptModelError
            also when no tokenizer can be built from the file.
    """
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    gguf_path = Path(gguf_path)
    checkpoint = read_gguf(gguf_path, architectures)
    config = checkpoint.config.to_dict()
    config.pop("quantization_config", None)
    config["architectures"] = [checkpoint.architecture]
    config["dtype"] = "float32"
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    except Exception as e:  # transformers raises ValueError, KeyError... on a file without a usable vocabulary
        raise CorruptModelError(f"{gguf_path}: no tokenizer can be built from it: {type(e).__name__}: {e}") from e
    tensors = {name: t.contiguous() for name, t in checkpoint.tensors.items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    (out / GGUF_TYPES_FILE).write_text(json.dumps(checkpoint.types, indent=2, sort_keys=True))
    tokenizer.save_pretrained(str(out))
    (out / "source.json").write_text(json.dumps({"gguf": str(gguf_path)}))
