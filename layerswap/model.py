"""What layerswap reads off a model: its wrappers, its family, its decoder layers.

One of each: :func:`unwrap` sees through ``torch.compile``, DDP/FSDP/DataParallel and
PEFT wrappers; :func:`family_of` names the model's :class:`~layerswap.family.Family`
or says why it cannot (it never guesses); :func:`decoder_layers` lists the original and
swapped decoder layers; :func:`substitution_of` tells which substitution made a layer.

Example::

    from layerswap.model import decoder_layers, family_of

    family_of(model).name                         # "llama"
    [name for name, _ in decoder_layers(model)]   # ["model.layers.0", ...]
"""

from __future__ import annotations

import re
import sys
from typing import TYPE_CHECKING, Any

from torch import nn

from layerswap import hf_internals
from layerswap.errors import UnknownSubstitutionError
from layerswap.family import Family
from layerswap.registry import families
from layerswap.substitution import Substitution
from layerswap.suggestions import did_you_mean

if TYPE_CHECKING:
    from transformers import PreTrainedConfig

__all__ = [
    "decoder_layers",
    "dropout_fields",
    "family_of",
    "layer_config",
    "locate",
    "mark_substitution",
    "pretrained_ancestors",
    "pretrained_owner",
    "substitution_of",
    "unwrap",
]

# the attribute a swapped (or use()-built) layer carries: the Substitution that made it
_MARK = "_layerswap_substitution"


def _parallel_wrapper_types() -> tuple[type[nn.Module], ...]:
    """The torch wrappers that keep the user's model as ``.module``."""
    from torch.nn.parallel import DataParallel, DistributedDataParallel

    found: list[type[nn.Module]] = [DataParallel, DistributedDataParallel]
    # no model is an FSDP instance before FSDP was imported, and importing it only to
    # check would cost every first swap() seconds
    fsdp = sys.modules.get("torch.distributed.fsdp")
    if fsdp is not None:
        found.append(fsdp.FullyShardedDataParallel)
    return tuple(found)


def unwrap(model: nn.Module, *, parallel: bool = True, peft: bool = False) -> nn.Module:
    """The model inside ``model``'s wrappers, or ``model`` itself.

    Always sees through ``torch.compile`` (its ``_orig_mod``); through DDP, FSDP (v1)
    and ``DataParallel`` (their ``.module``) unless ``parallel=False``; through a PEFT
    ``PeftModel`` (``get_base_model()``) only when ``peft=True``. PEFT is opt-in because
    module names differ inside and outside it (``base_model.model.model.layers.0`` vs
    ``model.layers.0``), and swaps, handles and reports keep the names the caller sees.
    FSDP2 (``fully_shard``) changes the model's class in place and wraps nothing.

    Example::

        unwrap(torch.compile(DistributedDataParallel(model))) is model   # True
        unwrap(peft_model, peft=True) is peft_model.get_base_model()    # True
    """
    parallel_types = _parallel_wrapper_types() if parallel else ()
    while True:
        inner: Any = None
        if type(model).__name__ == "OptimizedModule":
            inner = getattr(model, "_orig_mod", None)
        elif parallel_types and isinstance(model, parallel_types):
            inner = getattr(model, "module", None)
        elif peft and callable(getattr(model, "get_base_model", None)):
            inner = model.get_base_model()  # type: ignore[operator]
        if not isinstance(inner, nn.Module) or inner is model:
            return model
        model = inner


def substitution_of(layer: nn.Module) -> Substitution | None:
    """The substitution that put ``layer`` in its model (``None`` for other layers).

    Example::

        substitution_of(model.model.layers[0]).name   # "llama.decoder.fused" once swapped
    """
    return getattr(layer, _MARK, None)


def mark_substitution(layer: nn.Module, substitution: Substitution) -> None:
    """Record on ``layer`` that ``substitution`` made it (read by :func:`substitution_of`)."""
    setattr(layer, _MARK, substitution)


def _unknown_family(target: nn.Module, model_type: str | None, known: dict[str, Family]) -> str:
    pool = sorted({*known, *(family.model_type for family in known.values())})
    hint = did_you_mean(model_type or "", pool)
    parts = [f"no layerswap family fits {type(target).__name__} (model_type {model_type!r})"]
    parts[0] += _why_not(model_type)
    if hint:
        parts.append(hint)
    parts.append(f"known families: {', '.join(sorted(known))}")
    return "; ".join(parts) + ". Declare one with layerswap.register_family(Family(...))"


