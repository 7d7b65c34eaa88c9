"""The two checks: :func:`verify` a substitution on a model, :func:`assert_equivalent`
two models."""

from __future__ import annotations

import contextlib
import warnings
from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import nn

from layerswap.comparison.compare import Comparison
from layerswap.comparison.forward import ContextFactory, Run, forward
from layerswap.comparison.fp8 import ideal_fp8
from layerswap.comparison.generation import decode_tokens
from layerswap.comparison.inputs import InputsLike, prepare_inputs, unreached_thresholds
from layerswap.comparison.placement import (
    DeviceLike,
    DTypeLike,
    model_placement,
    target_placement,
    working_copy,
)
from layerswap.comparison.report import VerificationReport
from layerswap.comparison.tolerance import Tolerance, precision
from layerswap.errors import SwapWarning, VerificationError
from layerswap.model import decoder_layers_if_known
from layerswap.placement import without_autocast
from layerswap.proof import comparing
from layerswap.swap import rebuild_originals, swap
from layerswap.verify.candidate import SubstitutionLike, resolve_substitution
from layerswap.verify.kept_loss import left_out_positions, relearnt, run_candidate
from layerswap.verify.streaming import verify_streaming

if TYPE_CHECKING:
    from layerswap.substitution import Substitution

__all__ = ["assert_equivalent", "verify"]


def _fp8_floor(model: nn.Module, batch: dict[str, torch.Tensor], generate: int) -> Run:
    """``model`` (original layers) run, and decoding ``generate`` tokens, with its decoder
    GEMMs on FP8-rounded operands."""
    with ideal_fp8(layer for _, layer in decoder_layers_if_known(model)):
        return forward(model, batch, generate=generate)


def _calibrates(
    sub: Substitution | None, dtype: torch.dtype, tolerance: float | Tolerance | None
) -> bool:
    """FP8 with the default tolerance is judged against ideal FP8 rounding too."""
    return tolerance is None and precision(sub, dtype) == "fp8"


def _rounds(
    sub: Substitution | None, dtype: torch.dtype, tolerance: float | Tolerance | None
) -> bool:
    """bfloat16 and float16 with the default tolerance may be judged against the original's
    own rounding (see :func:`_float32_floor`)."""
    return tolerance is None and precision(sub, dtype) in (torch.bfloat16, torch.float16)


def _float32_floor(
    original: nn.Module,
    batch: dict[str, torch.Tensor],
    device: torch.device,
    *,
    backward: bool,
    generate: int,
    left_out: torch.Tensor | None,
    context: ContextFactory = contextlib.nullcontext,
) -> Run:
    """``original`` (original layers) run in float32: how far the reference itself is, in
    bfloat16 or float16, from the function both models compute. A mixture-of-experts
    router's near-ties, or a tiny random model's near-tied next tokens, flip under that
    rounding on either side; such a candidate is as close as the original's own run.
    ``left_out``: the positions the two runs' loss left out, left out here too; ``context``:
    what the run is made in (the original code, where a swap changed shared code)."""
    exact = working_copy(original, device, torch.float32, trainable=backward)
    return forward(
        exact,
        prepare_inputs(batch, exact, device, torch.float32),
        backward=backward,
        generate=generate,
        left_out=left_out,
        context=context,
    )


def verify(
    model: nn.Module,
    substitution: SubstitutionLike,
    inputs: InputsLike = None,
    *,
    dtype: DTypeLike = None,
    device: DeviceLike = None,
    backward: bool = False,
    generate: int | None = None,
    tolerance: float | Tolerance | None = None,
    streaming: bool = False,
) -> VerificationReport:
    """Compare ``model`` with ``model`` swapped by ``substitution``, on the same inputs.

    ``substitution`` is a registered name or a :class:`~layerswap.Substitution` (so a
    variant made with ``dataclasses.replace`` can be checked before it is registered).
    ``inputs`` defaults to :func:`default_inputs` for the model's vocabulary; a tensor of
    token ids or a mapping with ``input_ids`` (and ``attention_mask``) is accepted.
    ``dtype`` / ``device`` cast a copy (``device="auto"``: CUDA when present); ``None``
    keeps the model's. ``tolerance`` is a number (atol and rtol) or a :class:`Tolerance`;
    the default depends on the dtype. ``generate`` is how many tokens to decode greedily
    with the KV cache and compare (tokens and their logits); by default
    :data:`~layerswap.comparison.generation.DEFAULT_DECODE_TOKENS` for a model that
    generates (a causal LM), so a layer that mishandles the cache fails the default check;
    ``0`` skips it. ``streaming=True``
    keeps memory near one model plus one layer (see :mod:`layerswap.verify`); it
    compares no decoding.
    A model built inside :func:`layerswap.use` (its layers already swapped) is compared
    with original layers rebuilt from its converted weights.

    The comparison runs with ``torch.autocast`` off (a caller's autocast region does not
    reach it): ``dtype`` says what it computes in. The model is left exactly as it was. Raises
    :class:`~layerswap.errors.RequirementError` when the substitution cannot run here.

    Example::

        report = layerswap.verify(model, "llama.decoder.fused", backward=True, generate=4)
        if not report.passed:
            print(report.summary())      # names the first divergent layer
    """
    sub = resolve_substitution(substitution)
    already_swapped = _swapped_already(model, sub, generate=generate, streaming=streaming)
    generate = decode_tokens(model, generate, streaming=streaming)
    target_device, target_dtype = target_placement(model, device, dtype)
    comparison = Comparison.prepare(model, sub, target_device, target_dtype, tolerance, inputs)
    _warn_unreached(model, comparison.batch, generate)
    # compared in target_dtype, as asked: a caller's autocast region does not reach it
    with without_autocast(target_device):
        if streaming:
            return verify_streaming(model, sub, comparison, backward=backward)
        return _compare_on_a_copy(
            model,
            sub,
            comparison,
            (target_device, target_dtype),
            tolerance,
            backward=backward,
            generate=generate,
            already_swapped=already_swapped,
        )


