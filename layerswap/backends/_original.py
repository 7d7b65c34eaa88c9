"""What the original decoder layer computes with, read from an instance of it.

Some numbers a layer uses are not config fields under one name across families: the
attention's softmax scale (``head_dim ** -0.5``, Gemma's ``query_pre_attn_scalar **
-0.5``, Granite's ``attention_multiplier``), Granite's residual multiplier, Gemma 2's
attention logit soft-capping. Rather than re-deriving each from the config, a
replacement reads them off the original layer built for the same config on the meta
device (no memory, no initialisation), so it computes with exactly what the installed
transformers would.

Example::

    numbers = original_numbers(family, config, layer_idx=0)
    numbers.scaling          # 0.125 for head_dim 64
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from layerswap.family import probed_eps, stateless

if TYPE_CHECKING:
    from transformers import PreTrainedConfig

    from layerswap.family import Family

__all__ = ["OriginalNumbers", "original_numbers"]


@dataclass(frozen=True)
class OriginalNumbers:
    """The original layer's attention scale, residual multiplier and logit soft-cap."""

    scaling: float
    residual_multiplier: float = 1.0
    attn_logit_softcapping: float | None = None
    #: the epsilon of the layer's norms (its config field's name differs by family)
    norm_eps: float | None = None
    #: whether the layer applies the rotary embedding (:attr:`~layerswap.decoder_shape.Rope.layers`)
    rotary: bool = True
    #: whether its attention is causal where the model passes no mask: the original's own
    #: ``is_causal`` (Gemma 3 reads ``use_bidirectional_attention``; Llama keeps it causal
    #: whatever the config says)
    is_causal: bool = True


def original_numbers(family: Family, config: PreTrainedConfig, layer_idx: int) -> OriginalNumbers:
    """The numbers ``family``'s original decoder layer ``layer_idx`` uses under ``config``."""
    with torch.device("meta"):
        layer = family.decoder_class()(config, layer_idx)
    attention = getattr(layer, "self_attn", None)
    scaling = getattr(attention, "scaling", None)
    if scaling is None:
        scaling = float(getattr(attention, "head_dim", 0) or 1) ** -0.5
    softcap = getattr(attention, "attn_logit_softcapping", None)
    eps = None
    for _, name in family.normalization.places:
        norm = layer.get_submodule(name)
        eps = getattr(norm, "eps", None) or getattr(norm, "variance_epsilon", None)
        if eps is None and stateless(norm):
            # OLMo's LayerNorm writes its 1e-5 into forward()
            eps = probed_eps(norm, int(config.hidden_size))
        if eps is not None:
            break
    return OriginalNumbers(
        scaling=float(scaling),
        residual_multiplier=float(getattr(layer, "residual_multiplier", 1.0)),
        attn_logit_softcapping=None if softcap is None else float(softcap),
        norm_eps=None if eps is None else float(eps),
        rotary=family.rope.rotates(attention, config),
        is_causal=bool(getattr(attention, "is_causal", True)),
    )