def _why_not(model_type: str | None) -> str:
    """Coverage's reason for ``model_type`` where it is stored (``layerswap coverage`` and
    ``list --all`` store it), else where to get it: inferring it here would import and
    probe the modeling module inside an error path."""
    if not model_type:
        return ""
    from layerswap import verdicts

    stored = verdicts.read(verdicts.key_for("coverage", model_type), kind="coverage")
    reason = stored.get("reason") if stored is not None else None
    if isinstance(reason, str):
        return f": {reason}"
    return f" (`layerswap coverage {model_type}` says why)"


def family_of(model: nn.Module) -> Family:
    """The :class:`Family` of ``model`` (swapped or not, wrapped or not).

    Found from the layers layerswap swapped, else the decoder layer classes present,
    else ``config.model_type``. A model none of these places in a registered family
    raises :class:`~layerswap.errors.UnknownSubstitutionError` naming its model type
    and the close family names: there is no default family. Example::

        from layerswap.model import family_of
        family_of(model).name   # "llama"
    """
    target = unwrap(model)
    known = families()
    for module in target.modules():
        sub = substitution_of(module)
        if sub is not None and sub.family in known:
            return known[sub.family]
    class_names = {type(module).__name__ for module in target.modules()}
    model_type = getattr(getattr(target, "config", None), "model_type", None)
    by_class = [family for family in known.values() if family.decoder in class_names]
    if len(by_class) > 1:
        by_class = [family for family in by_class if family.model_type == model_type] or by_class
    if by_class:
        return by_class[0]
    for family in known.values():
        if family.model_type == model_type:
            return family
    raise UnknownSubstitutionError(_unknown_family(target, model_type, known))


def decoder_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The decoder layers of ``model`` by qualified name: original ones and swapped ones.

    Names are those of ``model`` as given (a ``torch.compile`` result is seen through;
    DDP and PEFT wrappers are not, so their prefixes stay). Example::

        [name for name, _ in decoder_layers(model)]   # ["model.layers.0", ...]
    """
    target = unwrap(model, parallel=False)
    original = family_of(target).decoder_class()
    found: list[tuple[str, nn.Module]] = []
    for name, module in target.named_modules():
        if found and name.startswith(found[-1][0] + "."):
            continue
        if isinstance(module, original) or substitution_of(module) is not None:
            found.append((name, module))
    return found


def decoder_layers_if_known(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """:func:`decoder_layers`, or none for a model no registered family describes: a
    model whose ``norm`` substitution names its model type alone is compared by its
    outputs, with no layer of its own to capture."""
    try:
        return decoder_layers(model)
    except UnknownSubstitutionError:
        return []


def layer_config(config: PreTrainedConfig) -> PreTrainedConfig:
    """The config a decoder layer reads: the text config of a composite model, else ``config``.

    Example::

        layer_config(llava.config) is llava.config.text_config   # True
    """
    return hf_internals.text_config_of(config)


_DROPOUT = re.compile(r"dropout|pdrop", re.IGNORECASE)


def dropout_fields(config: PreTrainedConfig) -> list[str]:
    """The fields of ``config``'s text config that set a dropout probability above 0.

    Example::

        dropout_fields(Phi3Config(attention_dropout=0.1, resid_pdrop=0.1))
        # ["attention_dropout", "resid_pdrop"]
    """
    values = layer_config(config).to_dict()
    return sorted(
        name
        for name, value in values.items()
        if _DROPOUT.search(name) and isinstance(value, float) and 0.0 < value < 1.0
    )


def locate(root: nn.Module, name: str) -> tuple[nn.Module, str]:
    """The module holding submodule ``name`` of ``root``, and the attribute it sits under.

    Example::

        parent, key = locate(model, "model.layers.0")   # (model.model.layers, "0")
    """
    owner_name, _, leaf = name.rpartition(".")
    return (root.get_submodule(owner_name) if owner_name else root), leaf


def pretrained_ancestors(root: nn.Module, names: list[str]) -> list[tuple[str, nn.Module]]:
    """Every ``PreTrainedModel`` in ``root`` (outermost first) containing one of ``names``."""
    from transformers import PreTrainedModel

    found = []
    for name, module in root.named_modules():
        if not isinstance(module, PreTrainedModel):
            continue
        prefix = f"{name}." if name else ""
        if any(layer.startswith(prefix) for layer in names):
            found.append((name, module))
    return found


def pretrained_owner(root: nn.Module, name: str) -> tuple[str, nn.Module | None]:
    """The innermost ``PreTrainedModel`` holding ``name``, and ``name`` relative to it.

    Example::

        pretrained_owner(llava, "model.language_model.layers.0")
        # ("layers.0", llava.model.language_model)
    """
    ancestors = pretrained_ancestors(root, [name])
    if not ancestors:
        return name, None
    owner_name, owner = ancestors[-1]
    return (name[len(owner_name) + 1 :] if owner_name else name), owner
