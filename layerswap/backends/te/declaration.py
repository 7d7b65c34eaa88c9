"""The ``te`` backend, declared: NVIDIA TransformerEngine decoder layers, BF16 and FP8,
GPU only; the families TransformerEngine's modules express, and why not the others.

Its layer: :mod:`layerswap.backends.te.decoder` (the weight layout:
:mod:`layerswap.backends.te.layout`); below the layer, on the model's own modules: its
norm, :mod:`layerswap.backends.te.norm`, and its packed attention projections,
:mod:`layerswap.backends.te.qkv`; what it needs at run time and its FP8 recipes:
:mod:`layerswap.backends.te.runtime`.
"""

from __future__ import annotations

from layerswap.backend import Backend, Dependency, Implementation, Lazy, Variant
from layerswap.backends._answers import answered
from layerswap.backends.declarations.norm_slot import norm_slot, qkv_slot
from layerswap.backends.te.runtime import fp8_unmet_requirement, unmet_requirement
from layerswap.capabilities import Capability, refusal
from layerswap.family import GATED_MLP, PRE_NORMS, SEPARATE_QKV, Family

__all__ = ["BACKEND", "EXPRESSES", "NORM_OFFSET", "unexpressible", "unsupported"]


# one reason for two fields each
_PROJECTIONS = (
    "the te converter maps separate q/k/v and gate/up projections (this family's original "
    "has {projections})"
)
_QK_NORMS = (
    "the te layer's q/k norms are q_norm/k_norm before the rotary embedding (this family's: "
    "{qk_norms})"
)

#: what TransformerEngine's layer computes one way only, in the order a family is checked
#: (:func:`unexpressible`). TE fuses one norm into the q/k/v GEMM and one into the MLP's
#: first GEMM, so only Llama's placement (a norm before attention and one before the MLP)
#: maps; its q/k norms are per head, with one weight for all heads; its layer runs
#: attention, then the MLP, and rotates halves of each head.
EXPRESSES: tuple[Capability, ...] = (
    Capability(
        "attention.sinks",
        expresses=(False,),
        reason="TransformerEngine's attention has no attention sinks (this family's "
        "self_attn.sinks)",
    ),
    Capability(
        "normalization.switch",
        expresses=(None,),
        reason="the te layer maps RMSNorm only (this family's norm is a LayerNorm where "
        "{normalization.switch[0]} is unset)",
    ),
    Capability(
        "layer.parallel",
        expresses=(False,),
        reason="the te layer runs attention, then the MLP (this family runs them in parallel)",
    ),
    Capability(
        "rope.layout",
        expresses=("half",),
        reason="the te layer applies the rotate-half rotary embedding (this family's rotary "
        "layout is {rope.layout})",
    ),
    Capability(
        "rope.layers",
        expresses=("all",),
        reason="the te layer applies the rotary embedding on every layer (this family skips it "
        "on some: {rope.layers})",
    ),
    Capability(
        "normalization.places",
        expresses=(PRE_NORMS,),
        reason="TransformerEngine's layer has norms before attention and the MLP only (this "
        "family: {norm_places})",
    ),
    Capability(
        "attention.qk_norm",
        refuses=("across",),
        reason="TransformerEngine's q/k norm is per head; this family normalises across heads",
    ),
    Capability(
        "attention.qk_norm",
        refuses=("head_weights",),
        reason="TransformerEngine's q/k norm has one weight for all heads; this family's has "
        "one per head",
    ),
    Capability(
        "attention.qk_norm_switch",
        expresses=(None,),
        reason="the te layer's q/k norms are fixed per family (this family's follow "
        "{attention.qk_norm_switch})",
    ),
    Capability(
        "normalization.kind",
        expresses=("rms",),
        reason="the te layer maps RMSNorm only (this family's norm is {norm_kind})",
    ),
    Capability(
        "feed_forward.kind",
        refuses=("original",),
        reason="the te layer maps gated MLPs only (this family keeps the original's "
        "{feed_forward.module_class}, a mixture-of-experts block)",
    ),
    Capability(
        "feed_forward.kind",
        # TE's LayerNormMLP has ungated activations, but the te layer and converter map
        # the gated MLP only
        expresses=("gated",),
        reason="the te layer maps gated MLPs only (this family's MLP is {feed_forward.kind})",
    ),
    Capability("attention.qkv_modules", expresses=(SEPARATE_QKV,), reason=_PROJECTIONS),
    Capability("feed_forward.modules", expresses=(GATED_MLP,), reason=_PROJECTIONS),
    Capability(
        "normalization.scale",
        expresses=(True,),
        reason="TransformerEngine's norms have a learned weight (this family's norms have none)",
    ),
    Capability("attention.qk_norm_after_rotary", expresses=(False,), reason=_QK_NORMS),
    Capability("attention.qk_norm_modules", expresses=(("q_norm", "k_norm"),), reason=_QK_NORMS),
    Capability(
        "attention.query_scale",
        expresses=(None,),
        reason="the te layer does not scale queries by their position (this family's "
        "{attention.query_scale} attention temperature)",
    ),
    Capability(
        "attention.clip_qkv",
        expresses=(None,),
        reason="the te layer does not clamp q, k and v (this family clamps them where "
        "{attention.clip_qkv} is set)",
    ),
)

