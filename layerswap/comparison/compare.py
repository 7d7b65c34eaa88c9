"""Turning a reference run and a candidate run into a :class:`VerificationReport`."""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, NamedTuple

import torch
from torch import nn

from layerswap.comparison.distance import Diff, _as_float, diff
from layerswap.comparison.excused import Excused, decoding_excused_from, excused_rows
from layerswap.comparison.forward import Run
from layerswap.comparison.fp8 import FLOOR_FACTOR, FLOOR_SLACK
from layerswap.comparison.generation import compare_generation
from layerswap.comparison.inputs import InputsLike, prepare_inputs
from layerswap.comparison.placement import dtype_name
from layerswap.comparison.report import (
    BackwardReport,
    GenerationReport,
    GradientReport,
    LayerReport,
    VerificationReport,
)
from layerswap.comparison.tolerance import Tolerance, precision
from layerswap.errors import SwapWarning, VerificationError

if TYPE_CHECKING:
    from layerswap.substitution import Substitution

__all__ = ["Comparison", "Diff", "compare_gradients", "diff"]


def _warn_non_finite(reference: Mapping[str, torch.Tensor]) -> None:
    """Say where the original's own gradients are not finite on these inputs: there the
    candidate is held to the same values, which says nothing of what it computes."""
    bad = [name for name, grad in reference.items() if not bool(torch.isfinite(grad).all())]
    if bad:
        warnings.warn(
            f"the original's own gradients are not finite on these inputs for {len(bad)} "
            f"parameters ({', '.join(bad[:3])}{'...' if len(bad) > 3 else ''}): the "
            "candidate is held to the same NaN/inf there and compared on the finite "
            "elements only (other inputs, without padding, may avoid them)",
            SwapWarning,
            stacklevel=3,
        )


def compare_gradients(
    reference: Mapping[str, torch.Tensor],
    candidate: Mapping[str, torch.Tensor],
    loss_reference: float,
    loss_candidate: float,
    tolerance: Tolerance,
    *,
    local: bool,
    floor: Mapping[str, torch.Tensor] | None = None,
) -> BackwardReport:
    """Loss and every gradient of ``reference``, keyed as in the original model.

    ``floor`` is the original's gradients computed in float32: each gradient is then held
    to :data:`~layerswap.comparison.fp8.FLOOR_FACTOR` times the reference's error there, where
    that is looser than ``tolerance``.
    """
    missing = [name for name in reference if name not in candidate]
    if missing:
        raise VerificationError(
            f"the candidate has no gradient for {', '.join(missing[:5])}"
            + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
            + "; pass substitution= so its gradients can be mapped to the original layout"
        )
    _warn_non_finite(reference)
    reports = []
    largest = max(
        (float(g.detach().abs().max()) for g in reference.values() if g.numel()), default=0.0
    )
    for name, ref_grad in reference.items():
        gradient = diff(ref_grad, candidate[name], rowwise=False)
        allowed = tolerance
        if floor is not None and name in floor:
            measured = diff(ref_grad, floor[name], rowwise=False)
            allowed = tolerance.widened(
                measured.max_rel_error, measured.cosine, FLOOR_FACTOR, FLOOR_SLACK
            )
        reports.append(
            GradientReport(
                name=name,
                max_abs_error=gradient.max_abs_error,
                max_rel_error=gradient.max_rel_error,
                cosine=gradient.cosine,
                passed=gradient.passes(allowed, gradient=True)
                or _rounding_noise(ref_grad, candidate[name], largest),
            )
        )
    first = next((r.name for r in reports if not r.passed), None)
    loss_error = abs(loss_reference - loss_candidate)
    if math.isnan(loss_error):
        loss_error = math.inf
    loss_ok = tolerance.allows(loss_error, abs(loss_reference))
    return BackwardReport(
        passed=loss_ok and first is None,
        loss_reference=loss_reference,
        loss_candidate=loss_candidate,
        loss_abs_error=loss_error,
        max_abs_error=max((r.max_abs_error for r in reports), default=0.0),
        max_rel_error=max((r.max_rel_error for r in reports), default=0.0),
        cosine=min((r.cosine for r in reports), default=1.0),
        gradients=tuple(reports),
        first_divergent_parameter=first,
        local=local,
    )


#: a gradient whose every element, in both runs, is within this many float32 epsilons of
#: the largest gradient anywhere in the model is zero at working precision
NOISE_EPSILONS = 16


