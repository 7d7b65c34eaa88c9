"""A layerswap backend in one module: decoder layers that stop at the first non-finite output.

``<family>.decoder.guarded`` is the family's own decoder layer, subclassed so that its
``forward`` raises :class:`FloatingPointError` naming the layer when an output holds a
NaN or an infinity, instead of letting it spread to the loss. The weights are the
original's (nothing is renamed), so the converter is the identity and verification
against the original is exact.

Installed (``pip install examples/third_party_backend``), the entry point
``layerswap.backends`` registers it; then, like a builtin backend::

    layerswap.swap(model, backend="guarded")
    layerswap list --backend guarded
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from layerswap import Backend, Family, Implementation
from layerswap.weights import Converter

__all__ = ["BACKEND", "layer_class"]

_CLASSES: dict[type, type] = {}
_LOCK = threading.Lock()


def _forward(self: Any, *args: Any, **kwargs: Any) -> Any:
    output = super(type(self), self).forward(*args, **kwargs)
    hidden = output[0] if isinstance(output, tuple) else output
    if not torch.isfinite(hidden).all():
        attention = getattr(self, "self_attn", None)
        where = getattr(self, "layer_idx", getattr(attention, "layer_idx", "?"))
        raise FloatingPointError(f"decoder layer {where} produced a NaN or an infinity")
    return output


def layer_class(family: Family) -> type[torch.nn.Module]:
    """The family's decoder layer with the guard, made once per original class."""
    original = family.decoder_class()
    with _LOCK:
        made = _CLASSES.get(original)
        if made is None:
            name = f"Guarded{original.__name__}"
            made = type(name, (original,), {"forward": _forward, "__qualname__": name})
            _CLASSES[original] = made
        return made


def _identity(family: Family) -> Converter:
    return Converter()


BACKEND = Backend(
    name="guarded",
    description="the family's own decoder layer, stopping at the first non-finite output",
    slots={
        "decoder": Implementation(
            replacement=layer_class,
            converter=_identity,
            description="the original layer; raises FloatingPointError on a NaN or infinity",
        )
    },
)
