"""Loading state into swapped layers in either layout: ``load_state_dict`` converts on load.

A swapped model's ``state_dict()`` is in the replacement layout (``qkv_proj``), but the
checkpoints around it are in the original one (``save_pretrained`` writes it, and
transformers' ``Trainer`` reads a checkpoint back with plain ``model.load_state_dict``,
with no weight conversion: transformers 5 has the same gap for its own fused MoE
layouts). So every replacement layer carries a ``load_state_dict`` pre-hook,
:class:`LayoutLoadHook`, which runs inside torch's own loading, whatever calls it
(``Trainer`` resume and ``load_best_model_at_end``, accelerate ``load_state``, a
user), and converts the layer's part of the incoming state:

- keys in the replacement layout load as they are;
- keys in the original layout are converted with the substitution's converter rules;
  a concatenated tensor given in part (a sharded checkpoint, ``strict=False``) fills
  its given slices, and the parts not given are reported missing;
- missing and unexpected keys are reported in the layout the caller gave: a layer
  given original-layout keys reports ``q_proj.weight`` missing, never ``qkv_proj``;
  a layer given nothing that tells the layouts apart reports the model's own
  (``state_dict()``) names;
- a key that cannot be mapped raises :class:`~layerswap.errors.ConversionError`
  naming it: a layer given both layouts at once, adapter (LoRA) state for a module
  the replacement fused away, a part of a tensor no rule can split.

Example::

    layerswap.swap(model, backend="fused")
    model.load_state_dict(original_layout_state_dict)      # converted on load
    model.load_state_dict(model.state_dict())              # the swapped layout too
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from layerswap.errors import ConversionError
from layerswap.weights import Concat, Converter, describe, is_extra_state

if TYPE_CHECKING:
    from transformers import PreTrainedConfig

    from layerswap.substitution import Substitution

__all__ = [
    "LAYER_COPIED",
    "LayoutLoadHook",
    "cast_like",
    "convert_incoming",
    "fused_modules",
    "install_load_hook",
    "is_own",
    "layer_state_hooks",
    "layout_hooks",
    "live_layout_hooks",
]


#: called with each replacement layer made by copying or unpickling one: what a swap arms
#: for its layers (:func:`layerswap.peft_targets.hold_while_alive` registers itself here)
LAYER_COPIED: list[Callable[[nn.Module], None]] = []

#: every replacement layer given a load hook, and every copy of one, while it lives: the
#: layouts a load that matches names before ``load_state_dict`` runs may meet
#: (:mod:`layerswap.dcp_loads`)
_LIVE: weakref.WeakSet[nn.Module] = weakref.WeakSet()
#: held while ``_LIVE`` is added to or read: a set one thread adds to (a swap, a copy) while
#: another iterates it (a ``dcp.load``'s plan) raises "Set changed size during iteration"
_LIVE_LOCK = threading.Lock()


def _live(layer: nn.Module) -> None:
    with _LIVE_LOCK:
        _LIVE.add(layer)


LAYER_COPIED.append(_live)


class LayoutLoadHook:
    """``load_state_dict`` pre-hook of one replacement layer: original-layout keys convert.

    Holds the substitution (whose converter it runs) and the layer's config (which
    gives the sizes of concatenated parts). Picklable and copyable with its module.
    """

    def __init__(self, substitution: Substitution, config: PreTrainedConfig) -> None:
        self.substitution = substitution
        self.config = config

    def __call__(
        self,
        module: nn.Module,
        state_dict: MutableMapping[str, Any],
        prefix: str,
        local_metadata: Mapping[str, Any],
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        convert_incoming(module, state_dict, prefix, self.substitution, self.config, missing_keys)

    def __repr__(self) -> str:
        return f"<LayoutLoadHook {self.substitution.name}>"


def layout_hooks(model: nn.Module) -> list[tuple[str, nn.Module, LayoutLoadHook]]:
    """``(name, layer, hook)`` for every replacement layer of ``model`` carrying a load hook.

    Read from the hooks, so copies and unpickled models count too. Example::

        [name for name, _, _ in layout_hooks(model)]   # ['model.layers.0', ...]
    """
    found = []
    for name, module in model.named_modules():
        for wrapped in module._load_state_dict_pre_hooks.values():
            hook = getattr(wrapped, "hook", wrapped)
            if isinstance(hook, LayoutLoadHook):
                found.append((name, module, hook))
                break
    return found


def live_layout_hooks() -> list[LayoutLoadHook]:
    """The load hooks of the replacement layers alive in this process, one per
    substitution and config (layers made or copied by any swap, still swapped or not)."""
    found: dict[tuple[int, int], LayoutLoadHook] = {}
    with _LIVE_LOCK:
        layers = list(_LIVE)
    for layer in layers:
        for wrapped in layer._load_state_dict_pre_hooks.values():
            hook = getattr(wrapped, "hook", wrapped)
            if isinstance(hook, LayoutLoadHook):
                found.setdefault((id(hook.substitution), id(hook.config)), hook)
    return list(found.values())


@contextlib.contextmanager
def layer_state_hooks(
    model: nn.Module, make: Callable[[LayoutLoadHook], Callable[..., None]]
) -> Iterator[None]:
    """While inside, each replacement layer of ``model`` (:func:`layout_hooks`) carries
    the ``state_dict`` post-hook ``make(its load hook)``; on leaving, none does.

    Example::

        with layer_state_hooks(model, lambda hook: ToOriginal(hook.substitution, hook.config)):
            model.state_dict()
    """
    handles = [
        layer.register_state_dict_post_hook(make(hook))  # type: ignore[no-untyped-call]
        for _, layer, hook in layout_hooks(model)
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def install_load_hook(
    layer: nn.Module, substitution: Substitution, config: PreTrainedConfig
) -> None:
    """Give ``layer`` (a replacement) the hook that converts original-layout state on load.

    Idempotent: a layer that has one already keeps it.
    """
    _live(layer)
    for hook in layer._load_state_dict_pre_hooks.values():
        if isinstance(getattr(hook, "hook", None), LayoutLoadHook):
            return
    layer.register_load_state_dict_pre_hook(LayoutLoadHook(substitution, config))  # type: ignore[no-untyped-call]


def fused_modules(converter: Any) -> dict[str, tuple[str, ...]]:
    """Module paths the converter fuses: replacement module -> original modules, in order.

    Read from the converter's :class:`~layerswap.weights.Concat` rules over ``.weight``
    tensors, e.g. ``{"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj",
    "self_attn.v_proj"), "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}``.
    """
    found: dict[str, tuple[str, ...]] = {}
    for rule in getattr(converter, "rules", ()):
        if isinstance(rule, Concat) and rule.target.endswith(".weight") and rule.dim == 0:
            found[rule.target.removesuffix(".weight")] = tuple(
                source.removesuffix(".weight") for source in rule.sources
            )
    return found


def _layouts(converter: Converter) -> tuple[set[str], set[str]]:
    """Keys only the original layout has, and keys only the replacement layout has."""
    sources = {key for rule in converter.rules for key in rule.sources}
    targets = {key for rule in converter.rules for key in rule.targets}
    return sources - targets, targets - sources


def convert_incoming(
    module: nn.Module,
    state_dict: MutableMapping[str, Any],
    prefix: str,
    substitution: Substitution,
    config: PreTrainedConfig,
    missing_keys: list[str],
) -> None:
    """Rewrite, in place, ``module``'s original-layout keys of ``state_dict`` (see module doc)."""
    converter = substitution.converter
    if not isinstance(converter, Converter):
        _convert_whole(module, state_dict, prefix, converter, config)
        return
    given = {key[len(prefix) :] for key in state_dict if key.startswith(prefix)}
    original_only, replacement_only = _layouts(converter)
    name = type(module).__name__
    _refuse_fused_away_state(given, original_only, prefix, name, substitution)
    original_given = sorted(given & original_only)
    if not original_given:
        return
    current = {
        key: value
        for key, value in module.state_dict(keep_vars=True).items()
        if not is_extra_state(key)
    }
    # torch's set_model_state_dict(full_state_dict=True) (accelerate's checkpoint loading
    # too) adds the model's own tensors under their names beside the state given: those
    # are no second layout, and are converted from what was given instead
    for key in sorted(given & replacement_only):
        if key in current and is_own(state_dict[prefix + key], current[key]):
            del state_dict[prefix + key]
            given.discard(key)
    replacement_given = sorted(given & replacement_only)
    if replacement_given:
        raise ConversionError(
            f"loading {prefix.rstrip('.') or name}: the state mixes the original layout "
            f"({prefix + original_given[0]!r}) and {substitution.name}'s layout "
            f"({prefix + replacement_given[0]!r}); give one layout per layer"
        )
    for rule in converter.rules:
        present = [key in given for key in rule.sources]
        if not all(target in current for target in rule.targets):
            # the layer has no such tensor (a bias the config turns off): torch reports
            # the given keys as unexpected, under the caller's names
            continue
        if not any(present):
            # the layer has it and none of its parts came: missing, in the caller's layout
            for target in rule.targets:
                state_dict[prefix + target] = current[target]
            missing_keys.extend(prefix + source for source in rule.sources)
            continue
        try:
            if all(present):
                tensors = [state_dict.pop(prefix + key) for key in rule.sources]
                if len({t.dtype for t in tensors if isinstance(t, torch.Tensor)}) > 1:
                    # parts in several dtypes: each cast to the layer's, as torch's copy_
                    # casts each tensor of a plain load
                    tensors = cast_like(tensors, current[rule.targets[0]])
                results = list(rule.to_replacement(tensors, config))
            else:
                results = _fill_parts(rule, state_dict, prefix, present, current, config)
                missing_keys.extend(
                    prefix + key for key, ok in zip(rule.sources, present, strict=True) if not ok
                )
        except ConversionError as exc:
            raise ConversionError(f"loading {prefix.rstrip('.') or name}: {exc}") from exc
        for target, result in zip(rule.targets, results, strict=True):
            state_dict[prefix + target] = result