def _rounding_noise(reference: torch.Tensor, candidate: torch.Tensor, largest: float) -> bool:
    """Whether both gradients are zero at working precision: no larger than
    :data:`NOISE_EPSILONS` float32 epsilons (2e-6) of the model's largest gradient. A
    router whose top-1 weight is renormalised to 1 (HunYuan MoE) gets no gradient in exact
    arithmetic; what the backward pass leaves there is rounding, in both runs, and its
    direction means nothing. Anything larger is compared as every gradient is (float32
    epsilons also in lower precisions, whose own noise is larger: never looser there)."""
    if not reference.numel() or not reference.dtype.is_floating_point:
        return False
    noise = NOISE_EPSILONS * torch.finfo(torch.float32).eps * largest
    worst = max(float(reference.detach().abs().max()), float(candidate.detach().abs().max()))
    return math.isfinite(worst) and worst <= noise


#: what a floor run is: the reference under ideal FP8 rounding (the tolerance is replaced
#: by one calibrated to it), or the original in float32 (the tolerance is only widened)
FloorKind = Literal["ideal FP8", "float32"]


def _against_floor(
    reference: torch.Tensor, floor: torch.Tensor | None, tolerance: Tolerance, kind: FloorKind
) -> tuple[Tolerance, float | None]:
    """The tolerance for one tensor: calibrated to the noise floor's errors there, if any."""
    if floor is None:
        return tolerance, None
    measured = diff(reference, floor, rowwise=True)
    adjust = tolerance.calibrated if kind == "ideal FP8" else tolerance.widened
    calibrated = adjust(measured.max_rel_error, measured.cosine, FLOOR_FACTOR, FLOOR_SLACK)
    return calibrated, measured.cosine