#: TE's RMSNorm scales by ``weight`` or ``1 + weight`` (``zero_centered_gamma``)
NORM_OFFSET = Capability(
    "normalization.offset",
    expresses=(0.0, 1.0),
    reason="TransformerEngine's RMSNorm scales by weight or 1 + weight; this family's norm "
    "offset is {normalization.offset}",
)


def unexpressible(family: Family) -> str | None:
    """Why TransformerEngine's layer cannot express ``family``'s structure
    (:data:`EXPRESSES`), or ``None``."""
    return refusal(EXPRESSES, family)


def unsupported(family: Family) -> str | None:
    """Why TransformerEngine's modules cannot express ``family``'s layer, or ``None``.

    A family with a norm offset TE's RMSNorm has not (:data:`NORM_OFFSET`) or, in its
    default configuration, dropout after the output projections has no TE layer; the rest
    is :func:`unexpressible`. Everything else the builtin families declare (q/k/v-only biases, q/k norm, GQA,
    sliding windows, tanh-GELU) maps onto TE modules.

    Example::

        te.unsupported(layerswap.get_family("olmo2"))   # "... q/k norm across heads ..."
    """
    if not NORM_OFFSET.met(family):
        return NORM_OFFSET.why_not(family)
    if family.layer.residual_dropout is not None:
        # judged on the family's default configuration; a config you bring is checked
        # again when a layer is built (TELayerSpec.for_layer)
        reason = answered("te-decoder", family, "layerswap.backends.te.layout:tiny_config_dropout")
        if reason is not None:
            return reason
    return unexpressible(family)


#: the ``te`` backend: TransformerEngine decoder layers in BF16, and the ``fp8`` variant:
#: the same layers and weights inside :func:`fp8_autocast` (``llama.decoder.te_fp8``;
#: ``sub.with_options(recipe="delayed")`` picks the recipe); TE's RMSNorm kernel on the
#: model's own norms (``norm``) and one TE ``Linear`` GEMM for each attention's packed
#: projections (``qkv``, FP8 inside :func:`fp8_autocast`)
BACKEND = Backend(
    name="te",
    description="NVIDIA TransformerEngine decoder layers, BF16 and FP8, GPU only",
    slots={
        "decoder": Implementation(
            replacement=Lazy("layerswap.backends.te.decoder:layer_class"),
            converter=Lazy("layerswap.backends.te.layout:te_converter"),
            supports=unsupported,
            description=(
                "NVIDIA TransformerEngine, GPU only: RMSNorm fused into the q/k/v and gate/up "
                "GEMMs, cuDNN/flash attention with GQA; BF16, and FP8 inside te.fp8_autocast"
            ),
        ),
        "norm": norm_slot(
            "layerswap.backends.te.norm:TENorm",
            description=(
                "NVIDIA TransformerEngine, GPU only: each RMS norm the model's classes compute "
                "(weight or 1 + weight, scaled in float32 or after the cast) as TE's RMSNorm "
                "kernel, zero_centered_gamma for 1 + weight"
            ),
        ),
        "qkv": qkv_slot(
            "layerswap.backends.te.qkv:TEProjections",
            description=(
                "NVIDIA TransformerEngine, GPU only: each attention's projections from one "
                "input (q/k/v, MLA's q_a/kv_a) packed into one TE Linear GEMM on the model's "
                "own weights, FP8 inside te.fp8_autocast; the attention itself the original's"
            ),
        ),
    },
    requirement=unmet_requirement,
    devices=("cuda",),
    tensor_parallel=(
        "TransformerEngine layers shard with TransformerEngine's own tensor parallelism "
        "(tp_group, sequence_parallel), which transformers' plan does not drive"
    ),
    dependencies=(
        Dependency(
            label="TransformerEngine",
            module="transformer_engine",
            distribution="transformer-engine",
            install="pip install 'layerswap[te]' on a CUDA machine",
        ),
    ),
    variants=(
        Variant(
            name="fp8",
            context=Lazy("layerswap.backends.te.runtime:fp8_autocast"),
            requirement=fp8_unmet_requirement,
            options={"recipe": "auto"},
            precision="fp8",
            description=(
                "NVIDIA TransformerEngine, GPU only: RMSNorm fused into the q/k/v and gate/up "
                "GEMMs, cuDNN/flash attention with GQA; FP8"
            ),
        ),
    ),
)
