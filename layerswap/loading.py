"""Loading and saving models whose layers were replaced: the weight transforms, and ``use()``.

``from_pretrained`` converts an original-layout checkpoint into replacement layers
with per-layer transforms (:func:`conversion_transforms`); ``save_pretrained``
reverses the same list to write the original layout again. A model built inside
:func:`layerswap.use` is finished by :func:`adopt_constructed`, which keeps the list it
made so loading (:func:`loading_transforms`) and saving share it.

Example::

    transforms = conversion_transforms(model, layerswap.get("llama.decoder.fused"))
    len(transforms)   # a few per swapped layer
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Sequence
from typing import Any

from torch import nn

from layerswap import hf_internals
from layerswap.config_view import ModelConfig
from layerswap.errors import ConversionError
from layerswap.layers import adopt_layer
from layerswap.model import layer_config, substitution_of
from layerswap.parallel import tp_plan_of
from layerswap.peft_targets import hold as hold_peft_targets
from layerswap.placement import Placement
from layerswap.placement_guard import guard
from layerswap.substitution import Substitution

__all__ = [
    "adopt_constructed",
    "conversion_transforms",
    "loading_transforms",
    "model_attributes",
    "refuse_two_layouts",
]

# models finished by adopt_constructed -> the weight transforms made for them
_ADOPTED: weakref.WeakKeyDictionary[nn.Module, list[Any]] = weakref.WeakKeyDictionary()


def conversion_transforms(
    model: nn.Module,
    sub: Substitution,
    replacement_cls: type[nn.Module] | None = None,
    *,
    view: ModelConfig | None = None,
) -> list[Any]:
    """``transformers`` weight transforms for the layers of ``model`` that ``sub`` made.

    ``from_pretrained`` applies them to load an original-layout checkpoint into the
    replacement layers; ``save_pretrained`` reverses them to write that layout. Layers
    of class ``replacement_cls`` count too, marked or not (a model still being built).

    Example::

        conversion_transforms(swapped_model, layerswap.get("llama.decoder.fused"))

    ``view``: ``model``'s config, unwrapped already (a swap's).
    """
    config = getattr(model, "config", None)
    if config is None:
        return []
    prefix = getattr(model, "base_model_prefix", "") or ""
    text = view.text if view is not None and view.config is config else layer_config(config)
    transforms: list[Any] = []
    for name, module in model.named_modules():
        made_here = substitution_of(module) is sub
        if not made_here and not (replacement_cls is not None and type(module) is replacement_cls):
            continue
        scope = name[len(prefix) + 1 :] if prefix and name.startswith(prefix + ".") else name
        transforms.extend(
            sub.converter.weight_transforms(text, scope_prefix=scope, base_model_prefix=prefix)
        )
    return transforms


def model_attributes(
    model: nn.Module, sub: Substitution, replacement_cls: type[nn.Module], transforms: list[Any]
) -> dict[str, Any]:
    """The attributes a ``PreTrainedModel`` holding ``sub``'s layers needs, by name.

    Its weight conversions with ``transforms`` added (``save_pretrained`` reverses them),
    its no-split classes with ``replacement_cls`` added (``device_map`` keeps each
    replacement layer on one device), and its tensor-parallel plan translated for the
    replacement's modules (:func:`layerswap.parallel.tp_plan_of`).
    """
    no_split = set(getattr(model, "_no_split_modules", None) or ())
    attributes = {
        hf_internals.WEIGHT_CONVERSIONS_ATTRIBUTE: (
            hf_internals.base_weight_conversions(model) + transforms
        ),
        "_no_split_modules": no_split | {replacement_cls.__name__},
    }
    layers = [
        name
        for name, module in model.named_modules()
        if substitution_of(module) is sub or type(module) is replacement_cls
    ]
    plan = tp_plan_of(model, sub, layers)
    if plan is not None:
        attributes[hf_internals.TP_PLAN_ATTRIBUTE] = plan
    return attributes


def adopt_constructed(model: Any, sub: Substitution, replacement_cls: type[nn.Module]) -> None:
    """Finish a model built inside :func:`layerswap.use`: checks and bookkeeping.

    Runs the upstream-structure check, adopts the replacement layers
    (:func:`layerswap.layers.adopt_layer`), gives them the hidden-state capture hooks,
    and records the weight conversions that ``save_pretrained`` reverses and the
    no-split class for ``device_map``. Nested ``use()`` blocks finish a model once.

    Example::

        adopt_constructed(LlamaForCausalLM(config), sub, sub.replacement_class())
    """
    from transformers import PreTrainedModel

    if not isinstance(model, PreTrainedModel):
        return
    layers = [(name, m) for name, m in model.named_modules() if type(m) is replacement_cls]
    if not layers:
        return
    fresh = [(name, layer) for name, layer in layers if substitution_of(layer) is None]
    if fresh:
        config = layer_config(model.config)
        # contract, structure, proof: before any change
        sub.parts.slot.prepare(sub, config, Placement.of(model))
        original_cls = sub.original_class()
        for _, layer in fresh:
            adopt_layer(layer, sub, config)
            hf_internals.capture_like_original(layer, model, original_cls)
        # built on the meta device: proven at use; with the model's own config, which a
        # switch of its attention implementation changes (``config`` may be a copy)
        guard(model, sub, model.config, proven=False)
        hold_peft_targets(model)  # while it exists, a new PEFT adapter cannot miss fused modules
    if model in _ADOPTED:
        return  # nested use() of the same substitution: done once
    transforms = conversion_transforms(model, sub)
    _ADOPTED[model] = transforms
    for attribute, value in model_attributes(model, sub, replacement_cls, transforms).items():
        setattr(model, attribute, value)


def loading_transforms(
    model: Any, sub: Substitution, replacement_cls: type[nn.Module], found: list[Any]
) -> list[Any]:
    """The transforms ``from_pretrained`` needs for ``model``'s replacement layers.

    Those made when the model was adopted (so loading and saving share one list),
    unless ``found`` already holds them.

    Example::

        extra = loading_transforms(model, sub, sub.replacement_class(), transforms)
    """
    transforms = _ADOPTED.get(model)
    if transforms is None:
        transforms = conversion_transforms(model, sub, replacement_cls)
    present = {id(transform) for transform in found}
    return [transform for transform in transforms if id(transform) not in present]


def refuse_two_layouts(
    model: nn.Module,
    keys: Iterable[str],
    transforms: Sequence[Any],
    sub: Substitution,
    replacement_cls: type[nn.Module],
) -> None:
    """:class:`ConversionError` where a checkpoint gives one of ``sub``'s layers a tensor
    both in the original layout (converted into it by ``sub``'s transforms) and in the
    replacement's (loaded as it is, under the same name): ``from_pretrained`` would keep
    one and drop the other without a word, where ``load_state_dict`` refuses the mix.
    Read from the names alone, before any tensor loads."""
    layers = [name for name, module in model.named_modules() if type(module) is replacement_cls]
    if not layers:
        return
    ours = {id(transform) for transform in loading_transforms(model, sub, replacement_cls, [])}
    converted: dict[str, str] = {}
    direct: dict[str, str] = {}
    for key, target, converter in hf_internals.landings(model, keys, transforms):
        if converter is None:
            direct.setdefault(target, key)
        elif id(converter) in ours:
            converted.setdefault(target, key)
    for target in sorted(set(direct) & set(converted)):
        layer = next((name for name in layers if target.startswith(name + ".")), None)
        if layer is not None:
            raise ConversionError(
                f"loading {layer}: the checkpoint mixes the original layout "
                f"({converted[target]!r}) and {sub.name}'s layout ({direct[target]!r}), "
                f"both for {target!r}; give one layout per layer"
            )
