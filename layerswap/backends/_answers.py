"""A backend's answer about a family that needs the family's tiny layer built: kept on
disk per transformers release (:func:`layerswap.verdicts.remembered`)."""

from __future__ import annotations

import hashlib

from layerswap import verdicts
from layerswap.backend import Lazy
from layerswap.family import Family

__all__ = ["answered"]


def answered(kind: str, family: Family, target: str) -> str | None:
    """``target(family)`` (``"module:function"``, imported only when not yet answered for
    this release and this declaration of ``family``)."""
    declaration = hashlib.sha256(repr(family).encode()).hexdigest()[:16]
    compute = Lazy(target)
    return verdicts.remembered(
        kind, f"{family.name}:{declaration}", lambda: compute(family), module=family.module
    )
