"""The structure of a family's decoder layer, grouped: attention, norms, MLP, rotary, layer.

A :class:`~layerswap.family.Family` holds one of each group; every backend reads its
replacement's structure from them (``family.attention.qk_norm``,
``family.feed_forward.kind``). A feature given as a string names the config attribute
that switches it (``qkv_bias="attention_bias"``); a bool means the modeling code fixes
it. Imports neither torch nor transformers.

A family is declared with the features flat (``Family(..., qkv_bias=True, mlp="plain")``,
the short form every builtin uses); :data:`FLAT` says which group each lands in.

Example::

    family = layerswap.get_family("qwen3")
    family.attention.qk_norm        # True: one weight for all heads
    family.feed_forward.modules     # ("gate_proj", "up_proj", "down_proj")
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = [
    "FLAT",
    "GATED_MLP",
    "NORM_PLACES",
    "PRE_NORMS",
    "ROTARY_LAYERS",
    "SEPARATE_QKV",
    "GROUPS",
    "Attention",
    "FeedForward",
    "LayerShape",
    "Normalization",
    "Rope",
    "switched",
]

#: Llama's norms: one before attention, one before the MLP
PRE_NORMS: tuple[tuple[str, str], ...] = (
    ("attn_in", "input_layernorm"),
    ("mlp_in", "post_attention_layernorm"),
)
#: the places a norm can have in a decoder layer, in the order they apply
NORM_PLACES = ("attn_in", "attn_out", "mlp_in", "mlp_out")
#: Llama's projections, the ones the fused layer concatenates
SEPARATE_QKV = ("q_proj", "k_proj", "v_proj")
GATED_MLP = ("gate_proj", "up_proj", "down_proj")


def _sliding(attention: Any, config: Any) -> bool:
    return getattr(attention, "sliding_window", None) is not None


def _sliding_or_unwindowed(attention: Any, config: Any) -> bool:
    return getattr(config, "sliding_window", None) is None or bool(
        getattr(attention, "is_sliding", False)
    )


def _sliding_or_forced(attention: Any, config: Any) -> bool:
    return _sliding(attention, config) or bool(getattr(attention, "force_rope", False))


#: the rules of :attr:`Rope.layers`: (the original layer's attention, config) -> whether
#: that layer applies the rotary embedding
ROTARY_LAYERS: dict[str, Callable[[Any, Any], bool]] = {
    "all": lambda attention, config: True,
    # SmolLM3: config.no_rope_layers[layer_idx], kept by the attention as use_rope
    "use_rope": lambda attention, config: bool(getattr(attention, "use_rope", True)),
    # Cohere 2: only layers with a sliding window rotate
    "sliding": _sliding,
    # EXAONE 4: sliding layers rotate, and every layer does when there is no window at all
    "sliding_or_unwindowed": _sliding_or_unwindowed,
    # Cohere 2 MoE: sliding layers rotate, and so do its dense first layers where
    # prefix_dense_sliding_window_pattern is 1 (kept by the attention as force_rope)
    "sliding_or_forced": _sliding_or_forced,
}


def switched(value: bool | str, config: Any) -> bool:
    """Whether a feature given as a bool, or as the name of the config field switching it,
    is on for ``config``."""
    return bool(getattr(config, value, False)) if isinstance(value, str) else bool(value)


@dataclass(frozen=True)
class Attention:
    """The attention block: projections, q/k norms, bounds, sinks, query scaling."""

    qkv_bias: bool | str = "attention_bias"
    o_bias: bool | str = "attention_bias"
    #: the original's q/k/v projections, or ``("qkv_proj",)`` where it fuses them (Phi-3)
    qkv_modules: tuple[str, ...] = SEPARATE_QKV
    #: q/k norms: ``True`` over each head with one weight for all heads (Qwen3),
    #: ``"head_weights"`` over each head with a weight per head (Cohere), ``"across"`` over
    #: all heads before they are split (OLMo 2), ``False`` none
    qk_norm: bool | str = False
    #: the config field that switches the q/k norms on (Cohere's ``use_qk_norm``); ``None``:
    #: :attr:`qk_norm` alone decides
    qk_norm_switch: str | None = None
    #: the original attention's q and k norm modules (HunYuan's ``query_layernorm``,
    #: ``key_layernorm``); the replacement keeps them under these names
    qk_norm_modules: tuple[str, str] = ("q_norm", "k_norm")
    #: the q/k norms apply to the rotated queries and keys (HunYuan), not before the
    #: rotary embedding (Qwen3)
    qk_norm_after_rotary: bool = False
    #: the config field bounding q, k and v after their projections (and q/k norms):
    #: ``clamp(-bound, bound)`` where the config sets it (OLMo's ``clip_qkv``); ``None``:
    #: no such field
    clip_qkv: str | None = None
    #: a learned logit per head joining every softmax as one more key whose value is zero
    #: (gpt-oss's ``self_attn.sinks``): attention may rest there instead of on a token
    sinks: bool = False
    #: queries scaled by their position after the rotary embedding: ``"llama4"``, Llama 4's
    #: attention temperature ``1 + beta * log(1 + floor(position / original max))`` with
    #: ``llama_4_scaling_beta`` and ``original_max_position_embeddings`` from the config's
    #: ``rope_parameters`` (Ministral 3); ``None``: no such scaling
    query_scale: str | None = None

    def has_qk_norm(self, config: Any) -> bool:
        """Whether ``config``'s layers norm queries and keys."""
        switch = self.qk_norm_switch
        return bool(self.qk_norm) and (switch is None or bool(getattr(config, switch, False)))

    def bound(self, config: Any) -> float | None:
        """The bound q, k and v are clamped to in ``config``'s layers, or ``None``."""
        bound = None if self.clip_qkv is None else getattr(config, self.clip_qkv, None)
        return None if bound is None else float(bound)

    def query_scaling(self, config: Any) -> tuple[float, float] | None:
        """``(beta, span)`` of :attr:`query_scale` in ``config``, or ``None`` (no scaling)."""
        if self.query_scale != "llama4":
            return None
        rope = getattr(config, "rope_parameters", None) or {}
        beta = rope.get("llama_4_scaling_beta")
        span = rope.get("original_max_position_embeddings")
        if beta is None:
            return None
        if span is None:
            span = getattr(config, "max_position_embeddings", None)
        if span is None:
            return None
        return float(beta), float(span)


