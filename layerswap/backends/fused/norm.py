"""The ``fused`` backend's norm: PyTorch's one-kernel ``F.rms_norm`` / ``F.layer_norm``,
in the casts the original makes (every kind of :data:`~layerswap.norms.KINDS`)."""

from __future__ import annotations

from layerswap.backends.norm import NormReplacement
from layerswap.norms import KINDS

__all__ = ["FusedNorm"]


class FusedNorm(NormReplacement):
    """A model's own norm computed by ``F.rms_norm`` / ``F.layer_norm``."""

    backend = "fused"
    kernels = KINDS
