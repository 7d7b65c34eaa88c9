"""Replacement layers, one module per backend.

A backend module offers ``substitution_for(family) -> Substitution | None``:
the substitution named ``"<family>.decoder.<backend>"``, or ``None`` when the
backend cannot express that family. The registry loops over families x
:data:`BUILTIN_BACKENDS`; importing a backend module must not need its optional
dependencies (those are the substitution's ``requirement``).
"""

from __future__ import annotations

import importlib
import warnings
from types import ModuleType

__all__ = ["BUILTIN_BACKENDS", "backend_module"]

BUILTIN_BACKENDS = ("fused", "te")


def backend_module(name: str) -> ModuleType | None:
    """The module of builtin backend ``name``, or ``None`` (with a warning) if it fails to import."""
    qualified = f"{__name__}.{name}"
    try:
        return importlib.import_module(qualified)
    except ModuleNotFoundError as exc:
        if exc.name == qualified:
            return None  # not shipped in this build
        warnings.warn(f"layerswap: backend {name!r} is unavailable: {exc}", RuntimeWarning, 2)
    except Exception as exc:
        warnings.warn(f"layerswap: backend {name!r} is unavailable: {exc}", RuntimeWarning, 2)
    return None
