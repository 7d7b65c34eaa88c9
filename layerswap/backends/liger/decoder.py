"""The ``liger`` backend's decoder layers, built from Liger-Kernel's Triton kernels, GPU only.

The layer keeps the original's modules and names (``self_attn.q_proj`` ... ``mlp.down_proj``,
the norms where the family puts them), so its weights are the original's, unconverted; what
changes is how they are used:

- every RMSNorm (input, post-attention, pre/post feed-forward, q/k norms per head or across
  heads) is Liger's RMSNorm kernel, with the family's offset (Gemma: ``1 + weight``, in
  Liger's "gemma" casting mode: all in float32; otherwise its "llama" mode: the normalised
  input cast back before the weight multiplies it);
- the gated MLP's activation-times-up is Liger's SwiGLU kernel (``silu``) or GeGLU kernel
  (tanh-approximated GELU);
- the rotary embedding is Liger's RoPE kernel, applied to the ``(cos, sin)`` the model
  passes (so every rotary variant the model's rotary module implements is kept);
- attention is ``scaled_dot_product_attention`` with grouped-query attention, as in the
  ``fused`` layer; the mask the model built holds padding and any sliding window.

The decoder-layer contract (signature, residuals, cache update) is
:mod:`layerswap.backends._layer`. The ``head`` slot's Liger form,
``"<family>.head.liger"``, is :mod:`layerswap.backends.liger.head`.

Refused, with the reason (:func:`unsupported`): attention logit soft-capping (SDPA has
none) and activations Liger has no gated kernel for. Nothing here imports Liger-Kernel
until a layer runs, so this module loads on any machine; :func:`unmet_requirement` says
why it cannot run.

Example::

    model = LlamaForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda()
    handle = layerswap.swap(model, "llama.decoder.liger")
    loss = model(input_ids, labels=input_ids).loss
"""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from layerswap.backends import _layer
from layerswap.backends._original import OriginalNumbers, original_numbers
from layerswap.backends.liger.declaration import (
    BACKEND,
    mlp_names,
    qkv_names,
    unsupported,
)
from layerswap.backends.liger.runtime import (
    NO_CUDA,
    NOT_INSTALLED,
    kernels,
    require_cuda,
    unmet_requirement,
)
from layerswap.errors import RequirementError
from layerswap.family import Family
from layerswap.weights import Converter, head_dim, qkv_sizes

if TYPE_CHECKING:
    from transformers import PreTrainedConfig

    from layerswap.hf_internals import LayerCache

__all__ = [
    "BACKEND",
    "CONVERTER",
    "GATED_KERNELS",
    "NOT_INSTALLED",
    "NO_CUDA",
    "LigerAttention",
    "LigerDecoderLayer",
    "LigerMLP",
    "LigerRMSNorm",
    "converter_for",
    "kernels",
    "layer_class",
    "tiny_config_problem",
    "unmet_requirement",
    "unsupported",
]

#: a config's activation -> the Liger kernel computing ``act(gate) * up`` with it
GATED_KERNELS = {
    "silu": "liger_swiglu",
    "swish": "liger_swiglu",
    "gelu_pytorch_tanh": "liger_geglu",  # Liger's GeGLU is the tanh approximation
    "gelu_new": "liger_geglu",
}

#: the original layer's weights are the replacement's: no tensor is renamed or fused
CONVERTER = Converter()


# --- what the layer can express ------------------------------------------------------------


def gated_kernel(activation: object) -> str | None:
    """The Liger kernel name for ``activation`` (a config's ``hidden_act``), or ``None``."""
    return GATED_KERNELS.get(str(activation))


def _config_problem(
    family: Family, config: PreTrainedConfig, numbers: OriginalNumbers
) -> str | None:
    """Why Liger's layer cannot compute ``family``'s layer with ``config`` and ``numbers``."""
    activation = getattr(config, family.feed_forward.activation, None)
    if gated_kernel(activation) is None:
        return (
            f"Liger has no gated-MLP kernel for {family.feed_forward.activation}={activation!r} (it has "
            "SwiGLU for silu and GeGLU for the tanh-approximated GELU)"
        )
    if numbers.attn_logit_softcapping is not None:
        return (
            "the liger layer attends with scaled_dot_product_attention, which has no "
            f"attention logit soft-capping (attn_logit_softcapping={numbers.attn_logit_softcapping})"
        )
    dropout = family.layer.residual_dropout_p(config)
    if dropout:
        return (
            "the liger layer applies no dropout after the output projections (this config's "
            f"{family.layer.residual_dropout}={dropout}; set it to 0 to train with liger)"
        )
    return None


def tiny_config_problem(family: Family) -> str | None:
    """Why Liger's layer cannot compute ``family``'s layer with its tiny config (built
    here: its activation, soft-capping, dropout), ``None`` when it can or when the tiny
    layer cannot be built (then judged per layer)."""
    try:
        config = family.tiny_config()
        numbers = original_numbers(family, config, 0)
    except Exception:  # a family whose tiny layer cannot be built here: judged per layer
        return None
    return _config_problem(family, config, numbers)