@dataclass(frozen=True)
class Normalization:
    """The decoder layer's norms: their kind, places, offset and scale."""

    #: ``"rms"`` (RMSNorm), ``"layer"`` (LayerNorm with a bias: StarCoder2) or
    #: ``"layer_nobias"`` (mean-centred LayerNorm without a bias: Cohere)
    kind: str = "rms"
    #: where the norms sit: (place, module name) pairs, places ``attn_in`` / ``attn_out``
    #: (around attention) and ``mlp_in`` / ``mlp_out``
    places: tuple[tuple[str, str], ...] = PRE_NORMS
    #: added to the weight before it scales (Gemma's ``1 + weight``)
    offset: float = 0.0
    #: the norms (the layer's and q/k norms) scale by a learned weight; ``False``: they
    #: have no parameters at all (OLMo's LayerNorm, nanochat's RMSNorm)
    scale: bool = True
    #: ``(config field, kind)``: where that field is ``None`` in a config, the norms are
    #: ``kind`` instead (Cohere 2 MoE: ``("rms_norm_eps", "layer_nobias")``)
    switch: tuple[str, str] | None = None

    def kind_for(self, config: Any) -> str:
        """The norm kind of ``config``'s layers: :attr:`kind`, or the switched one."""
        if self.switch is not None and getattr(config, self.switch[0], None) is None:
            return self.switch[1]
        return self.kind

    def at(self, place: str) -> str | None:
        """The name of the norm at ``place`` (``"attn_in"`` ...), or ``None``."""
        return dict(self.places).get(place)


@dataclass(frozen=True)
class FeedForward:
    """The MLP: its kind, modules, bias and activation."""

    #: ``"gated"``, ``down(act(gate(x)) * up(x))``, ``"plain"``, ``down(act(up(x)))``, or
    #: ``"original"``: the original's own MLP module, kept as it is (mixture-of-experts
    #: blocks: Mixtral, Qwen2-MoE), with its class and parameter names
    kind: str = "gated"
    #: the original's MLP modules in that order: gated (gate, up, down), or (gate_up, down)
    #: where the original fuses them already (Phi-3); plain (up, down), Starcoder 2's
    #: ``("c_fc", "c_proj")``; none for ``kind="original"``
    modules: tuple[str, ...] = GATED_MLP
    bias: bool | str = False
    #: for ``kind="original"``: the class of the original's MLP module in the family's
    #: modeling module (``"MixtralSparseMoeBlock"``); ``None`` otherwise
    module_class: str | None = None
    #: the decoder layer's attribute holding the MLP: ``"mlp"``, or for a kept
    #: mixture-of-experts block another name (GraniteMoE's ``"block_sparse_moe"``)
    attribute: str = "mlp"
    #: the config field naming the activation
    activation: str = "hidden_act"
    #: the activation is a module with learned parameters, built as the original MLP
    #: builds it, in the config's ``dtype`` (Apertus's xIELU; built from its name alone it
    #: would hold them in bfloat16 and round what is loaded into it)
    activation_dtype: bool = False


