"""The ``fused`` backend's decoder layer: pure PyTorch for every family, CPU and GPU.

One projection computes q, k and v; one computes gate and up; norms are
``torch.nn.functional.rms_norm`` or ``layer_norm`` (with or without a bias); attention is
``scaled_dot_product_attention`` with grouped-query attention (computed eagerly where the
family soft-caps the logits); the rotary embedding rotates halves or interleaved pairs,
as the family does, over all or the first dims of each head; attention and MLP run one
after the other or, where the family does, in parallel. The layer follows the transformers 5 decoder-layer
contract: it receives ``position_embeddings=(cos, sin)``, the 4-D mask the model
built (which already encodes padding and any sliding window) and the cache, and
returns the hidden-states tensor.

One class serves all families; :func:`layer_class` derives a named subclass per
family (``FusedLlamaDecoderLayer`` ...) that carries the family's features. The
decoder-layer contract itself (signature, residuals, cache update, rotate-half convention,
per-family classes) is :mod:`layerswap.backends._layer`, shared with the ``te`` backend.

Example::

    from layerswap.backends import fused

    sub = fused.BACKEND.substitution(layerswap.get_family("qwen3"))
    handle = layerswap.swap(model, sub)      # the same as layerswap.get("qwen3.decoder.fused")
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN

from layerswap import hf_internals
from layerswap.backends import _layer
from layerswap.backends._original import original_numbers
from layerswap.backends.fused.declaration import BACKEND
from layerswap.errors import RequirementError, UpstreamDriftError
from layerswap.family import Family
from layerswap.rotary import rotate
from layerswap.versions import transformers_version
from layerswap.weights import Converter, gate_up_concat, head_dim, qkv_concat, qkv_sizes

if TYPE_CHECKING:
    from transformers import PreTrainedConfig

    from layerswap.hf_internals import LayerCache

__all__ = [
    "BACKEND",
    "CONVERTER",
    "FusedAttention",
    "FusedDecoderLayer",
    "FusedMLP",
    "FusedRMSNorm",
    "converter_for",
    "layer_class",
    "original_mlp",
]

#: original q/k/v -> ``self_attn.qkv_proj``, gate/up -> ``mlp.gate_up_proj``; biases when present.
#: Every other tensor keeps its name, so this one converter serves every family whose
#: original has separate projections (:func:`converter_for` drops the rest).
CONVERTER = Converter(
    (
        qkv_concat("self_attn.qkv_proj"),
        qkv_concat("self_attn.qkv_proj", bias=True),
        gate_up_concat("mlp.gate_up_proj"),
        gate_up_concat("mlp.gate_up_proj", bias=True),
    )
)


def converter_for(family: Family) -> Converter:
    """:data:`CONVERTER` without the concatenations ``family``'s original needs none of: its
    own fused ``qkv_proj``/``gate_up_proj`` (Phi-3), a plain MLP's two projections."""
    qkv = CONVERTER.rules[:2] if len(family.attention.qkv_modules) == 3 else ()
    gate_up = CONVERTER.rules[2:] if len(family.feed_forward.modules) == 3 else ()
    return CONVERTER if qkv and gate_up else Converter((*qkv, *gate_up))


class FusedRMSNorm(nn.Module):
    """RMSNorm through ``F.rms_norm``; scales by ``offset + weight`` (Gemma: offset 1).

    ``size`` may be a shape, ``(heads, head_dim)``: q/k norms with a weight per head
    (Cohere) normalise each head over its last axis and scale by that head's weight.
    ``scale=False``: no weight at all (nanochat), as ``F.rms_norm`` without one.
    """

    weight: nn.Parameter | None

    def __init__(
        self, size: int | tuple[int, ...], eps: float, offset: float = 0.0, *, scale: bool = True
    ) -> None:
        super().__init__()
        # the original's initial value, so an unloaded weight means the same thing
        if scale:
            self.weight = nn.Parameter(torch.full(_shape(size), 1.0 - offset))
        else:
            self.register_parameter("weight", None)
        self.size = _shape(size)
        self.eps = eps
        self.offset = offset

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.weight is None:
            return F.rms_norm(hidden_states, (hidden_states.shape[-1],), None, self.eps)
        weight = self.weight + self.offset if self.offset else self.weight
        weight = weight.to(hidden_states.dtype)
        if torch.onnx.is_in_onnx_export():
            # the TorchScript ONNX exporter has no rms_norm (ONNX has it from opset 23)
            scale = torch.rsqrt(hidden_states.pow(2).mean(-1, keepdim=True) + self.eps)
            return hidden_states * scale * weight
        axis = (hidden_states.shape[-1],)
        if weight.dim() > 1:
            return F.rms_norm(hidden_states, axis, None, self.eps) * weight
        return F.rms_norm(hidden_states, axis, weight, self.eps)

    def extra_repr(self) -> str:
        offset = f", offset={self.offset}" if self.offset else ""
        scale = "" if self.weight is not None else ", scale=False"
        return f"{self.size}, eps={self.eps}{offset}{scale}"


