"""SpeculativeConfig: how a server speculates (vLLM's `--speculative-config` names), parsed once from its JSON text.
Pure Python, no torch.

    {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": a, "prompt_lookup_max": b}
    {"method": "draft_model", "model": M, "num_speculative_tokens": k}

"ngram": prompt lookup (runtime/scheduler/ngram.py), the scheduler proposes the draft. "draft_model": a smaller model
M (a folder, a .gguf file or an embedded name, with the target's vocabulary) runs in the worker beside the target and
proposes k tokens greedily (runtime/model/draft_runner.py); the scheduler only reserves the k slots
(runtime/scheduler/draft_slots.py). disable_by_batch_size (vLLM's name): a step whose running sequences number at
least this many proposes nothing; None (the default): the measured rule decides per step
(runtime/scheduler/spec_gate.py: the verify step's cost at that batch size against the running acceptance).
"""

from __future__ import annotations

import msgspec

MAX_SPECULATIVE_TOKENS = 32  # drafts per sequence per step at most (a verify step runs k + 1 rows per sequence)


class InvalidSpeculativeConfig(ValueError):
    """The --speculative-config text is malformed or out of range; the message names the field (ServerArgs turns
    it into InvalidConfig)."""


class SpeculativeConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, frozen=True):
    """method: "ngram" or "draft_model". num_speculative_tokens: drafts proposed per sequence per step, k in [1, 32].
    prompt_lookup_min / prompt_lookup_max: the shortest and longest suffix (tokens) the n-gram proposer looks up,
    1 <= min <= max. disable_by_batch_size: propose nothing in a step with at least this many running sequences
    (None: the measured rule of runtime/scheduler/spec_gate.py). model: the draft model (method "draft_model" only,
    where it is required)."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    disable_by_batch_size: int | None = None
    model: str | None = None


def parse_speculative_config(text: str | None) -> SpeculativeConfig | None:
    """The SpeculativeConfig of the JSON text of `--speculative-config` (None: no speculation).

    Raises InvalidSpeculativeConfig naming the field: malformed JSON, an unknown field, a wrong type, a value out
    of range, a method other than "ngram" / "draft_model", "draft_model" without a model or "ngram" with one."""
    if text is None:
        return None
    try:
        cfg = msgspec.json.decode(text, type=SpeculativeConfig)
    except msgspec.DecodeError as e:  # ValidationError is a DecodeError: both name the field
        raise InvalidSpeculativeConfig(f"speculative_config: {e}") from e
    problem = _problem(cfg)
    if problem is not None:
        raise InvalidSpeculativeConfig(f"speculative_config: {problem}")
    return cfg


def _problem(cfg: SpeculativeConfig) -> str | None:
    if cfg.method not in ("ngram", "draft_model"):
        return f"method must be 'ngram' or 'draft_model', got {cfg.method!r}"
    if cfg.method == "draft_model" and not cfg.model:
        return "model is required with method 'draft_model' (the draft model's folder, .gguf file or name)"
    if cfg.method == "ngram" and cfg.model is not None:
        return "model is only used with method 'draft_model'"
    if not 1 <= cfg.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
        return f"num_speculative_tokens must be in [1, {MAX_SPECULATIVE_TOKENS}], got {cfg.num_speculative_tokens}"
    if cfg.prompt_lookup_min < 1:
        return f"prompt_lookup_min must be >= 1, got {cfg.prompt_lookup_min}"
    if cfg.prompt_lookup_max < cfg.prompt_lookup_min:
        return f"prompt_lookup_max must be >= prompt_lookup_min, got {cfg.prompt_lookup_max}"
    if cfg.disable_by_batch_size is not None and cfg.disable_by_batch_size < 1:
        return f"disable_by_batch_size must be None or >= 1, got {cfg.disable_by_batch_size}"
    return None