# --- the layer ------------------------------------------------------------------------------


class LigerRMSNorm(nn.Module):
    """RMSNorm through Liger's kernel; scales by ``offset + weight`` (Gemma: offset 1).

    ``in_place`` lets Liger's backward write the input's gradient over the output's; only
    safe where nothing else reads that gradient (a norm feeding projections, not one whose
    output joins the residual stream).
    """

    def __init__(self, size: int, eps: float, offset: float = 0.0, *, in_place: bool = False):
        super().__init__()
        # the original's initial value, so an unloaded weight means the same thing
        self.weight = nn.Parameter(torch.full((size,), 1.0 - offset))
        self.eps = eps
        self.offset = offset
        # Gemma's norm computes in float32 and casts last; Llama's casts before the weight
        self.casting_mode = "gemma" if offset else "llama"
        self.in_place = in_place

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        normed: torch.Tensor = kernels().liger_rms_norm(
            hidden_states,
            self.weight,
            self.eps,
            offset=self.offset,
            casting_mode=self.casting_mode,
            in_place=self.in_place,
        )
        return normed

    def extra_repr(self) -> str:
        offset = f", offset={self.offset}" if self.offset else ""
        return f"{tuple(self.weight.shape)}, eps={self.eps}{offset}, casting={self.casting_mode}"


def _family_norm(
    size: int, config: PreTrainedConfig, family: Family, *, in_place: bool = False
) -> LigerRMSNorm:
    return LigerRMSNorm(size, config.rms_norm_eps, family.normalization.offset, in_place=in_place)


class LigerAttention(nn.Module):
    """Self-attention with the original's projections, Liger's RoPE and q/k norms, and SDPA."""

    def __init__(
        self, config: PreTrainedConfig, layer_idx: int, family: Family, numbers: OriginalNumbers
    ) -> None:
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = head_dim(config)
        q_size, kv_size, _ = qkv_sizes(config)
        self.num_key_value_groups = q_size // kv_size
        self.scaling = numbers.scaling
        self.attention_dropout = float(getattr(config, "attention_dropout", 0.0) or 0.0)
        self.is_causal = numbers.is_causal  # the original's, not a config field it may ignore
        qkv_bias = family.flag("qkv_bias", config)
        # under the original's names: q_proj, k_proj, v_proj, or one qkv_proj ([q | k | v])
        self.qkv_names = qkv_names(family)
        self.sizes = (q_size, kv_size, kv_size)
        widths = (sum(self.sizes),) if len(self.qkv_names) == 1 else self.sizes
        for name, width in zip(self.qkv_names, widths, strict=True):
            self.add_module(name, nn.Linear(config.hidden_size, width, bias=qkv_bias))
        self.o_proj = nn.Linear(q_size, config.hidden_size, bias=family.flag("o_bias", config))
        self.q_norm: LigerRMSNorm | None = None
        self.k_norm: LigerRMSNorm | None = None
        # per head (Qwen3, Gemma 3) or over all heads at once (OLMo 2)
        self.qk_norm_across = family.attention.qk_norm == "across"
        if family.attention.qk_norm:
            sizes = (q_size, kv_size) if self.qk_norm_across else (self.head_dim, self.head_dim)
            self.q_norm = _family_norm(sizes[0], config, family)
            self.k_norm = _family_norm(sizes[1], config, family)

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None,
        cache: LayerCache | None = None,
    ) -> torch.Tensor:
        batch, length, _ = hidden_states.shape
        if len(self.qkv_names) == 1:
            projected_qkv = self.get_submodule(self.qkv_names[0])(hidden_states)
            query, key, value = _layer.split_heads(projected_qkv, self.sizes, self.head_dim)
        else:
            shape = (batch, length, -1, self.head_dim)
            query, key, value = (
                self.get_submodule(name)(hidden_states).view(shape) for name in self.qkv_names
            )
        if self.q_norm is not None and self.k_norm is not None:
            if self.qk_norm_across:
                query = self.q_norm(query.flatten(-2)).view_as(query)
                key = self.k_norm(key.flatten(-2)).view_as(key)
            else:
                query, key = self.q_norm(query), self.k_norm(key)
        cos, sin = position_embeddings
        # Liger's RoPE takes (batch, heads, seq, head_dim) views of bshd storage and rotates
        # that storage in place: the projections' (or norms') fresh outputs, which no
        # backward reads
        query, key = kernels().liger_rope(query.transpose(1, 2), key.transpose(1, 2), cos, sin)
        value = value.transpose(1, 2)
        key, value = _layer.update_cache(
            cache,
            key,
            value,
            self.layer_idx,
            layout="bhsd",
            position_embeddings=position_embeddings,
        )
        output = self._attend(
            query, key, value, attention_mask, causal=_layer.causal_call(self.is_causal, cache)
        )
        projected: torch.Tensor = self.o_proj(output.transpose(1, 2).reshape(batch, length, -1))
        return projected

    def _attend(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        mask: torch.Tensor | None,
        *,
        causal: bool = True,
    ) -> torch.Tensor:
        """SDPA over (batch, heads, seq, head_dim); the mask is the model's 4-D mask or None;
        ``causal``: whether attention without a mask is causal."""
        _layer.check_mask(mask, "liger", self.config)
        is_causal, key, value = _layer.causal_keys(query, key, value, mask, causal)
        dropout = self.attention_dropout if self.training else 0.0
        return _layer.sdpa(
            query, key, value, mask, is_causal=is_causal, scale=self.scaling, dropout=dropout
        )


