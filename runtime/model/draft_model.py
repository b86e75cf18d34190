"""The draft model of speculative decoding (method "draft_model"): loading it beside the target and checking that
the two share a vocabulary.

The draft is any model the loader reads (a folder, a .gguf file or an embedded name), loaded with the target's dtype,
device and quantization setting, its rotary tables covering the target's max_model_len. Its proposals are token ids
the target verifies, so the two must index the same vocabulary: a different vocab_size is refused at load. Equal
sizes with a different tokenizer are not detected; they cost acceptance only (the target verifies every token).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from runtime.config import InvalidConfig, ServerArgs
from runtime.model.errors import ModelLoadError
from runtime.model.hf_config import ModelConfig
from runtime.model.loader import load_config, load_weights, resolve_model
from runtime.model.models import CausalLM, build_model
from runtime.model.quant_plan import QuantPlan


class DraftVocabMismatch(ModelLoadError):
    """The draft model's vocabulary size differs from the target's (the message names both sizes)."""


class DraftModel(NamedTuple):
    """A loaded draft model: model (called as model(input_ids, meta, k_cache, v_cache), as the target) and its
    ModelConfig (its KV layout: layers, KV heads, head_dim)."""

    model: CausalLM
    config: ModelConfig


def load_draft_model(
    name: str,
    args: ServerArgs,
    target: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    max_model_len: int,
    backend: str | None,
) -> DraftModel:
    """Load the draft model `name` (a folder, a .gguf file or an embedded name) for the target whose config is target:
    its weights in dtype on device, quantized as args.quantization asks for its own files, rotary tables covering
    max_model_len (tokens). Reads config.json before any weight, so a refusal is cheap.

    Raises:
        DraftVocabMismatch: the draft's vocab_size differs from the target's (both named).
        InvalidConfig: tensor_parallel_size > 1 (the draft runs unsharded beside a sharded target: not built). A
            sliding-window target keeps one KV cache group (runtime/model/hybrid_kv.py hybrid_layout).
        ModelLoadError subclasses, InvalidConfig: as resolve_model, load_config, load_weights and build_model raise.
    """
    if args.tensor_parallel_size > 1:
        raise InvalidConfig("speculative_config method 'draft_model' is not supported with tensor_parallel_size > 1")
    folder = resolve_model(name)
    cfg = load_config(folder)
    if cfg.vocab_size != target.vocab_size:
        raise DraftVocabMismatch(
            f"draft model {name!r} has vocab_size {cfg.vocab_size}, the target model has {target.vocab_size}: "
            "a draft model must share the target's vocabulary"
        )
    quantization = QuantPlan.for_folder(args.quantization, folder, device.type)
    weights = load_weights(folder, dtype, device)
    return DraftModel(build_model(cfg, weights, max_model_len, backend, quantization=quantization), cfg)
