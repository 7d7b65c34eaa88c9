"""How far one tensor is from its reference: the largest absolute and relative errors and
the lowest cosine, computed in float32 (:func:`diff`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from layerswap.comparison.tolerance import Tolerance
from layerswap.errors import VerificationError

__all__ = ["Diff", "diff"]


@dataclass(frozen=True)
class Diff:
    """How far one tensor is from its reference (see :func:`diff`)."""

    max_abs_error: float
    max_rel_error: float
    cosine: float
    scale: float

    def passes(self, tolerance: Tolerance, *, gradient: bool = False) -> bool:
        """Whether the errors and the cosine are within ``tolerance``."""
        return tolerance.allows(self.max_abs_error, self.scale, gradient=gradient) and (
            self.cosine >= tolerance.min_cosine
        )


def _as_float(value: torch.Tensor) -> float:
    number = float(value)
    return number if not math.isnan(number) else math.inf


def diff(reference: torch.Tensor, candidate: torch.Tensor, *, rowwise: bool) -> Diff:
    """Errors of ``candidate`` against ``reference``, computed in float32.

    Where the reference is not finite (the original's own NaN), the candidate matches it
    only with the same value there; the errors are of the finite elements.

    ``rowwise`` takes the cosine of every last-dimension vector (one per token) and
    keeps the lowest; otherwise the cosine of the two flattened tensors.
    """
    if reference.shape != candidate.shape:
        raise VerificationError(
            f"shapes differ: reference {tuple(reference.shape)}, candidate {tuple(candidate.shape)}"
        )
    ref = reference.detach().to(torch.float32)
    cand = candidate.detach().to(device=ref.device, dtype=torch.float32)
    if ref.numel() == 0:
        return Diff(0.0, 0.0, 1.0, 0.0)
    # where the reference itself is not finite, a candidate with the very same value (NaN
    # where it is NaN, the same infinity) reproduces it; any other value there is inf
    same = ~torch.isfinite(ref) & ((cand == ref) | (torch.isnan(cand) & torch.isnan(ref)))
    if bool(same.any()):
        ref = torch.where(same, torch.zeros_like(ref), ref)
        cand = torch.where(same, torch.zeros_like(cand), cand)
    max_abs = _as_float((ref - cand).abs().max())
    if not torch.isfinite(cand).all() or not torch.isfinite(ref).all():
        max_abs = math.inf
    scale = float(ref.abs().max())
    max_rel = max_abs / scale if scale > 0 else (0.0 if max_abs == 0 else math.inf)
    # float64 for the cosine: in float32 two equal vectors come out at 0.9999998
    width = ref.shape[-1] if rowwise and ref.dim() > 1 else ref.numel()
    ref_rows = ref.reshape(-1, width).to(torch.float64)
    cand_rows = cand.reshape(-1, width).to(torch.float64)
    cosines = torch.nn.functional.cosine_similarity(ref_rows, cand_rows, dim=-1, eps=1e-12)
    # two all-zero vectors are identical, though cosine_similarity calls them orthogonal
    both_zero = (ref_rows.abs().amax(-1) == 0) & (cand_rows.abs().amax(-1) == 0)
    cosines = torch.where(both_zero, torch.ones_like(cosines), cosines)
    cosine = float(cosines.min()) if torch.isfinite(cosines).all() else -math.inf
    return Diff(max_abs, max_rel, cosine, scale)
