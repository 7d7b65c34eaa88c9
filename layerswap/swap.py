"""Swapping the decoder layers of a model that already exists, and undoing it.

Layers are converted one at a time. Tensors that only change name (or not at all)
move into the replacement as the very same ``Parameter`` objects; tensors that are
concatenated are computed, and the original parameters they came from are emptied
(``param.data = <empty>``) right after their layer is swapped. Peak extra memory is
therefore about one layer. The original layer objects are kept, so ``undo()`` puts
them back (identity) and converts the weights back into their very same
``Parameter`` objects, bitwise (concatenation and splitting are exact).

Example::

    handle = layerswap.swap(model, "llama.decoder.fused")   # or backend="fused"
    print(handle.report())
    handle.undo()

    with layerswap.swap(model, backend="fused"):
        logits = model(input_ids).logits
"""

from __future__ import annotations

import warnings
import weakref
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from layerswap.errors import (
    ConversionError,
    LayerswapError,
    SubstitutionError,
    SwapWarning,
    UnknownSubstitutionError,
)
from layerswap.family import Family
from layerswap.peft_targets import guard as guard_peft_targets
from layerswap.registry import families, get
from layerswap.state import install_load_hook
from layerswap.substitution import Substitution
from layerswap.weights import is_extra_state

if TYPE_CHECKING:
    from types import TracebackType

    from transformers import PreTrainedConfig

__all__ = [
    "SwapHandle",
    "adopt_constructed",
    "build_replacement_layer",
    "rebuild_originals",
    "conversion_transforms",
    "decoder_layers",
    "family_of",
    "loading_transforms",
    "substitution_of",
    "swap",
]

# the attribute a swapped (or use()-built) layer carries: the Substitution that made it
_MARK = "_layerswap_substitution"
_MISSING: Any = object()
_HOOK_DICTS = (
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
)


def _unwrap(model: nn.Module) -> nn.Module:
    """The module a ``torch.compile`` result wraps, or ``model`` itself."""
    inner = getattr(model, "_orig_mod", None)
    if isinstance(inner, nn.Module) and type(model).__name__ == "OptimizedModule":
        return inner
    return model


def substitution_of(layer: nn.Module) -> Substitution | None:
    """The substitution that put ``layer`` in its model (``None`` for other layers)."""
    return getattr(layer, _MARK, None)


def family_of(model: nn.Module) -> Family:
    """The :class:`Family` of ``model`` (swapped or not, compiled or not).

    Found from the layers layerswap swapped, else the decoder layer classes present,
    else ``config.model_type``. Example::

        from layerswap.swap import family_of
        family_of(model).name   # "llama"
    """
    target = _unwrap(model)
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
    raise UnknownSubstitutionError(
        f"no layerswap family fits {type(target).__name__} (model_type {model_type!r}); "
        f"known families: {', '.join(sorted(known))}. Declare one with "
        "layerswap.substitution.register_family(Family(...))"
    )


