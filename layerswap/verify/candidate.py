"""The substitution under test: checked for this machine, and the context it runs in.

Shared by :func:`layerswap.verify` and :func:`layerswap.bench`.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, TypeAlias

from layerswap.errors import RequirementError
from layerswap.verify.forward import ContextFactory

if TYPE_CHECKING:
    from layerswap.substitution import Substitution

__all__ = ["SubstitutionLike", "candidate_context", "resolve_substitution"]

SubstitutionLike: TypeAlias = "str | Substitution"


def resolve_substitution(substitution: SubstitutionLike) -> Substitution:
    """The registered substitution (or the one given), if it can run here.

    Raises :class:`~layerswap.errors.RequirementError` naming what is missing.
    """
    from layerswap.registry import get

    sub = get(substitution)
    reason = sub.unmet_requirement()
    if reason is not None:
        raise RequirementError(f"{sub.name} cannot run here: {reason}")
    return sub


def candidate_context(substitution: Substitution | None) -> ContextFactory:
    """The context a substitution's layers must run in (e.g. an FP8 autocast), if any."""
    return contextlib.nullcontext if substitution is None else substitution.forward_context
