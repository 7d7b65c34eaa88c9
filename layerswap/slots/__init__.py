"""What a substitution can replace in a model: the slots, as objects.

A :class:`Slot` is everything layerswap knows about one kind of part — every decoder
layer (``decoder``), or the causal LM's head and loss (``head``): its original class for
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
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from layerswap.errors import SubstitutionError

if TYPE_CHECKING:
    from transformers import PreTrainedConfig

    from layerswap.family import Family
    from layerswap.handle import SwapHandle
    from layerswap.patching import Scoped
    from layerswap.substitution import Substitution

__all__ = ["ModelParts", "Slot", "get_slot", "register_slot", "slot_names", "unregister_slot"]


@dataclass(frozen=True)
class ModelParts:
    """A model as coverage describes it: its decoder layers and the rest, as readable text."""

    model: Any  # the causal LM, built on the meta device
    family: Family
    layers: list[tuple[str, Any]]  # (qualified name, module) per decoder layer
    layers_text: str  # "model.layers.0-3 (LlamaDecoderLayer)"
    outside: tuple[str, ...]  # the modules outside the layers that hold tensors


class Slot:
    """One kind of model part a substitution replaces; subclasses say how.

    Every method takes the substitution it acts for; the slot holds no state of its own.
    """

    #: the slot's name, the middle part of ``<family>.<slot>.<backend>``
    name: str = ""
    #: what it replaces, in a few words (``layerswap list``)
    description: str = ""
    #: whether a substitution of this slot is compared with its original at first use on
    #: a transformers release (:func:`layerswap.proof.ensure_proven`)
    proven_at_first_use: bool = False

    def original(self, family: Family) -> str:
        """``"module:Class"`` of what this slot replaces in ``family``."""
        raise NotImplementedError

    def swap(self, model: Any, sub: Substitution) -> SwapHandle:
        """Put ``sub`` into the built ``model`` (of ``sub``'s family), reversibly."""
        raise NotImplementedError

    def rebuild_originals(self, model: Any, sub: Substitution) -> int:
        """Put originals holding the converted weights where ``sub``'s parts are; how many."""
        raise NotImplementedError

    def construction(self, sub: Substitution) -> list[Scoped]:
        """The patches :func:`layerswap.use` starts so that models are built with ``sub``."""
        raise NotImplementedError

    def swapped_by(self, model: Any) -> str | None:
        """The name of the substitution of this slot ``model`` runs, ``None`` for the original."""
        raise NotImplementedError

    def prepare(self, sub: Substitution, config: PreTrainedConfig) -> None:
        """Everything checked before ``sub`` changes a model of ``config``, in order: the
        call contract and the structure (:meth:`Substitution.check_upstream`, on the text
        config, unwrapped once there), then what the slot adds (the decoder slot: the
        first-use proof). Raises; changes nothing."""
        sub.check_upstream(config)

    def check_call(self, sub: Substitution, config: PreTrainedConfig | None) -> None:
        """Raise :class:`~layerswap.errors.UpstreamDriftError` when transformers calls the
        original with something the replacement does not handle (default: nothing to check)."""

    def coverage(self, parts: ModelParts) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """(what a substitution of this slot replaces, what stays the original's)."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<Slot {self.name}>"


#: the builtin slots, imported when first asked for
_BUILTIN = {"decoder": "layerswap.slots.decoder", "head": "layerswap.slots.head"}
_SLOTS: dict[str, Slot] = {}
_ADDED: list[str] = []  # names of slots registered beyond the builtin ones, in order
_LOCK = threading.RLock()


def slot_names() -> tuple[str, ...]:
    """The names of the slots, builtin first (no slot module is imported).

    Example::

        slot_names()   # ("decoder", "head")
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