def decoder_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The decoder layers of ``model`` by qualified name: original ones and swapped ones.

    Example::

        [name for name, _ in decoder_layers(model)]   # ["model.layers.0", ...]
    """
    target = _unwrap(model)
    original = family_of(target).decoder_class()
    found: list[tuple[str, nn.Module]] = []
    for name, module in target.named_modules():
        if found and name.startswith(found[-1][0] + "."):
            continue
        if isinstance(module, original) or substitution_of(module) is not None:
            found.append((name, module))
    return found


# --- per-layer work ---------------------------------------------------------------------


@dataclass
class _LayerRecord:
    name: str
    parent: nn.Module
    key: str
    original: nn.Module
    replacement: nn.Module | None  # None once undone (its storage is released)
    replacement_cls: type[nn.Module]
    owner: nn.Module | None  # the PreTrainedModel whose forward records hidden states
    name_in_owner: str
    capture_installed: bool  # whether transformers had hooked the owner at swap time


def _locate(root: nn.Module, key: str) -> tuple[nn.Module, str]:
    owner_name, _, leaf = key.rpartition(".")
    return (root.get_submodule(owner_name) if owner_name else root), leaf


def _device_of(layer: nn.Module) -> torch.device:
    for tensor in layer.parameters():
        return tensor.device
    for buffer in layer.buffers():
        return buffer.device
    return torch.device("cpu")


def _layer_index(layer: nn.Module, position: int) -> int:
    for holder in (layer, getattr(layer, "self_attn", None)):
        index = getattr(holder, "layer_idx", None)
        if isinstance(index, int):
            return index
    return position


def _assign(replacement: nn.Module, converted: dict[str, torch.Tensor], where: str) -> None:
    """Put converted tensors into ``replacement``: same ``Parameter`` objects where given."""
    expected = {
        key: value
        for key, value in replacement.state_dict(keep_vars=True).items()
        if not is_extra_state(key)
    }
    name = type(replacement).__name__
    for key in expected:
        if key not in converted:
            raise ConversionError(
                f"{where}: {name}'s tensor {key!r} gets no value from the converter"
            )
    for key, value in converted.items():
        if key not in expected:
            raise ConversionError(
                f"{where}: the converter produced tensor {key!r}, which {name} lacks"
            )
        if tuple(value.shape) != tuple(expected[key].shape):
            raise ConversionError(
                f"{where}: tensor {key!r} converts to shape {tuple(value.shape)}, "
                f"but {name} has {tuple(expected[key].shape)}"
            )
    for key, value in converted.items():
        owner, leaf = _locate(replacement, key)
        if leaf in owner._parameters:
            if isinstance(value, nn.Parameter):
                owner._parameters[leaf] = value
            else:
                owner._parameters[leaf] = nn.Parameter(
                    value.detach(), requires_grad=value.requires_grad
                )
        else:
            owner._buffers[leaf] = value.detach()


def _build(
    cls: type[nn.Module],
    config: PreTrainedConfig,
    layer_idx: int,
    device: torch.device,
    converted: dict[str, torch.Tensor],
    where: str,
) -> nn.Module:
    """Construct the replacement without allocating its weights when possible.

    Built on the meta device, its parameters are then replaced by the converted
    tensors. A class that cannot be built there, or keeps tensors the converter does
    not provide (non-persistent buffers), is built on the layer's device instead.
    """
    replacement: nn.Module | None = None
    try:
        with torch.device("meta"):
            replacement = cls(config, layer_idx)
    except LayerswapError:
        raise
    except Exception:
        replacement = None
    if replacement is not None:
        _assign(replacement, converted, where)
        leftover = [
            tensor
            for tensor in (*replacement.parameters(), *replacement.buffers())
            if tensor.is_meta
        ]
        if not leftover or device.type == "meta":
            return replacement
    with torch.device(device):
        replacement = cls(config, layer_idx)
    _assign(replacement, converted, where)
    return replacement


def _carry_state(original: nn.Module, replacement: nn.Module, sub: Substitution) -> None:
    replacement.train(original.training)
    # hooks (transformers' hidden-state capture among them) keep firing on the new layer
    for attribute in _HOOK_DICTS:
        hooks = getattr(original, attribute, None)
        if hooks:
            setattr(replacement, attribute, OrderedDict(hooks))
    for attribute in ("gradient_checkpointing", "_gradient_checkpointing_func"):
        if attribute in original.__dict__:
            setattr(replacement, attribute, original.__dict__[attribute])
    setattr(replacement, _MARK, sub)
    accelerate_hook = getattr(original, "_hf_hook", None)
    if accelerate_hook is not None:
        from accelerate.hooks import add_hook_to_module  # type: ignore[import-not-found]

        add_hook_to_module(replacement, accelerate_hook)


def _release(done: nn.Module, keeper: nn.Module) -> None:
    """Empty the tensors of ``done`` that ``keeper`` does not hold itself.

    The ``Parameter`` objects stay (``undo`` fills them again); their storage goes, so
    a swap or an undo never holds much more than one extra layer.
    """
    kept = {id(tensor) for tensor in keeper.state_dict(keep_vars=True).values()}
    for tensor in done.state_dict(keep_vars=True).values():
        if id(tensor) not in kept:
            tensor.data = torch.empty((0,), dtype=tensor.dtype, device=tensor.device)


# Converting runs outside inference mode: a tensor made inside torch.inference_mode() can
# never be trained, so a swap (or an undo) made there would freeze the model for good.
_NORMAL_TENSORS = torch.inference_mode(False)


@_NORMAL_TENSORS
def _swap_layer(
    root: nn.Module,
    name: str,
    layer: nn.Module,
    position: int,
    sub: Substitution,
    replacement_cls: type[nn.Module],
    config: PreTrainedConfig,
) -> _LayerRecord:
    where = f"layer {name!r}"
    parent, key = _locate(root, name)
    state = layer.state_dict(keep_vars=True)
    try:
        # grad mode on: a computed tensor then requires grad iff one of its sources does
        with torch.enable_grad():
            converted = sub.converter.to_replacement(state, _layer_config(config))
        replacement = _build(
            replacement_cls,
            _layer_config(config),
            _layer_index(layer, position),
            _device_of(layer),
            converted,
            where,
        )
    except ConversionError as exc:
        if str(exc).startswith(where):
            raise
        raise ConversionError(f"{where}: {exc}") from exc
    except LayerswapError:
        raise
    except Exception as exc:
        raise ConversionError(f"{where}: {type(exc).__name__}: {exc}") from exc
    _carry_state(layer, replacement, sub)
    install_load_hook(replacement, sub, _layer_config(config))
    name_in_owner, owner = _owner(root, name)
    installed = _capture_installed(owner)
    if owner is not None and not installed:
        _capture_like_original(replacement, owner, type(layer))
    parent._modules[key] = replacement
    _release(layer, replacement)
    return _LayerRecord(
        name, parent, key, layer, replacement, type(replacement), owner, name_in_owner, installed
    )


def _layer_config(config: PreTrainedConfig) -> PreTrainedConfig:
    """The config a layer converter reads (the text config of a composite model)."""
    get_text_config = getattr(config, "get_text_config", None)
    return get_text_config() if callable(get_text_config) else config


@_NORMAL_TENSORS
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
    use :func:`swap`.

    Example::

        fused = build_replacement_layer("llama.decoder.fused", model.model.layers[0],
                                        config=model.config)
    """
    sub = get(substitution)
    where = f"layer {type(layer).__name__}"
    state = {
        key: value.detach().requires_grad_(value.requires_grad)
        for key, value in layer.state_dict(keep_vars=True).items()
    }
    with torch.enable_grad():
        converted = sub.converter.to_replacement(state, _layer_config(config))
    index = _layer_index(layer, 0) if layer_idx is None else layer_idx
    replacement = _build(
        sub.replacement_class(),
        _layer_config(config),
        index,
        _device_of(layer),
        converted,
        where,
    )
    replacement.train(layer.training)
    setattr(replacement, _MARK, sub)
    install_load_hook(replacement, sub, _layer_config(config))
    return replacement


