"""One class per family made from a backend's class: made once, pickled as how to make it.

A swapped model holds ``FusedLlamaDecoderLayer`` or ``FusedLlamaForCausalLM``: a subclass
of a backend's class made for one family. :func:`family_class` makes it once per (base,
family), under a lock, so two threads swapping at once get the same class. Its metaclass,
:class:`FamilyClass`, makes a pickle hold the recipe -- the factory, the base class and the
family's declaration (by value) -- rather than a name to look up: a fresh process that
loads the pickle makes the class again without the registry, for a family nobody
registered there too. The decoder layers (:mod:`layerswap.backends._layer`) and the heads
(:mod:`layerswap.backends.head`) both make theirs here.

Example::

    cls = family_class(FusedDecoderLayer, family, lambda meta: meta(name, bases, namespace),
                       factory=family_layer_class, export="FusedLlamaDecoderLayer")
"""

from __future__ import annotations

import copyreg
import sys
import threading
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from layerswap.family import Family

__all__ = ["FamilyClass", "class_named", "family_class", "find_families_with"]

T = TypeVar("T", bound=type)

_MADE: dict[tuple[type, Family], type] = {}
_LOCK = threading.RLock()


class FamilyClass(type):
    """The metaclass of the classes :func:`family_class` makes: pickled as their recipe."""

    #: ``(factory, base, family)``: ``factory(base, family)`` gives the class again
    _layerswap_recipe: tuple[Callable[[Any, Family], type], type, Family]


def _reduce(cls: FamilyClass) -> str | tuple[Any, ...]:
    recipe = cls.__dict__.get("_layerswap_recipe")
    if recipe is None:  # a user's subclass of a per-family class: pickled by its name
        return cls.__qualname__
    factory, base, family = recipe
    return factory, (base, family)


copyreg.pickle(FamilyClass, _reduce)


def family_class(
    base: type,
    family: Family,
    make: Callable[[type[FamilyClass]], T],
    *,
    factory: Callable[[Any, Family], type],
    export: str | None = None,
    current: Callable[[T], bool] | None = None,
) -> T:
    """The class ``make(FamilyClass)`` gives for ``base`` and ``family``, made once.

    ``make`` builds the class with the metaclass it is given; ``factory(base, family)`` is
    the public function that gives it (what a pickle calls). ``export`` also sets it as that
    attribute of ``base``'s module, for readable reprs and imports; ``current`` says whether
    a class made before still holds (a head made for a causal-LM class that was since
    replaced does not).
    """
    key = (base, family)
    with _LOCK:
        made = _MADE.get(key)
        if made is not None and (current is None or current(made)):  # type: ignore[arg-type]
            return made  # type: ignore[return-value]
        fresh = make(FamilyClass)
        fresh._layerswap_recipe = (factory, base, family)  # type: ignore[attr-defined]
        _MADE[key] = fresh
        if export is not None:
            vars(sys.modules[base.__module__]).setdefault(export, fresh)
        return fresh


#: every registered family by name: the registry gives its ``families`` here when it
#: loads (:func:`find_families_with`), so that no backend imports the registry
_registered: Callable[[], Mapping[str, Family]] | None = None
#: the bare families of model types no family covers whose causal LM a name ends with
_bare: Callable[[str], list[Family]] | None = None


def find_families_with(
    source: Callable[[], Mapping[str, Family]],
    bare: Callable[[str], list[Family]] | None = None,
) -> None:
    """Where :func:`class_named` finds the registered families (the registry's
    ``families``, given when the registry loads), and the bare families of the model types
    a slot that takes any model type makes its classes for (``bare(name)``)."""
    global _registered, _bare
    _registered = source
    _bare = bare


def class_named(
    base: type, name: str, name_of: Callable[[Family], str], make: Callable[[Family], T]
) -> T:
    """The class called ``name`` among every registered family's (``name_of(family)``),
    made with ``make(family)``; :class:`AttributeError` as a module's ``__getattr__`` raises
    when no family's class has that name. The head slot resolves the class its
    substitutions name this way (on use, for the causal-LM class the family has then)."""
    if name.startswith("__"):
        # `from <module> import x` asks for __path__ first, maybe while the registry is
        # loading this very module: no registry lookup for dunder names
        raise AttributeError(f"module {base.__module__!r} has no attribute {name!r}")
    if _registered is None:
        # a class imported by its name before anything loaded the registry: only the
        # builtin families are registered then (a family registered by hand loaded it)
        from layerswap.families import BUILTIN_FAMILIES

        families: Mapping[str, Family] = {family.name: family for family in BUILTIN_FAMILIES}
    else:
        families = _registered()
    for family in families.values():
        if name_of(family) == name:
            return make(family)
    for family in _bare(name) if _bare is not None else ():
        if name_of(family) == name:
            return make(family)
    raise AttributeError(f"module {base.__module__!r} has no attribute {name!r}")
