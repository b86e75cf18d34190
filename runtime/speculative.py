"""SpeculativeConfig: how a server speculates (vLLM's `--speculative-config` names), parsed once from its JSON text.
Pure Python, no torch.

    {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": a, "prompt_lookup_max": b}
    {"method": "draft_model", "model": M, "num_speculative_tokens": k}

Only "ngram" (prompt lookup: runtime/scheduler/ngram.py) is built; "draft_model" is refused
(InvalidSpeculativeConfig naming the method). disable_by_batch_size (vLLM's name): a step whose running sequences
number at least this many proposes nothing; None (the default): the measured rule decides per step
(runtime/scheduler/spec_gate.py: the verify step's cost at that batch size against the running acceptance).
"""

from __future__ import annotations

import msgspec

MAX_SPECULATIVE_TOKENS = 32  # drafts per sequence per step at most (a verify step runs k + 1 rows per sequence)


class InvalidSpeculativeConfig(ValueError):
    """The --speculative-config text is malformed or out of range; the message names the field (ServerArgs turns
    it into InvalidConfig)."""


class SpeculativeConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, frozen=True):
    """method: "ngram". num_speculative_tokens: drafts proposed per sequence per step, k in [1, 32].
    prompt_lookup_min / prompt_lookup_max: the shortest and longest suffix (tokens) the n-gram proposer looks up,
    1 <= min <= max. disable_by_batch_size: propose nothing in a step with at least this many running sequences
    (None: the measured rule of runtime/scheduler/spec_gate.py). model: the draft model (method "draft_model", not
    built)."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    disable_by_batch_size: int | None = None
    model: str | None = None


def parse_speculative_config(text: str | None) -> SpeculativeConfig | None:
    """The SpeculativeConfig of the JSON text of `--speculative-config` (None: no speculation).

    Raises InvalidSpeculativeConfig naming the field: malformed JSON, an unknown field, a wrong type, a value out
    of range, or a method other than "ngram" (the draft model is not built yet)."""
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
    if cfg.method == "draft_model":
        return "method 'draft_model' is not supported yet (use 'ngram')"
    if cfg.method != "ngram":
        return f"method must be 'ngram', got {cfg.method!r}"
    if not 1 <= cfg.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
        return f"num_speculative_tokens must be in [1, {MAX_SPECULATIVE_TOKENS}], got {cfg.num_speculative_tokens}"
    if cfg.prompt_lookup_min < 1:
        return f"prompt_lookup_min must be >= 1, got {cfg.prompt_lookup_min}"
    if cfg.prompt_lookup_max < cfg.prompt_lookup_min:
        return f"prompt_lookup_max must be >= prompt_lookup_min, got {cfg.prompt_lookup_max}"
    if cfg.disable_by_batch_size is not None and cfg.disable_by_batch_size < 1:
        return f"disable_by_batch_size must be None or >= 1, got {cfg.disable_by_batch_size}"
    return None
