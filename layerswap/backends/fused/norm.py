"""The ``fused`` backend's norm: PyTorch's one-kernel ``F.rms_norm`` / ``F.layer_norm``,
in the casts the original makes (every kind of :data:`~layerswap.norms.KINDS`, and the
grouped ones, :data:`~layerswap.norms.GROUPED_KINDS`, as one ``F.rms_norm`` over the groups)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import ClassVar

from torch import Tensor

from layerswap.backends.norm import NormReplacement
from layerswap.norms import GROUPED_KINDS, KINDS

__all__ = ["FusedNorm"]


class FusedNorm(NormReplacement):
    """A model's own norm computed by ``F.rms_norm`` / ``F.layer_norm``."""

    backend = "fused"
    kernels: ClassVar[Mapping[str, Callable[..., Tensor]]] = {**KINDS, **GROUPED_KINDS}