def _fill_parts(
    rule: Any,
    state_dict: MutableMapping[str, Any],
    prefix: str,
    present: list[bool],
    current: Mapping[str, torch.Tensor],
    config: PreTrainedConfig,
) -> list[torch.Tensor]:
    """A concatenated tensor from the parts given and the layer's current values of the rest."""
    missing = [key for key, ok in zip(rule.sources, present, strict=True) if not ok]
    if not isinstance(rule, Concat):
        raise ConversionError(
            f"tensor {prefix + missing[0]!r} is missing, and {describe(rule)} cannot load "
            f"{prefix + rule.sources[present.index(True)]!r} without it"
        )
    given = [state_dict[prefix + key] for key, ok in zip(rule.sources, present, strict=True) if ok]
    (target,) = rule.targets
    with torch.no_grad():
        parts = list(torch.split(current[target].detach(), rule.part_sizes(config), dim=rule.dim))
    # the parts not given keep the layer's values exactly: the given ones are cast to the
    # layer's dtype (as torch's copy_ would), never the layer's values to theirs
    tensors = [
        state_dict.pop(prefix + key) if ok else part.to(device=given[0].device)
        for key, ok, part in zip(rule.sources, present, parts, strict=True)
    ]
    return list(rule.to_replacement(cast_like(tensors, current[target]), config))


