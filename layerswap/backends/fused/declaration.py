"""The ``fused`` backend, declared: pure PyTorch, every family, CPU and GPU.

Its layers: :mod:`layerswap.backends.fused.decoder` and
:mod:`layerswap.backends.fused.head`.
"""

from __future__ import annotations

from layerswap.backend import Backend, Implementation, Lazy
from layerswap.backends.declarations.head_slot import head_slot
from layerswap.backends.declarations.norm_slot import (
    experts_slot,
    mlp_slot,
    norm_slot,
    qkv_slot,
    rotary_slot,
)

__all__ = ["BACKEND"]

#: the ``fused`` backend: its decoder layer for every family, and its head
BACKEND = Backend(
    name="fused",
    description="pure PyTorch, CPU and GPU: fused projections, F.rms_norm, SDPA",
    slots={
        "decoder": Implementation(
            replacement=Lazy("layerswap.backends.fused.decoder:layer_class"),
            converter=Lazy("layerswap.backends.fused.decoder:converter_for"),
            description=(
                "pure PyTorch, CPU and GPU: fused QKV and gate/up projections, F.rms_norm, "
                "scaled_dot_product_attention with GQA"
            ),
        ),
        "head": head_slot(
            "layerswap.backends.fused.head",
            "Fused",
            description=(
                "pure PyTorch, CPU and GPU: in training, linear + cross-entropy chunk by chunk "
                "(never the full logits; logits None)"
            ),
        ),
        "norm": norm_slot(
            "layerswap.backends.fused.norm:FusedNorm",
            description=(
                "pure PyTorch, CPU and GPU: each norm the model's classes compute as one "
                "F.rms_norm / F.layer_norm kernel, in the original's casts"
            ),
        ),
        "mlp": mlp_slot(
            "layerswap.backends.fused.mlp:FusedMLP",
            description=(
                "pure PyTorch, CPU and GPU: each gated MLP the model's classes compute, its "
                "activation recomputed in the backward pass (one intermediate fewer kept)"
            ),
        ),
        "experts": experts_slot(
            "layerswap.backends.fused.experts:FusedExperts",
            description=(
                "pure PyTorch, CPU and GPU: each gated experts module of a mixture-of-experts "
                "block, its gate recomputed in the backward pass (one intermediate fewer kept)"
            ),
        ),
        "qkv": qkv_slot(
            "layerswap.backends.fused.projections:FusedProjections",
            description=(
                "pure PyTorch, CPU and GPU: each attention's projections from one input (q/k/v, "
                "MLA's q_a/kv_a) as one matrix product, the attention itself the original's"
            ),
        ),
        "rotary": rotary_slot(
            "layerswap.backends.fused.rotary:FusedRotary",
            description=(
                "pure PyTorch, CPU and GPU: each attention's rotate-half rotary application "
                "written into one output in place, bit for bit the original's"
            ),
        ),
    },
    # tests/test_parallel.py: tensor parallel and FSDP loading equal the original
    tensor_parallel=None,
)