@torch.no_grad()
@_NORMAL_TENSORS
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
    sub = _choose(substitution, None, family_of(model))
    target = _unwrap(model)
    if sub.slot == "head":
        from layerswap.heads import unswap_head

        return int(unswap_head(target))
    config = _layer_config(target.config)
    original_cls = sub.original_class()
    rebuilt = 0
    for position, (name, layer) in enumerate(decoder_layers(target)):
        owner = substitution_of(layer)
        if owner is None:
            continue
        if owner.name != sub.name:
            raise SubstitutionError(
                f"layer {name!r} was swapped by {owner.name}, not by {sub.name}"
            )
        state = {k: v for k, v in layer.state_dict().items() if not is_extra_state(k)}
        converted = sub.converter.to_original(state, config)
        with torch.device("meta"):
            original = original_cls(config, _layer_index(layer, position))
        original.load_state_dict(converted, strict=True, assign=True)
        original.train(layer.training)
        parent, key = _locate(target, name)
        parent._modules[key] = original
        rebuilt += 1
    return rebuilt


@_NORMAL_TENSORS
def _restore_layer(record: _LayerRecord, sub: Substitution, config: PreTrainedConfig) -> None:
    replacement = record.replacement
    assert replacement is not None, "restored twice"
    state = {
        key: value
        for key, value in replacement.state_dict(keep_vars=True).items()
        if not is_extra_state(key)
    }
    try:
        values = sub.converter.to_original(state, _layer_config(config))
    except ConversionError as exc:
        raise ConversionError(f"layer {record.name!r}: cannot convert back: {exc}") from exc
    targets = record.original.state_dict(keep_vars=True)
    missing = sorted(set(targets) - set(values))
    if missing:
        raise ConversionError(
            f"layer {record.name!r}: converting back gives no value for {missing[0]!r}"
        )
    for key, tensor in targets.items():
        value = values[key]
        if value is not tensor:
            tensor.data = value.detach()
    record.parent._modules[record.key] = record.original
    hooked_meanwhile = not record.capture_installed and _capture_installed(record.owner)
    if hooked_meanwhile and record.owner is not None:
        # transformers hooked the model while this layer was out: hook it now
        _capture_subtree(record.original, record.name_in_owner, record.owner)
    _release(replacement, record.original)
    record.replacement = None


