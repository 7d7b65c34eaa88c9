"""Backends and substitutions from other packages: the entry-point groups, read.

A plugin declares a :class:`~layerswap.backend.Backend` or a
:class:`~layerswap.substitution.Substitution` (one, an iterable, or a zero-argument
callable giving either) under ``layerswap.backends`` or ``layerswap.substitutions``;
:func:`load_group` hands each to the registry. A plugin that fails is skipped with a
warning naming it, so one broken package does not take the registry down.
"""

from __future__ import annotations

import importlib.metadata
import warnings
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from layerswap.errors import SubstitutionError

__all__ = ["BACKEND_ENTRY_POINT_GROUP", "ENTRY_POINT_GROUP", "load_group"]

ENTRY_POINT_GROUP = "layerswap.substitutions"
BACKEND_ENTRY_POINT_GROUP = "layerswap.backends"

T = TypeVar("T")


def _as_items(obj: Any, kind: type[T], origin: str, group: str) -> list[T]:
    """An entry point's object as a list of ``kind``: one, an iterable, or a callable giving either."""
    if isinstance(obj, kind):
        return [obj]
    if callable(obj) and not isinstance(obj, (Iterable, type)):
        return _as_items(obj(), kind, origin, group)
    if isinstance(obj, Iterable) and not isinstance(obj, (str, bytes)):
        items = list(obj)
        if all(isinstance(item, kind) for item in items):
            return items
    raise SubstitutionError(
        f"entry point {origin} of {group!r} must give a {kind.__name__}, an iterable of "
        f"them, or a zero-argument callable returning either; it gave {type(obj).__name__}"
    )


def load_group(group: str, kind: type[T], add: Callable[[T], list[Any]]) -> list[Any]:
    """Every ``kind`` the entry points of ``group`` give, handed to ``add``; what it added.

    Example::

        load_group("layerswap.backends", Backend, registry_add_backend)
    """
    added: list[Any] = []
    for entry_point in importlib.metadata.entry_points(group=group):
        origin = f"{entry_point.name!r} ({entry_point.value})"
        try:
            for item in _as_items(entry_point.load(), kind, origin, group):
                added.extend(add(item))
        except Exception as exc:
            warnings.warn(
                f"layerswap: skipping the {group} plugin {origin}: {exc}",
                RuntimeWarning,
                stacklevel=4,
            )
    return added