def _kept(tensor: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
    """``tensor``'s rows in ``keep`` (all of them where nothing is left out)."""
    return tensor if keep is None else tensor[keep.to(tensor.device)]


def _compare_layers(
    reference: Run,
    candidate: Run,
    tolerance: Tolerance,
    floor: Run | None,
    kind: FloorKind,
    excused: Excused | None,
) -> list[LayerReport]:
    if len(reference.layers) != len(candidate.layers):
        raise VerificationError(
            f"the reference ran {len(reference.layers)} decoder layers, "
            f"the candidate {len(candidate.layers)}"
        )
    floors = [out for _, out in floor.layers] if floor is not None else None
    layers = []
    for index, ((name, ref_out), (_, cand_out)) in enumerate(
        zip(reference.layers, candidate.layers, strict=True)
    ):
        keep = ~excused.rows[index] if excused is not None else None
        ref_kept = _kept(ref_out, keep)
        output = diff(ref_kept, _kept(cand_out, keep), rowwise=True)
        allowed, floor_cosine = _against_floor(
            ref_kept, _kept(floors[index], keep) if floors is not None else None, tolerance, kind
        )
        layers.append(
            LayerReport(
                index=index,
                name=name,
                max_abs_error=output.max_abs_error,
                max_rel_error=output.max_rel_error,
                cosine=output.cosine,
                passed=output.passes(allowed),
                min_cosine=allowed.min_cosine,
                rtol=allowed.rtol,
                floor_cosine=floor_cosine,
                near_ties=excused.near_ties[index] if excused is not None else 0,
                excused_rows=int((~keep).sum()) if keep is not None else 0,
            )
        )
    return layers


def _top1_and_kl(
    reference: torch.Tensor, candidate: torch.Tensor, is_logits: bool
) -> tuple[float | None, float | None]:
    """Top-1 agreement and mean KL(reference || candidate) of the next-token predictions."""
    if not (is_logits and reference.numel()):
        return None, None
    ref_logits = reference.to(torch.float32)
    cand_logits = candidate.to(device=ref_logits.device, dtype=torch.float32)
    top1 = float((ref_logits.argmax(-1) == cand_logits.argmax(-1)).float().mean())
    # in float64: float32 rounding of the log-probabilities alone gives a KL near 1e-8,
    # which would hide what the swap itself changes
    ref_logp = torch.log_softmax(ref_logits.double(), dim=-1)
    cand_logp = torch.log_softmax(cand_logits.double(), dim=-1)
    kl_rows = (ref_logp.exp() * (ref_logp - cand_logp)).sum(-1)
    kl = max(_as_float(kl_rows.mean()), 0.0)  # rounding can make a zero KL negative
    return top1, kl


def _output_rows(excused: Excused | None, output: torch.Tensor, batch: int) -> torch.Tensor | None:
    """The rows of the compared output that are kept: every token not excused after the
    last layer (per-token outputs), or every sequence whose last token is not (a pooled
    output, one row per sequence); ``None``: all of them."""
    if excused is None:
        return None
    tokens = excused.after_last_layer
    if output.shape[0] == tokens.shape[0]:
        return ~tokens
    return ~excused.sequences(batch) if output.shape[0] == batch else None


def _decode_divergence(reference: Run, candidate: Run, tolerance: Tolerance) -> str | None:
    """The first decoder layer whose output differs at the first decoding step that
    differs, of the steps both models were fed the same tokens up to (``None``: none)."""
    if (
        reference.decode_layers is None
        or candidate.decode_layers is None
        or reference.tokens is None
        or candidate.tokens is None
    ):
        return None
    for step, (expected, actual) in enumerate(
        zip(reference.decode_layers, candidate.decode_layers, strict=False)
    ):
        # step ``step`` feeds the token generated at that step: the same on both sides?
        if not torch.equal(reference.tokens[:, : step + 1], candidate.tokens[:, : step + 1]):
            return None
        for (name, want), (_, got) in zip(expected, actual, strict=False):
            if want.shape != got.shape or not diff(want, got, rowwise=True).passes(tolerance):
                return f"{name} (decoding step {step + 1})"
    return None


def _compare_decoding(
    reference: Run,
    candidate: Run,
    tolerance: Tolerance,
    floor: Run | None,
    sequences: torch.Tensor | None,
    prompt: torch.Tensor,
) -> GenerationReport | None:
    """Cached decoding compared, of the sequences kept (``None``: all of them), each up to
    the step a mixture-of-experts near-tie in decoding leaves out
    (:func:`~layerswap.comparison.excused.decoding_excused_from`; ``prompt`` is the prompt's
    valid positions)."""
    if reference.tokens is None or candidate.tokens is None:
        return None
    batch, new = reference.tokens.shape
    from_step = decoding_excused_from(
        reference.decode_routing,
        candidate.decode_routing,
        reference.tokens,
        candidate.tokens,
        prompt,
    )
    # the sequences a near-tie in decoding left out, and the step it left them out from
    decoded: list[tuple[int, int]] = []
    if from_step is not None:
        for row in range(batch):
            if int(from_step[row]) < new and (sequences is None or bool(sequences[row])):
                decoded.append((row, int(from_step[row])))
        whole = from_step == 0
        sequences = ~whole if sequences is None else sequences & ~whole.to(sequences.device)
    steps = None
    if from_step is not None:
        steps = torch.arange(new).unsqueeze(0) < from_step.unsqueeze(1)
        steps = _kept(steps, sequences)

    def kept(tensor: torch.Tensor | None) -> torch.Tensor | None:
        return tensor if tensor is None else _kept(tensor, sequences)

    floored = None
    if floor is not None and floor.tokens is not None:
        floored = (_kept(floor.tokens, sequences), kept(floor.token_logits))
    report = compare_generation(
        _kept(reference.tokens, sequences),
        _kept(candidate.tokens, sequences),
        tolerance,
        kept(reference.token_logits),
        kept(candidate.token_logits),
        floor=floored,
        kept=steps,
    )
    if sequences is None and not decoded:
        return report
    wholly = int((~sequences).sum()) if sequences is not None else 0
    left_out = wholly + sum(1 for _, step in decoded if step > 0)
    return dataclasses.replace(report, excused_sequences=left_out, excused_steps=tuple(decoded))


def _compare_backward(
    reference: Run,
    candidate: Run,
    tolerance: Tolerance,
    *,
    local: bool,
    floor: Mapping[str, torch.Tensor] | None,
) -> BackwardReport | None:
    """The losses and gradients compared, where both runs took them, with the positions
    the loss left out counted (:func:`compare_gradients`)."""
    if reference.gradients is None or candidate.gradients is None:
        return None
    assert reference.loss is not None and candidate.loss is not None
    backward = compare_gradients(
        reference.gradients,
        candidate.gradients,
        reference.loss,
        candidate.loss,
        tolerance,
        local=local,
        floor=floor,
    )
    if reference.loss_left_out is not None:
        left_out = int(reference.loss_left_out.sum())
        backward = dataclasses.replace(backward, excused_positions=left_out)
    return backward


class _Logits(NamedTuple):
    """The logits (or pooled output) compared over the kept rows, and the tolerance they
    were held to (with the noise floor's cosine it was calibrated to, if any)."""

    error: Diff
    top1: float | None
    kl: float | None
    allowed: Tolerance
    floor_cosine: float | None
    passed: bool


def _compare_logits(
    reference: Run,
    candidate: Run,
    floor: Run | None,
    keep: torch.Tensor | None,
    tolerance: Tolerance,
    floor_kind: FloorKind,
) -> _Logits:
    """The outputs compared on the rows ``keep`` (``None``: all), held to ``tolerance``
    calibrated to the floor run's errors there, if any."""
    ref_logits = _kept(reference.logits, keep)
    cand_logits = _kept(candidate.logits, keep)
    error = diff(ref_logits, cand_logits, rowwise=True)
    top1, kl = _top1_and_kl(ref_logits, cand_logits, reference.is_logits)
    floor_logits = _kept(floor.logits, keep) if floor is not None else None
    allowed, floor_cosine = _against_floor(ref_logits, floor_logits, tolerance, floor_kind)
    return _Logits(error, top1, kl, allowed, floor_cosine, error.passes(allowed))


@dataclass(frozen=True)
class Comparison:
    """What the reference and the candidate runs share: the substitution (by name),
    where they run, the tolerance and the inputs. :meth:`report` judges two runs."""

    substitution: str | None
    device: torch.device
    dtype: torch.dtype
    tolerance: Tolerance
    batch: dict[str, torch.Tensor]

    @classmethod
    def prepare(
        cls,
        model: nn.Module,
        substitution: Substitution | None,
        device: torch.device,
        dtype: torch.dtype,
        tolerance: float | Tolerance | None,
        inputs: InputsLike,
    ) -> Comparison:
        """The tolerance for the substitution's precision, ``inputs`` on ``device``."""
        tol = Tolerance.coerce(tolerance, precision(substitution, dtype))
        batch = prepare_inputs(inputs, model, device, dtype)
        name = substitution.name if substitution is not None else None
        return cls(name, device, dtype, tol, batch)

    def excused(self, reference: Run, candidate: Run) -> Excused | None:
        """The rows the comparison of the two runs leaves out (:mod:`layerswap.comparison.excused`)."""
        if reference.routing is None or candidate.routing is None:
            return None
        return excused_rows(reference.routing, candidate.routing, self.valid_tokens())

    def valid_tokens(self) -> torch.Tensor:
        """Which prompt tokens are real (the batch's attention mask; every token where it
        has none), (batch, seq) bool."""
        mask = self.batch.get("attention_mask")
        ids = self.batch["input_ids"]
        return torch.ones_like(ids, dtype=torch.bool) if mask is None else mask.bool()

    def report(
        self,
        reference: Run,
        candidate: Run,
        *,
        mode: Literal["full", "streaming", "models"],
        local_gradients: bool = False,
        floor: Run | None = None,
        floor_kind: FloorKind = "ideal FP8",
    ) -> VerificationReport:
        """The verdict on ``candidate`` against ``reference``.

        Gradients and generated tokens are compared when both runs have them;
        ``local_gradients`` says the gradients are per layer (streaming mode). ``floor``
        is the reference run under :func:`~layerswap.comparison.fp8.ideal_fp8` (``floor_kind``
        ``"ideal FP8"``): each layer and the logits are then held to :data:`FLOOR_FACTOR`
        times its errors there, and decoding to the agreement ideal FP8's own decoding
        reaches. With ``floor_kind="float32"`` it is the original run in float32: every
        tolerance (layers, logits, gradients, decoding) is widened to :data:`FLOOR_FACTOR`
        times the reference's own rounding error, never narrowed.
        """
        tolerance = self.tolerance
        backward = _compare_backward(
            reference,
            candidate,
            tolerance,
            local=local_gradients,
            floor=floor.gradients if floor is not None and floor_kind == "float32" else None,
        )
        ids = self.batch["input_ids"]
        excused = self.excused(reference, candidate)
        sequences = ~excused.sequences(int(ids.shape[0])) if excused is not None else None
        prompt = self.valid_tokens()
        generation = _compare_decoding(reference, candidate, tolerance, floor, sequences, prompt)
        if generation is not None and not generation.passed:
            generation = dataclasses.replace(
                generation,
                first_divergent_layer=_decode_divergence(reference, candidate, tolerance),
            )
        layers = _compare_layers(reference, candidate, tolerance, floor, floor_kind, excused)
        keep = _output_rows(excused, reference.logits, int(ids.shape[0]))
        logits = _compare_logits(reference, candidate, floor, keep, tolerance, floor_kind)
        first = next((layer.index for layer in layers if not layer.passed), None)
        passed = (
            logits.passed
            and first is None
            and (backward is None or backward.passed)
            and (generation is None or generation.passed)
        )
        return VerificationReport(
            passed=passed,
            substitution=self.substitution,
            mode=mode,
            device=str(self.device),
            dtype=dtype_name(self.dtype),
            tolerance=tolerance,
            max_abs_error=logits.error.max_abs_error,
            max_rel_error=logits.error.max_rel_error,
            cosine=logits.error.cosine,
            top1_agreement=logits.top1,
            kl=logits.kl,
            logits_passed=logits.passed,
            layers=tuple(layers),
            first_divergent_layer=first,
            batch=int(ids.shape[0]),
            seq_len=int(ids.shape[1]),
            backward=backward,
            generation=generation,
            logits_min_cosine=logits.allowed.min_cosine,
            logits_rtol=logits.allowed.rtol,
            logits_floor_cosine=logits.floor_cosine,
            floor=floor_kind if floor is not None else None,
        )