def is_own(given: Any, own: Any) -> bool:
    """Whether ``given`` is the tensor ``own`` or a view of all of its memory: a state dict
    holding the module's own tensors (torch's ``set_model_state_dict(full_state_dict=True)``,
    accelerate's loading) rather than a second copy. Two ``DTensor`` objects are compared by their
    local shards; a ``DTensor`` and a plain tensor are never the same."""
    if given is own:
        return True
    if not isinstance(given, torch.Tensor) or not isinstance(own, torch.Tensor):
        return False
    if given.device != own.device or given.device.type == "meta" or given.shape != own.shape:
        return False
    local_given, local_own = getattr(given, "to_local", None), getattr(own, "to_local", None)
    if local_given is not None and local_own is not None:  # DTensors: their shards
        given, own = local_given(), local_own()
    elif local_given is not None or local_own is not None:
        return False
    return bool(given.data_ptr() == own.data_ptr() and given.data_ptr() != 0)


def cast_like(tensors: list[Any], like: torch.Tensor) -> list[Any]:
    """Floating ``tensors`` in ``like``'s dtype (the others as they are)."""
    return [
        t.to(dtype=like.dtype)
        if isinstance(t, torch.Tensor) and t.is_floating_point() and like.is_floating_point()
        else t
        for t in tensors
    ]


def _refuse_fused_away_state(
    given: set[str],
    original_only: set[str],
    prefix: str,
    name: str,
    substitution: Substitution,
) -> None:
    """Raise if state (an adapter's) is given for a module the replacement does not have."""
    gone = {key.rpartition(".")[0] for key in original_only if key.endswith((".weight", ".bias"))}
    stranded = sorted(
        key for key in given - original_only if any(key.startswith(module + ".") for module in gone)
    )
    if not stranded:
        return
    modules = sorted(m for m in gone if any(key.startswith(m + ".") for key in stranded))
    fused = {
        original: replacement
        for replacement, originals in fused_modules(substitution.converter).items()
        for original in originals
    }
    into = sorted({fused[m] for m in modules if m in fused})
    fused_into = f", which {substitution.name} fuses into {', '.join(into)}" if into else ""
    raise ConversionError(
        f"loading {prefix.rstrip('.') or name}: {len(stranded)} key(s) hold state for "
        f"{', '.join(modules)}{fused_into} (e.g. {prefix + stranded[0]!r}); this {name} has "
        "no such modules. Adapters (PEFT) move between layouts with "
        "layerswap.adapters.load_adapter (see docs/integrations.md)"
    )


def _convert_whole(
    module: nn.Module,
    state_dict: MutableMapping[str, Any],
    prefix: str,
    converter: Any,
    config: PreTrainedConfig,
) -> None:
    """A converter without rules: a layer whose keys are not its own converts as a whole."""
    expected = set(module.state_dict(keep_vars=True))
    local = {key[len(prefix) :]: key for key in state_dict if key.startswith(prefix)}
    if not local or set(local) <= expected:
        return
    tensors = {key: state_dict[full] for key, full in local.items() if not is_extra_state(key)}
    converted = converter.to_replacement(tensors, config)
    for full in local.values():
        if not is_extra_state(full[len(prefix) :]):
            state_dict.pop(full)
    for key, value in converted.items():
        state_dict[prefix + key] = value
