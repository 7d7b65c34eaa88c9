"""What :func:`~layerswap.verify` measured: the report and its parts, as plain data."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from typing import Any, Literal

from layerswap.comparison.fp8 import FLOOR_FACTOR as _FLOOR_FACTOR
from layerswap.comparison.tolerance import Tolerance

__all__ = [
    "BackwardReport",
    "GenerationReport",
    "GradientReport",
    "LayerReport",
    "VerificationReport",
]


def _finite_or_str(value: Any) -> Any:
    """Strict JSON has no NaN or infinity: write those as strings, keep everything else."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {key: _finite_or_str(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_finite_or_str(item) for item in value]
    return value


@dataclass(frozen=True)
class LayerReport:
    """The comparison of one decoder layer's output (valid, non-padded positions only).

    ``min_cosine`` and ``rtol`` are what this layer was held to: the report's tolerance,
    or, for FP8, that tolerance calibrated to the ideal-FP8 noise floor measured at this
    layer, whose cosine is ``floor_cosine`` (see :mod:`layerswap.comparison.fp8`); in
    bfloat16/float16 over the fixed tolerance, that tolerance widened to the original's
    own error against float32 at this layer (``floor_cosine``: the original's cosine).

    ``near_ties`` counts the tokens the candidate routed to other experts at this layer
    where the reference's routing was a near-tie; ``excused_rows`` the tokens left out of
    this layer's comparison: those, and what earlier near-ties reach (see
    :mod:`layerswap.comparison.excused`).
    """

    index: int
    name: str
    max_abs_error: float
    max_rel_error: float
    cosine: float
    passed: bool
    min_cosine: float | None = None
    rtol: float | None = None
    floor_cosine: float | None = None
    near_ties: int = 0
    excused_rows: int = 0


@dataclass(frozen=True)
class GradientReport:
    """The comparison of one parameter's gradient, in the original layout."""

    name: str
    max_abs_error: float
    max_rel_error: float
    cosine: float
    passed: bool


@dataclass(frozen=True)
class BackwardReport:
    """Loss and gradients of the candidate against the reference.

    In streaming mode the gradients are per layer ("local"): each layer gets the
    reference's input for that layer and the same upstream gradient, so a difference
    points at that layer alone; the loss is still the whole model's.
    ``excused_positions`` positions' loss terms were left out of the loss of both runs:
    the output rows a mixture-of-experts near-tie excused (see
    :mod:`layerswap.verify.kept_loss`).
    """

    passed: bool
    loss_reference: float
    loss_candidate: float
    loss_abs_error: float
    max_abs_error: float
    max_rel_error: float
    cosine: float
    gradients: tuple[GradientReport, ...]
    first_divergent_parameter: str | None
    local: bool = False
    excused_positions: int = 0


@dataclass(frozen=True)
class GenerationReport:
    """Greedy generation of ``new_tokens`` tokens by both models from the same prompt.

    The prompt runs once, then each token with the KV cache (cached decoding).
    ``max_abs_error`` is that of the logits each token was chosen from, up to the first
    mismatch; ``logits_passed`` whether those are within tolerance. ``excused_sequences``
    sequences were left out: a token of theirs was routed to other experts at a near-tie
    of the reference's (see :mod:`layerswap.comparison.excused`), in the prompt (the whole
    sequence) or while decoding (from that step on). ``excused_steps`` is, for the latter,
    each such sequence (its index in the batch) and its decoding step (0: the prompt as
    decoding ran it; ``t``: the token generated at step ``t - 1``).
    """

    passed: bool
    new_tokens: int
    agreement: float
    first_mismatch: int | None
    reference_tokens: tuple[tuple[int, ...], ...]
    candidate_tokens: tuple[tuple[int, ...], ...]
    max_abs_error: float | None = None
    logits_passed: bool = True
    excused_sequences: int = 0
    excused_steps: tuple[tuple[int, int], ...] = ()
    #: where decoding diverges though the forward pass agrees: the first decoder layer whose
    #: output differs at the first decoding step that differs, ``"model.layers.1 (decoding
    #: step 1)"`` (``None``: none found, or the tokens fed already differed)
    first_divergent_layer: str | None = None


