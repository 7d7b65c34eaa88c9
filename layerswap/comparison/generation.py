"""Two greedy generations compared: token agreement, and the logits of every step up to
the first mismatch, each computed from the same prefix.

Example::

    from layerswap.comparison.generation import compare_generation

    report = compare_generation(reference_tokens, candidate_tokens, tolerance)
    report.agreement, report.first_mismatch       # (1.0, None)
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from layerswap.comparison.distance import Diff, diff
from layerswap.comparison.fp8 import FLOOR_FACTOR, FLOOR_SLACK
from layerswap.comparison.model_classes import task_of
from layerswap.comparison.report import GenerationReport
from layerswap.comparison.tolerance import Tolerance
from layerswap.model import unwrap

__all__ = ["DEFAULT_DECODE_TOKENS", "compare_generation", "decode_tokens"]


def _agreement(
    reference: torch.Tensor, candidate: torch.Tensor, kept: torch.Tensor | None = None
) -> tuple[float, int | None]:
    """The share of positions where two generations agree, and the first that differs
    (of the steps ``kept``, ``[batch, new_tokens]``; ``None``: all of them)."""
    width = min(reference.shape[1], candidate.shape[1])
    same = reference[:, :width] == candidate[:, :width]
    compared = kept[:, :width] if kept is not None else torch.ones_like(same)
    agreement = float(same[compared].float().mean()) if compared.any() else 1.0
    if reference.shape != candidate.shape:
        agreement = min(agreement, width / max(reference.shape[1], candidate.shape[1]))
    mismatched = ((~same) & compared).any(dim=0).nonzero()
    first_mismatch = int(mismatched[0]) if len(mismatched) else None
    if first_mismatch is None and reference.shape != candidate.shape:
        first_mismatch = width
    return agreement, first_mismatch


def _stepped_logits(
    reference: torch.Tensor,
    candidate: torch.Tensor,
    first_mismatch: int | None,
    width: int,
    kept: torch.Tensor | None = None,
) -> Diff:
    """The logits of every decoding step up to the first mismatch (same prefixes), of the
    steps ``kept`` (``None``: all of them)."""
    steps = width if first_mismatch is None else first_mismatch + 1
    if kept is None:
        return diff(reference[:, :steps], candidate[:, :steps], rowwise=True)
    rows = kept[:, :steps]
    return diff(
        reference[:, :steps][rows.to(reference.device)],
        candidate[:, :steps][rows.to(candidate.device)],
        rowwise=True,
    )


def _parts_at_a_near_tie(
    reference: torch.Tensor,
    candidate: torch.Tensor,
    reference_logits: torch.Tensor,
    candidate_logits: torch.Tensor,
    step: int,
    kept: torch.Tensor | None = None,
) -> bool:
    """Whether every row that differs at ``step`` chose between two tokens whose reference
    logits are within twice the runs' largest logit difference at that step."""
    differs = reference[:, step] != candidate[:, step]
    if kept is not None:
        differs &= kept[:, step]
    rows = differs.nonzero().flatten()
    ref_step = reference_logits[rows, step].to(torch.float64)
    cand_step = candidate_logits[rows, step].to(device=ref_step.device, dtype=torch.float64)
    ours = ref_step.gather(1, reference[rows, step].unsqueeze(1).to(ref_step.device))
    theirs = ref_step.gather(1, candidate[rows, step].unsqueeze(1).to(ref_step.device))
    margin = (ours - theirs).squeeze(1)
    difference = (ref_step - cand_step).abs().amax(dim=-1)
    return bool((margin <= 2 * difference).all())


def compare_generation(
    reference: torch.Tensor,
    candidate: torch.Tensor,
    tolerance: Tolerance,
    reference_logits: torch.Tensor | None = None,
    candidate_logits: torch.Tensor | None = None,
    *,
    floor: tuple[torch.Tensor, torch.Tensor | None] | None = None,
    kept: torch.Tensor | None = None,
) -> GenerationReport:
    """Token agreement of two greedy generations (``[batch, new_tokens]`` each), and the
    logits of every step up to the first mismatch (each computed from the same prefix).

    ``floor`` is the tokens and logits the original generated in float32 (or under ideal
    FP8 rounding, for an FP8 candidate): the agreement required is then at most the
    reference's own with that run, and the logits are held to
    :data:`~layerswap.comparison.fp8.FLOOR_FACTOR` times its errors there. A
    generation that parts from the reference passes too where it parts at a near-tie:
    at the first differing step (same prefix on both sides) the reference's logit of
    its own token exceeds that of the candidate's by no more than twice the largest
    difference between the two runs' logits there (a rounding flip; after it the
    prefixes differ and nothing more can be compared).

    ``kept`` (``[batch, new_tokens]``) is the steps compared, tokens and logits (``None``:
    all of them): a sequence's steps from a mixture-of-experts near-tie in decoding on are
    left out (:func:`~layerswap.comparison.excused.decoding_excused_from`).
    """
    width = min(reference.shape[1], candidate.shape[1])
    if kept is not None:
        kept = kept.cpu()
    agreement, first_mismatch = _agreement(reference, candidate, kept)
    exact = first_mismatch is None
    if floor is not None:
        floor_tokens, floor_logits = floor
        floor_agreement, floor_mismatch = _agreement(reference, floor_tokens, kept)
        tolerance = dataclasses.replace(
            tolerance,
            min_token_agreement=min(tolerance.min_token_agreement, floor_agreement),
        )
        if reference_logits is not None and floor_logits is not None:
            measured = _stepped_logits(reference_logits, floor_logits, floor_mismatch, width, kept)
            tolerance = tolerance.widened(
                measured.max_rel_error, measured.cosine, FLOOR_FACTOR, FLOOR_SLACK
            )
    logits_error, logits_passed = None, True
    tie = False
    if reference_logits is not None and candidate_logits is not None:
        stepped = _stepped_logits(reference_logits, candidate_logits, first_mismatch, width, kept)
        logits_error, logits_passed = stepped.max_abs_error, stepped.passes(tolerance)
        if floor is not None and first_mismatch is not None and first_mismatch < width:
            tie = _parts_at_a_near_tie(
                reference, candidate, reference_logits, candidate_logits, first_mismatch, kept
            )
    return GenerationReport(
        passed=(exact or tie or agreement >= tolerance.min_token_agreement) and logits_passed,
        max_abs_error=logits_error,
        logits_passed=logits_passed,
        new_tokens=int(reference.shape[1]),
        agreement=agreement,
        first_mismatch=first_mismatch,
        reference_tokens=tuple(tuple(int(t) for t in row) for row in reference),
        candidate_tokens=tuple(tuple(int(t) for t in row) for row in candidate),
    )


#: greedy tokens decoded with the KV cache and compared when ``generate`` is not given
DEFAULT_DECODE_TOKENS = 4


def decode_tokens(model: nn.Module, generate: int | None, *, streaming: bool = False) -> int:
    """How many tokens to decode: ``generate`` when given, else the default for ``model``
    (:data:`DEFAULT_DECODE_TOKENS` for a model that generates, none in streaming mode)."""
    if generate is not None:
        return generate
    if streaming or not task_of(unwrap(model)).can_generate:
        return 0
    return DEFAULT_DECODE_TOKENS
