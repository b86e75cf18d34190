"""Typed errors of kernels/."""

from __future__ import annotations


class KernelError(Exception):
    """Base class of every error raised by kernels/."""


class UnknownBackend(KernelError, ValueError):
    """The attention backend name is not "auto", "reference" or "triton"."""


class KernelInputError(KernelError, ValueError):
    """Tensors passed to a kernel have mismatched shapes, dtypes or devices, or a block id is out of range."""
