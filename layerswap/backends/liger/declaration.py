"""The ``liger`` backend, declared: Liger-Kernel's Triton kernels in layerswap's decoder
layer and head, GPU only; the families its layer expresses, and why not the others.

Its layers: :mod:`layerswap.backends.liger.decoder` and
:mod:`layerswap.backends.liger.head`; what it needs at run time:
:mod:`layerswap.backends.liger.runtime`.
"""

from __future__ import annotations

import functools

from layerswap.backend import Backend, Dependency, Implementation, Lazy
from layerswap.backends._answers import answered
from layerswap.backends.declarations.head_slot import head_slot
from layerswap.backends.declarations.norm_slot import (
    experts_slot,
    mlp_slot,
    norm_slot,
    rotary_slot,
)
from layerswap.backends.liger.runtime import unmet_requirement
from layerswap.capabilities import Capability, refusal
from layerswap.family import Family

__all__ = ["BACKEND", "EXPRESSES", "mlp_names", "qkv_names", "unsupported"]


# one reason for two fields
_PROJECTIONS = (
    # fused as the original fuses them (Phi-3's qkv_proj, gate_up_proj), or separate
    "the liger layer keeps q/k/v and the MLP as one or three projections "
    "(this family: {attention.qkv_modules}, {feed_forward.modules})"
)
_QK_NORMS = (
    "the liger layer's q/k norms are q_norm/k_norm before the rotary embedding "
    "(this family's: {qk_norms})"
)

#: what the liger layer computes one way only, in the order a family is checked: the first
#: row a family does not meet is the reason it is refused (:func:`unsupported`)
EXPRESSES: tuple[Capability, ...] = (
    Capability(
        "attention.sinks",
        expresses=(False,),
        reason="the liger layer's attention has no attention sinks (this family's self_attn.sinks)",
    ),
    Capability(
        "normalization.switch",
        expresses=(None,),
        reason="the liger layer uses Liger's RMSNorm kernel (this family's norm is a LayerNorm "
        "where {normalization.switch[0]} is unset)",
    ),
    Capability(
        "normalization.kind",
        expresses=("rms",),
        reason="the liger layer uses Liger's RMSNorm kernel (this family's norm is a LayerNorm)",
    ),
    Capability(
        "layer.parallel",
        expresses=(False,),
        reason="the liger layer runs attention, then the MLP (this family runs them in parallel)",
    ),
    Capability(
        "rope.layout",
        expresses=("half",),
        reason="Liger's RoPE kernel rotates halves of each head by the angle (this family's "
        "rotary layout is {rope.layout})",
    ),
    Capability(
        "rope.layers",
        expresses=("all",),
        reason="the liger layer applies Liger's RoPE kernel on every layer (this family skips "
        "it on some: {rope.layers})",
    ),
    Capability(
        "attention.qk_norm",
        refuses=("head_weights",),
        reason="the liger layer's q/k norms have one weight for all heads (this family's: one "
        "per head)",
    ),
    Capability(
        "attention.qk_norm_switch",
        expresses=(None,),
        reason="the liger layer's q/k norms are fixed per family (this family's follow "
        "{attention.qk_norm_switch})",
    ),
    Capability(
        "feed_forward.kind",
        refuses=("original",),
        reason="Liger's SwiGLU/GeGLU kernels compute dense gated MLPs; this family keeps the "
        "original's {feed_forward.module_class}, a mixture-of-experts block",
    ),
    Capability(
        "feed_forward.kind",
        expresses=("gated",),
        reason="Liger's SwiGLU/GeGLU kernels compute gated MLPs; this family's MLP is {feed_forward.kind!r}",
    ),
    Capability(
        "attention.qkv_modules", test=lambda names: len(names) in (1, 3), reason=_PROJECTIONS
    ),
    Capability(
        "feed_forward.modules", test=lambda names: len(names) in (2, 3), reason=_PROJECTIONS
    ),
    Capability(
        "normalization.scale",
        expresses=(True,),
        reason="Liger's RMSNorm kernel scales by a learned weight (this family's norms have none)",
    ),
    Capability("attention.qk_norm_after_rotary", expresses=(False,), reason=_QK_NORMS),
    Capability("attention.qk_norm_modules", expresses=(("q_norm", "k_norm"),), reason=_QK_NORMS),
    Capability(
        "attention.query_scale",
        expresses=(None,),
        reason="the liger layer does not scale queries by their position (this family's "
        "{attention.query_scale} attention temperature)",
    ),
    Capability(
        "attention.clip_qkv",
        expresses=(None,),
        reason="the liger layer does not clamp q, k and v (this family clamps them where "
        "{attention.clip_qkv} is set)",
    ),
)