# --- model-level bookkeeping -----------------------------------------------------------


def _pretrained_ancestors(root: nn.Module, layer_names: list[str]) -> list[tuple[str, nn.Module]]:
    """Every ``PreTrainedModel`` in ``root`` that contains one of ``layer_names``."""
    from transformers import PreTrainedModel

    found = []
    for name, module in root.named_modules():
        if not isinstance(module, PreTrainedModel):
            continue
        prefix = f"{name}." if name else ""
        if any(layer.startswith(prefix) for layer in layer_names):
            found.append((name, module))
    return found


def _relative(name: str, ancestor: str) -> str:
    return name[len(ancestor) + 1 :] if ancestor else name


def conversion_transforms(
    model: nn.Module, sub: Substitution, replacement_cls: type[nn.Module] | None = None
) -> list[Any]:
    """``transformers`` weight transforms for the layers of ``model`` that ``sub`` made.

    ``from_pretrained`` applies them to load an original-layout checkpoint into the
    replacement layers; ``save_pretrained`` reverses them to write that layout.
    """
    config = getattr(model, "config", None)
    if config is None:
        return []
    prefix = getattr(model, "base_model_prefix", "") or ""
    transforms: list[Any] = []
    for name, module in model.named_modules():
        made_here = substitution_of(module) is sub
        if not made_here and not (replacement_cls is not None and type(module) is replacement_cls):
            continue
        scope = name[len(prefix) + 1 :] if prefix and name.startswith(prefix + ".") else name
        transforms.extend(
            sub.converter.weight_transforms(
                _layer_config(config), scope_prefix=scope, base_model_prefix=prefix
            )
        )
    return transforms


def _base_conversions(model: nn.Module) -> list[Any]:
    existing = model.__dict__.get("_weight_conversions")
    if existing is not None:
        return list(existing)
    # what save_pretrained would use for a model not loaded by from_pretrained
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import PrefixChange

    return [
        transform
        for transform in get_model_conversion_mapping(model, add_legacy=False)
        if not isinstance(transform, PrefixChange)
    ]


@dataclass
class _ModelState:
    """Instance attributes set on the models above swapped layers, to put back on undo."""

    saved: list[tuple[nn.Module, str, Any]] = field(default_factory=list)

    def set(self, module: nn.Module, attribute: str, value: Any) -> None:
        self.saved.append((module, attribute, module.__dict__.get(attribute, _MISSING)))
        setattr(module, attribute, value)

    def restore(self) -> None:
        for module, attribute, previous in reversed(self.saved):
            if previous is _MISSING:
                module.__dict__.pop(attribute, None)
            else:
                setattr(module, attribute, previous)
        self.saved.clear()


