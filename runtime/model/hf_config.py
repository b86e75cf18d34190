"""ModelConfig: the fields of a Hugging Face config.json that the decoder families use, read without torch.

Each family writes its attention layout its own way; load_config reads them all into one form: layer_types (one
"full_attention" or "sliding_attention" per layer) and sliding_window (tokens). Llama has no window; Mistral and
Phi-3 apply their sliding_window to every layer; Qwen2 / Qwen3 only with use_sliding_window (layers from
max_window_layers on, unless layer_types says otherwise); Gemma 3 interleaves local and global layers (layer_types,
or the older sliding_window_pattern: every pattern-th layer global). Rope parameters come in transformers 5's
rope_parameters (per layer type for Gemma 3) or the older rope_theta / rope_scaling / rope_local_base_freq keys.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from runtime.model.errors import CorruptModelError, ModelNotFoundError, UnsupportedModelError

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "MistralForCausalLM",
    "Qwen3ForCausalLM",
    "Phi3ForCausalLM",
    "Gemma3ForCausalLM",
)
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope")
SUPPORTED_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
_GEMMA3 = "Gemma3ForCausalLM"
_GEMMA3_PATTERN = 6  # transformers' default sliding_window_pattern: 5 local layers, then a global one


@dataclass(frozen=True)
class ModelConfig:
    """The fields of a decoder config.json that the model uses (sizes in elements, lengths in tokens).

    rope_type is one of SUPPORTED_ROPE_TYPES; rope_scaling holds that type's parameters as in the Hugging Face
    config (llama3: factor, low_freq_factor, high_freq_factor, original_max_position_embeddings; longrope:
    short_factor, long_factor, original_max_position_embeddings, max_position_embeddings, optional factor and
    attention_factor). The global layers use them; local_rope_theta, when set (Gemma 3), is the base of the sliding
    layers' plain rope. partial_rotary_factor: the fraction of head_dim that is rotated (Phi-4-mini: 0.75).
    layer_types: FULL_ATTENTION or SLIDING_ATTENTION per layer; sliding_window: tokens a query sees on a sliding layer
    (itself included), None when no layer slides. query_pre_attn_scalar: attention scale is its -1/2 power (None:
    head_dim's). final_logit_softcapping: logits = cap * tanh(logits / cap) when set. hidden_act: the GLU's
    activation, one of SUPPORTED_ACTIVATIONS.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_type: str
    rope_scaling: dict[str, Any]
    max_position_embeddings: int
    tie_word_embeddings: bool
    eos_token_ids: list[int] = field(default_factory=list)
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None
    local_rope_theta: float | None = None
    partial_rotary_factor: float = 1.0
    query_pre_attn_scalar: float | None = None
    final_logit_softcapping: float | None = None
    hidden_act: str = "silu"

    def layer_window(self, layer: int) -> int | None:
        """The sliding window (tokens) of layer `layer`, or None for a full-attention layer."""
        if self.layer_types and self.layer_types[layer] == SLIDING_ATTENTION:
            return self.sliding_window
        return None


def read_json(path: Path) -> dict[str, Any]:
    """The JSON object in path. Raises ModelNotFoundError (no file) or CorruptModelError (not JSON)."""
    try:
        return json.loads(path.read_text())
    except FileNotFoundError as e:
        raise ModelNotFoundError(f"{path} is missing") from e
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CorruptModelError(f"{path} is not valid JSON: {e}") from e


def load_config(folder: Path) -> ModelConfig:
    """Read folder/config.json (and generation_config.json for EOS ids) into a ModelConfig. No torch.

    Raises:
        ModelNotFoundError / CorruptModelError: config.json missing or not JSON.
        UnsupportedModelError: an architecture outside SUPPORTED_ARCHITECTURES, an unsupported rope type or
            activation, or a feature the kernels lack (attention logit softcapping, bidirectional attention).
    """
    path = Path(folder) / "config.json"
    raw = read_json(path)
    arch = (raw.get("architectures") or [""])[0]
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"{path}: architecture {arch!r} is not supported; supported architectures: {list(SUPPORTED_ARCHITECTURES)}"
        )
    _reject_unsupported_features(raw, path)
    heads = int(raw["num_attention_heads"])
    max_pos = int(raw.get("max_position_embeddings", 2048))
    global_rope, local_rope = _rope_sections(raw)
    theta, rope_type, rope_scaling = _rope_params(global_rope, raw, arch, max_pos, path)
    layers = int(raw["num_hidden_layers"])
    layer_types, window = _attention_layout(raw, arch, layers)
    return ModelConfig(
        architecture=arch,
        vocab_size=int(raw["vocab_size"]),
        hidden_size=int(raw["hidden_size"]),
        intermediate_size=int(raw["intermediate_size"]),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=int(raw.get("head_dim") or int(raw["hidden_size"]) // heads),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_type=rope_type,
        rope_scaling=rope_scaling,
        max_position_embeddings=max_pos,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", arch == _GEMMA3)),
        eos_token_ids=_eos_ids(raw, Path(folder)),
        layer_types=layer_types,
        sliding_window=window,
        local_rope_theta=_local_theta(local_rope, raw, path) if arch == _GEMMA3 else None,
        partial_rotary_factor=float(global_rope.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))),
        query_pre_attn_scalar=_optional_float(raw, "query_pre_attn_scalar", 256.0 if arch == _GEMMA3 else None),
        final_logit_softcapping=_optional_float(raw, "final_logit_softcapping", None),
        hidden_act=_activation(raw, arch, path),
    )