def _compare_on_a_copy(
    model: nn.Module,
    sub: Substitution,
    comparison: Comparison,
    placement: tuple[torch.device, torch.dtype],
    tolerance: float | Tolerance | None,
    *,
    backward: bool,
    generate: int,
    already_swapped: bool,
) -> VerificationReport:
    # the whole-model comparison: the original against a swapped working copy
    target_device, target_dtype = placement
    work = working_copy(model, target_device, target_dtype, trainable=backward)
    batch = comparison.batch
    # a swap of the copy that changes shared code (an adopted patch) is taken back when the
    # comparison ends, and suspended for every pass of the reference after it
    with contextlib.ExitStack() as swapped:
        runs = _run_both(
            model,
            work,
            batch,
            sub,
            swapped,
            already_swapped=already_swapped,
            backward=backward,
            generate=generate,
            calibrate=_calibrates(sub, target_dtype, tolerance),
        )
        reference, candidate, floor = runs.reference, runs.candidate, runs.floor
        left_out = None
        if backward:
            left_out = left_out_positions(work, comparison.excused(reference, candidate), batch)
        if left_out is not None:
            reference, candidate = _learn_over_kept_positions(
                runs, work, model, sub, comparison, left_out, swapped=already_swapped
            )
        report = comparison.report(reference, candidate, mode="full", floor=floor)
        if report.passed or not _rounds(sub, target_dtype, tolerance):
            return report
        # over the fixed tolerance in bfloat16/float16: judged again against the original's
        # own rounding error, measured by running it in float32 (only then: it costs a copy)
        del work
        exact = _float32_floor(
            runs.original,
            batch,
            target_device,
            backward=backward,
            generate=generate,
            left_out=left_out,
            context=runs.original_code,
        )
    return comparison.report(reference, candidate, mode="full", floor=exact, floor_kind="float32")


def _swapped_already(
    model: nn.Module, sub: Substitution, *, generate: int | None, streaming: bool
) -> bool:
    """Whether ``model``'s layers are swapped by ``sub`` already (built inside
    :func:`layerswap.use`), once the options :func:`verify` cannot honour are refused: a
    negative ``generate``, or ``streaming`` with decoding or with such a model."""
    if generate is not None and generate < 0:
        raise ValueError(f"generate must be >= 0, got {generate}")
    if streaming and generate:
        raise ValueError(
            "generate= needs the whole swapped model; use streaming=False to compare generation"
        )
    if streaming and not sub.parts.slot.replaces_layers:
        raise ValueError(
            f"streaming mode builds one replacement layer at a time; {sub.name} replaces "
            f"{sub.parts.slot.description}, not the decoder layers: use streaming=False"
        )
    already_swapped = sub.parts.slot.swapped_by(model) is not None
    if already_swapped and streaming:
        raise ValueError(
            "streaming mode compares an original model with its swap; this model's layers "
            "are already swapped (built inside use()?): use streaming=False"
        )
    return already_swapped


class _BothRuns(NamedTuple):
    reference: Run
    candidate: Run
    #: the original run on FP8-rounded operands (:func:`_fp8_floor`), where calibrated
    floor: Run | None
    #: the model holding original layers, for a float32 run (:func:`_float32_floor`)
    original: nn.Module
    #: what every pass of the reference made after the swap runs in (the swap's
    #: :meth:`~layerswap.handle.SwapHandle.original_code`)
    original_code: ContextFactory = contextlib.nullcontext


