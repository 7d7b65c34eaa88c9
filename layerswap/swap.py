"""Swapping a part of a model that already exists, and undoing it.

:func:`swap` finds the model's family and the substitution, and hands the model to the
substitution's slot (:mod:`layerswap.slots`): the decoder slot swaps every decoder
layer, converting its weights (:mod:`layerswap.slots.decoder`), the head slot the causal
LM's head (:mod:`layerswap.slots.head`). Each returns a :class:`SwapHandle` that says what
was swapped and undoes it.

Example::

    handle = layerswap.swap(model, "llama.decoder.fused")   # or backend="fused"
    print(handle.report())
    handle.undo()

    with layerswap.swap(model, backend="fused"):
        logits = model(input_ids).logits
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

from torch import nn

from layerswap.errors import SubstitutionError, SwapWarning, UnknownSubstitutionError
from layerswap.family import Family
from layerswap.handle import SwapHandle
from layerswap.layers import convert_layer, layer_index
from layerswap.model import decoder_layers, family_of, substitution_of, unwrap
from layerswap.registry import get
from layerswap.slots.decoder import LayerSwapHandle
from layerswap.substitution import Substitution

if TYPE_CHECKING:
    from transformers import PreTrainedConfig

__all__ = [
    "LayerSwapHandle",
    "SwapHandle",
    "build_replacement_layer",
    "decoder_layers",
    "family_of",
    "rebuild_originals",
    "substitution_of",
    "swap",
]


def rebuild_originals(model: nn.Module, substitution: str | Substitution) -> int:
    """Put original layers, holding the converted weights, where ``substitution``'s layers are.

    For a model built or loaded inside :func:`layerswap.use`, which has no swap to
    undo: this makes the original-layout twin that :func:`layerswap.verify` compares
    it with. It works in place and is not reversible, so call it on a copy. Returns the
    number of layers rebuilt.

    Example::

        reference = copy.deepcopy(model_built_in_use)
        rebuild_originals(reference, "llama.decoder.fused")
    """
    target = unwrap(model, parallel=False)
    sub = get(substitution)
    _family_for(target, sub)  # a model no family (nor the slot's model type) fits: refused
    return sub.parts.slot.rebuild_originals(target, sub)


def _family_for(target: nn.Module, sub: Substitution) -> Family:
    """The family ``target`` is of, for swapping ``sub``: a registered one, or ``sub``'s
    own model type's where its slot takes any model type and the model is one of it."""
    own = sub.parts.family
    try:
        found = family_of(target)
    except UnknownSubstitutionError:
        if not sub.parts.slot.takes_any_model_type or not any(
            type(module).__module__ == own.module for module in target.modules()
        ):
            raise
        return own
    # a model type reusing another's classes (EXAONE's model is a LlamaForCausalLM)
    if sub.parts.slot.takes_any_model_type and found.module == own.module:
        return own
    return found


def swap(
    model: nn.Module,
    substitution: str | Substitution | None = None,
    *,
    backend: str | None = None,
) -> SwapHandle:
    """Swap a substitution's part of a built ``model`` (every decoder layer, layer by
    layer, or the head), reversibly.

    ``substitution`` is a registered name or a :class:`Substitution`; ``backend``
    (default ``"fused"``) picks ``"<family>.decoder.<backend>"`` for the model's
    family. Atomic: if any layer fails to convert, the layers already swapped are
    put back and a :class:`ConversionError` names the layer and the tensor. Works on
    meta-device models without moving data. A ``torch.compile`` result is swapped
    through its ``_orig_mod`` with a :class:`SwapWarning` (it must recompile).

    Example::

        handle = layerswap.swap(model, "llama.decoder.fused")
        handle.undo()
    """
    # only torch.compile is seen through: a handle's layer names are those the caller sees
    target = unwrap(model, parallel=False)
    if target is not model:
        warnings.warn(
            "swapping the layers inside a torch.compile result: compile the model again "
            "(torch.compile(model)) after the swap and after undo, or it may run stale code",
            SwapWarning,
            stacklevel=2,
        )
    if substitution is not None and backend is not None:
        raise TypeError("swap() takes a substitution or a backend, not both")
    family: Family | None = None
    if substitution is None:
        family = family_of(target)
        substitution = f"{family.name}.decoder.{backend or 'fused'}"
    sub = get(substitution)  # the one name resolved: every step below is handed objects
    if family is None:
        family = _family_for(target, sub)
    if sub.family != family.name:
        raise SubstitutionError(
            f"{sub.name} is for {sub.family} models, but this model is {family.name} "
            f"({type(target).__name__}); use {family.name}.{sub.slot}.{sub.backend} "
            "or swap(model, backend=...)"
        )
    return sub.parts.slot.swap(target, sub)


def build_replacement_layer(
    substitution: str | Substitution,
    layer: nn.Module,
    *,
    config: PreTrainedConfig,
    layer_idx: int | None = None,
) -> nn.Module:
    """A replacement for ``layer`` carrying its weights, leaving ``layer`` untouched.

    Tensors that only change name share storage with ``layer`` (no copy) but are new
    ``Parameter`` objects with the same ``requires_grad``; concatenated ones are new
    tensors. For side-by-side comparisons (``layerswap.verify``); to swap a model,
    use :func:`layerswap.swap`.

    Example::

        fused = build_replacement_layer("llama.decoder.fused", model.model.layers[0],
                                        config=model.config)
    """
    index = layer_index(layer, 0) if layer_idx is None else layer_idx
    return convert_layer(layer, get(substitution), config, layer_idx=index, detach=True)
