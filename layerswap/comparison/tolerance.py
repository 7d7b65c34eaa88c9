"""How far a candidate may be from the reference: :class:`Tolerance` and its defaults."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from layerswap.comparison.placement import DTypeLike, dtype_name, resolve_dtype

if TYPE_CHECKING:
    from layerswap.substitution import Substitution

__all__ = ["Tolerance", "precision"]


@dataclass(frozen=True)
class Tolerance:
    """How far a candidate may be from the reference and still count as the same model.

    A tensor passes when ``max|candidate - reference| <= atol + rtol * max|reference|``
    and the lowest cosine similarity between matching token vectors is at least
    ``min_cosine``. Errors are scaled by the reference's largest magnitude, not taken
    element by element, because element-wise relative errors explode on values near zero
    that carry no information. Gradients use ``gradient_rtol`` in place of ``rtol``
    (a backward pass goes through twice as many roundings); generated tokens must agree
    on at least ``min_token_agreement`` of the positions.

    Example::

        >>> Tolerance.for_dtype("bfloat16").rtol
        0.05
        >>> Tolerance.coerce(1e-3, "float32").atol
        0.001
    """

    atol: float
    rtol: float
    min_cosine: float
    gradient_rtol: float
    min_token_agreement: float = 1.0

    def allows(self, max_abs_error: float, scale: float, *, gradient: bool = False) -> bool:
        """Whether an error of ``max_abs_error`` on values of magnitude ``scale`` passes."""
        rtol = self.gradient_rtol if gradient else self.rtol
        return max_abs_error <= self.atol + rtol * scale

    def calibrated(
        self, floor_max_rel: float, floor_cosine: float, factor: float, slack: float
    ) -> Tolerance:
        """This tolerance held to ``factor`` times a measured noise floor's errors.

        The relative error allowed is ``factor`` times the floor's, the cosine deficit
        (``1 - cosine``) ``factor`` times the floor's plus ``slack``; ``atol`` and the
        gradient and token thresholds stay. Used for FP8, whose rounding errors depend
        on the model's width and depth (see :mod:`layerswap.comparison.fp8`).

        Example::

            >>> Tolerance.for_dtype("fp8").calibrated(0.1, 0.99, 2.0, 1e-4).min_cosine
            0.9799
        """
        return dataclasses.replace(
            self,
            rtol=factor * floor_max_rel,
            min_cosine=round(1.0 - factor * (1.0 - floor_cosine) - slack, 12),
        )

    def widened(
        self, floor_max_rel: float, floor_cosine: float, factor: float, slack: float
    ) -> Tolerance:
        """This tolerance, loosened where ``factor`` times a measured floor's errors exceed it.

        Never tighter than ``self``: the relative errors allowed (``rtol`` and
        ``gradient_rtol``) become at least ``factor`` times the floor's, the cosine
        deficit at least ``factor`` times the floor's plus ``slack``. Used for bfloat16
        and float16, where the original's own rounding against float32 is the floor.

        Example::

            >>> Tolerance.for_dtype("bfloat16").widened(0.1, 0.99, 2.0, 1e-4).rtol
            0.2
        """
        allowed = factor * floor_max_rel
        return dataclasses.replace(
            self,
            rtol=max(self.rtol, allowed),
            gradient_rtol=max(self.gradient_rtol, allowed),
            min_cosine=min(self.min_cosine, round(1.0 - factor * (1.0 - floor_cosine) - slack, 12)),
        )

    @classmethod
    def for_dtype(cls, dtype: DTypeLike) -> Tolerance:
        """The default tolerance for computations in ``dtype`` (``"fp8"`` is accepted)."""
        if isinstance(dtype, str) and dtype.strip().lower() in ("fp8", "float8"):
            return _DEFAULT_TOLERANCES["fp8"]
        resolved = resolve_dtype(dtype) or torch.float32
        return _DEFAULT_TOLERANCES.get(dtype_name(resolved), _DEFAULT_TOLERANCES["float32"])

    @classmethod
    def scaled(cls, value: float) -> Tolerance:
        """``max|candidate - reference| <= value * (1 + max|reference|)`` for every tensor,
        gradients and the loss included, with no cosine threshold; every generated token the
        same. The proof's tolerance (:mod:`layerswap.proof`): two float32 models that must
        compute the same thing.

        Example::

            >>> Tolerance.scaled(1e-4).allows(2e-4, 1.0)
            True
        """
        return cls(atol=value, rtol=value, min_cosine=-1.0, gradient_rtol=value)

    @classmethod
    def coerce(cls, tolerance: float | Tolerance | None, dtype: DTypeLike) -> Tolerance:
        """A :class:`Tolerance` from ``None`` (dtype default), a number or a Tolerance.

        A number sets both ``atol`` and ``rtol`` (and ``gradient_rtol``); the cosine and
        token thresholds stay the dtype's defaults.
        """
        if isinstance(tolerance, Tolerance):
            return tolerance
        default = cls.for_dtype(dtype)
        if tolerance is None:
            return default
        value = float(tolerance)
        if not value >= 0:
            raise ValueError(f"tolerance must be a non-negative number, got {tolerance!r}")
        return dataclasses.replace(default, atol=value, rtol=value, gradient_rtol=value)


# Why these numbers: a float32 swap only reorders roundings (fused matmuls, another
# attention kernel), which moves results by ~1e-7 relative per op; 1e-4 leaves room for a
# few dozen layers and still catches any wrong weight, which moves them by percents.
# bfloat16 keeps 8 bits of mantissa (relative step 2**-8 ~ 4e-3) and float16 11 bits
# (~5e-4); a few such steps add up over the layers. FP8 matmuls (e4m3, 3 bits) are
# coarser still, so only the direction of the output is held tightly.
_DEFAULT_TOLERANCES: dict[str, Tolerance] = {
    "float32": Tolerance(atol=1e-5, rtol=1e-4, min_cosine=0.99999, gradient_rtol=1e-3),
    "float16": Tolerance(atol=1e-3, rtol=1e-2, min_cosine=0.9995, gradient_rtol=5e-2),
    "bfloat16": Tolerance(
        atol=1e-2, rtol=5e-2, min_cosine=0.995, gradient_rtol=0.1, min_token_agreement=0.75
    ),
    "fp8": Tolerance(
        atol=5e-2, rtol=0.25, min_cosine=0.95, gradient_rtol=0.5, min_token_agreement=0.5
    ),
}


def precision(substitution: Substitution | None, dtype: torch.dtype) -> DTypeLike:
    """What the default tolerance is chosen for: the substitution's own precision where its
    variant declares one (``"fp8"`` for ``te_fp8``), else the parameters' dtype."""
    if substitution is not None and substitution.precision is not None:
        return substitution.precision  # type: ignore[return-value]
    return dtype
