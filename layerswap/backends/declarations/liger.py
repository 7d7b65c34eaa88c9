"""The ``liger`` backend, declared: Liger-Kernel's Triton kernels in layerswap's decoder
layer and head, GPU only; the families its layer expresses, and why not the others.

Its layers: :mod:`layerswap.backends.liger` (decoder) and
:mod:`layerswap.backends.head_liger` (head); what it needs at run time:
:mod:`layerswap.backends.liger_runtime`.
"""

from __future__ import annotations

import functools

from layerswap.backend import Backend, Dependency, Implementation, Lazy
from layerswap.backends.declarations._answers import answered
from layerswap.backends.declarations.head_slot import head_slot
from layerswap.backends.liger_runtime import unmet_requirement
from layerswap.family import Family

__all__ = ["BACKEND", "mlp_names", "qkv_names", "unsupported"]


@functools.cache
def unsupported(family: Family) -> str | None:
    """Why the ``liger`` layer cannot express ``family``, or ``None``.

    Every norm placement, q/k norms per head or across heads, the norm offset, biases,
    GQA, sliding windows (through the mask) and residual multipliers map onto the layer.
    Judged on the family's default configuration (its tiny config); a config you bring is
    checked again when a layer is built.

    Example::

        liger.unsupported(layerswap.families()["gemma2"])   # "... soft-capping ..."
    """
    if getattr(family, "attention_sinks", False):
        return "the liger layer's attention has no attention sinks (this family's self_attn.sinks)"
    switch = getattr(family, "norm_switch", None)
    if switch is not None:
        return (
            "the liger layer uses Liger's RMSNorm kernel (this family's norm is a LayerNorm "
            f"where {switch[0]} is unset)"
        )
    if getattr(family, "norm", "rms") != "rms":
        return "the liger layer uses Liger's RMSNorm kernel (this family's norm is a LayerNorm)"
    if getattr(family, "parallel", False):
        return "the liger layer runs attention, then the MLP (this family runs them in parallel)"
    if getattr(family, "rotary", "half") != "half":
        return (
            "Liger's RoPE kernel rotates halves of each head by the angle (this family's "
            f"rotary layout is {getattr(family, 'rotary', None)})"
        )
    if family.rotary_layers != "all":
        return (
            "the liger layer applies Liger's RoPE kernel on every layer (this family skips it "
            f"on some: {family.rotary_layers})"
        )
    if getattr(family, "qk_norm", False) == "head_weights":
        return "the liger layer's q/k norms have one weight for all heads (this family's: one per head)"
    if getattr(family, "qk_norm_switch", None) is not None:
        return (
            "the liger layer's q/k norms are fixed per family (this family's follow "
            f"{getattr(family, 'qk_norm_switch', None)})"
        )
    if getattr(family, "mlp", "gated") == "original":
        return (
            "Liger's SwiGLU/GeGLU kernels compute dense gated MLPs; this family keeps the "
            f"original's {getattr(family, 'mlp_class', None)}, a mixture-of-experts block"
        )
    if getattr(family, "mlp", "gated") != "gated":
        return (
            "Liger's SwiGLU/GeGLU kernels compute gated MLPs; this family's MLP is "
            f"{getattr(family, 'mlp', None)!r}"
        )
    if len(qkv_names(family)) not in (1, 3) or len(mlp_names(family)) not in (2, 3):
        return (
            f"the liger layer keeps q/k/v and the MLP as one or three projections "
            f"(this family: {qkv_names(family)}, {mlp_names(family)})"
        )
    if not getattr(family, "norm_scale", True):
        return "Liger's RMSNorm kernel scales by a learned weight (this family's norms have none)"
    if getattr(family, "qk_norm_after_rotary", False) or getattr(
        family, "qk_norm_modules", ("q_norm", "k_norm")
    ) != ("q_norm", "k_norm"):
        return (
            "the liger layer's q/k norms are q_norm/k_norm before the rotary embedding (this "
            f"family's: {'/'.join(getattr(family, 'qk_norm_modules', ()))}"
            f"{', after it' if getattr(family, 'qk_norm_after_rotary', False) else ''})"
        )
    if getattr(family, "query_scale", None) is not None:
        return (
            "the liger layer does not scale queries by their position (this family's "
            f"{getattr(family, 'query_scale', None)} attention temperature)"
        )
    if getattr(family, "clip_qkv", None) is not None:
        return (
            "the liger layer does not clamp q, k and v (this family clamps them where "
            f"{getattr(family, 'clip_qkv', None)} is set)"
        )
    return answered("liger-decoder", family, "layerswap.backends.liger:tiny_config_problem")


def qkv_names(family: Family) -> tuple[str, ...]:
    """The original's q/k/v projections: three, or one where it fuses them (Phi-3)."""
    return tuple(getattr(family, "qkv_modules", ("q_proj", "k_proj", "v_proj")))


def mlp_names(family: Family) -> tuple[str, ...]:
    """The original's MLP projections: gate, up, down, or gate_up, down (Phi-3)."""
    return tuple(getattr(family, "mlp_modules", ("gate_proj", "up_proj", "down_proj")))


#: the ``liger`` backend: its decoder layer (where :func:`unsupported` finds nothing) and head
BACKEND = Backend(
    name="liger",
    description="Liger-Kernel's Triton kernels inside layerswap's decoder layer and head",
    slots={
        "decoder": Implementation(
            replacement=Lazy("layerswap.backends.liger:layer_class"),
            converter=Lazy("layerswap.backends.liger:converter_for"),
            supports=unsupported,
            description=(
                "Liger-Kernel's Triton kernels, GPU only: RMSNorm, SwiGLU/GeGLU and RoPE in "
                "the original's modules and weights, scaled_dot_product_attention with GQA"
            ),
        ),
        "head": head_slot(
            "layerswap.backends.head_liger",
            "Liger",
            description=(
                "Liger-Kernel, GPU only: in training, Liger's fused linear cross-entropy "
                "(never the full logits; logits None)"
            ),
            upstream=Lazy("layerswap.backends.head_liger:check_liger_head"),
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
