"""The ``liger`` backend's MLP: Liger-Kernel's SwiGLU and GeGLU kernels, one Triton kernel
for ``act(gate) * up`` that keeps only the gate and up outputs for the backward pass (GPU
only). Liger's GeGLU applies GELU's tanh approximation: MLPs gated by exact GELU, ReLU or an
activation of their own stay the original's."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import ClassVar

from torch import Tensor

from layerswap.backends.mlp import MLPKernel, MLPReplacement

__all__ = ["LigerMLP"]


def _silu_mul(gate: Tensor, up: Tensor, act: Callable[[Tensor], Tensor]) -> Tensor:
    from liger_kernel.ops.swiglu import LigerSiLUMulFunction

    out: Tensor = LigerSiLUMulFunction.apply(gate, up)
    return out


def _gelu_mul(gate: Tensor, up: Tensor, act: Callable[[Tensor], Tensor]) -> Tensor:
    from liger_kernel.ops.geglu import LigerGELUMulFunction

    out: Tensor = LigerGELUMulFunction.apply(gate, up)
    return out


class LigerMLP(MLPReplacement):
    """A model's own gated MLP whose ``act(gate) * up`` is Liger's SwiGLU / GeGLU kernel."""

    backend = "liger"
    kernels: ClassVar[Mapping[str, MLPKernel]] = {"silu": _silu_mul, "gelu_tanh": _gelu_mul}
