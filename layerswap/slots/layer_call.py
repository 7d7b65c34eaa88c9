"""The decoder slot's call contract: what transformers calls the original layer (and its
attention) with, each parameter handled by the replacement.

:func:`layerswap.substitution.check_call_contract` asks the slot
(:meth:`layerswap.slots.decoder.DecoderSlot.check_call`), which checks here, before any
model is touched.

Example::

    check_layer_call(layerswap.get("llama.decoder.fused"), config)
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from layerswap.errors import UpstreamDriftError
from layerswap.versions import transformers_version

if TYPE_CHECKING:
    from transformers import PreTrainedConfig

    from layerswap.substitution import Substitution

__all__ = ["call_parameters", "check_layer_call", "handled_parameters"]


def call_parameters(function: Callable[..., Any]) -> list[str]:
    """The parameters of ``function`` a caller can name, ``self`` and ``*args``/``**kwargs`` left out."""
    variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    return [
        name
        for name, parameter in inspect.signature(function).parameters.items()
        if name != "self" and parameter.kind not in variadic
    ]


def handled_parameters(replacement: type) -> frozenset[str]:
    """The call parameters ``replacement`` handles: its declared ``handles``, else the
    parameters its ``forward`` names (what ``**kwargs`` swallows is not handled).

    Example::

        handled_parameters(layerswap.get("llama.decoder.fused").replacement_class())
        # frozenset({'cache', 'past_key_values', 'attention_mask', ...})
    """
    declared = getattr(replacement, "handles", None)
    if declared is not None:
        return frozenset(declared)
    return frozenset(call_parameters(replacement.forward))  # type: ignore[attr-defined]


def _passes_on(replacement: type, original: type) -> bool:
    """A subclass of ``original`` whose ``forward`` takes ``**kwargs`` and declares no
    ``handles`` (it hands what it is given to the original's ``forward``)."""
    if not issubclass(replacement, original) or getattr(replacement, "handles", None):
        return False
    kinds = {p.kind for p in inspect.signature(replacement.forward).parameters.values()}  # type: ignore[attr-defined]
    return inspect.Parameter.VAR_KEYWORD in kinds


def _attention_class(original: type, config: PreTrainedConfig | None) -> type | None:
    """The class of the original layer's ``self_attn`` (built on the meta device), if any."""
    if config is None:
        return None
    import torch

    try:
        with torch.device("meta"):
            layer = original(config, 0)
    except Exception:  # a config this class cannot take: the structure check says why
        return None
    attention = getattr(layer, "self_attn", None)
    return None if attention is None else type(attention)


def check_layer_call(sub: Substitution, config: PreTrainedConfig | None = None) -> None:
    """The decoder slot's part of :func:`check_call_contract`: the layer's (and its
    attention's) call parameters, each handled by the replacement."""
    version = transformers_version()
    original = sub.original_class()
    taken = call_parameters(original.forward)
    if "position_embeddings" not in taken:
        raise UpstreamDriftError(
            f"{sub.family}: {original.__name__}.forward in transformers {version} no longer "
            f"takes position_embeddings (it takes {taken}); {sub.name} follows the older "
            "contract"
        )
    if sub.unmet_requirement() is not None:
        return  # cannot run here anyway: the requirement error says why, when it is used
    replacement = sub.replacement_class()
    if _passes_on(replacement, original):
        return  # a subclass of the original hands its call to the original's forward
    handled = handled_parameters(replacement)
    declared = getattr(replacement, "family", None)  # a backend's per-family class
    shape = getattr(declared, "layer", None)
    ignored = frozenset(getattr(shape, "ignored_arguments", ()))
    callees: list[type] = [original]
    if getattr(replacement, "replaces_attention", False):
        attention = _attention_class(original, config)
        if attention is not None:
            callees.append(attention)
    for callee in callees:
        taken = call_parameters(callee.forward)  # type: ignore[attr-defined]
        unknown = [
            name
            for name in taken
            if name not in handled and not (callee is original and name in ignored)
        ]
        if unknown:
            names = ", ".join(repr(name) for name in unknown)
            raise UpstreamDriftError(
                f"{sub.family}: {callee.__name__}.forward in transformers {version} takes "
                f"{names}, which {replacement.__name__} ({sub.name}) does not handle: the "
                "layer contract changed since this layerswap was made, and the swapped "
                "model would compute something else. Upgrade layerswap, or install a "
                "transformers release it supports (docs/compatibility.md)"
            )
