"""WeightSource: a checkpoint's tensors by their Hugging Face names, each taken once as the model is built."""

from __future__ import annotations

import torch

from runtime.model.errors import CorruptModelError


def frozen(t: torch.Tensor) -> torch.nn.Parameter:
    """t as a parameter without gradient (the models here only run inference)."""
    return torch.nn.Parameter(t, requires_grad=False)


class WeightSource:
    """Hugging Face tensors by name; take() removes what it returns so the weights are held once."""

    def __init__(self, weights: dict[str, torch.Tensor]) -> None:
        self.weights = weights

    def take(self, name: str) -> torch.Tensor:
        """Remove and return tensor `name`; raises CorruptModelError when the checkpoint lacks it."""
        if name not in self.weights:
            raise CorruptModelError(f"the checkpoint has no tensor {name!r}")
        return self.weights.pop(name)

    def take_optional(self, name: str) -> torch.Tensor | None:
        """Remove and return tensor `name`, or None when absent."""
        return self.weights.pop(name, None)
