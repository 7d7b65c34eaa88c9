"""Model families derived from the installed transformers, not written by hand.

:func:`infer_declaration` reads a family's declaration off its modeling module: the causal
LM, config and decoder-layer classes from transformers' auto mappings, and the layer's
structure from one layer built for a tiny config -- which projections (separate or
already fused, a gated or a plain MLP) and norms it has and where the norms sit (by
their names), q/k norms per head (one weight, or a weight per head) or across heads and
the config field that switches them on, which biases follow which config switch. Probed
numerically: the norm's kind (RMSNorm, LayerNorm with or without a bias) and whether it
scales by ``weight`` or ``1 + weight``; the rotary layout (rotate-half or interleaved
pairs, from the module's ``apply_rotary_pos_emb``); whether attention and MLP run in
parallel (the MLP's input does not change when the attention's output does). Also which
config field names the activation. What the layer computes with beyond structure
(softmax scale, Granite's residual multiplier) the replacement reads off the original
layer itself (:mod:`layerswap.backends._original`). An MLP that is a block of the modeling
module's own (mixture of experts: Mixtral, Qwen2-MoE) is kept as it is (``mlp="original"``).

A family whose layer has anything else -- another module, a parameter of its own, absent
rotary embeddings -- is refused with the reason
(:class:`~layerswap.errors.UnsupportedFamilyError`), never declared half-right.

Inference sees structure, not every detail of a forward pass, so a family becomes
builtin only once the generated tests verify it (:data:`VERIFIED`): the fused layer
against the original in float32 on padded inputs, a training step, greedy generation,
save and plain reload, undo. :func:`layerswap.coverage.coverage` reports every decoder family the installed
transformers ships.

This module sits below the registry: it imports no backend and registers nothing. A
declaration is proven (its fused layer against the original) by
:func:`layerswap.inference.infer_family`, which passes that proof in as ``prove``.

Here: the model type's classes, its tiny model, and the probes run in order. Beside it,
one concern each: ``_infer_tiny`` (the tiny config and what a declaration records of
it), ``_infer_layer`` (one layer run on fixed inputs: norm kinds, rotary layout, which
tensor reaches which branch), ``_infer_switches`` (the config fields that switch the
layer's structure) and ``_infer_probes`` (:data:`PROBES`, each reading a ``Subject``).

Example::

    family = infer_declaration("olmo2")     # Family(name="olmo2", norms=(("attn_out", ...
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch
from torch import nn

from layerswap.errors import UnsupportedFamilyError
from layerswap.families._infer_layer import gist, seeded_layer, training_output
from layerswap.families._infer_probes import CLAMP_THAT_BITES, PROBES, Subject, different_layers
from layerswap.families._infer_tiny import query_scaled_rope, tiny_config_for, tiny_of
from layerswap.families._inferred import INFERRED
from layerswap.family import Family

__all__ = [
    "CLAMP_THAT_BITES",
    "PROBES",
    "VERIFIED",
    "Prove",
    "decoder_model_types",
    "ModelTypeClasses",
    "model_type_classes",
    "infer_declaration",
    "seeded_layer",
    "tiny_config_for",
    "training_output",
]

#: model types whose inferred declaration the generated tests verify in CI: the builtin
#: families beyond the hand-written ones, read off their one list,
#: ``layerswap/families/_inferred.py`` (``python scripts/gen_families.py --add TYPE``)
VERIFIED: tuple[str, ...] = tuple(family.model_type for family in INFERRED)

#: ``prove(family, where)``: raises :class:`~layerswap.errors.UnsupportedFamilyError`
#: when an inferred declaration does not compute what the original does
#: (:func:`layerswap.inference.prove_inferred`, above the registry, passes itself in)
Prove = Callable[[Family, str], None]


def _wrapper_reason(model_type: str, config_class: Any, prove: Prove | None) -> str | None:
    """Why a multimodal wrapper (Gemma 4: no ``model.layers``, or a tower that cannot be
    built here) is not covered: its language model's reason. ``None``: not a wrapper."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    text = getattr(config_class, "sub_configs", {}).get("text_config")
    text_type = getattr(text, "model_type", None)
    if (
        not text_type
        or text_type == model_type
        or text_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    ):
        return None
    try:
        infer_declaration(text_type, prove=prove)
    except UnsupportedFamilyError as exc:
        return f"{model_type}: a multimodal wrapper whose language model is {exc}"
    return (
        f"{model_type}: a multimodal wrapper whose language model ({text_type}) fits the fused "
        "layer, but the wrapper is not proven on its media inputs (layerswap.comparison.multimodal)"
    )


def _auto_names(model_type: str) -> tuple[str, str, str]:
    """(modeling module, causal LM class name, config class name) from the auto mappings."""
    from transformers.models.auto.configuration_auto import (
        CONFIG_MAPPING_NAMES,
        model_type_to_module_name,
    )
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    causal_lm = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    config = CONFIG_MAPPING_NAMES.get(model_type)
    if not causal_lm or not config:
        raise UnsupportedFamilyError(
            f"{model_type}: transformers has no causal LM for this model type"
        )
    package = model_type_to_module_name(model_type)
    return f"transformers.models.{package}.modeling_{package}", causal_lm, config


