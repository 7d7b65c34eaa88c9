"""The ``te`` backend's norm: TransformerEngine's RMSNorm kernel on a model's own RMS norms
(GPU only).

TransformerEngine's RMSNorm (``transformer_engine_torch.rmsnorm_fwd`` / ``rmsnorm_bwd``,
the kernels ``te.RMSNorm`` runs) reads the input and the weight in one dtype, computes in
float32 (``x * rsqrt(mean(x**2) + eps) * w``, or ``* (1 + w)`` with
``zero_centered_gamma``) and rounds once to the output dtype. That is, cast for cast:

- ``rms_float`` (normalised and scaled in float32, then cast: Qwen3-Next, OLMo 2): the
  kernel with the norm's weight;
- ``rms_offset`` (scaled by ``1 + w`` in float32, then cast: Gemma): the kernel with
  ``zero_centered_gamma``, which adds the 1 in float32 too;
- ``rms`` (normalised in float32, cast, then scaled by the weight in its own dtype:
  Llama) and ``rms_offset_cast`` (the same, by ``1 + w``): the kernel with a unit weight
  normalises and rounds to the input's dtype, and the weight is applied after it in the
  casts the kind makes (an elementwise product, as the original's).

A weight in another dtype than the input (a norm kept in float32 beside a bfloat16
stream) runs the kernel in float32 and rounds once at the end, which is the same number.
``rms_native`` (everything in the input's dtype, normalised in bfloat16 where the input
is) is not TE's computation and stays the original's, as do LayerNorms and grouped norms.
The result is the kind's to float32 rounding (TE's reduction order and ``rsqrtf``), as
every GPU kernel's is; it is proven against the original on a GPU only.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from layerswap.backends.norm import NormReplacement
from layerswap.backends.te import runtime
from layerswap.norms import NormFunction

__all__ = ["TENorm"]


@functools.cache
def _extension() -> tuple[Any, Mapping[torch.dtype, Any]]:
    """TransformerEngine's PyTorch extension and its dtype tags, or
    :class:`RequirementError` with the reason it cannot run here."""
    runtime._te()
    from transformer_engine.pytorch.constants import TE_DType

    # the extension module itself (what ``te.RMSNorm``'s forward and backward call)
    return importlib.import_module("transformer_engine_torch"), TE_DType


class _RMSNorm(torch.autograd.Function):
    """TE's RMSNorm kernel over the rows of a 2-D ``x``, its ``gamma`` in ``x``'s dtype."""

    @staticmethod
    def forward(
        ctx: Any, x: Tensor, gamma: Tensor, eps: float, zero_centered: bool, otype: torch.dtype
    ) -> Tensor:
        tex, te_dtype = _extension()
        out, _, rsigma = tex.rmsnorm_fwd(
            x, gamma, eps, None, None, te_dtype[otype], 0, zero_centered
        )
        ctx.save_for_backward(x, gamma, rsigma)
        ctx.zero_centered = zero_centered
        return out  # type: ignore[no-any-return]

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        tex, _ = _extension()
        x, gamma, rsigma = ctx.saved_tensors
        # TE's backward takes the output gradient in the weight's dtype
        dx, dgamma = tex.rmsnorm_bwd(
            grad.to(gamma.dtype).contiguous(), x, rsigma, gamma, 0, ctx.zero_centered
        )
        return dx, dgamma if ctx.needs_input_grad[1] else None, None, None, None


_UNIT: dict[tuple[int, torch.dtype, torch.device], Tensor] = {}


def _unit(width: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """A weight of ones (made once per width, dtype and device, outside inference mode so
    that it may be saved for a backward pass)."""
    key = (width, dtype, device)
    unit = _UNIT.get(key)
    if unit is None:
        with torch.inference_mode(False):
            unit = _UNIT[key] = torch.ones(width, dtype=dtype, device=device)
    return unit


def _te_rms(x: Tensor, w: Tensor | None, eps: float, zero_centered: bool) -> Tensor:
    """TE's RMSNorm of ``x`` over its last dimension, scaled by ``w`` (``1 + w`` where
    ``zero_centered``; no scale where ``w`` is ``None``), in ``x``'s dtype."""
    _extension()
    runtime.require_cuda(x, "TENorm")
    width = x.shape[-1]
    if x.numel() == 0:
        return x.new_empty(x.shape)
    if w is None:
        w, zero_centered = _unit(width, x.dtype, x.device), False
    rows = x.reshape(-1, width)
    if w.dtype == x.dtype:
        out = _RMSNorm.apply(rows.contiguous(), w, eps, zero_centered, x.dtype)  # type: ignore[no-untyped-call]
    else:
        # TE's kernels read the input and the weight in one dtype: float32 holds both
        # exactly, and its result rounds once, to the input's dtype, as the kind's does
        wide = _RMSNorm.apply(  # type: ignore[no-untyped-call]
            rows.float().contiguous(), w.float(), eps, zero_centered, torch.float32
        )
        out = wide.to(x.dtype)
    result: Tensor = out.view(x.shape)
    return result


def _scaled_in_float32(offset: bool) -> NormFunction:
    def kernel(x: Tensor, w: Tensor | None, b: Tensor | None, eps: float) -> Tensor:
        return _te_rms(x, w, eps, offset)

    return kernel


def _scaled_after(offset: bool) -> NormFunction:
    def kernel(x: Tensor, w: Tensor | None, b: Tensor | None, eps: float) -> Tensor:
        normed = _te_rms(x, None, eps, False)
        if w is None:
            return normed
        return normed * (1.0 + w) if offset else w * normed

    return kernel


#: the kinds TE's RMSNorm kernel computes, and how
_KERNELS: Mapping[str, NormFunction] = {
    "rms": _scaled_after(False),
    "rms_float": _scaled_in_float32(False),
    "rms_offset": _scaled_in_float32(True),
    "rms_offset_cast": _scaled_after(True),
}


class TENorm(NormReplacement):
    """A model's own RMS norm computed by TransformerEngine's RMSNorm kernel."""

    backend = "te"
    kernels = _KERNELS