def _register_model_state(
    state: _ModelState,
    root: nn.Module,
    layer_names: list[str],
    sub: Substitution,
    replacement_cls: type[nn.Module],
) -> None:
    for _, model in _pretrained_ancestors(root, layer_names):
        transforms = conversion_transforms(model, sub)
        state.set(model, "_weight_conversions", _base_conversions(model) + transforms)
        no_split = set(getattr(model, "_no_split_modules", None) or ())
        state.set(model, "_no_split_modules", no_split | {replacement_cls.__name__})


# transformers records hidden states with forward hooks that it installs lazily, on the
# first output_hidden_states call, on modules whose class is listed in the model's
# _can_record_outputs -- the original classes. A replacement layer would be missed.
# layerswap installs on a replacement layer the hooks its original would get, unless
# the original already has them (then they are carried over with its other hooks).


def _capture_tasks(owner: nn.Module) -> list[tuple[str, Any]]:
    """``(output name, OutputRecorder)`` pairs of ``owner``, as transformers builds them."""
    try:
        from transformers.utils.output_capturing import _CAN_RECORD_REGISTRY, OutputRecorder
    except ImportError:  # pragma: no cover - older or newer transformers
        return []
    tasks = []
    for key, specs in _CAN_RECORD_REGISTRY.get(owner).items():
        for spec in specs if isinstance(specs, list) else [specs]:
            if isinstance(spec, OutputRecorder):
                tasks.append((key, spec))
            elif isinstance(spec, type):
                index = 0 if "hidden_states" in key else 1
                tasks.append((key, OutputRecorder(target_class=spec, index=index)))
    return tasks


def _capture_installed(owner: nn.Module | None) -> bool:
    return owner is not None and bool(owner.__dict__.get("_output_capturing_hooks_installed"))


class _CaptureHook:
    """transformers' output-capture hook, picklable (transformers' own is a closure).

    The real hook is made by transformers itself, on a throwaway module, so the
    capture logic stays transformers'; pickling keeps the arguments.
    """

    def __init__(self, key: str, index: int, initial: bool) -> None:
        from transformers.utils.output_capturing import install_output_capuring_hook

        self.key, self.index, self.initial = key, index, initial
        # made now, not on first call: a hook that changes its own state while
        # torch.compile traces it breaks the graph on every layer
        holder = nn.Module()
        install_output_capuring_hook(holder, key, index, initial)
        (self._hook,) = holder._forward_hooks.values()

    def __call__(self, module: nn.Module, args: Any, output: Any) -> Any:
        return self._hook(module, args, output)

    def __getstate__(self) -> dict[str, Any]:
        return {"key": self.key, "index": self.index, "initial": self.initial}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["key"], state["index"], state["initial"])  # type: ignore[misc]


def _capture_like_original(layer: nn.Module, owner: nn.Module, original_cls: type) -> None:
    """Give a replacement layer the capture hooks an ``original_cls`` layer would get."""
    for key, spec in _capture_tasks(owner):
        target = spec.target_class
        if spec.layer_name is None and target is not None and issubclass(original_cls, target):
            hook = _CaptureHook(key, spec.index, spec.capture_initial_hidden_state)
            layer.register_forward_hook(hook)


def _capture_subtree(layer: nn.Module, name: str, owner: nn.Module) -> None:
    """Install on a restored layer the hooks transformers gave its model while it was out."""
    try:
        from transformers.utils.output_capturing import recursively_install_hooks
    except ImportError:  # pragma: no cover - older or newer transformers
        return
    recursively_install_hooks(layer, f".{name}", _capture_tasks(owner))


def _owner(root: nn.Module, layer_name: str) -> tuple[str, nn.Module | None]:
    """The innermost ``PreTrainedModel`` holding ``layer_name``, and the layer's name in it."""
    found: tuple[str, nn.Module | None] = ("", None)
    for name, model in _pretrained_ancestors(root, [layer_name]):
        found = (name, model)
    owner_name, owner = found
    return _relative(layer_name, owner_name), owner


