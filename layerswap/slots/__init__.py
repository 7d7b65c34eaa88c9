"""What a substitution can replace in a model: the slots, as objects.

A :class:`Slot` is everything layerswap knows about one kind of part — every decoder
layer (``decoder``), the causal LM's head and loss (``head``), or what an adopted patch
function rebinds (``patch``): its original class for
a family, how to swap a substitution into a built model and undo it, the patches that
build it inside :func:`layerswap.use`, which substitution a model runs in it, how to
rebuild the original for :func:`layerswap.verify`, and what it replaces
(:func:`layerswap.coverage`). ``swap``, ``use``, ``verify``, ``coverage`` and the
proof ask the slot; none of them tests a slot's name. A new slot is one module holding
a ``Slot`` subclass, named here (or given to :func:`register_slot`).

This module imports neither torch nor transformers: a slot's module is imported the
first time the slot is asked for.

Example::

    from layerswap.slots import get_slot

    get_slot("head").original(layerswap.get_family("llama"))
    # "transformers.models.llama.modeling_llama:LlamaForCausalLM"
"""

from __future__ import annotations

import importlib
import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

from layerswap.errors import SubstitutionError, SwapWarning
from layerswap.patching.undo import UndoLog
from layerswap.stacklevels import external_stacklevel
from layerswap.substitution import ModelParts, Slot

__all__ = [
    "ModelParts",
    "undo_first",
    "Slot",
    "get_slot",
    "register_slot",
    "slot_names",
    "takes_any_model_type",
    "unregister_slot",
]


def undo_first(owner: object) -> str:
    """What to do about modules ``owner`` (a substitution, or its name) swapped already:
    undo that swap; a model with no handle to undo is given its originals back by
    :func:`layerswap.swap.rebuild_originals`."""
    name = getattr(owner, "name", owner)
    return (
        "undo that swap first (a model with no handle, built inside use(), copied or "
        "loaded whole: from layerswap.swap import rebuild_originals; "
        f"rebuild_originals(model, {str(name)!r}))"
    )


@contextmanager
def rolling_back(name: str) -> Iterator[UndoLog]:
    """A swap's changes, all or nothing: every change recorded in the log it yields is
    taken back when the block raises (:meth:`UndoLog.all_or_nothing`). A step that fails
    in turn while the model is put back is a :class:`~layerswap.errors.SwapWarning`
    naming the substitution and pointing at the caller's line; the failure that started
    the rollback stays the one raised.

    Example::

        with rolling_back(sub.name) as changes:
            changes.set_class(model, replacement)
    """

    def warn(failure: BaseException) -> None:
        warnings.warn(
            f"rolling back {name}: {failure}", SwapWarning, stacklevel=external_stacklevel()
        )

    changes = UndoLog()
    with changes.all_or_nothing(warn):
        yield changes


#: the builtin slots, imported when first asked for
_BUILTIN = {
    "decoder": "layerswap.slots.decoder",
    "head": "layerswap.slots.head",
    "patch": "layerswap.slots.patch",
    "norm": "layerswap.slots.norm",
    "mlp": "layerswap.slots.mlp",
    "experts": "layerswap.slots.experts",
    "qkv": "layerswap.slots.qkv",
    "rotary": "layerswap.slots.rotary",
}
#: the builtin slots whose substitutions may name any causal-LM model type, with or
#: without a registered family (their modules are not imported to say so)
_ANY_MODEL_TYPE = frozenset({"norm", "mlp", "experts", "qkv", "rotary", "head"})
_SLOTS: dict[str, Slot] = {}
_ADDED: list[str] = []  # names of slots registered beyond the builtin ones, in order
_LOCK = threading.RLock()


def slot_names() -> tuple[str, ...]:
    """The names of the slots, builtin first (no slot module is imported).

    Example::

        slot_names()   # ("decoder", "head", "patch")
    """
    with _LOCK:
        return (*_BUILTIN, *_ADDED)


def get_slot(name: str) -> Slot:
    """The slot called ``name``.

    Raises :class:`~layerswap.errors.SubstitutionError` naming the slots there are.
    """
    with _LOCK:
        found = _SLOTS.get(name)
        if found is not None:
            return found
        module = _BUILTIN.get(name)
        if module is None:
            raise SubstitutionError(f"unknown slot {name!r}; slots are {', '.join(slot_names())}")
        slot: Slot = importlib.import_module(module).SLOT
        _SLOTS[name] = slot
        return slot


def takes_any_model_type(name: str) -> bool:
    """Whether substitutions of the slot ``name`` may name any causal-LM model type (the
    ``norm`` slot), not only a registered family; ``False`` for an unknown slot."""
    with _LOCK:
        if name in _BUILTIN and name not in _SLOTS:
            return name in _ANY_MODEL_TYPE
        found = _SLOTS.get(name)
    return bool(getattr(found, "takes_any_model_type", False))


def register_slot(slot: Slot, *, replace: bool = False) -> Slot:
    """Make ``slot`` known, so that backends may declare implementations of it.

    Example::

        class Embeddings(Slot):
            name = "embeddings"
            ...
        register_slot(Embeddings())
    """
    if not isinstance(slot, Slot) or not slot.name or "." in slot.name:
        raise SubstitutionError(
            f"register_slot takes a Slot instance with a name without dots, got {slot!r}"
        )
    with _LOCK:
        if slot.name in slot_names() and not replace:
            raise SubstitutionError(
                f"a slot named {slot.name!r} exists; pass replace=True to replace it"
            )
        if slot.name not in slot_names():
            _ADDED.append(slot.name)
        _SLOTS[slot.name] = slot
        return slot


def unregister_slot(name: str) -> Slot:
    """Forget a slot registered with :func:`register_slot` (the builtin ones stay)."""
    with _LOCK:
        if name not in _ADDED:
            raise SubstitutionError(
                f"{name!r} is not a registered slot"
                + (" (the builtin slots stay)" if name in _BUILTIN else "")
            )
        _ADDED.remove(name)
        return _SLOTS.pop(name)