class LigerMLP(nn.Module):
    """The original's gated MLP (its projections under its names) with Liger's SwiGLU or
    GeGLU kernel for ``act(gate) * up``."""

    def __init__(self, config: PreTrainedConfig, family: Family) -> None:
        super().__init__()
        bias = family.flag("mlp_bias", config)
        activation = getattr(config, family.feed_forward.activation, None)
        kernel = gated_kernel(activation)
        if kernel is None:  # LigerDecoderLayer checks first; this guards direct use
            raise RequirementError(f"Liger has no gated-MLP kernel for {activation!r}")
        self.kernel = kernel
        # under the original's names: gate_proj, up_proj, down_proj, or gate_up_proj
        # (gate first) and down_proj
        self.names = mlp_names(family)
        hidden, inner = config.hidden_size, config.intermediate_size
        widths = (inner, inner) if len(self.names) == 3 else (2 * inner,)
        for name, width in zip(self.names[:-1], widths, strict=True):
            self.add_module(name, nn.Linear(hidden, width, bias=bias))
        self.add_module(self.names[-1], nn.Linear(inner, hidden, bias=bias))

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if len(self.names) == 3:
            gate = self.get_submodule(self.names[0])(hidden_states)
            up = self.get_submodule(self.names[1])(hidden_states)
        else:
            gate, up = self.get_submodule(self.names[0])(hidden_states).chunk(2, dim=-1)
        gated = getattr(kernels(), self.kernel)(gate, up)
        return self.get_submodule(self.names[-1])(gated)  # type: ignore[no-any-return]

    def extra_repr(self) -> str:
        return f"kernel={self.kernel}"


class LigerDecoderLayer(_layer.DecoderLayer):
    """The Liger-Kernel decoder layer; use the per-family subclass from :func:`layer_class`.

    Constructed like the original, ``Layer(config, layer_idx)``, with the original's module
    names and weights; building needs no Liger-Kernel, running does (on CUDA tensors).
    ``output_attentions=True`` gets no weights (SDPA computes none): the layer warns.
    """

    backend = "liger"
    summary = "Liger-Kernel decoder layer"
    # sdpa's is_causal, read per call as the original's attention reads it
    call_options = frozenset({"is_causal"})

    def __init__(self, config: PreTrainedConfig, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        family = self.declared_family()
        numbers = original_numbers(family, config, layer_idx)
        problem = _config_problem(family, config, numbers)
        if problem is not None:
            raise RequirementError(
                f"{family.name}.decoder.liger cannot build this layer: {problem}"
            )
        self.self_attn = LigerAttention(config, layer_idx, family, numbers)
        self.add_module(family.feed_forward.attribute, LigerMLP(config, family))
        # the norms under the original's names, wherever the family puts them; a norm
        # before attention or the MLP feeds projections only, so its backward may work in
        # place (Liger's default); one after joins the residual stream, so it may not
        for place, name in family.normalization.places:
            in_place = place in ("attn_in", "mlp_in")
            self.add_module(
                name, _family_norm(config.hidden_size, config, family, in_place=in_place)
            )
        self.residual_multiplier = numbers.residual_multiplier

    def _call_context(self, hidden_states: torch.Tensor) -> AbstractContextManager[Any]:
        require_cuda(hidden_states, self)
        return contextlib.nullcontext()


def layer_class(family: Family) -> type[LigerDecoderLayer]:
    """The Liger decoder layer class for ``family`` (made once, then cached).

    Builtin families' classes are importable from this module by name
    (``layerswap.backends.liger.decoder:LigerLlamaDecoderLayer``,
    and from its package, ``layerswap.backends.liger``); a pickle holds how to make it again.
    """
    return _layer.family_layer_class(LigerDecoderLayer, family)


def converter_for(family: Family) -> Converter:
    """The liger layer's converter: none needed (the original's weights, unrenamed)."""
    return CONVERTER


def __getattr__(name: str) -> Any:
    # a per-family class imported by its name (``from layerswap.backends.liger import ...``)
    # before this process made it: made now
    return _layer.layer_class_named(LigerDecoderLayer, name)