# models finished by adopt_constructed -> the weight transforms made for them
_ADOPTED: weakref.WeakKeyDictionary[nn.Module, list[Any]] = weakref.WeakKeyDictionary()


def adopt_constructed(model: Any, sub: Substitution, replacement_cls: type[nn.Module]) -> None:
    """Finish a model built inside :func:`layerswap.use`: checks and bookkeeping.

    Runs the upstream-structure check, marks the replacement layers, gives them the
    hidden-state capture hooks, and records the weight conversions that
    ``save_pretrained`` reverses and the no-split class for ``device_map``.
    """
    from transformers import PreTrainedModel

    if not isinstance(model, PreTrainedModel):
        return
    layers = [(name, m) for name, m in model.named_modules() if type(m) is replacement_cls]
    if not layers:
        return
    fresh = [(name, layer) for name, layer in layers if substitution_of(layer) is None]
    if fresh:
        sub.check_upstream(_layer_config(model.config))
        original_cls = sub.original_class()
        for _, layer in fresh:
            setattr(layer, _MARK, sub)
            install_load_hook(layer, sub, _layer_config(model.config))
            _capture_like_original(layer, model, original_cls)
        guard_peft_targets()  # a new PEFT adapter cannot silently miss fused modules
    if model in _ADOPTED:
        return  # nested use() of the same substitution: done once
    transforms = conversion_transforms(model, sub)
    _ADOPTED[model] = transforms
    model._weight_conversions = _base_conversions(model) + transforms
    no_split = set(getattr(model, "_no_split_modules", None) or ())
    model._no_split_modules = no_split | {replacement_cls.__name__}


def loading_transforms(
    model: Any, sub: Substitution, replacement_cls: type[nn.Module], found: list[Any]
) -> list[Any]:
    """The transforms ``from_pretrained`` needs for ``model``'s replacement layers.

    Those made when the model was adopted (so loading and saving share one list),
    unless ``found`` already holds them.
    """
    transforms = _ADOPTED.get(model)
    if transforms is None:
        transforms = conversion_transforms(model, sub, replacement_cls)
    present = {id(transform) for transform in found}
    return [transform for transform in transforms if id(transform) not in present]


# --- the public entry point --------------------------------------------------------------


class SwapHandle:
    """A swap in effect: what was swapped, and the way back.

    ``undo()`` puts the original layer objects back and converts the weights back
    into their own ``Parameter`` objects (bitwise); a second ``undo()`` does
    nothing. As a context manager the swap is undone on exit, on any exception too.

    Example::

        with layerswap.swap(model, backend="fused") as handle:
            print(handle.report())
    """

    def __init__(
        self,
        model: nn.Module,
        substitution: Substitution,
        records: list[_LayerRecord],
        model_state: _ModelState,
        config: PreTrainedConfig,
    ) -> None:
        self.model = model
        self.substitution = substitution
        self._records = records
        self._model_state = model_state
        self._config = config
        self._active = True

    @property
    def active(self) -> bool:
        """Whether the swap is still in effect."""
        return self._active

    @property
    def swapped(self) -> list[tuple[str, type[nn.Module], type[nn.Module]]]:
        """(qualified module name, original class, replacement class) per swapped layer."""
        return [
            (record.name, type(record.original), record.replacement_cls) for record in self._records
        ]

    def undo(self) -> None:
        """Put the original layers and weights back (a no-op when already undone)."""
        if not self._active:
            return
        pending = [record for record in self._records if record.replacement is not None]
        for record in pending:
            if record.parent._modules.get(record.key) is not record.replacement:
                raise SubstitutionError(
                    f"cannot undo {self.substitution.name}: layer {record.name!r} is no longer "
                    f"the swapped {record.replacement_cls.__name__} (it was replaced since)"
                )
        # layer by layer, releasing each replacement: memory stays near one extra layer
        for record in reversed(pending):
            _restore_layer(record, self.substitution, self._config)
        self._model_state.restore()
        self._active = False

    def report(self) -> str:
        """A readable summary: the substitution and every swapped layer."""
        state = "active" if self._active else "undone"
        lines = [f"{self.substitution.name}: {len(self._records)} layers swapped ({state})"]
        width = max((len(record.name) for record in self._records), default=0)
        for name, original, replacement in self.swapped:
            lines.append(f"  {name:<{width}}  {original.__name__} -> {replacement.__name__}")
        return "\n".join(lines)

    def __iter__(self) -> Iterator[tuple[str, type[nn.Module], type[nn.Module]]]:
        return iter(self.swapped)

    def __len__(self) -> int:
        return len(self._records)

    def __enter__(self) -> SwapHandle:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.undo()

    def __repr__(self) -> str:
        state = "active" if self._active else "undone"
        return f"<SwapHandle {self.substitution.name}: {len(self._records)} layers, {state}>"


