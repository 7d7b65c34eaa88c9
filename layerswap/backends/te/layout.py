"""Where one decoder layer's tensors live in the TransformerEngine layer, and its shape.

This module needs neither TransformerEngine nor a GPU: the weight mapping is plain
tensor work, so it is tested everywhere and used by ``swap``, ``use`` +
``from_pretrained`` and ``save_pretrained`` alike.

The TE layer keeps the parameter names of ``transformer_engine.pytorch.TransformerLayer``
built with ``fuse_qkv_params=True, qkv_weight_interleaved=False``::

    original (transformers)                    TE layer
    input_layernorm.weight                     self_attention.layernorm_qkv.layer_norm_weight
    self_attn.{q,k,v}_proj.weight  (rows)      self_attention.layernorm_qkv.weight
    self_attn.{q,k,v}_proj.bias                self_attention.layernorm_qkv.bias   (when present)
    self_attn.{q,k}_norm.weight                self_attention.{q,k}_norm.weight    (qwen3)
    self_attn.o_proj.weight / .bias            self_attention.proj.weight / .bias
    post_attention_layernorm.weight            layernorm_mlp.layer_norm_weight
    mlp.{gate,up}_proj.weight (rows, gate 1st) layernorm_mlp.fc1_weight           (.fc1_bias)
    mlp.down_proj.weight                       layernorm_mlp.fc2_weight           (.fc2_bias)

Why one fused q/k/v parameter laid out ``[q | k | v]`` (not per-group interleaved):
the layer splits the projection itself, so the plain concatenation is the simplest
exact layout; GQA needs nothing special because every query head keeps its index
and every key/value head its index. A single parameter also survives loaders that
*replace* parameters (``from_pretrained`` does): TE's separate
``query_weight``/``key_weight``/``value_weight`` are views of one buffer, and once
replaced they are concatenated again on every forward.

Norm weights are renamed, not changed: Gemma's ``1 + weight`` RMSNorm is TE's
``zero_centered_gamma`` RMSNorm, which stores the same number.

Example::

    from layerswap.backends.te.layout import te_converter

    converter = te_converter(layerswap.families()["llama"])
    te_state = converter.to_replacement(layer.state_dict(), config)
    back = converter.to_original(te_state, config)   # bitwise equal to layer.state_dict()
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

from layerswap.backends._original import original_numbers
from layerswap.backends.te.declaration import NORM_OFFSET, unexpressible
from layerswap.errors import SubstitutionError
from layerswap.weights import (
    Concat,
    Converter,
    Rename,
    Rule,
    gate_up_sizes,
    head_dim,
    qkv_concat,
)

if TYPE_CHECKING:
    from transformers import PreTrainedConfig

    from layerswap.family import Family

__all__ = ["TE_ACTIVATIONS", "TELayerSpec", "te_converter", "unexpressible"]

#: transformers ``hidden_act`` -> TE gated activation (first half activated, second half linear).
#: TE's GELU is the tanh approximation, so only the tanh-GELU names map to ``geglu``.
TE_ACTIVATIONS: dict[str, str] = {
    "silu": "swiglu",
    "swish": "swiglu",
    "gelu_pytorch_tanh": "geglu",
    "gelu_new": "geglu",
    "gelu_fast": "geglu",
    "relu": "reglu",
    "quick_gelu": "qgeglu",
}

# rope types whose cos/sin are exactly cos(angle), sin(angle): no attention factor folded
# in, so the angle can be recovered and TE's fused rotary kernel applies. Others (yarn,
# longrope) scale cos/sin and take the elementwise path with the model's own tensors.
_UNIT_ROPE_TYPES = frozenset({"default", "linear", "dynamic", "llama3"})


@functools.cache
def te_converter(family: Family) -> Converter:
    """The weight converter between ``family``'s decoder layer and the TE layer.

    Biases are optional rules (present when the config switches them on); every
    tensor must have a rule, so an unknown tensor is an error naming it, not a
    silently dropped weight. TE's ``*._extra_state`` entries (FP8 scaling state) have
    no place in the original layout and are left out on the way back.

    Example::

        te_converter(layerswap.families()["qwen2"]).to_replacement(state, config)
    """
    rules: list[Rule] = [
        Rename("input_layernorm.weight", "self_attention.layernorm_qkv.layer_norm_weight"),
        qkv_concat("self_attention.layernorm_qkv"),
        qkv_concat("self_attention.layernorm_qkv", bias=True),
        Rename("self_attn.o_proj.weight", "self_attention.proj.weight"),
        Rename("self_attn.o_proj.bias", "self_attention.proj.bias", optional=True),
        Rename("post_attention_layernorm.weight", "layernorm_mlp.layer_norm_weight"),
        Concat(
            ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
            "layernorm_mlp.fc1_weight",
            sizes=gate_up_sizes,
        ),
        Concat(
            ("mlp.gate_proj.bias", "mlp.up_proj.bias"),
            "layernorm_mlp.fc1_bias",
            sizes=gate_up_sizes,
            optional=True,
        ),
        Rename("mlp.down_proj.weight", "layernorm_mlp.fc2_weight"),
        Rename("mlp.down_proj.bias", "layernorm_mlp.fc2_bias", optional=True),
    ]
    if family.attention.qk_norm:
        rules += [
            Rename("self_attn.q_norm.weight", "self_attention.q_norm.weight"),
            Rename("self_attn.k_norm.weight", "self_attention.k_norm.weight"),
        ]
    return Converter(tuple(rules), passthrough=False)


@dataclass(frozen=True)
class TELayerSpec:
    """Everything the TE layer needs to know about one decoder layer of one model.

    Built from the family's declaration and the model config by :meth:`for_layer`;
    raises :class:`~layerswap.errors.SubstitutionError` for a config TE cannot express.

    Example::

        spec = TELayerSpec.for_layer(layerswap.families()["qwen3"], config, layer_idx=0)
        spec.q_size, spec.kv_size, spec.activation     # (256, 64, 'swiglu')
    """

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    norm_eps: float
    activation: str
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    zero_centered_norm: bool = False
    causal: bool = True
    sliding_window: int | None = None
    attention_dropout: float = 0.0
    initializer_range: float = 0.02
    unit_rope: bool = True
    #: the original's softmax scale and branch multiplier (read off the original layer)
    attention_scale: float | None = None
    residual_multiplier: float = 1.0

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def softmax_scale(self) -> float:
        if self.attention_scale is not None:
            return self.attention_scale
        return float(self.head_dim**-0.5)

    @property
    def window_size(self) -> tuple[int, int] | None:
        """TE's ``(left, right)`` window: transformers keeps keys ``q - window < k <= q``."""
        return None if self.sliding_window is None else (self.sliding_window - 1, 0)

    @classmethod
    def for_layer(cls, family: Family, config: PreTrainedConfig, layer_idx: int) -> TELayerSpec:
        """The spec of decoder layer ``layer_idx`` of a ``family`` model with ``config``."""
        if not NORM_OFFSET.met(family):
            raise SubstitutionError(f"{family.name}: {NORM_OFFSET.why_not(family)}")
        hidden_act = getattr(config, family.feed_forward.activation, None)
        activation = TE_ACTIVATIONS.get(str(hidden_act))
        if activation is None:
            raise SubstitutionError(
                f"{family.name}: TransformerEngine has no gated activation equal to "
                f"{family.feed_forward.activation}={hidden_act!r} (it has {sorted(TE_ACTIVATIONS)})"
            )
        reason = unexpressible(family)
        if reason is not None:
            raise SubstitutionError(f"{family.name}: {reason}")
        rope = getattr(config, "rope_parameters", None) or {}
        numbers = original_numbers(family, config, layer_idx)
        dropout = family.layer.residual_dropout_p(config)
        if dropout:
            raise SubstitutionError(
                f"{family.name}: the te layer applies no dropout after the output projections "
                f"(this config's {family.layer.residual_dropout}={dropout}; set it to 0 to use te)"
            )
        if numbers.attn_logit_softcapping is not None:
            raise SubstitutionError(
                f"{family.name}: TransformerEngine's attention has no logit soft-capping "
                f"(attn_logit_softcapping={numbers.attn_logit_softcapping})"
            )
        return cls(
            hidden_size=int(config.hidden_size),
            num_heads=int(config.num_attention_heads),
            num_kv_heads=int(
                getattr(config, "num_key_value_heads", None) or config.num_attention_heads
            ),
            head_dim=head_dim(config),
            intermediate_size=int(config.intermediate_size),
            norm_eps=float(config.rms_norm_eps),
            activation=activation,
            qkv_bias=family.flag("qkv_bias", config),
            o_bias=family.flag("o_bias", config),
            mlp_bias=family.flag("mlp_bias", config),
            qk_norm=bool(family.attention.qk_norm),  # per head: unexpressible() refuses "across"
            zero_centered_norm=family.normalization.offset == 1.0,
            causal=numbers.is_causal,
            sliding_window=_sliding_window(config, layer_idx),
            attention_dropout=float(getattr(config, "attention_dropout", 0.0) or 0.0),
            initializer_range=float(getattr(config, "initializer_range", 0.02) or 0.02),
            unit_rope=rope.get("rope_type", "default") in _UNIT_ROPE_TYPES,
            attention_scale=numbers.scaling,
            residual_multiplier=numbers.residual_multiplier,
        )


def _sliding_window(config: PreTrainedConfig, layer_idx: int) -> int | None:
    """The layer's sliding window, the way the modeling code decides it."""
    window = getattr(config, "sliding_window", None)
    if not window:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and layer_idx < len(layer_types):
        # qwen2/qwen3: per-layer; mistral has no layer_types and slides everywhere
        return int(window) if layer_types[layer_idx] == "sliding_attention" else None
    return int(window)


def tiny_config_dropout(family: Family) -> str | None:
    """Why the te layer cannot take ``family``'s default configuration (its tiny config,
    built here): dropout after the output projections; ``None`` when it can or no tiny
    config is built here (then judged per layer, :meth:`TELayerSpec.for_layer`)."""
    try:
        dropout = family.layer.residual_dropout_p(family.tiny_config())
    except Exception:  # no tiny config here: judged per layer
        return None
    if not dropout:
        return None
    return (
        "the te layer applies no dropout after the output projections (this "
        f"family's default {family.layer.residual_dropout}={dropout}; set it to 0 to use te)"
    )
