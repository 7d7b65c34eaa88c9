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
from collections.abc import Callable
from typing import Any

from layerswap.errors import UnsupportedFamilyError
from layerswap.family import Family

__all__ = [
    "NOT_STANDALONE",
    "SWITCHED_ON",
    "bare_family",
    "language_model_of",
    "no_causal_lm",
    "norm_class_name",
    "ships_model_type",
    "wrapped_model_type",
]

#: model types whose causal LM does not run on token ids alone, so no tiny model of theirs
#: can be proven, and why
NOT_STANDALONE = {
    "gemma4_assistant": (
        "a draft model that runs inside its target model (it reads the target's shared "
        "key/value states): no model of its own runs on token ids"
    ),
    "gemma4_unified_assistant": (
        "a draft model that runs inside its target model (it reads the target's shared "
        "key/value states): no model of its own runs on token ids"
    ),
    "git": (
        "its causal LM's loss leaves out the image's patch positions first (GitForCausalLM "
        "shifts its logits by image_patch_tokens), so on token ids alone it has no loss to "
        "train or prove"
    ),
    "musicgen": (
        "its causal LM decodes audio codes, num_codebooks rows of ids per sequence, not a "
        "batch of token ids"
    ),
    "musicgen_melody": (
        "its causal LM decodes audio codes, num_codebooks rows of ids per sequence, not a "
        "batch of token ids"
    ),
}


_GEMMA4_MOE = {
    "enable_moe_block": True,
    "num_experts": 4,
    "top_k_experts": 2,
    "moe_intermediate_size": 64,
}

#: modules a model type's default config leaves out, switched on in the tiny model of its
#: bare family so that the slots below the decoder layer see (and prove) them; family
#: inference keeps the defaults, and names the switch in its reason
SWITCHED_ON: dict[str, dict[str, Any]] = {
    # GraniteMoE-Shared's shared expert MLP (shared_intermediate_size 0 builds none)
    "granitemoeshared": {"shared_intermediate_size": 64},
    # Gemma 4's mixture-of-experts block beside the dense MLP (Gemma 4 26B-A4B), in the
    # text model and in the multimodal wrapper's text config
    "gemma4_text": _GEMMA4_MOE,
    "gemma4": {"text_config": _GEMMA4_MOE},
    # X-MOD's language adapters: its default config chooses none, and the model refuses to
    # run until one is chosen
    "xmod": {"default_language": "en_XX"},
}


def ships_model_type(model_type: str) -> bool:
    """Whether the installed transformers knows ``model_type`` (has a config class for it)."""
    from transformers import CONFIG_MAPPING

    return model_type in CONFIG_MAPPING


def wrapped_model_type(model_type: str) -> str | None:
    """The model type of the language model a wrapper's default config holds (LLaVA's:
    ``"llama"``); ``None`` for a model type without another's text config, or that the
    installed transformers does not ship. Builds the config class's default only."""
    from transformers import CONFIG_MAPPING

    if not ships_model_type(model_type):
        return None
    try:
        text = getattr(CONFIG_MAPPING[model_type](), "text_config", None)
    except Exception:  # a config class that needs arguments: no wrapper of a default
        return None
    inner = getattr(text, "model_type", None)
    return inner if isinstance(inner, str) and inner and inner != model_type else None


def language_model_of(model_type: str) -> tuple[str, str] | None:
    """For a model type transformers has no causal LM for, the model type whose
    substitutions reach its decoder's modules, and how the two relate; ``None`` where there
    is none.

    A multimodal wrapper (LLaVA, InternVL, PaliGemma) runs a language model of another
    model type: that one's substitutions swap its modules inside the wrapper. A wrapper's
    text model (``qwen2_vl_text``, ``mllama_text_model``) is the wrapper's: the wrapper's
    substitutions swap it. Reads config classes only; imports no modeling module.

    Example::

        language_model_of("llava")            # ("llama", "it wraps a llama language model")
        language_model_of("qwen2_vl_text")    # ("qwen2_vl", "it is qwen2_vl's language model")
    """
    from transformers import CONFIG_MAPPING

    inner = wrapped_model_type(model_type)
    if inner is not None:
        return inner, f"it wraps a {inner} language model"
    if not ships_model_type(model_type):
        return None
    for owner, config_class in CONFIG_MAPPING.items():
        sub_configs = getattr(config_class, "sub_configs", None) or {}
        part = sub_configs.get("text_config")
        if owner != model_type and getattr(part, "model_type", None) == model_type:
            return owner, f"it is {owner}'s language model"
    return None