def _shape(size: int | tuple[int, ...]) -> tuple[int, ...]:
    return (size,) if isinstance(size, int) else tuple(size)


class FusedLayerNorm(nn.Module):
    """LayerNorm through ``F.layer_norm``; scales by ``offset + weight``, adds a bias unless
    ``bias=False`` (Cohere's mean-centred norm has none). ``size`` may be a shape, as for
    :class:`FusedRMSNorm`. ``scale=False``: neither weight nor bias (OLMo's LayerNorm)."""

    weight: nn.Parameter | None

    def __init__(
        self,
        size: int | tuple[int, ...],
        eps: float,
        offset: float = 0.0,
        *,
        bias: bool = True,
        scale: bool = True,
    ) -> None:
        super().__init__()
        if scale:
            self.weight = nn.Parameter(torch.full(_shape(size), 1.0 - offset))
        else:
            self.register_parameter("weight", None)
        self.bias = nn.Parameter(torch.zeros(_shape(size))) if bias and scale else None
        self.size = _shape(size)
        self.eps = eps
        self.offset = offset

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.weight is None:
            return F.layer_norm(hidden_states, (hidden_states.shape[-1],), None, None, self.eps)
        weight = self.weight + self.offset if self.offset else self.weight
        dtype = hidden_states.dtype
        bias = None if self.bias is None else self.bias.to(dtype)
        axis = (hidden_states.shape[-1],)
        if weight.dim() > 1:
            normed = F.layer_norm(hidden_states, axis, None, None, self.eps) * weight.to(dtype)
            return normed if bias is None else normed + bias
        return F.layer_norm(hidden_states, axis, weight.to(dtype), bias, self.eps)

    def extra_repr(self) -> str:
        offset = f", offset={self.offset}" if self.offset else ""
        if self.weight is None:
            return f"{self.size}, eps={self.eps}, scale=False"
        bias = "" if self.bias is not None else ", bias=False"
        return f"{self.size}, eps={self.eps}{offset}{bias}"


def _family_norm(
    size: int | tuple[int, ...],
    config: PreTrainedConfig,
    family: Family,
    eps: float | None = None,
) -> nn.Module:
    eps = float(config.rms_norm_eps) if eps is None else eps
    kind = family.normalization.kind_for(config)
    scale = family.normalization.scale
    if kind in ("layer", "layer_nobias"):
        return FusedLayerNorm(
            size, eps, family.normalization.offset, bias=kind == "layer", scale=scale
        )
    return FusedRMSNorm(size, eps, family.normalization.offset, scale=scale)


