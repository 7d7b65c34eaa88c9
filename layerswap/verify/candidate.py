"""The substitution under test: checked for this machine, and the context it runs in.

Shared by :func:`layerswap.verify` and :func:`layerswap.bench`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, TypeAlias

import torch

from layerswap.comparison.forward import ContextFactory
from layerswap.errors import LayerswapError, RequirementError, UpstreamDriftError
from layerswap.versions import transformers_version

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
    """The context a substitution's layers run in: its own (an FP8 autocast), where an
    error the replacement raises is a refusal naming the cause.

    The candidate runs where the original ran (same inputs, same model otherwise), so an
    exception that is not layerswap's (a ``TypeError`` from a call the replacement does
    not take, an ``AttributeError`` from a cache it cannot update) means the replacement
    cannot run under this model's contract: raised as
    :class:`~layerswap.errors.UpstreamDriftError`, one line, the original error chained.
    Running out of memory stays what it is.
    """
    if substitution is None:
        return contextlib.nullcontext
    sub = substitution

    @contextlib.contextmanager
    def running() -> Iterator[None]:
        try:
            with sub.forward_context():
                yield
        except (LayerswapError, torch.OutOfMemoryError, MemoryError):
            raise
        except Exception as error:
            raise UpstreamDriftError(
                f"{sub.name} fails where the original runs, on transformers "
                f"{transformers_version()}: {type(error).__name__}: {error}. The replacement "
                "cannot run under this model's call; upgrade layerswap, or install a "
                "transformers release it supports (docs/compatibility.md)"
            ) from error

    return running