def no_causal_lm(model_type: str, rest: str, offered: Callable[[str], object]) -> str | None:
    """Why ``<model_type>.<rest>`` (``rest``: ``"norm.liger"``) names no substitution where
    transformers has no causal LM for ``model_type``: the substitution that swaps its
    modules (:func:`language_model_of`; ``offered(name)`` is ``None`` for one not offered),
    or that no slot takes it; ``None`` for a model type transformers does not ship."""
    found = language_model_of(model_type)
    if found is not None:
        other, how = found
        instead = f"{other}.{rest}"
        if offered(instead) is not None:
            return (
                f"transformers has no causal LM for {model_type}; {how}, whose modules "
                f"{instead} swaps inside a {model_type} model too: swap(model, {instead!r})"
            )
    if not ships_model_type(model_type):
        return None
    return (
        f"transformers has no causal LM for {model_type}, nor for a language model it "
        "wraps, and the first-use proof builds and runs a tiny causal LM: no slot takes it"
    )


def bare_family(model_type: str) -> Family:
    """The family of ``model_type`` read off the installed transformers' auto mappings,
    with the tiny config family inference builds; :class:`UnsupportedFamilyError` with
    the reason for a model type transformers has no causal LM for."""
    from layerswap.families.infer import model_type_classes, tiny_config_for

    if model_type in NOT_STANDALONE:
        raise UnsupportedFamilyError(f"{model_type}: {NOT_STANDALONE[model_type]}")
    try:
        classes = model_type_classes(model_type)
    except UnsupportedFamilyError:
        classes = _reused_classes(model_type)
    config_class = classes.config_class.__name__
    if classes.config_class.__module__ != classes.module_name.replace(
        "modeling_", "configuration_"
    ):
        config_class = f"{classes.config_class.__module__}:{config_class}"
    try:
        # every field of the tiny config inference builds the model type on: sizes it
        # derives from others (latent ranks, per-layer kinds) included
        parts = _tiny_parts(classes.config_class)
        for key, value in SWITCHED_ON.get(model_type, {}).items():
            # a part's switch goes into that part (the wrapper's text config)
            merged = isinstance(value, dict) and isinstance(parts.get(key), dict)
            parts[key] = {**parts[key], **value} if merged else value
        built = tiny_config_for(classes.config_class, **parts)
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
        config_class=config_class,
        causal_lm=classes.causal_lm_name,
        tiny=tiny,
        description=f"{model_type}, read off {classes.module_name} (its norms only)",
    )


def _tiny_parts(config_class: type) -> dict[str, Any]:
    """A multimodal config's parts (``text_config``, ``vision_config`` ...), each tiny: their
    towers are built too, and at their default sizes a tiny model would not be one."""
    parts: dict[str, Any] = {}
    try:
        default = config_class()
    except Exception:  # a config that needs arguments: its parts as they come
        return parts
    from layerswap.families.infer import tiny_config_for

    for key in getattr(config_class, "sub_configs", None) or {}:
        part = getattr(default, key, None)
        if part is None or not hasattr(part, "to_diff_dict"):
            continue
        try:
            parts[key] = tiny_config_for(type(part)).to_diff_dict()
        except Exception:  # a part tiny sizes do not fit: left at its own
            continue
    return parts


def _reused_classes(model_type: str) -> Any:
    """The classes of a model type whose causal LM is another model type's (EXAONE,
    InternLM3: ``LlamaForCausalLM`` with a config class of their own), as
    :func:`~layerswap.families.infer.model_type_classes` gives them."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from layerswap.families.infer import ModelTypeClasses

    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    try:
        causal_lm = getattr(transformers, str(name))
        config_class = CONFIG_MAPPING[model_type]
    except (AttributeError, KeyError, ImportError) as exc:
        raise UnsupportedFamilyError(f"{model_type}: transformers has no causal LM for it") from exc
    module_name = causal_lm.__module__
    module = importlib.import_module(module_name)
    return ModelTypeClasses(module_name, module, str(name), causal_lm, config_class)


def norm_class_name(module_name: str) -> str:
    """The first class ``module_name`` defines (else imports from another model's module)
    named as a norm: what a ``norm`` substitution names as its original; every such class
    of a model is asked what it computes."""
    from torch import nn

    from layerswap.norms import is_norm_class

    module = importlib.import_module(module_name)
    named = [
        (value.__module__ != module_name, not name.endswith("Norm"), name)
        for name, value in vars(module).items()
        if inspect.isclass(value)
        and issubclass(value, nn.Module)
        and is_norm_class(value, module_name)
    ]
    # its own first (then one it imports from another model: Gemma 4's assistant), and a
    # plain norm's name ends so (LlamaRMSNorm) where a gated one's goes on (...RMSNormGated)
    for _, _, name in sorted(named, key=lambda row: row[:2]):
        return name
    raise UnsupportedFamilyError(f"{module_name} defines no norm class")
