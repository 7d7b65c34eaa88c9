"""Every place layerswap reaches into transformers below its public API, in one module.

transformers exposes no public way to do some of what a swap needs: hook the hidden-state
capture onto a layer class the model did not declare, give ``from_pretrained`` and
``save_pretrained`` per-layer weight transforms, read the attention weights an
``output_attentions=True`` call collects. Each function here names the transformers
internal it touches and why, so an upstream change breaks one module, and a reader sees
the whole surface at once. Imports of transformers happen inside the functions: this
module costs nothing to import.

Example::

    from layerswap import hf_internals

    hf_internals.output_capture_installed(model)   # has transformers hooked it yet?
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import nn

if TYPE_CHECKING:
    from collections.abc import Sequence

__all__ = [
    "CONVERSION_MAPPING_TARGET",
    "POST_INIT_TARGET",
    "WEIGHT_CONVERSIONS_ATTRIBUTE",
    "CaptureHook",
    "attention_collector",
    "base_weight_conversions",
    "capture_like_original",
    "capture_subtree",
    "conversion_ops_class",
    "output_capture_installed",
    "output_capture_tasks",
    "weight_converter",
    "weight_renaming",
]

#: ``layerswap.wrap`` target run when a ``PreTrainedModel`` finishes ``__init__``: the one
#: moment every construction path (``Model(config)``, ``Auto*``, ``from_pretrained``)
#: passes through before weights load, so ``use()`` finishes models there.
POST_INIT_TARGET = "transformers.modeling_utils:PreTrainedModel.post_init"

#: ``layerswap.wrap`` target giving ``from_pretrained`` its list of weight transforms, as
#: ``modeling_utils`` imported it from ``transformers.conversion_mapping``; ``use()`` adds
#: the replacement layers' transforms to that list.
CONVERSION_MAPPING_TARGET = "transformers.modeling_utils:get_model_conversion_mapping"

#: the instance attribute where ``from_pretrained`` keeps the transforms it applied and
#: ``save_pretrained`` reads them back (reversed) to write the checkpoint's own layout
WEIGHT_CONVERSIONS_ATTRIBUTE = "_weight_conversions"


# --- hidden-state (output) capture ---------------------------------------------------------
# transformers records hidden states with forward hooks that it installs lazily, on the
# first output_hidden_states call, on modules whose class is listed in the model's
# _can_record_outputs: the original classes. A replacement layer would be missed, so
# layerswap installs on it the hooks its original would get, with transformers' own code.


def output_capture_tasks(owner: nn.Module) -> list[tuple[str, Any]]:
    """``(output name, OutputRecorder)`` pairs of ``owner``, as transformers builds them.

    Touches ``transformers.utils.output_capturing._CAN_RECORD_REGISTRY`` (the per-class
    ``_can_record_outputs`` after transformers' normalisation) and ``OutputRecorder``.
    Empty on a transformers without output capturing.
    """
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


def output_capture_installed(owner: nn.Module | None) -> bool:
    """Whether transformers has installed its capture hooks on ``owner`` already.

    Reads the instance flag ``_output_capturing_hooks_installed`` that transformers sets
    on the first ``output_hidden_states`` call.
    """
    return owner is not None and bool(owner.__dict__.get("_output_capturing_hooks_installed"))


class CaptureHook:
    """transformers' output-capture hook, picklable (transformers' own is a closure).

    The real hook is made by ``transformers.utils.output_capturing.
    install_output_capuring_hook`` (sic) on a throwaway module, so the capture logic
    stays transformers'; pickling keeps the arguments. Example::

        layer.register_forward_hook(CaptureHook("hidden_states", 0, True))
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


def capture_like_original(layer: nn.Module, owner: nn.Module, original_cls: type) -> None:
    """Give a replacement ``layer`` the capture hooks an ``original_cls`` layer would get.

    Reads ``OutputRecorder``'s fields (``target_class``, ``layer_name``, ``index``,
    ``capture_initial_hidden_state``) the way transformers matches them to modules.
    """
    for key, spec in output_capture_tasks(owner):
        target = spec.target_class
        if spec.layer_name is None and target is not None and issubclass(original_cls, target):
            hook = CaptureHook(key, spec.index, spec.capture_initial_hidden_state)
            layer.register_forward_hook(hook)


def capture_subtree(layer: nn.Module, name: str, owner: nn.Module) -> None:
    """Install on ``layer`` (named ``name`` in ``owner``) the hooks ``owner`` got meanwhile.

    For an original layer put back by undo after transformers hooked the model: calls
    ``transformers.utils.output_capturing.recursively_install_hooks``, the function
    transformers itself installs with.
    """
    try:
        from transformers.utils.output_capturing import recursively_install_hooks
    except ImportError:  # pragma: no cover - older or newer transformers
        return
    recursively_install_hooks(layer, f".{name}", output_capture_tasks(owner))


def attention_collector() -> Any | None:
    """transformers' collector of this call's outputs, ``None`` without output capturing.

    ``transformers.utils.output_capturing._active_collector``: where an
    ``output_attentions=True`` call collects attention weights. A replacement layer that
    computes them appends there (see ``layerswap.backends._layer.attention_weights_sink``).
    """
    try:
        from transformers.utils.output_capturing import _active_collector
    except ImportError:  # pragma: no cover - a transformers without output capturing
        return None
    return _active_collector


# --- weight transforms for from_pretrained / save_pretrained --------------------------------


def base_weight_conversions(model: nn.Module) -> list[Any]:
    """The weight transforms ``save_pretrained`` reverses for ``model``, before layerswap's.

    Those ``from_pretrained`` recorded on the model (``_weight_conversions``), else what
    it would have used: ``transformers.conversion_mapping.get_model_conversion_mapping``
    without ``transformers.core_model_loading.PrefixChange`` entries (which only apply
    when loading).
    """
    existing = model.__dict__.get(WEIGHT_CONVERSIONS_ATTRIBUTE)
    if existing is not None:
        return list(existing)
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import PrefixChange

    return [
        transform
        for transform in get_model_conversion_mapping(model, add_legacy=False)
        if not isinstance(transform, PrefixChange)
    ]


def weight_renaming(sources: Sequence[str], targets: Sequence[str]) -> Any:
    """A ``transformers.core_model_loading.WeightRenaming`` (keys renamed, values kept)."""
    from transformers.core_model_loading import WeightRenaming

    return WeightRenaming(list(sources), list(targets))


def weight_converter(sources: Sequence[str], targets: Sequence[str], operation: Any) -> Any:
    """A ``transformers.core_model_loading.WeightConverter`` applying one ``operation``."""
    from transformers.core_model_loading import WeightConverter

    return WeightConverter(list(sources), list(targets), operations=[operation])


def conversion_ops_class() -> type:
    """``transformers.core_model_loading.ConversionOps``, the base of a converter operation."""
    from transformers.core_model_loading import ConversionOps

    base: type = ConversionOps
    return base
