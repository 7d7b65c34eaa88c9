"""The ``te`` backend, declared: NVIDIA TransformerEngine decoder layers, BF16 and FP8,
GPU only; the families TransformerEngine's modules express, and why not the others.

Its layer: :mod:`layerswap.backends.te` (the weight layout:
:mod:`layerswap.backends.te_layout`); what it needs at run time and its FP8 recipes:
:mod:`layerswap.backends.te_runtime`.
"""

from __future__ import annotations

from layerswap.backend import Backend, Dependency, Implementation, Lazy, Variant
from layerswap.backends.declarations._answers import answered
from layerswap.backends.te_runtime import fp8_unmet_requirement, unmet_requirement
from layerswap.family import GATED_MLP, PRE_NORMS, SEPARATE_QKV, Family

__all__ = ["BACKEND", "unexpressible", "unsupported"]


def unsupported(family: Family) -> str | None:
    """Why TransformerEngine's modules cannot express ``family``'s layer, or ``None``.

    TE's RMSNorm scales by ``weight`` or ``1 + weight`` (``zero_centered_gamma``), so a
    family with another norm offset has no TE layer; the rest is :func:`unexpressible`.
    Everything else the builtin families declare (q/k/v-only biases, q/k norm, GQA,
    sliding windows, tanh-GELU) maps onto TE modules.

    Example::

        te.unsupported(layerswap.get_family("olmo2"))   # "... q/k norm across heads ..."
    """
    if family.norm_offset not in (0.0, 1.0):
        return (
            f"TransformerEngine's RMSNorm scales by weight or 1 + weight; this family's "
            f"norm offset is {family.norm_offset}"
        )
    if family.residual_dropout is not None:
        # judged on the family's default configuration; a config you bring is checked
        # again when a layer is built (TELayerSpec.for_layer)
        reason = answered("te-decoder", family, "layerswap.backends.te_layout:tiny_config_dropout")
        if reason is not None:
            return reason
    return unexpressible(family)


#: the ``te`` backend: TransformerEngine decoder layers in BF16, and the ``fp8`` variant:
#: the same layers and weights inside :func:`fp8_autocast` (``llama.decoder.te_fp8``;
#: ``sub.with_options(recipe="delayed")`` picks the recipe)
BACKEND = Backend(
    name="te",
    description="NVIDIA TransformerEngine decoder layers, BF16 and FP8, GPU only",
    slots={
        "decoder": Implementation(
            replacement=Lazy("layerswap.backends.te:layer_class"),
            converter=Lazy("layerswap.backends.te_layout:te_converter"),
            supports=unsupported,
            description=(
                "NVIDIA TransformerEngine, GPU only: RMSNorm fused into the q/k/v and gate/up "
                "GEMMs, cuDNN/flash attention with GQA; BF16, and FP8 inside te.fp8_autocast"
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
            context=Lazy("layerswap.backends.te_runtime:fp8_autocast"),
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


def unexpressible(family: Family) -> str | None:
    """Why TransformerEngine's layer cannot express ``family``'s structure, or ``None``.

    TE fuses one norm into the q/k/v GEMM and one into the MLP's first GEMM, so only
    Llama's placement (a norm before attention and one before the MLP) maps; its q/k
    norms are per head, with one weight for all heads; its layer runs attention, then
    the MLP, and rotates halves of each head.
    """
    if getattr(family, "attention_sinks", False):
        return (
            "TransformerEngine's attention has no attention sinks (this family's self_attn.sinks)"
        )
    if family.norm_switch is not None:
        return (
            "the te layer maps RMSNorm only (this family's norm is a LayerNorm where "
            f"{family.norm_switch[0]} is unset)"
        )
    if family.parallel:
        return "the te layer runs attention, then the MLP (this family runs them in parallel)"
    if family.rotary != "half":
        return (
            "the te layer applies the rotate-half rotary embedding (this family's rotary "
            f"layout is {family.rotary})"
        )
    if family.rotary_layers != "all":
        return (
            "the te layer applies the rotary embedding on every layer (this family skips it "
            f"on some: {family.rotary_layers})"
        )
    if family.norms != PRE_NORMS:
        places = ", ".join(place for place, _ in family.norms)
        return f"TransformerEngine's layer has norms before attention and the MLP only (this family: {places})"
    if family.qk_norm == "across":
        return "TransformerEngine's q/k norm is per head; this family normalises across heads"
    if family.qk_norm == "head_weights":
        return "TransformerEngine's q/k norm has one weight for all heads; this family's has one per head"
    if family.qk_norm_switch is not None:
        return f"the te layer's q/k norms are fixed per family (this family's follow {family.qk_norm_switch})"
    if family.norm != "rms":
        return f"the te layer maps RMSNorm only (this family's norm is {_NORM_NAMES[family.norm]})"
    if family.mlp == "original":
        return (
            f"the te layer maps gated MLPs only (this family keeps the original's "
            f"{family.mlp_class}, a mixture-of-experts block)"
        )
    if family.mlp != "gated":
        # TE's LayerNormMLP has ungated activations, but the te layer and converter map
        # the gated MLP only
        return f"the te layer maps gated MLPs only (this family's MLP is {family.mlp})"
    if (family.qkv_modules, family.mlp_modules) != (SEPARATE_QKV, GATED_MLP):
        return (
            "the te converter maps separate q/k/v and gate/up projections (this family's "
            f"original has {', '.join((*family.qkv_modules, *family.mlp_modules))})"
        )
    if not family.norm_scale:
        return "TransformerEngine's norms have a learned weight (this family's norms have none)"
    if family.qk_norm_after_rotary or family.qk_norm_modules != ("q_norm", "k_norm"):
        return (
            "the te layer's q/k norms are q_norm/k_norm before the rotary embedding (this "
            f"family's: {'/'.join(family.qk_norm_modules)}"
            f"{', after it' if family.qk_norm_after_rotary else ''})"
        )
    if family.query_scale is not None:
        return (
            "the te layer does not scale queries by their position (this family's "
            f"{family.query_scale} attention temperature)"
        )
    if family.clip_qkv is not None:
        return (
            "the te layer does not clamp q, k and v (this family clamps them where "
            f"{family.clip_qkv} is set)"
        )
    return None


_NORM_NAMES = {
    "rms": "an RMSNorm",
    "layer": "a LayerNorm",
    "layer_nobias": "a LayerNorm without a bias",
}
