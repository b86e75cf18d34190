"""The errors of model loading: one base class and what went wrong (missing, corrupt, unsupported). No torch."""

from __future__ import annotations


class ModelLoadError(Exception):
    """A model cannot be loaded. The message names the file and, where useful, lists what is supported."""


class ModelNotFoundError(ModelLoadError):
    """The model name, folder or file does not exist (or a required file inside it is missing)."""


class CorruptModelError(ModelLoadError):
    """A model file exists but cannot be parsed (bad JSON, truncated safetensors or GGUF)."""


class UnsupportedModelError(ModelLoadError):
    """The architecture (or a feature such as its rope scaling) is not implemented here."""