def _choose(
    substitution: str | Substitution | None, backend: str | None, family: Family
) -> Substitution:
    if substitution is not None and backend is not None:
        raise TypeError("swap() takes a substitution or a backend, not both")
    if substitution is None:
        return get(f"{family.name}.decoder.{backend or 'fused'}")
    return get(substitution)


def swap(
    model: nn.Module,
    substitution: str | Substitution | None = None,
    *,
    backend: str | None = None,
) -> SwapHandle:
    """Swap every decoder layer of a built ``model``, layer by layer, reversibly.

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
    target = _unwrap(model)
    if target is not model:
        warnings.warn(
            "swapping the layers inside a torch.compile result: compile the model again "
            "(torch.compile(model)) after the swap and after undo, or it may run stale code",
            SwapWarning,
            stacklevel=2,
        )
    family = family_of(target)
    sub = _choose(substitution, backend, family)
    if sub.family != family.name:
        raise SubstitutionError(
            f"{sub.name} is for {sub.family} models, but this model is {family.name} "
            f"({type(target).__name__}); use {family.name}.decoder.{sub.backend} "
            "or swap(model, backend=...)"
        )
    if sub.slot == "head":
        from layerswap.heads import swap_head

        return swap_head(target, sub)
    replacement_cls = sub.replacement_class()
    original_cls = sub.original_class()
    config = getattr(target, "config", None)
    if config is None:
        raise SubstitutionError(f"{type(target).__name__} has no config; swap() needs one")
    layers = decoder_layers(target)
    done = [name for name, layer in layers if substitution_of(layer) is not None]
    if done:
        owner = substitution_of(dict(layers)[done[0]])
        raise SubstitutionError(
            f"{len(done)} layers of this model are already swapped by "
            f"{getattr(owner, 'name', owner)}; undo that swap first"
        )
    for name, layer in layers:
        if type(layer) is not original_cls:
            raise SubstitutionError(
                f"layer {name!r} is a {type(layer).__name__}, a subclass of "
                f"{original_cls.__name__}; {sub.name} replaces exact {original_cls.__name__} "
                "layers only, so it would drop that subclass's behaviour"
            )
    if not layers:
        raise SubstitutionError(f"no {original_cls.__name__} found in {type(target).__name__}")
    sub.check_upstream(_layer_config(config))
    names = [name for name, _ in layers]
    records: list[_LayerRecord] = []
    model_state = _ModelState()
    try:
        for position, (name, layer) in enumerate(layers):
            records.append(_swap_layer(target, name, layer, position, sub, replacement_cls, config))
        _register_model_state(model_state, target, names, sub, replacement_cls)
    except BaseException:
        model_state.restore()
        for record in reversed(records):
            try:
                _restore_layer(record, sub, config)
            except Exception as failure:  # keep the original error the one raised
                warnings.warn(
                    f"rolling back {sub.name}: layer {record.name!r} could not be restored: "
                    f"{failure}",
                    SwapWarning,
                    stacklevel=2,
                )
        raise
    guard_peft_targets()  # a new PEFT adapter cannot silently miss fused modules
    return SwapHandle(target, sub, records, model_state, config)