@dataclass(frozen=True)
class Rope:
    """The rotary embedding: how a head's dims pair, and which layers rotate."""

    #: ``"half"`` (i, i + d/2), Llama's rotate-half, or ``"interleaved"`` (2i, 2i + 1) with
    #: the model's cos/sin applied as they come (Cohere), or ``"interleaved_from_half"``,
    #: (2i, 2i + 1) with the first half of cos/sin repeated pairwise, as GLM applies the
    #: rotate-half layout it is given, or ``"half_narrow"``: rotate-half with cos/sin given
    #: for one half only (gpt-oss), or ``"half_reversed"``: rotate-half by the negative
    #: angle (nanochat's ``rotate_half`` is ``(x2, -x1)``)
    layout: str = "half"
    #: which layers apply it, a key of :data:`ROTARY_LAYERS`: ``"all"``, or a rule read off
    #: the original attention (Cohere 2 rotates on sliding-window layers only, SmolLM3
    #: where ``no_rope_layers`` says so)
    layers: str = "all"

    def rotates(self, attention: Any, config: Any) -> bool:
        """Whether the original layer with this ``attention`` applies the rotary embedding."""
        return ROTARY_LAYERS[self.layers](attention, config)


@dataclass(frozen=True)
class LayerShape:
    """How the decoder layer joins its blocks, and what else it takes or keeps."""

    #: attention and MLP in parallel, both reading the layer's input:
    #: ``x + attn(attn_in(x)) + mlp(mlp_in(x))`` (Cohere: both places name one norm)
    parallel: bool = False
    #: the config field of the dropout the original applies in training to the attention's
    #: and the MLP's outputs (after ``o_proj`` and ``down_proj``: Seed-OSS's
    #: ``residual_dropout``); ``None``: no such dropout
    residual_dropout: str | None = None
    #: call parameters the original decoder layer takes and never reads (Mllama's
    #: self-attention layers are called with the cross-attention inputs every layer of
    #: the model gets): the call contract accepts them, the behavioural proof shows the
    #: swapped model computes the same with them given
    ignored_arguments: tuple[str, ...] = ()
    #: the decoder layers of another kind the model interleaves with this family's, which a
    #: swap leaves the original's, described (Mllama's cross-attention layers); ``""``: none
    kept_layers: str = ""

    def residual_dropout_p(self, config: Any) -> float:
        """The probability of the branch-output dropout in ``config``'s layers (0: none)."""
        field = self.residual_dropout
        return 0.0 if field is None else float(getattr(config, field, 0.0) or 0.0)


#: a feature's flat name (``Family(..., qkv_bias=True)``) -> (its group, its name there), in
#: the order declarations write them
FLAT: dict[str, tuple[str, str]] = {
    "qkv_bias": ("attention", "qkv_bias"),
    "o_bias": ("attention", "o_bias"),
    "mlp_bias": ("feed_forward", "bias"),
    "qk_norm": ("attention", "qk_norm"),
    "norm_offset": ("normalization", "offset"),
    "norm": ("normalization", "kind"),
    "activation": ("feed_forward", "activation"),
    "mlp": ("feed_forward", "kind"),
    "mlp_modules": ("feed_forward", "modules"),
    "mlp_class": ("feed_forward", "module_class"),
    "mlp_name": ("feed_forward", "attribute"),
    "qkv_modules": ("attention", "qkv_modules"),
    "norms": ("normalization", "places"),
    "qk_norm_switch": ("attention", "qk_norm_switch"),
    "parallel": ("layer", "parallel"),
    "rotary": ("rope", "layout"),
    "norm_switch": ("normalization", "switch"),
    "attention_sinks": ("attention", "sinks"),
    "rotary_layers": ("rope", "layers"),
    "norm_scale": ("normalization", "scale"),
    "clip_qkv": ("attention", "clip_qkv"),
    "residual_dropout": ("layer", "residual_dropout"),
    "query_scale": ("attention", "query_scale"),
    "qk_norm_modules": ("attention", "qk_norm_modules"),
    "qk_norm_after_rotary": ("attention", "qk_norm_after_rotary"),
    "activation_dtype": ("feed_forward", "activation_dtype"),
    "ignored_arguments": ("layer", "ignored_arguments"),
    "kept_layers": ("layer", "kept_layers"),
}

#: each group's class, by the :class:`~layerswap.family.Family` field holding it
GROUPS: dict[str, type] = {
    "attention": Attention,
    "normalization": Normalization,
    "feed_forward": FeedForward,
    "rope": Rope,
    "layer": LayerShape,
}