def _run_both(
    model: nn.Module,
    work: nn.Module,
    batch: dict[str, torch.Tensor],
    sub: Substitution,
    swapped: contextlib.ExitStack,
    *,
    already_swapped: bool,
    backward: bool,
    generate: int,
    calibrate: bool,
) -> _BothRuns:
    """The reference and the candidate run on ``work`` (a working copy of ``model``), one
    after the other, so both hold exactly the same weights. The swap of ``work`` is
    released when ``swapped`` closes."""
    if already_swapped:
        # built inside use(): the copy runs as the candidate, then gets original layers
        # holding its weights converted back, and runs again as the reference
        candidate = run_candidate(work, batch, sub, backward=backward, generate=generate)
        rebuild_originals(work, sub)
        reference = forward(work, batch, backward=backward, generate=generate)
        floor = _fp8_floor(work, batch, generate) if calibrate else None
        return _BothRuns(reference, candidate, floor, work)
    # the copy runs as the reference, is swapped in place, and runs again as the
    # candidate, which therefore holds exactly the reference's weights, converted
    reference = forward(work, batch, backward=backward, generate=generate)
    floor = _fp8_floor(work, batch, generate) if calibrate else None
    with comparing():  # this comparison is the proof: it reports, rather than refuses
        handle = swap(work, sub)
    swapped.callback(handle.release)
    candidate = run_candidate(work, batch, sub, backward=backward, generate=generate)
    return _BothRuns(reference, candidate, floor, model, handle.original_code)


def _learn_over_kept_positions(
    runs: _BothRuns,
    work: nn.Module,
    model: nn.Module,
    sub: Substitution,
    comparison: Comparison,
    left_out: torch.Tensor,
    *,
    swapped: bool,
) -> tuple[Run, Run]:
    """Both runs' loss and gradients taken again with the loss terms of ``left_out`` (rows
    a mixture-of-experts near-tie excused) left out (:mod:`layerswap.verify.kept_loss`).

    ``work`` is the model that ran last (the candidate, or, when the user's ``model`` is
    ``swapped``, the reference); the other runs on one more working copy of ``model``.
    """
    again = working_copy(model, comparison.device, comparison.dtype, trainable=True)
    original, replaced = (work, again) if swapped else (again, work)
    batch = comparison.batch
    learnt = forward(original, batch, backward=True, left_out=left_out, context=runs.original_code)
    cand = run_candidate(replaced, batch, sub, backward=True, left_out=left_out)
    return relearnt(runs.reference, learnt), relearnt(runs.candidate, cand)


def _warn_unreached(model: nn.Module, batch: dict[str, torch.Tensor], generate: int) -> None:
    """Say which position thresholds of the config the comparison stops short of."""
    positions = int(batch["input_ids"].shape[-1]) + generate
    unreached = unreached_thresholds(model, positions)
    if unreached:
        named = ", ".join(f"{name}={value}" for name, value in unreached.items())
        warnings.warn(
            f"verify compares {positions} positions; the config sets {named}: what the "
            "layers compute past that is not compared. Pass inputs longer than it to "
            "compare it",
            SwapWarning,
            stacklevel=3,
        )


def assert_equivalent(
    reference: nn.Module,
    candidate: nn.Module,
    inputs: InputsLike = None,
    *,
    tolerance: float | Tolerance | None = None,
    substitution: SubstitutionLike | None = None,
    backward: bool = False,
    generate: int | None = None,
) -> VerificationReport:
    """Raise :class:`~layerswap.errors.VerificationError` unless ``candidate`` matches.

    For tests: both models run on ``inputs`` (default :func:`default_inputs`) on the
    reference's device; their logits and every decoder layer's output are compared. The
    error message names the first divergent layer and its errors. ``substitution`` lets
    ``backward=True`` map the candidate's gradients to the original layout (needed when
    the candidate is swapped). Cached decoding is compared as :func:`verify` does
    (``generate``). Neither model is modified. Returns the report on success.

    Example::

        candidate = copy.deepcopy(model)
        layerswap.swap(candidate, "llama.decoder.fused")
        layerswap.assert_equivalent(model, candidate, tolerance=1e-4)
    """
    __tracebackhide__ = True
    sub = resolve_substitution(substitution) if substitution is not None else None
    device, dtype = model_placement(reference)
    generate = decode_tokens(reference, generate)
    comparison = Comparison.prepare(reference, sub, device, dtype, tolerance, inputs)
    ref_run = forward(reference, comparison.batch, backward=backward, generate=generate)
    cand_batch = prepare_inputs(comparison.batch, candidate, *model_placement(candidate))
    cand_run = run_candidate(candidate, cand_batch, sub, backward=backward, generate=generate)
    left_out = None
    if backward:
        left_out = left_out_positions(reference, comparison.excused(ref_run, cand_run), cand_batch)
    if left_out is not None:
        # the loss over the positions kept only (:mod:`layerswap.verify.kept_loss`)
        again = forward(reference, comparison.batch, backward=True, left_out=left_out)
        ref_run = relearnt(ref_run, again)
        again = run_candidate(candidate, cand_batch, sub, backward=True, left_out=left_out)
        cand_run = relearnt(cand_run, again)
    floor = (
        _fp8_floor(reference, comparison.batch, generate)
        if _calibrates(sub, dtype, tolerance)
        else None
    )
    report = comparison.report(ref_run, cand_run, mode="models", floor=floor)
    if not report.passed:
        raise VerificationError(report.failure_message())
    return report
