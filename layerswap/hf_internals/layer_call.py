"""The decoder layer's call contract: what transformers calls a layer with, read.

The parameters a layer is called with, the cache and its update, the rotary layout and
sections, the text config a layer reads. Part of :mod:`layerswap.hf_internals`, where
every touch point is named.
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from collections.abc import Sequence

__all__ = [
    "CACHE_ARGUMENTS",
    "CALL_OPTIONS",
    "IGNORED_CALL_KEYWORDS",
    "LAYER_CALL_PARAMETERS",
    "LayerCache",
    "LayerCall",
    "activation_in_dtype",
    "layer_attention_type",
    "merge_rotary_sections",
    "read_layer_call",
    "refuse_unread",
    "rotary_sections",
    "ATTENTION_FIELD",
    "attention_implementation",
    "text_config_of",
    "text_config_object",
    "torch_dtype_of",
]


# --- the decoder layer's call contract -----------------------------------------------------
# How a transformers model calls its decoder layers, and a layer its cache, changed over
# releases. Until 5.3 the cache came as ``past_key_values`` with a ``cache_position``,
# which the static cache needs in ``cache.update``'s ``cache_kwargs`` to know where to
# write; from 5.4 ``cache_position`` is gone; from 5.24 the cache comes as ``cache`` (the old
# name deprecated until 5.40) and ``cache.update`` receives the layer's keyword arguments
# as ``kwargs=``. A replacement layer reads its call here, and nowhere else, so every
# release it supports is read the same way; the upstream check refuses an original that
# takes a parameter outside :data:`LAYER_CALL_PARAMETERS`.

#: the names by which transformers releases pass the KV cache to a layer, newest first
CACHE_ARGUMENTS = ("cache", "past_key_values")

#: every parameter of a decoder layer's (or its attention's) ``forward``, on the supported
#: releases, that :func:`read_layer_call` reads: a replacement that reads its call here
#: handles all of them
LAYER_CALL_PARAMETERS = frozenset(
    {
        "hidden_states",
        "attention_mask",
        "position_ids",
        "position_embeddings",
        *CACHE_ARGUMENTS,
        "cache_position",
        "use_cache",
        "output_attentions",
    }
)


#: keywords transformers models pass their decoder layers at call time (through
#: ``**kwargs``, typed ``TransformersKwargs``) that an original layer under sdpa or eager
#: attention never reads: the loss's item count (Trainer), the output-capture switches
#: (transformers' hooks read them, not the layer), and the packed-sequence metadata only
#: flash-attention and Mamba kernels read, and what a vision wrapper hands its language
#: model along with the prompt (Aya Vision's and InternVL's ``image_sizes``). A
#: replacement may take them and do nothing
IGNORED_CALL_KEYWORDS = frozenset(
    {
        "num_items_in_batch",
        "image_sizes",
        "output_hidden_states",
        "output_router_logits",
        "cu_seq_lens_q",
        "cu_seq_lens_k",
        "max_length_q",
        "max_length_k",
        "seq_idx",
    }
)
#: call-time keywords the original's attention reads (sdpa's ``is_causal``: ``False``
#: attends both ways where the model dropped the mask): a replacement layer handles each
#: as the original does (it says so: ``DecoderLayer.call_options``) or refuses the call
CALL_OPTIONS = frozenset({"is_causal"})


def refuse_unread(kwargs: Mapping[str, Any], accepted: Collection[str], layer: str) -> None:
    """Raise :class:`~layerswap.errors.UpstreamDriftError` naming the first keyword of
    ``kwargs`` a layer does not handle: neither :data:`LAYER_CALL_PARAMETERS`, nor
    :data:`IGNORED_CALL_KEYWORDS`, nor in ``accepted`` (the call options the layer handles,
    the arguments its family's original ignores). One set lookup per keyword: a call
    passes two or three.

    Example::

        refuse_unread({"is_causal": False}, frozenset(), "TELlamaDecoderLayer")   # raises
    """
    for name in kwargs:
        if name in LAYER_CALL_PARAMETERS or name in IGNORED_CALL_KEYWORDS or name in accepted:
            continue
        from layerswap.errors import UpstreamDriftError

        what = (
            "an attention option of the original layer"
            if name in CALL_OPTIONS
            else "a keyword this layerswap does not know"
        )
        raise UpstreamDriftError(
            f"{layer} was called with {name}={kwargs[name]!r} ({what}), which it does not "
            "handle the way the original does: the swapped model would compute something "
            f"else. Call the model without {name}, use a backend that handles it, or "
            "upgrade layerswap"
        )


@dataclass(frozen=True)
class LayerCache:
    """The KV cache a layer was called with, updated the way the calling release does.

    ``cache`` is ``None`` when the call has none (training, ``use_cache=False``).
    ``cache_position`` is set by the releases that pass it (up to 5.3): their static
    cache writes at those positions, read from ``cache_kwargs``. ``passed`` is the rest of
    the call's keyword arguments, which releases from 5.24 hand to ``cache.update`` as
    ``kwargs=`` (``by_name``: the call named the cache ``cache``, as those releases do).
    """

    cache: Any | None = None
    cache_position: torch.Tensor | None = None
    passed: Mapping[str, Any] = field(default_factory=dict)
    by_name: str = "cache"

    @property
    def is_causal(self) -> bool | None:
        """The call's ``is_causal`` (``None``: not given; the layer's own default holds)."""
        causal = self.passed.get("is_causal")
        return None if causal is None else bool(causal)

    @property
    def position_ids(self) -> torch.Tensor | None:
        """The call's ``position_ids`` (Ministral 3 scales its queries by position)."""
        positions = self.passed.get("position_ids")
        return None if positions is None else positions

    def update(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        layer_idx: int,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``key``/``value`` (batch, heads, seq, head_dim); all of the layer's so far.

        Example::

            key, value = call.cache.update(key, value, self.layer_idx, (cos, sin))
        """
        if self.cache is None:
            return key, value
        if self.cache_position is not None:
            # transformers up to 5.3: Cache.update(key, value, layer_idx, cache_kwargs)
            cos, sin = position_embeddings if position_embeddings is not None else (None, None)
            cache_kwargs = {"sin": sin, "cos": cos, "cache_position": self.cache_position}
            updated = self.cache.update(key, value, layer_idx, cache_kwargs)
        elif self.by_name == "cache":
            # transformers from 5.24: Cache.update(key, value, layer_idx, kwargs=kwargs)
            updated = self.cache.update(key, value, layer_idx, kwargs=dict(self.passed))
        else:
            updated = self.cache.update(key, value, layer_idx)
        cached_key, cached_value = updated
        return cached_key, cached_value


@dataclass(frozen=True)
class LayerCall:
    """What a decoder layer was called with, read the same way on every supported release.

    Example::

        call = read_layer_call(kwargs, attention_mask=attention_mask, cache=cache)
        call.cache.update(key, value, layer_idx, call.position_embeddings)
    """

    attention_mask: torch.Tensor | None
    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None
    cache: LayerCache
    #: whether this call asks for attention weights (``output_attentions=True``)
    output_attentions: bool


def rotary_sections(config: Any) -> tuple[int, ...] | None:
    """The M-RoPE sections of ``config`` (Qwen2-VL: how many of a head's frequency pairs
    rotate by the temporal, height and width position), ``None`` for plain RoPE."""
    parameters = getattr(config, "rope_parameters", None)
    sections = parameters.get("mrope_section") if isinstance(parameters, dict) else None
    return tuple(int(size) for size in sections) if sections else None


def merge_rotary_sections(
    position_embeddings: tuple[torch.Tensor, torch.Tensor], sections: Sequence[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin as one position per token, where the model passes one per M-RoPE axis.

    Up to transformers 5.2x, Qwen2-VL's and Qwen2.5-VL's rotary embedding returns cos/sin
    of shape ``(3, batch, seq, head_dim)`` (temporal, height, width) and the attention
    takes each section of the head's dims from its axis; later releases merge them in the
    rotary embedding and pass ``(batch, seq, head_dim)``, as every other model does. The
    same merge here gives layerswap's layers the later form on every release.
    """
    cos, sin = position_embeddings
    if cos.dim() != 4 or cos.shape[0] != 3:
        return position_embeddings
    split = [int(size) for size in sections] * 2  # the halves of rotate-half's layout

    def merge(table: torch.Tensor) -> torch.Tensor:
        parts = torch.split(table, split, dim=-1)
        return torch.cat([part[index % 3] for index, part in enumerate(parts)], dim=-1)

    return merge(cos), merge(sin)


def text_config_of(config: Any) -> Any:
    """The config a decoder layer reads: a composite (multimodal) config's text config,
    by transformers' ``get_text_config()``, else ``config`` itself.

    The user's config is never changed. Where its ``dtype`` is a name
    (``save_pretrained`` leaves ``"float32"`` in the model's own config), a shallow copy
    whose ``dtype`` is the torch dtype it names is returned instead: a layer that builds
    tensors in ``config.dtype`` (Apertus's xIELU) cannot be built from a name -- by
    transformers or by layerswap's checks (:func:`torch_dtype_of`).
    """
    return torch_dtyped(text_config_object(config))


def torch_dtyped(text: Any) -> Any:
    """``text`` (a text config), or a shallow copy of it whose ``dtype`` is the torch
    dtype its ``dtype`` names where that is a name (:func:`text_config_of`)."""
    named = getattr(text, "dtype", None)
    dtype = torch_dtype_of(text)
    if isinstance(named, str) and dtype is not None:
        text = copy.copy(text)
        text.dtype = dtype
    return text


def text_config_object(config: Any) -> Any:
    """The text config object itself (``get_text_config()``, else ``config``), never a
    copy: one a caller watches for later changes (:func:`implementations`)."""
    get_text_config = getattr(config, "get_text_config", None)
    return get_text_config() if callable(get_text_config) else config


#: the field behind PreTrainedConfig's ``_attn_implementation`` property (what
#: ``set_attn_implementation`` writes)
ATTENTION_FIELD = "_attn_implementation_internal"


def attention_implementation(config: Any) -> Any:
    """The attention implementation ``config`` selects (``"sdpa"``, ``"eager"``), read
    from the field behind PreTrainedConfig's property by a plain lookup: the placement
    guard reads it at every forward pass, where the property, through the config's own
    ``__getattribute__``, costs microseconds. Read through the property where a release
    keeps it elsewhere."""
    held = object.__getattribute__(config, "__dict__")
    if ATTENTION_FIELD in held:
        return held[ATTENTION_FIELD]
    return getattr(config, "_attn_implementation", None)


def attention_function(name: Any) -> Any:
    """The function transformers' ``ALL_ATTENTION_FUNCTIONS`` dispatches the attention
    implementation ``name`` to (``"sdpa"``: ``sdpa_attention_forward``, or what was
    registered under that name since: ``AttentionInterface.register``); ``None`` for a
    name it holds no function for (``"eager"``: the modeling module's own), or before
    ``transformers.modeling_utils`` is imported. A dictionary lookup: the placement guard
    asks it at every forward pass."""
    module = sys.modules.get("transformers.modeling_utils")
    functions = getattr(module, "ALL_ATTENTION_FUNCTIONS", None)
    if functions is None or not isinstance(name, str):
        return None
    try:
        return functions.get(name)
    except Exception:  # a mapping of another shape on another release
        return None


def torch_dtype_of(config: Any) -> torch.dtype | None:
    """``config.dtype`` as a torch dtype (``"float32"`` -> ``torch.float32``), ``None``
    where it is unset or names none."""
    dtype = getattr(config, "dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype.removeprefix("torch."), None)
    return dtype if isinstance(dtype, torch.dtype) else None


def layer_attention_type(config: Any, layer_idx: int) -> str:
    """The ``attention_type`` an original layer has (``"sliding_attention"`` ...).

    transformers up to 5.3 reads it off each decoder layer to pick that layer's mask
    (``causal_mask_mapping[decoder_layer.attention_type]``); later releases ignore it.
    """
    layer_types = getattr(config, "layer_types", None)
    if layer_types and 0 <= layer_idx < len(layer_types):
        return str(layer_types[layer_idx])
    return "full_attention"


def read_layer_call(
    kwargs: Mapping[str, Any],
    *,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    cache: Any | None = None,
    use_cache: bool | None = None,
    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
    accepted: Collection[str] = frozenset(),
    layer: str = "the replacement layer",
) -> LayerCall:
    """A layer's call, from its named arguments and the rest (``kwargs``).

    The cache is found under either name (``cache``, or ``past_key_values`` as releases
    before 5.24 and deprecated callers name it); ``cache_position`` where the release
    passes it. A keyword in ``kwargs`` that the layer (``layer``, for the message) does
    not handle is refused (:func:`refuse_unread`; ``accepted``: the call options it
    handles, as :data:`CALL_OPTIONS` names them, and arguments its original ignores),
    never swallowed. Example::

        def forward(self, hidden_states, attention_mask=None, position_ids=None,
                    cache=None, use_cache=False, position_embeddings=None, **kwargs):
            call = read_layer_call(kwargs, attention_mask=attention_mask, cache=cache,
                                   position_ids=position_ids, use_cache=use_cache,
                                   position_embeddings=position_embeddings)
    """
    if kwargs:
        refuse_unread(kwargs, accepted, layer)
    by_name = "cache"
    rest = dict(kwargs)
    legacy = rest.pop("past_key_values", None)
    if cache is None and legacy is not None:
        cache, by_name = legacy, "past_key_values"
    cache_position = rest.pop("cache_position", None)
    # what the original's attention receives besides its named arguments, as
    # transformers hands it on to Cache.update
    passed = {**rest, "position_ids": position_ids, "use_cache": use_cache}
    return LayerCall(
        attention_mask=attention_mask,
        position_embeddings=position_embeddings,
        cache=LayerCache(cache, cache_position, passed, by_name),
        output_attentions=bool(rest.get("output_attentions")),
    )


def activation_in_dtype(name: str, config: Any) -> nn.Module:
    """The activation ``name`` of transformers' ``ACT2CLS`` built with the config's
    ``dtype``, as Apertus's MLP builds xIELU (``ACT2CLS["xielu"](dtype=config.dtype)``):
    its learned parameters in the model's precision, not the class's default."""
    from transformers.activations import ACT2CLS

    entry = ACT2CLS[name]
    cls, options = entry if isinstance(entry, tuple) else (entry, {})
    # None too, as Apertus passes it: torch's default dtype, not the class's bfloat16
    built: nn.Module = cls(**options, dtype=torch_dtype_of(config))
    return built
