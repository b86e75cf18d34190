"""Mistral (Jiang et al. 2023, "Mistral 7B"): Llama's layers with sliding-window attention on every layer.

A query at position p attends to the keys at p - sliding_window < k <= p (section 2 of the paper; transformers'
sliding-window mask). The window comes from the config (ModelConfig.layer_window); the layers are Llama's.
Every layer keeps its whole KV here (a block that falls out of every window is not released yet).
"""

from __future__ import annotations

from runtime.model.models.decoder import Family

MISTRAL = Family()
