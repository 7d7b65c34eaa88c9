"""Where and in what dtype the compared models run, and the working copy they run as.

Shared by :func:`layerswap.verify` and :func:`layerswap.bench`.
"""

from __future__ import annotations

import copy
from typing import TypeAlias

import torch
from torch import nn

from layerswap.errors import RequirementError
from layerswap.placement_guard import unguard

__all__ = [
    "DTYPE_CHOICES",
    "DTypeLike",
    "DeviceLike",
    "dtype_name",
    "model_placement",
    "resolve_device",
    "resolve_dtype",
    "target_placement",
    "working_copy",
]

DTypeLike: TypeAlias = "str | torch.dtype | None"
DeviceLike: TypeAlias = "str | torch.device | None"

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}

DTYPE_CHOICES = ("float32", "bfloat16", "float16")


def resolve_dtype(dtype: DTypeLike) -> torch.dtype | None:
    """The ``torch.dtype`` named by ``dtype`` (``"bfloat16"``, ``"bf16"``, ``torch.half``...).

    ``None`` stays ``None`` (keep the model's dtype). Unknown names raise ``ValueError``
    listing the accepted ones.

    Example::

        >>> resolve_dtype("bf16")
        torch.bfloat16
    """
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    key = str(dtype).strip().lower().removeprefix("torch.")
    if key not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPE_CHOICES)}")
    return _DTYPES[key]


def resolve_device(device: DeviceLike) -> torch.device | None:
    """The ``torch.device`` named by ``device``; ``"auto"`` is CUDA when present, else CPU.

    ``None`` stays ``None`` (keep the model's device). Asking for CUDA on a machine
    without it raises :class:`~layerswap.errors.RequirementError`.

    Example::

        >>> resolve_device("cpu")
        device(type='cpu')
    """
    if device is None:
        return None
    if isinstance(device, str) and device.strip().lower() == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    resolved = torch.device(device)
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise RequirementError(
            f"CUDA was requested but is not available (torch {torch.__version__})"
        )
    return resolved


def dtype_name(dtype: torch.dtype) -> str:
    """``"bfloat16"`` for ``torch.bfloat16``: the name reports and tables show."""
    return str(dtype).removeprefix("torch.")


def model_placement(model: nn.Module) -> tuple[torch.device, torch.dtype]:
    """The device and dtype of the model's first floating-point parameter."""
    for param in model.parameters():
        if param.is_floating_point():
            return param.device, param.dtype
    return torch.device("cpu"), torch.float32


def target_placement(
    model: nn.Module, device: DeviceLike, dtype: DTypeLike
) -> tuple[torch.device, torch.dtype]:
    """The device and dtype to run in: those asked for, else the model's own."""
    model_device, model_dtype = model_placement(model)
    return resolve_device(device) or model_device, resolve_dtype(dtype) or model_dtype


def working_copy(
    model: nn.Module, device: torch.device, dtype: torch.dtype, *, trainable: bool
) -> nn.Module:
    """A deep copy on ``device`` in ``dtype``; the caller's model is only read."""
    if any(p.device.type == "meta" for p in model.parameters()):
        raise ValueError("cannot verify a model on the meta device: it has no weights")
    work = copy.deepcopy(model)
    # compared with the original by the caller: not proven again where it is cast
    unguard(work)
    work.to(device=device, dtype=dtype)
    for param in work.parameters():
        param.grad = None
        if trainable and param.is_floating_point():
            param.requires_grad_(True)
    return work