def _reject_unsupported_features(raw: dict[str, Any], path: Path) -> None:
    if raw.get("attn_logit_softcapping") is not None:
        raise UnsupportedModelError(f"{path}: attention logit softcapping is not supported (Gemma 2); Gemma 3 is")
    if raw.get("use_bidirectional_attention"):
        raise UnsupportedModelError(f"{path}: bidirectional attention (an embedding model) is not supported")


def _optional_float(raw: dict[str, Any], key: str, default: float | None) -> float | None:
    value = raw.get(key, default)
    return None if value is None else float(value)


def _activation(raw: dict[str, Any], arch: str, path: Path) -> str:
    default = "gelu_pytorch_tanh" if arch == _GEMMA3 else "silu"
    act = raw.get("hidden_activation") or raw.get("hidden_act") or default
    if act not in SUPPORTED_ACTIVATIONS:
        raise UnsupportedModelError(f"{path}: activation {act!r} is not supported; supported: {SUPPORTED_ACTIVATIONS}")
    return str(act)


def _rope_sections(raw: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the global layers' rope parameters, the sliding layers' ones), rope_scaling and rope_parameters merged;
    the second is empty unless the config has one per layer type (Gemma 3)."""
    params = dict(raw.get("rope_parameters") or {})
    scaling = dict(raw.get("rope_scaling") or {})
    if FULL_ATTENTION in params or SLIDING_ATTENTION in params:
        return {**scaling, **(params.get(FULL_ATTENTION) or {})}, dict(params.get(SLIDING_ATTENTION) or {})
    return {**scaling, **params}, {}


def _rope_params(
    merged: dict[str, Any], raw: dict[str, Any], arch: str, max_pos: int, path: Path
) -> tuple[float, str, dict[str, Any]]:
    default_theta = 1_000_000.0 if arch == _GEMMA3 else 10_000.0
    theta = float(merged.get("rope_theta", raw.get("rope_theta", default_theta)))
    rope_type = merged.get("rope_type", merged.get("type", "default"))
    if arch == "Phi3ForCausalLM" and rope_type in ("su", "yarn"):
        rope_type = "longrope"  # Phi-3's older names of its LongRoPE scaling (transformers' Phi3Config does the same)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"{path}: rope type {rope_type!r} is not supported; supported: {list(SUPPORTED_ROPE_TYPES)}"
        )
    if rope_type == "longrope":
        original = merged.get("original_max_position_embeddings", raw.get("original_max_position_embeddings"))
        if original is None or "short_factor" not in merged or "long_factor" not in merged:
            raise CorruptModelError(
                f"{path}: longrope needs short_factor, long_factor and original_max_position_embeddings"
            )
        merged = {**merged, "original_max_position_embeddings": int(original), "max_position_embeddings": max_pos}
    return theta, rope_type, merged


def _local_theta(local: dict[str, Any], raw: dict[str, Any], path: Path) -> float:
    if local.get("rope_type", "default") != "default":
        raise UnsupportedModelError(f"{path}: the sliding layers' rope type {local['rope_type']!r} is not supported")
    return float(local.get("rope_theta", raw.get("rope_local_base_freq", 10_000.0)))


def _attention_layout(raw: dict[str, Any], arch: str, layers: int) -> tuple[tuple[str, ...], int | None]:
    """(layer type per layer, sliding window or None): see the module docstring for each family's keys."""
    window = raw.get("sliding_window", 4096 if arch == _GEMMA3 else None)  # transformers' Gemma 3 default
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") and not raw.get("use_sliding_window", False):
        window = None
    if arch == "LlamaForCausalLM" or window is None:
        return (FULL_ATTENTION,) * layers, None
    given = raw.get("layer_types")
    if arch in ("MistralForCausalLM", "Phi3ForCausalLM"):
        types = [SLIDING_ATTENTION] * layers
    elif given:
        types = list(given)
    elif arch == _GEMMA3:
        pattern = int(raw.get("sliding_window_pattern", _GEMMA3_PATTERN))
        types = [SLIDING_ATTENTION if (i + 1) % pattern else FULL_ATTENTION for i in range(layers)]
    else:  # Qwen2 / Qwen3 with use_sliding_window and no layer_types (transformers' rule)
        first = int(raw.get("max_window_layers", layers))
        types = [SLIDING_ATTENTION if i >= first else FULL_ATTENTION for i in range(layers)]
    if SLIDING_ATTENTION not in types:
        return tuple(types), None
    return tuple(types), int(window)


def _eos_ids(raw: dict[str, Any], folder: Path) -> list[int]:
    ids: list[int] = []
    sources = [raw]
    gen = folder / "generation_config.json"
    if gen.is_file():
        sources.append(read_json(gen))
    for source in sources:
        value = source.get("eos_token_id")
        for v in value if isinstance(value, list) else [value]:
            if isinstance(v, int) and v not in ids:
                ids.append(v)
    return ids
