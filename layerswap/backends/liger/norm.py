"""The ``liger`` backend's norm: Liger-Kernel's RMSNorm kernel, in the casting mode and
with the offset of the kind a norm computes (GPU only).

Liger's ``LigerRMSNormFunction`` takes the casting mode ("llama": normalised in float32,
cast, then scaled; "gemma": all in float32; "none": the input's dtype) and an offset (1 for
``(1 + w)``), which together express every RMS kind of :data:`~layerswap.norms.KINDS`;
it runs out of place, so the residual stream that fed the norm stays as it was.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import Tensor

from layerswap.backends.norm import NormReplacement
from layerswap.norms import NormFunction

__all__ = ["LigerNorm"]


def _rms(casting_mode: str, offset: float) -> NormFunction:
    def kernel(x: Tensor, w: Tensor | None, b: Tensor | None, eps: float) -> Tensor:
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction

        out: Tensor = LigerRMSNormFunction.apply(x, w, eps, offset, casting_mode, False)
        return out

    return kernel


#: the kinds Liger's RMSNorm kernel computes, and how
_KERNELS: Mapping[str, NormFunction] = {
    "rms": _rms("llama", 0.0),
    "rms_float": _rms("gemma", 0.0),
    "rms_offset": _rms("gemma", 1.0),
    "rms_offset_cast": _rms("llama", 1.0),
    "rms_native": _rms("none", 0.0),
}


class LigerNorm(NormReplacement):
    """A model's own RMS norm computed by Liger-Kernel's Triton RMSNorm kernel."""

    backend = "liger"
    kernels = _KERNELS