@functools.cache
def unsupported(family: Family) -> str | None:
    """Why the ``liger`` layer cannot express ``family``, or ``None``.

    Every norm placement, q/k norms per head or across heads, the norm offset, biases,
    GQA, sliding windows (through the mask) and residual multipliers map onto the layer;
    what does not is :data:`EXPRESSES`. Judged on the family's default configuration (its
    tiny config); a config you bring is checked again when a layer is built.

    Example::

        liger.unsupported(layerswap.families()["gemma2"])   # "... soft-capping ..."
    """
    return refusal(EXPRESSES, family) or answered(
        "liger-decoder", family, "layerswap.backends.liger.decoder:tiny_config_problem"
    )


def qkv_names(family: Family) -> tuple[str, ...]:
    """The original's q/k/v projections: three, or one where it fuses them (Phi-3)."""
    return family.attention.qkv_modules


def mlp_names(family: Family) -> tuple[str, ...]:
    """The original's MLP projections: gate, up, down, or gate_up, down (Phi-3)."""
    return family.feed_forward.modules


#: the ``liger`` backend: its decoder layer (where :func:`unsupported` finds nothing) and head
BACKEND = Backend(
    name="liger",
    description="Liger-Kernel's Triton kernels inside layerswap's decoder layer and head",
    slots={
        "decoder": Implementation(
            replacement=Lazy("layerswap.backends.liger.decoder:layer_class"),
            converter=Lazy("layerswap.backends.liger.decoder:converter_for"),
            supports=unsupported,
            description=(
                "Liger-Kernel's Triton kernels, GPU only: RMSNorm, SwiGLU/GeGLU and RoPE in "
                "the original's modules and weights, scaled_dot_product_attention with GQA"
            ),
        ),
        "head": head_slot(
            "layerswap.backends.liger.head",
            "Liger",
            description=(
                "Liger-Kernel, GPU only: in training, Liger's fused linear cross-entropy "
                "(never the full logits; logits None)"
            ),
            upstream=Lazy("layerswap.backends.liger.head:check_liger_head"),
        ),
        "norm": norm_slot(
            "layerswap.backends.liger.norm:LigerNorm",
            description=(
                "Liger-Kernel, GPU only: each RMS norm the model's classes compute as Liger's "
                "RMSNorm kernel, in its casting mode and offset"
            ),
        ),
        "mlp": mlp_slot(
            "layerswap.backends.liger.mlp:LigerMLP",
            description=(
                "Liger-Kernel, GPU only: each SiLU- or tanh-GELU-gated MLP the model's "
                "classes compute, act(gate) * up as Liger's SwiGLU / GeGLU kernel"
            ),
        ),
        "experts": experts_slot(
            "layerswap.backends.liger.experts:LigerExperts",
            description=(
                "Liger-Kernel, GPU only: each SiLU-gated experts module of a mixture-of-experts "
                "block as Liger's fused MoE kernel (what Liger's LigerExperts runs)"
            ),
        ),
        "rotary": rotary_slot(
            "layerswap.backends.liger.rotary:LigerRotary",
            description=(
                "Liger-Kernel, GPU only: each attention's rotate-half rotary application of q "
                "and k as Liger's RoPE kernel (what Liger's patch binds)"
            ),
        ),
    },
    requirement=unmet_requirement,
    devices=("cuda",),
    tensor_parallel=(
        "the liger layers split their packed projections per rank as the fused ones do, "
        "but have not run sharded on a GPU yet"
    ),
    dependencies=(
        Dependency(
            label="Liger-Kernel",
            module="liger_kernel",
            distribution="liger-kernel",
            install="pip install 'layerswap[liger]' on a CUDA machine",
        ),
    ),
)
