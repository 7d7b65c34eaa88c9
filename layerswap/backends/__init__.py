"""Replacement layers, one module per backend.

A backend module offers ``substitution_for(family) -> Substitution | None``:
the substitution named ``"<family>.decoder.<backend>"``, or ``None`` when the
backend cannot express that family. A backend with variants (``te`` and its FP8
form ``te_fp8``) or with more than one slot (``fused`` and ``liger`` offer a head too)
offers ``substitutions_for(family) -> list[Substitution]`` instead, which the registry
prefers. The registry loops over families x :data:`BUILTIN_BACKENDS`; importing a backend module must not need its optional
dependencies (those are the substitution's ``requirement``).

Every builtin backend's layer derives from ``_layer.DecoderLayer``, which holds the
transformers decoder-layer contract (forward signature, residual structure, cache
update, ``extra_repr``); a backend supplies only its attention and feed-forward.
"""

from __future__ import annotations

import importlib
import warnings
from types import ModuleType
from typing import Any

__all__ = ["BUILTIN_BACKENDS", "backend_module", "backend_substitutions"]

BUILTIN_BACKENDS = ("fused", "te", "liger")


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


def backend_substitutions(module: ModuleType, family: Any) -> list[Any]:
    """Every substitution ``module`` offers for ``family`` (see the module docstring)."""
    many = getattr(module, "substitutions_for", None)
    if many is not None:
        return list(many(family))
    one = module.substitution_for(family)
    return [] if one is None else [one]
