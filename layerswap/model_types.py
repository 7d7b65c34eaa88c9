"""A family for a model type no declaration covers: what the slots below the decoder layer
need of it (where transformers keeps its classes, a tiny config), and nothing more.

The ``norm`` slot swaps what a model's own norm classes compute in any causal LM of the
installed transformers, whether or not a backend can replace its decoder layers; the
registry makes such a family on demand (:meth:`layerswap.catalog.Registry.get`) for a slot
that takes any model type, and never offers it a decoder or head substitution.

Example::

    family = bare_family("qwen3_next")
    family.causal_lm          # "Qwen3NextForCausalLM"
"""

from __future__ import annotations

import importlib
import inspect

from layerswap.errors import UnsupportedFamilyError
from layerswap.family import Family

__all__ = ["bare_family", "norm_class_name"]


def bare_family(model_type: str) -> Family:
    """The family of ``model_type`` read off the installed transformers' auto mappings,
    with the tiny config family inference builds; :class:`UnsupportedFamilyError` with
    the reason for a model type transformers has no causal LM for."""
    from layerswap.families.infer import model_type_classes, tiny_config_for

    classes = model_type_classes(model_type)
    try:
        # every field of the tiny config inference builds the model type on: sizes it
        # derives from others (latent ranks, per-layer kinds) included
        built = tiny_config_for(classes.config_class)
        tiny = {
            key: value
            for key, value in built.to_diff_dict().items()
            if key not in ("model_type", "transformers_version", "architectures")
        }
    except Exception as exc:
        raise UnsupportedFamilyError(f"{model_type}: no tiny config ({exc})") from exc
    return Family(
        name=model_type,
        model_type=model_type,
        module=classes.module_name,
        decoder="",
        config_class=classes.config_class.__name__,
        causal_lm=classes.causal_lm_name,
        tiny=tiny,
        description=f"{model_type}, read off {classes.module_name} (its norms only)",
    )


def norm_class_name(module_name: str) -> str:
    """The first class of ``module_name`` named as a norm (what a ``norm`` substitution
    names as its original); every such class of a model is asked what it computes."""
    from torch import nn

    module = importlib.import_module(module_name)
    named = [
        name
        for name, value in vars(module).items()
        if inspect.isclass(value)
        and issubclass(value, nn.Module)
        and value.__module__ == module_name
        and "Norm" in name
    ]
    # a plain norm's name ends so (LlamaRMSNorm); a gated one's goes on (...RMSNormGated)
    for name in sorted(named, key=lambda name: not name.endswith("Norm")):
        return name
    raise UnsupportedFamilyError(f"{module_name} defines no norm class")