def decoder_model_types() -> Iterator[str]:
    """Every model type with a causal LM in the installed transformers, sorted."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    yield from sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


class ModelTypeClasses(NamedTuple):
    """What transformers has for a model type, imported (:func:`_classes`)."""

    module_name: str  # the modeling module's
    module: Any
    causal_lm_name: str  # as the auto mapping names it
    causal_lm: Any
    config_class: type  # the class that builds the causal LM's config


def model_type_classes(model_type: str) -> ModelTypeClasses:
    """The modeling module, causal LM and config class of ``model_type``; a model type
    they cannot be imported for is refused."""
    module_name, causal_lm_name, config_name = _auto_names(model_type)
    try:
        module = importlib.import_module(module_name)
        causal_lm = getattr(module, causal_lm_name)
        config_class = getattr(
            importlib.import_module(module_name.replace("modeling_", "configuration_")), config_name
        )
    except (ImportError, AttributeError) as exc:
        raise UnsupportedFamilyError(f"{model_type}: {exc}") from exc
    # a multimodal wrapper's causal LM is its language model alone (Gemma 4, Llama 4,
    # Qwen3.5): built from the text config class it declares
    own_config = getattr(causal_lm, "config_class", None)
    if isinstance(own_config, type) and own_config is not config_class:
        config_class = own_config
    return ModelTypeClasses(module_name, module, causal_lm_name, causal_lm, config_class)


def _tiny_config(model_type: str, causal_lm: Any, config_class: type) -> tuple[Any, str | None]:
    """The tiny config the layers are probed on, and the family's ``query_scale``."""
    try:
        config = tiny_config_for(config_class)
    except Exception as exc:
        raise UnsupportedFamilyError(f"{model_type}: no tiny config ({gist(exc)})") from exc
    # the fused layer reads the 4-D masks of both; eager where the model refuses SDPA
    # (Gemma 2: soft-capped attention)
    config._attn_implementation = "sdpa" if getattr(causal_lm, "_supports_sdpa", True) else "eager"
    # Llama 4's attention temperature (Ministral 3): queries scaled by a function of the
    # position, read from the default rotary parameters the tiny config leaves out
    try:
        default_rope = getattr(config_class(), "rope_parameters", None) or {}
    except Exception:  # a config that needs arguments: nothing to read here
        default_rope = {}
    query_scale = (
        "llama4"
        if isinstance(default_rope, dict) and default_rope.get("llama_4_scaling_beta") is not None
        else None
    )
    if query_scale is not None:  # the layer reads both fields: the tiny config keeps them
        config.rope_parameters = query_scaled_rope(config.rope_parameters, default_rope)
    return config, query_scale


def _decoder_layers(
    model_type: str, causal_lm: Any, config_class: type, config: Any, prove: Prove | None
) -> tuple[nn.Module, Any]:
    """The tiny model, built on the meta device, and its decoder layers (one class), else
    the reason: a multimodal wrapper's, or what stops the model building."""
    with torch.device("meta"):
        try:
            model = causal_lm(config)
        except Exception as exc:
            raise UnsupportedFamilyError(
                _wrapper_reason(model_type, config_class, prove)
                or f"{model_type}: cannot build a tiny model ({gist(exc)})"
            ) from exc
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, nn.ModuleList) or not len(layers):
        raise UnsupportedFamilyError(
            _wrapper_reason(model_type, config_class, prove)
            or f"{model_type}: no model.layers of decoder layers"
        )
    if len({type(layer) for layer in layers}) != 1:
        raise UnsupportedFamilyError(different_layers(model_type, layers))
    return model, layers


def _subject(model_type: str, prove: Prove | None) -> Subject:
    """The classes of ``model_type``, a tiny config, and the model built on the meta device."""
    module_name, module, causal_lm_name, causal_lm, config_class = model_type_classes(model_type)
    config, query_scale = _tiny_config(model_type, causal_lm, config_class)
    model, layers = _decoder_layers(model_type, causal_lm, config_class, config, prove)
    decoder = type(layers[0])
    if decoder.__module__ != module_name:
        raise UnsupportedFamilyError(
            f"{model_type}: its decoder layer lives in {decoder.__module__}"
        )
    subject = Subject(
        model_type,
        module_name,
        module,
        causal_lm_name,
        config_class,
        config,
        model,
        layers,
        decoder,
        where=f"{model_type} ({decoder.__name__})",
        layer=layers[0],
    )
    subject.fields.update(
        model_type=model_type,
        module=module_name,
        decoder=decoder.__name__,
        config_class=config_class.__name__,
        causal_lm=causal_lm_name,
        query_scale=query_scale,
        description=f"inferred from {module_name}",
    )
    return subject


def infer_declaration(
    model_type: str, *, name: str | None = None, prove: Prove | None = None
) -> Family:
    """The :class:`~layerswap.Family` of ``model_type``, read off the installed transformers.

    Raises :class:`~layerswap.errors.UnsupportedFamilyError` with the reason when the
    decoder layer has structure the replacement layers cannot express, or when ``prove``
    refuses the declaration (structure can fit while the forward pass differs: rotary
    applied to some layers only, another rotary convention). Each step is one probe of
    :data:`PROBES`. :func:`layerswap.inference.infer_family` is this, proven.
    """
    subject = _subject(model_type, prove)
    for probe in PROBES:
        probe(subject)
    scaled_rope = subject.config.rope_parameters if subject.fields["query_scale"] else None
    family = Family(
        name=name or model_type.removesuffix("_text"),
        tiny=tiny_of(subject.config_class, scaled_rope),
        **subject.fields,
    )
    if prove is not None:
        prove(family, subject.where)
    return family
