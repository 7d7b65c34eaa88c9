"""A swapped model's gradients, mapped back to the original model's layout."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from layerswap.comparison.inputs import text_config
from layerswap.model import decoder_layers

if TYPE_CHECKING:
    from layerswap.substitution import Substitution

__all__ = ["gradients_to_original", "layer_gradients_to_original"]


def layer_gradients_to_original(
    layer: nn.Module,
    gradients: Mapping[str, torch.Tensor],
    substitution: Substitution,
    config: Any,
) -> dict[str, torch.Tensor]:
    """Map one replacement layer's gradients (relative names) to the original layout.

    The converter maps weights, ``w_replacement = to_replacement(w_original)``; the
    gradient of the original weights is the vector-Jacobian product of that map with the
    replacement's gradients. Autograd through the converter gets it right for any
    differentiable converter: renames, concatenations and custom rules alike (applying
    ``to_original`` to the gradients would be wrong for a rule that scales or shifts).
    """
    converter = substitution.converter
    state = {key: value.detach() for key, value in layer.state_dict().items()}
    with torch.no_grad():
        original = converter.to_original(state, config)
    leaves = {
        key: value.detach().clone().requires_grad_(True)
        for key, value in original.items()
        if isinstance(value, torch.Tensor) and value.is_floating_point()
    }
    with torch.enable_grad():
        converted = converter.to_replacement(dict(leaves), config)
        terms = [
            (converted[key] * grad.to(converted[key])).sum()
            for key, grad in gradients.items()
            if key in converted and converted[key].requires_grad
        ]
        if not terms:
            return {key: torch.zeros_like(leaf) for key, leaf in leaves.items()}
        grads = torch.autograd.grad(
            torch.stack(terms).sum(), list(leaves.values()), allow_unused=True
        )
    return {
        key: (grad if grad is not None else torch.zeros_like(leaf)).detach().cpu()
        for (key, leaf), grad in zip(leaves.items(), grads, strict=True)
    }


def gradients_to_original(
    model: nn.Module,
    gradients: Mapping[str, torch.Tensor],
    substitution: Substitution,
) -> dict[str, torch.Tensor]:
    """The swapped model's gradients, keyed and shaped as in the original model (as they
    are where the substitution puts no layer of its own in place of the decoder layers)."""
    if not substitution.parts.slot.replaces_layers:
        return dict(gradients)
    replacement = substitution.replacement_class()
    config = text_config(model)
    mapped = dict(gradients)
    for qualname, layer in decoder_layers(model):
        if not isinstance(layer, replacement):
            continue
        prefix = qualname + "."
        local = {
            name[len(prefix) :]: mapped.pop(name)
            for name in list(mapped)
            if name.startswith(prefix)
        }
        converted = layer_gradients_to_original(layer, local, substitution, config)
        mapped.update({prefix + key: value for key, value in converted.items()})
    return mapped