class FusedAttention(nn.Module):
    """Self-attention with one q/k/v projection and ``scaled_dot_product_attention``."""

    def __init__(self, config: PreTrainedConfig, layer_idx: int, family: Family) -> None:
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = head_dim(config)
        self.sizes = list(qkv_sizes(config))
        self.num_key_value_groups = self.sizes[0] // self.sizes[1]
        numbers = original_numbers(family, config, layer_idx)
        self.scaling = numbers.scaling
        # Gemma 2: scores = tanh(scores / cap) * cap; SDPA cannot, so attention is eager
        self.softcap = numbers.attn_logit_softcapping
        self.rotates = numbers.rotary
        self.attention_dropout = float(getattr(config, "attention_dropout", 0.0))
        self.is_causal = numbers.is_causal  # the original's, not a config field it may ignore
        self.qkv_proj = nn.Linear(
            config.hidden_size, sum(self.sizes), bias=family.flag("qkv_bias", config)
        )
        self.o_proj = nn.Linear(
            self.sizes[0], config.hidden_size, bias=family.flag("o_bias", config)
        )
        q_norm: nn.Module | None = None
        k_norm: nn.Module | None = None
        # per head (Qwen3), per head with a weight each (Cohere), or over all heads (OLMo 2)
        self.qk_norm_across = family.attention.qk_norm == "across"
        self.qk_norm_after_rotary = family.attention.qk_norm_after_rotary
        self.rotary = hf_internals.rotary_layout(family.name, family.rope.layout)
        if family.flag("qk_norm", config):
            heads = [size // self.head_dim for size in self.sizes[:2]]
            q_size, k_size = (
                (self.sizes[0], self.sizes[1])
                if self.qk_norm_across
                else ((heads[0], self.head_dim), (heads[1], self.head_dim))
                if family.attention.qk_norm == "head_weights"
                else (self.head_dim, self.head_dim)
            )
            q_norm = _family_norm(q_size, config, family, numbers.norm_eps)
            k_norm = _family_norm(k_size, config, family, numbers.norm_eps)
        # under the original's names (q_norm, k_norm; HunYuan's query_layernorm, ...), so
        # their weights keep their names
        self.qk_norm_names = family.attention.qk_norm_modules
        for name, norm in zip(self.qk_norm_names, (q_norm, k_norm), strict=True):
            self.add_module(name, norm)
        # gpt-oss: one learned logit per head, a key every query sees, whose value is zero
        self.sinks: nn.Parameter | None = None
        if family.attention.sinks:
            self.sinks = nn.Parameter(torch.empty(self.sizes[0] // self.head_dim))
        # OLMo, OLMoE: q, k and v clamped to [-bound, bound] where the config sets clip_qkv
        self.qkv_bound = family.attention.bound(config)
        # Seed-OSS: dropout on the output projection's result, in training
        self.output_dropout = family.layer.residual_dropout_p(config)
        # Ministral 3: queries scaled by 1 + beta * log(1 + floor(position / span))
        self.query_scaling = family.attention.query_scaling(config)

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None,
        cache: LayerCache | None = None,
        *,
        output_attentions: bool = False,
    ) -> torch.Tensor:
        batch, length, _ = hidden_states.shape
        query, key, value = _layer.split_heads(
            self.qkv_proj(hidden_states), self.sizes, self.head_dim
        )
        if not self.qk_norm_after_rotary:
            query, key = self._normed(query, key)
        if self.qkv_bound is not None:
            bound = self.qkv_bound
            query, key, value = (t.clamp(-bound, bound) for t in (query, key, value))
        query, key, value = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
        if self.rotates:  # NoPE layers (Cohere 2's full-attention ones) leave q and k as they are
            cos, sin = position_embeddings
            query, key = rotate(query, cos, sin, self.rotary), rotate(key, cos, sin, self.rotary)
        if self.qk_norm_after_rotary:  # HunYuan: the rotated queries and keys
            query, key = self._normed(query, key)
        if self.query_scaling is not None:
            query = query * self._query_factor(cache).to(query.dtype)
        key, value = _layer.update_cache(
            cache,
            key,
            value,
            self.layer_idx,
            layout="bhsd",
            position_embeddings=position_embeddings,
        )
        asked = output_attentions or bool(getattr(self.config, "output_attentions", False))
        sink = _layer.attention_weights_sink(asked)
        output, weights = self._attend(
            query,
            key,
            value,
            attention_mask,
            weights=sink is not None,
            causal=_layer.causal_call(self.is_causal, cache),
        )
        if sink is not None:
            sink.append(weights)
        projected: torch.Tensor = self.o_proj(output.transpose(1, 2).reshape(batch, length, -1))
        if self.output_dropout:
            projected = F.dropout(projected, self.output_dropout, self.training)
        return projected

    def _normed(self, query: torch.Tensor, key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``query`` and ``key`` through the q/k norms, if the layer has them."""
        q_norm, k_norm = (getattr(self, name, None) for name in self.qk_norm_names)
        if q_norm is None or k_norm is None:
            return query, key
        if self.qk_norm_across:  # over all heads: (batch, seq, heads, head_dim) only
            return q_norm(query.flatten(-2)).view_as(query), k_norm(key.flatten(-2)).view_as(key)
        return q_norm(query), k_norm(key)

    def _query_factor(self, cache: LayerCache | None) -> torch.Tensor:
        """Llama 4's attention temperature per position, (batch, 1, seq, 1)."""
        positions = None if cache is None else cache.position_ids
        if positions is None:
            raise RequirementError(
                "this family scales its queries by position (llama_4_scaling_beta): the "
                "layer needs the position_ids transformers passes to every decoder layer"
            )
        assert self.query_scaling is not None
        beta, span = self.query_scaling
        factor = 1 + beta * torch.log(1 + torch.floor(positions / span))
        return factor[:, None, :, None]

    def _attend(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        mask: torch.Tensor | None,
        *,
        weights: bool = False,
        causal: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Attention output, (batch, heads, query, head_dim), and, when ``weights`` asks
        (``output_attentions=True``), the attention weights, computed for that call the
        way transformers' eager attention computes them. ``causal``: whether attention
        without a mask is causal (:func:`~layerswap.backends._layer.causal_call`)."""
        _layer.check_mask(mask, "fused", self.config)
        is_causal, key, value = _layer.causal_keys(query, key, value, mask, causal)
        if weights or self.softcap is not None:
            return self._attend_eagerly(query, key, value, mask, is_causal)
        if self.sinks is not None:
            # grouped keys and values expanded, and the causal mask made explicit, here
            key, value, mask = self._with_sinks(query, key, value, mask, is_causal)
            is_causal = False
        dropout = self.attention_dropout if self.training else 0.0
        output = _layer.sdpa(
            query, key, value, mask, is_causal=is_causal, scale=self.scaling, dropout=dropout
        )
        return output, None

    def _with_sinks(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        mask: torch.Tensor | None,
        is_causal: bool,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Keys and values with one more position, zero, and an additive mask (per head)
        whose last column is the head's sink logit: softmax over [q k^T * scale, sink] as
        gpt-oss's attention takes it, then nothing from the sink's zero value -- exact,
        and still one ``scaled_dot_product_attention`` call."""
        assert self.sinks is not None
        batch, heads, length, _ = query.shape
        if key.shape[1] != heads:
            key = key.repeat_interleave(heads // key.shape[1], dim=1)
            value = value.repeat_interleave(heads // value.shape[1], dim=1)
        key_length = key.shape[2]
        if is_causal or mask is None:
            allowed = torch.ones(length, key_length, dtype=torch.bool, device=query.device)
            mask = allowed.tril(key_length - length) if is_causal else allowed
            mask = mask[None, None]
        mask = mask[:, :, :, :key_length]
        if mask.dtype == torch.bool:
            lowest = torch.finfo(query.dtype).min
            mask = torch.zeros(mask.shape, dtype=query.dtype, device=query.device).masked_fill(
                ~mask, lowest
            )
        sink = self.sinks.to(query.dtype).view(1, heads, 1, 1)
        mask = torch.cat(
            (
                mask.to(query.dtype).expand(batch, heads, length, key_length),
                sink.expand(batch, heads, length, 1),
            ),
            dim=-1,
        )
        zero = key.new_zeros(batch, heads, 1, key.shape[-1])
        return torch.cat((key, zero), dim=2), torch.cat((value, zero), dim=2), mask

    def _attend_eagerly(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        mask: torch.Tensor | None,
        is_causal: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention through explicit weights: softmax(q k^T * scale + mask) v, as
        transformers' eager attention (softmax in float32, dropout on the weights), the
        scores soft-capped before the mask where the family caps them."""
        if self.num_key_value_groups > 1:
            key = key.repeat_interleave(self.num_key_value_groups, dim=1)
            value = value.repeat_interleave(self.num_key_value_groups, dim=1)
        scores = torch.matmul(query, key.transpose(2, 3)) * self.scaling
        if self.softcap is not None:
            scores = torch.tanh(scores / self.softcap) * self.softcap
        if is_causal:
            length = query.shape[2]
            mask = torch.ones(length, key.shape[2], dtype=torch.bool, device=query.device).tril()
        elif mask is not None:
            mask = mask[:, :, :, : key.shape[2]]
        if mask is not None:
            if mask.dtype == torch.bool:
                scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
            else:
                scores = scores + mask
        if self.sinks is not None:  # gpt-oss: the sink joins the softmax, then leaves
            sink = self.sinks.to(scores.dtype).view(1, -1, 1, 1)
            sink = sink.expand(scores.shape[0], -1, scores.shape[2], 1)
            scores = torch.cat((scores, sink), dim=-1)
        weights = F.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
        if self.sinks is not None:
            weights = weights[..., :-1]
        weights = F.dropout(weights, p=self.attention_dropout, training=self.training)
        return torch.matmul(weights, value), weights


class FusedMLP(nn.Module):
    """Gated MLP with one gate/up projection (gate first); a plain MLP (``down(act(up(x)))``,
    Nemotron, Arcee) has the original's two projections under the original's names."""

    def __init__(self, config: PreTrainedConfig, family: Family) -> None:
        super().__init__()
        bias = family.flag("mlp_bias", config)
        hidden, size = config.hidden_size, config.intermediate_size
        self.intermediate_size = size
        self.gated = family.feed_forward.kind == "gated"
        self.up_name, self.down_name = (
            ("gate_up_proj", "down_proj") if self.gated else family.feed_forward.modules
        )
        width = 2 * size if self.gated else size
        self.add_module(self.up_name, nn.Linear(hidden, width, bias=bias))
        self.add_module(self.down_name, nn.Linear(size, hidden, bias=bias))
        name = getattr(config, family.feed_forward.activation)
        self.act_fn = (
            hf_internals.activation_in_dtype(name, config)
            if family.feed_forward.activation_dtype
            else ACT2FN[name]
        )
        # Seed-OSS: dropout on the down projection's result, in training
        self.output_dropout = family.layer.residual_dropout_p(config)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        up, down = getattr(self, self.up_name), getattr(self, self.down_name)
        if not self.gated:
            out: torch.Tensor = down(self.act_fn(up(hidden_states)))
        else:
            gate, up_states = up(hidden_states).chunk(2, dim=-1)
            out = down(self.act_fn(gate) * up_states)
        if self.output_dropout:
            out = F.dropout(out, self.output_dropout, self.training)
        return out


def original_mlp(family: Family, config: PreTrainedConfig, layer_idx: int) -> nn.Module:
    """The original layer's own MLP module for ``layer_idx`` (``mlp="original"``: MoE blocks).

    Built by building the original decoder layer for ``(config, layer_idx)`` and keeping its
    ``mlp``: the same class, parameter names and constructor arguments, whatever the
    original chooses per layer (Qwen2-MoE's dense layers in ``mlp_only_layers``), and the
    router's class, which transformers' ``output_router_logits`` recording hooks. The
    original's attention and norms are built too and dropped: while a model is loaded
    (on the meta device) that costs nothing, and otherwise one layer's attention weights
    for a moment.
    """
    mlp = family.decoder_class()(config, layer_idx).get_submodule(family.feed_forward.attribute)
    if type(mlp).__module__ != family.module:
        raise UpstreamDriftError(
            f"{family.name}: the original layer's mlp is a {type(mlp).__qualname__} from "
            f"{type(mlp).__module__}, not a block of {family.module} (transformers "
            f"{transformers_version()})"
        )
    return mlp


class FusedDecoderLayer(_layer.DecoderLayer):
    """The fused decoder layer; use the per-family subclass from :func:`layer_class`.

    Constructed like the original, ``Layer(config, layer_idx)``, and called like it.
    With ``output_attentions=True`` it computes the attention weights, as the original's
    eager attention does, for that call.
    """

    backend = "fused"
    summary = "Fused decoder layer"
    records_attention_weights = True
    # sdpa's is_causal, read per call as the original's attention reads it
    call_options = frozenset({"is_causal"})

    def __init__(self, config: PreTrainedConfig, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        family = self.declared_family()
        self.self_attn = FusedAttention(config, layer_idx, family)
        # under the original's name (GraniteMoE's block_sparse_moe), so weights keep theirs
        self.add_module(
            family.feed_forward.attribute,
            original_mlp(family, config, layer_idx)
            if family.feed_forward.kind == "original"
            else FusedMLP(config, family),
        )
        # the norms under the original's names, wherever the family puts them
        numbers = original_numbers(family, config, layer_idx)
        for name in dict.fromkeys(name for _, name in family.normalization.places):
            self.add_module(
                name, _family_norm(config.hidden_size, config, family, numbers.norm_eps)
            )
        self.residual_multiplier = numbers.residual_multiplier


def layer_class(family: Family) -> type[FusedDecoderLayer]:
    """The fused decoder layer class for ``family`` (made once, then cached).

    Builtin families' classes are importable from this module by name
    (``layerswap.backends.fused.decoder:FusedLlamaDecoderLayer``,
    and from its package, ``layerswap.backends.fused``); a pickle holds how to make it again.
    """
    return _layer.family_layer_class(FusedDecoderLayer, family)


def __getattr__(name: str) -> Any:
    # a per-family class imported by its name (``from layerswap.backends.fused import ...``)
    # before this process made it: made now
    return _layer.layer_class_named(FusedDecoderLayer, name)