@dataclass(frozen=True)
class VerificationReport:
    """Everything :func:`verify` measured; ``passed`` is the verdict.

    ``max_abs_error``, ``max_rel_error``, ``cosine``, ``top1_agreement`` and ``kl`` are
    about the logits; ``layers`` has one entry per decoder layer, in order, and
    ``first_divergent_layer`` is the index of the first one over tolerance (or ``None``).

    Example::

        report = layerswap.verify(model, "llama.decoder.fused")
        print(report.summary())
        json.loads(report.to_json())["layers"][0]["cosine"]
    """

    passed: bool
    substitution: str | None
    mode: Literal["full", "streaming", "models"]
    device: str
    dtype: str
    tolerance: Tolerance
    max_abs_error: float
    max_rel_error: float
    cosine: float
    top1_agreement: float | None
    kl: float | None
    logits_passed: bool
    layers: tuple[LayerReport, ...]
    first_divergent_layer: int | None
    batch: int
    seq_len: int
    backward: BackwardReport | None = None
    generation: GenerationReport | None = None
    # what the logits were held to, and the ideal-FP8 noise floor's cosine there (FP8)
    logits_min_cosine: float | None = None
    logits_rtol: float | None = None
    logits_floor_cosine: float | None = None
    #: the noise floor the run was judged against: ``"ideal FP8"`` (FP8's default), or
    #: ``"float32"`` (bfloat16/float16 over the fixed tolerance: the original's own
    #: rounding against float32 widened it); ``None``: the fixed tolerance alone
    floor: str | None = None

    @property
    def calibrated(self) -> bool:
        """Whether the tolerance was calibrated to an ideal-FP8 noise floor."""
        return self.floor == "ideal FP8"

    def to_dict(self) -> dict[str, Any]:
        """A plain dict (nested dataclasses become dicts, tuples become lists)."""
        return dataclasses.asdict(self)

    def to_json(self, **kwargs: Any) -> str:
        """Strict JSON (non-finite numbers written as strings); kwargs go to json.dumps."""
        return json.dumps(_finite_or_str(self.to_dict()), allow_nan=False, **kwargs)

    @property
    def near_ties(self) -> int:
        """Tokens the candidate routed to other experts where the reference's routing was a
        near-tie: left out of the comparison, with what they reach after (see
        :mod:`layerswap.comparison.excused`)."""
        return sum(layer.near_ties for layer in self.layers)

    @property
    def first_divergent(self) -> LayerReport | None:
        """The :class:`LayerReport` of the first divergent layer, if any."""
        if self.first_divergent_layer is None:
            return None
        return self.layers[self.first_divergent_layer]

    def summary(self) -> str:
        """A few readable lines: verdict, logits metrics, and what diverged first."""
        verdict = "PASS" if self.passed else "FAIL"
        what = self.substitution or "candidate"
        lines = [
            f"{verdict}: {what} vs original ({self.mode}, {self.device}, {self.dtype}, "
            f"{self.batch}x{self.seq_len} tokens)",
            f"logits: max abs {self.max_abs_error:.3g}, max rel {self.max_rel_error:.3g}, "
            f"cosine {self.cosine:.6f}"
            + (f", top-1 {self.top1_agreement:.1%}" if self.top1_agreement is not None else "")
            + (f", KL {self.kl:.3g}" if self.kl is not None else ""),
        ]
        if self.calibrated:
            lines.append(
                f"FP8: held to {_FLOOR_FACTOR:g}x the error of ideal FP8 rounding at each layer "
                f"(ideal FP8 logits cosine {self.logits_floor_cosine:.6f})"
            )
        elif self.floor == "float32":
            lines.append(
                f"{self.dtype}: over the fixed tolerance, so held to {_FLOOR_FACTOR:g}x the "
                f"original's own {self.dtype} error against float32 at each layer, gradient and "
                f"decoding step (the original's logits cosine {self.logits_floor_cosine:.6f})"
            )
        if self.near_ties:
            lines.append(self._near_ties_line())
        if self.generation is not None and self.generation.excused_steps:
            steps = ", ".join(
                f"sequence {row} at decode step {step}"
                for row, step in self.generation.excused_steps
            )
            lines.append(
                "mixture-of-experts: cached decoding routed a token to other experts at a "
                f"near-tie of the original's router ({steps}); left out from that step on "
                "with the later steps of its sequence (logits and tokens)"
            )
        lines.extend(self._problems())
        return "\n".join(lines)

    def _near_ties_line(self) -> str:
        per_layer = ", ".join(
            f"layer {layer.index}: {layer.near_ties}" for layer in self.layers if layer.near_ties
        )
        last = self.layers[-1].excused_rows if self.layers else 0
        sequences = 0
        if self.generation is not None:
            decoded = sum(1 for _, step in self.generation.excused_steps if step > 0)
            sequences = self.generation.excused_sequences - decoded
        learnt = self.backward.excused_positions if self.backward is not None else 0
        return (
            f"mixture-of-experts: {self.near_ties} token(s) routed to other experts at a "
            f"near-tie of the original's router ({per_layer}); left out from there on with "
            f"the later tokens of their sequence ({last} of the output's rows"
            + (f", {sequences} sequence(s) of decoding" if sequences else "")
            + ")"
            + (
                f"; loss and gradients over the other positions ({learnt} left out)"
                if learnt
                else ""
            )
        )

    def _problems(self) -> list[str]:
        tol = self.tolerance
        problems: list[str] = []
        layer = self.first_divergent
        if layer is not None:
            rtol = tol.rtol if layer.rtol is None else layer.rtol
            min_cosine = tol.min_cosine if layer.min_cosine is None else layer.min_cosine
            floor = (
                f"; {'ideal FP8 rounding' if self.calibrated else 'the original in ' + self.dtype}"
                f": cosine {layer.floor_cosine:.6f}"
                if layer.floor_cosine is not None
                else ""
            )
            problems.append(
                f"first divergent layer: {layer.index} ({layer.name}): max abs error "
                f"{layer.max_abs_error:.3g}, max rel error {layer.max_rel_error:.3g} "
                f"(rtol {rtol:g}, atol {tol.atol:g}), cosine {layer.cosine:.6f} "
                f"(min {min_cosine:g}){floor}"
            )
        elif not self.logits_passed:
            rtol = tol.rtol if self.logits_rtol is None else self.logits_rtol
            problems.append(
                f"logits over tolerance although every decoder layer passed: max rel error "
                f"{self.max_rel_error:.3g} (rtol {rtol:g}), cosine {self.cosine:.6f}"
            )
        if self.backward is not None and not self.backward.passed:
            bw = self.backward
            problems.append(
                f"gradients differ: first divergent parameter {bw.first_divergent_parameter}, "
                f"max rel error {bw.max_rel_error:.3g} (rtol {tol.gradient_rtol:g}); "
                f"loss {bw.loss_reference:.6g} vs {bw.loss_candidate:.6g}"
            )
        if self.generation is not None and not self.generation.passed:
            gen = self.generation
            if gen.first_mismatch is not None:
                problems.append(
                    f"cached decoding: generated tokens differ from position "
                    f"{gen.first_mismatch}: agreement {gen.agreement:.1%} "
                    f"(min {tol.min_token_agreement:.0%})"
                )
            if not gen.logits_passed:
                problems.append(
                    f"cached decoding: the logits of the generated tokens differ: max abs "
                    f"error {gen.max_abs_error:.3g} (atol {tol.atol:g}, rtol {tol.rtol:g})"
                )
            if gen.first_divergent_layer is not None:
                problems.append(
                    "cached decoding: the first decoder layer whose output differs is "
                    f"{gen.first_divergent_layer}"
                )
        return problems

    def failure_message(self) -> str:
        """One line naming what diverged first (empty when the report passed)."""
        if self.passed:
            return ""
        what = self.substitution or "candidate"
        return f"{what} does not match the original: " + "; ".join(self._problems())
