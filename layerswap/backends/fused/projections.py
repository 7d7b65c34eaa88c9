"""The ``fused`` backend's attention projections: each group an attention computes from one
input (q/k/v; MLA's q_a/kv_a) as one matrix product, in pure PyTorch.

One GEMM instead of two or three: one kernel launch and one read of the input where the
original had several, which is what decoding a token at a time is bound by on a GPU; in
training the weight and input gradients are one GEMM each too. The values are the same
products, computed by the same kind of kernel over a wider output.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from layerswap.backends.projections import ProjectionsReplacement

__all__ = ["FusedProjections"]


class FusedProjections(ProjectionsReplacement):
    """A model's own attention whose projections from one input are one product."""

    backend = "fused"
    kernels: ClassVar[Mapping[str, Any]] = {"packed": "torch.nn.functional.linear"}
