"""What every class-swapping replacement shares: a subclass of the model's own class whose
``forward`` is a backend's kernel.

The slots below the decoder layer that keep a module's parameters (``norm``, ``mlp``) give
each instance they swap a class made here: ``type(name, (Replacement, Original), ...)``,
so that the instance keeps its parameters (the very same ``Parameter`` objects, under the
same names) and every other attribute, ``isinstance(module, Original)`` still holds
(transformers' ``_init_weights`` asks it), and undo is setting the class back. A backend's
replacement names what it computes (``kernels``) and says why not for the rest
(:meth:`ClassReplacement.refusal`).

Example::

    class FusedNorm(NormReplacement):
        backend = "fused"
        kernels = KINDS
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar

from torch import nn

if TYPE_CHECKING:
    from layerswap.patching.undo import UndoLog

__all__ = ["ClassReplacement"]

_MADE: dict[tuple[type, type, Any, str], type[ClassReplacement]] = {}
_LOCK = threading.Lock()


class ClassReplacement(nn.Module):
    """The base of a backend's class-swapping replacement; :meth:`subclass_for` makes the
    classes, one per (original class, what it computes, substitution)."""

    #: the backend's name
    backend: ClassVar[str] = ""
    #: what this backend computes, keyed by :meth:`kernel_key` of a spec
    kernels: ClassVar[Mapping[str, Any]] = {}
    #: set on each made class: the original class, what it computes, the substitution
    _layerswap_original: ClassVar[type]
    _layerswap_spec: ClassVar[Any]
    _layerswap_swapped_by: ClassVar[str]

    @classmethod
    def kernel_key(cls, spec: Any) -> str:
        """The :attr:`kernels` key a module computing ``spec`` needs (its ``kind``)."""
        return str(spec.kind)

    @classmethod
    def refusal(cls, spec: Any) -> str | None:
        """Why this backend does not compute ``spec`` (``None``: it does)."""
        key = cls.kernel_key(spec)
        if key in cls.kernels:
            return None
        return f"it computes {key}, which the {cls.backend} backend lacks"

    @classmethod
    def made_namespace(cls, original: type, spec: Any) -> dict[str, Any]:
        """What a made class holds beyond the class's own (nothing; the ``rotary`` slot:
        the original's ``forward``, calling the backend's kernel)."""
        return {}

    @classmethod
    def subclass_for(cls, original: type, spec: Any, substitution: str) -> type[ClassReplacement]:
        """The class an ``original`` module computing ``spec`` becomes (made once)."""
        key = (cls, original, spec, substitution)
        with _LOCK:
            made = _MADE.get(key)
            if made is None:
                namespace: dict[str, Any] = {
                    "__module__": cls.__module__,
                    "__qualname__": f"{cls.__name__}[{original.__name__}]",
                    "_layerswap_original": original,
                    "_layerswap_spec": spec,
                    "_layerswap_swapped_by": substitution,
                    **cls.made_namespace(original, spec),
                }
                made = type(f"{cls.__name__}[{original.__name__}]", (cls, original), namespace)
                assert issubclass(made, ClassReplacement)
                _MADE[key] = made
            return made

    def _layerswap_attach(self, changes: UndoLog) -> None:
        """What a swap changes beyond the class, each change logged in ``changes`` (nothing:
        the class alone; the ``qkv`` slot packs the projections)."""

    def _layerswap_members(self) -> dict[str, tuple[nn.Module, type]]:
        """The modules inside this one whose class :meth:`_layerswap_attach` set, by name,
        with that class (none; the ``qkv`` slot: each packed projection, a
        ``PackedLinear``): an undo checks them as it checks this module."""
        return {}

    def _layerswap_detach(self) -> None:
        """Take back what :meth:`_layerswap_attach` changed, on a module given its original
        class outside an undo (:meth:`~layerswap.slots.class_swap.ClassSwapSlot.rebuild_originals`)."""

    def __reduce_ex__(self, protocol: Any) -> Any:
        # pickled as how to make its class again (a made class is not importable by name)
        # and its state: torch.save(model) and copies of a swapped model keep their classes
        made = type(self)
        base = next(
            c
            for c in made.__mro__[1:]
            if issubclass(c, ClassReplacement) and "_layerswap_original" not in vars(c)
        )
        arguments = (
            base,
            made._layerswap_original,
            made._layerswap_spec,
            made._layerswap_swapped_by,
        )
        return (_remade, arguments, dict(self.__dict__))


def _remade(
    base: type[ClassReplacement], original: type, spec: Any, substitution: str
) -> ClassReplacement:
    made = base.subclass_for(original, spec, substitution)
    return made.__new__(made)
