"""transformers' hidden-state (output) capture, followed onto replacement layers.

transformers hooks the layer classes a model declares so that ``output_hidden_states``
and ``output_attentions`` collect what they return; a replacement layer is of another
class. Part of :mod:`layerswap.hf_internals`, where every touch point is named.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import nn

if TYPE_CHECKING:
    pass

__all__ = [
    "CaptureHook",
    "attention_collector",
    "capture_like_original",
    "capture_subtree",
    "output_capture_installed",
    "output_capture_tasks",
]


# --- hidden-state (output) capture ---------------------------------------------------------
# transformers records hidden states with forward hooks that it installs lazily, on the
# first output_hidden_states call, on modules whose class is listed in the model's
# _can_record_outputs: the original classes. A replacement layer would be missed, so
# layerswap installs on it the hooks its original would get, with transformers' own code.


def output_capture_tasks(owner: nn.Module) -> list[tuple[str, Any]]:
    """``(output name, OutputRecorder)`` pairs of ``owner``, as transformers builds them.

    Touches ``transformers.utils.output_capturing._CAN_RECORD_REGISTRY`` (the per-class
    ``_can_record_outputs`` after transformers' normalisation: a dict keyed by
    ``str(class)`` up to 5.22, a registry keyed on the model from 5.23) and
    ``OutputRecorder``.
    Empty on a transformers without output capturing.
    """
    try:
        from transformers.utils.output_capturing import _CAN_RECORD_REGISTRY, OutputRecorder
    except ImportError:  # pragma: no cover - older or newer transformers
        return []
    if type(_CAN_RECORD_REGISTRY) is dict:  # up to 5.22: a plain dict keyed by str(class)
        flags = _CAN_RECORD_REGISTRY.get(str(owner.__class__)) or {}
    else:  # from 5.23: a registry keyed on the model
        flags = _CAN_RECORD_REGISTRY.get(owner) or {}
    tasks = []
    for key, specs in flags.items():
        for spec in specs if isinstance(specs, list) else [specs]:
            if isinstance(spec, OutputRecorder):
                tasks.append((key, spec))
            elif isinstance(spec, (type, str)):  # a class, or (5.22) a class's name
                index = 0 if "hidden_states" in key else 1
                named = {"class_name": spec} if isinstance(spec, str) else {"target_class": spec}
                tasks.append((key, OutputRecorder(index=index, **named)))
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

    Reads ``OutputRecorder``'s fields (``target_class``, or ``class_name`` where a release
    names the class, ``layer_name``, ``index``, ``capture_initial_hidden_state``) the way
    transformers matches them to modules.
    """
    names = {klass.__name__ for klass in original_cls.__mro__}
    for key, spec in output_capture_tasks(owner):
        target = spec.target_class
        matches = (target is not None and issubclass(original_cls, target)) or (
            getattr(spec, "class_name", None) in names
        )
        if spec.layer_name is None and matches:
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
