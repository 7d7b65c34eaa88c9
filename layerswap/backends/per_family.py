"""One class per family made from a backend's class: made once, importable by name.

A swapped model holds ``FusedLlamaDecoderLayer`` or ``FusedLlamaForCausalLM``: a subclass
of a backend's class made for one family. :func:`family_class` makes it once per (base,
family), under a lock, so two threads swapping at once get the same class; its
``__qualname__`` names it in the base's module, and a fresh process that unpickles a model
makes it again from that name (the module's ``__getattr__`` calls :func:`class_named`).
The decoder layers (:mod:`layerswap.backends._layer`) and the heads
(:mod:`layerswap.backends.head`) both make theirs here.

Example::

    cls = family_class(FusedDecoderLayer, family, lambda: type(...), export="FusedLlamaDecoderLayer")
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from layerswap.family import Family

__all__ = ["class_named", "family_class"]

T = TypeVar("T", bound=type)

_MADE: dict[tuple[type, Family], type] = {}
_LOCK = threading.RLock()


def family_class(
    base: type,
    family: Family,
    make: Callable[[], T],
    *,
    export: str | None = None,
    current: Callable[[T], bool] | None = None,
) -> T:
    """The class ``make()`` gives for ``base`` and ``family``, made once.

    ``export`` also sets it as that attribute of ``base``'s module (where a pickle finds
    it without asking :func:`class_named`); ``current`` says whether a class made before
    still holds (a head made for a causal-LM class that was since replaced does not).
    """
    key = (base, family)
    with _LOCK:
        made = _MADE.get(key)
        if made is not None and (current is None or current(made)):  # type: ignore[arg-type]
            return made  # type: ignore[return-value]
        fresh = make()
        _MADE[key] = fresh
        if export is not None:
            vars(sys.modules[base.__module__]).setdefault(export, fresh)
        return fresh


def class_named(
    base: type, name: str, name_of: Callable[[Family], str], make: Callable[[Family], T]
) -> T:
    """The class called ``name`` among every known family's (``name_of(family)``), made
    with ``make(family)``; :class:`AttributeError` as a module's ``__getattr__`` raises
    when no family's class has that name."""
    if name.startswith("__"):
        # `from <module> import x` asks for __path__ first, maybe while the registry is
        # loading this very module: no registry lookup for dunder names
        raise AttributeError(f"module {base.__module__!r} has no attribute {name!r}")
    from layerswap.registry import families

    for family in families().values():
        if name_of(family) == name:
            return make(family)
    raise AttributeError(f"module {base.__module__!r} has no attribute {name!r}")
