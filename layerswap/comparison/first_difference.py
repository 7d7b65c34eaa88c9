"""Two models run the same way and held to one tolerance: the first output that differs, in words.

The proof (:mod:`layerswap.proof`) asks of its tiny models no report, only where they
first differ and how (``"new token 2: max abs difference 2.23"``). Each check here runs
both models through the passes :func:`~layerswap.verify.verify` runs
(:func:`~layerswap.comparison.forward.forward`,
:func:`~layerswap.comparison.forward.generate_tokens`) and judges them with its comparisons
(:func:`~layerswap.comparison.distance.diff`,
:func:`~layerswap.comparison.compare.compare_gradients`) under a :class:`Tolerance`; each
returns ``None`` where the two agree.

``reference_context`` runs the reference's passes in a context: an adopted patch function
(:mod:`layerswap.adoption`) changes code both models run, taken back there so that the
reference runs the original code.

Example::

    tolerance = Tolerance.scaled(1e-4)
    outputs_differ(reference, candidate, batch, tolerance)                 # None
    decoding_differs(reference, candidate, batch, tolerance, new_tokens=3, cache="static")
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import NamedTuple

import torch
from torch import nn

from layerswap.comparison.compare import compare_gradients
from layerswap.comparison.distance import Diff, diff
from layerswap.comparison.excused import excused_rows
from layerswap.comparison.forward import ContextFactory, forward, generate_tokens
from layerswap.comparison.fp8 import FLOOR_FACTOR, FLOOR_SLACK
from layerswap.comparison.inputs import inputs_for, text_config
from layerswap.comparison.placement import dtype_name
from layerswap.comparison.tolerance import Tolerance
from layerswap.placement import LOW_PRECISION

__all__ = [
    "CHECKS",
    "decoding_differs",
    "first_difference",
    "gradients_differ",
    "long_sequence",
    "low_precision_differs",
    "outputs_differ",
    "random_in_training",
    "regime",
    "GRADIENT_FACTOR",
    "LONG_SEQUENCE",
    "Rounding",
    "rounding_differs",
    "unpadded",
]

Batch = Mapping[str, torch.Tensor]


def _described(difference: Diff) -> str:
    return f"max abs difference {difference.max_abs_error:.3g}"


def outputs_differ(
    reference: nn.Module,
    candidate: nn.Module,
    batch: Batch,
    tolerance: Tolerance,
    *,
    reference_context: ContextFactory = contextlib.nullcontext,
) -> str | None:
    """How the outputs at every real token differ (no layer's output is captured)."""
    expected = forward(
        reference, batch, routing=False, layer_outputs=False, context=reference_context
    )
    actual = forward(candidate, batch, routing=False, layer_outputs=False)
    difference = diff(expected.logits, actual.logits, rowwise=True)
    return None if difference.passes(tolerance) else _described(difference)


def unpadded(batch: Batch) -> dict[str, torch.Tensor]:
    """``batch`` with every token attended: its padding read as tokens, so that a model
    drops the mask (transformers passes SDPA layers none where nothing is masked)."""
    return {**batch, "attention_mask": torch.ones_like(batch["attention_mask"])}


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    # generate()'s advice on a tiny random model's generation settings says nothing about
    # the layers compared
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _both(context: ContextFactory) -> ContextFactory:
    @contextlib.contextmanager
    def entered() -> Iterator[None]:
        with _quiet(), context():
            yield

    return entered


def decoding_differs(
    reference: nn.Module,
    candidate: nn.Module,
    batch: Batch,
    tolerance: Tolerance,
    *,
    new_tokens: int,
    cache: str | None = None,
    reference_context: ContextFactory = contextlib.nullcontext,
) -> str | None:
    """How greedy decoding of ``new_tokens`` tokens with ``cache`` (``"static"``; ``None``:
    dynamic) differs: every step's logits, then the tokens. ``None`` also where the
    reference cannot decode this way: there is nothing to compare."""
    try:
        expected_tokens, expected_logits = generate_tokens(
            reference, batch, new_tokens, _both(reference_context), cache=cache
        )
    except Exception:
        return None
    try:
        actual_tokens, actual_logits = generate_tokens(
            candidate, batch, new_tokens, _quiet, cache=cache
        )
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    for step in range(min(expected_logits.shape[1], actual_logits.shape[1])):
        difference = diff(expected_logits[:, step], actual_logits[:, step], rowwise=True)
        if not difference.passes(tolerance):
            return f"new token {step + 1}: {_described(difference)}"
    if not torch.equal(expected_tokens, actual_tokens):
        return "different tokens generated"
    return None


#: maps a model's gradients to the original model's names and shapes
GradientMap = Callable[[nn.Module, Mapping[str, torch.Tensor]], Mapping[str, torch.Tensor]]


def _loss_and_ends(
    model: nn.Module,
    batch: Batch,
    context: ContextFactory = contextlib.nullcontext,
    to_original: GradientMap | None = None,
    *,
    training: bool = False,
) -> tuple[float, dict[str, torch.Tensor]]:
    """The loss, and the gradients of the input embeddings and the head (one tensor where
    they are tied), by what they are; with ``to_original``, every gradient besides, by
    the original model's names; in training mode with ``training``."""
    run = forward(
        model,
        batch,
        backward=True,
        routing=False,
        layer_outputs=False,
        context=context,
        training=training,
        outputs=False,
    )
    assert run.loss is not None and run.gradients is not None
    mapped = {} if to_original is None else dict(to_original(model, run.gradients))
    names = {id(param): name for name, param in model.named_parameters()}
    ends = {
        "embedding gradient": model.get_input_embeddings(),  # type: ignore[operator]
        "head gradient": model.get_output_embeddings(),  # type: ignore[operator]
    }
    found = {}
    for label, module in ends.items():
        name = names.get(id(getattr(module, "weight", None)))
        if name is not None and name in run.gradients:
            found[label] = run.gradients[name]
            mapped.pop(name, None)
    return run.loss, {**found, **mapped}


def random_in_training(
    model: nn.Module, batch: Batch, context: ContextFactory = contextlib.nullcontext
) -> bool:
    """Whether ``model``'s forward pass in training mode computes something else from one
    call to the next (a dropout, a router's jitter noise): such a pass cannot be compared
    call for call with another model's. The global generator is left as it was."""
    device = batch["input_ids"].device
    logits = []
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        for seed in (1, 2):
            torch.manual_seed(seed)
            run = forward(
                model, batch, routing=False, layer_outputs=False, context=context, training=True
            )
            logits.append(run.logits)
    return not torch.equal(*logits)


def gradients_differ(
    reference: nn.Module,
    candidate: nn.Module,
    batch: Batch,
    tolerance: Tolerance,
    *,
    reference_context: ContextFactory = contextlib.nullcontext,
    candidate_context: ContextFactory = contextlib.nullcontext,
    to_original: GradientMap | None = None,
) -> str | None:
    """How the loss, or the gradients of the input embeddings and the head, differ
    (``candidate_context``: what the candidate's loss is computed in: a head's fused loss).

    Both run in training mode, the mode a backward pass is taken in (a layer may compute
    another way there), where the original's training pass is deterministic; where it is
    random (:func:`random_in_training`: a dropout), in eval mode, once the candidate is
    seen to be random in training too (a replacement that drops the original's dropout
    trains another model).

    With ``to_original`` (the candidate's gradients to the original's layout,
    :func:`~layerswap.comparison.gradients.gradients_to_original`) every other parameter's
    gradient is compared too: a layer whose backward computes its own weights' gradients
    wrong can pass a right gradient down to the embeddings."""
    training = not random_in_training(reference, batch, reference_context)
    if not training and not random_in_training(candidate, batch, candidate_context):
        return (
            "the original computes at random in training (a dropout) and the swapped model "
            "does not: it leaves that dropout out"
        )
    identity: GradientMap | None = None if to_original is None else (lambda model, grads: grads)
    loss_expected, expected = _loss_and_ends(
        reference, batch, reference_context, identity, training=training
    )
    loss_actual, actual = _loss_and_ends(
        candidate, batch, candidate_context, to_original, training=training
    )
    report = compare_gradients(expected, actual, loss_expected, loss_actual, tolerance, local=False)
    if not tolerance.allows(report.loss_abs_error, abs(report.loss_reference)):
        return f"loss: max abs difference {report.loss_abs_error:.3g}"
    for gradient in report.gradients:
        if not gradient.passed:
            return f"{gradient.name}: max abs difference {gradient.max_abs_error:.3g}"
    return None


#: how many times the original's own rounding error a replacement's gradients may be off
#: in bfloat16 or float16: gradients gather more rounding than logits, with heavier tails
#: (a correct replacement measures 1.62x at most over the fused substitutions of 57 families
#: in both dtypes, and flint's 5.36x in bfloat16 on the proof's seed, 0.95x to 5.36x over
#: three seeds); the proof's two layers each scaling their gradient by 1.08 only in bfloat16
#: (1.02 in float16) are refused
GRADIENT_FACTOR = 8.0


class Rounding(NamedTuple):
    """What :func:`rounding_differs` compared, and the first pass that differs."""

    #: the passes compared: ``("forward", "backward")``, or ``("forward",)``
    compared: tuple[str, ...]
    #: ``(pass, detail)`` of the first that differs, or ``None``
    differs: tuple[str, str] | None


def rounding_differs(
    reference: nn.Module,
    candidate: nn.Module,
    batch: Batch,
    dtype: torch.dtype | None,
    *,
    reference_context: ContextFactory = contextlib.nullcontext,
    autocast: torch.dtype | None = None,
) -> Rounding:
    """How ``candidate`` run in ``dtype`` (bfloat16, float16: the dtype a model computes
    in) is farther from the original's float32 results than the original's own run in
    ``dtype`` is (:class:`Rounding`): the logits (``"forward"``) or the gradients of the
    input embeddings and the head (``"backward"``). A replacement may take another path
    in another dtype (a kernel of its own, a cast left out, a backward written for it).
    The floor is the original's own rounding error; the candidate's logits may be twice
    as far (the gradients :data:`GRADIENT_FACTOR` times), its relative error and its
    cosine deficit (plus :data:`~layerswap.comparison.fp8.FLOOR_SLACK`), above ``dtype``'s
    default ``atol`` (:meth:`~layerswap.comparison.tolerance.Tolerance.calibrated`). Not
    the dtype's default relative tolerance, which on a tiny model is several times the
    floor and let a norm 4% off pass; a correct replacement's logits measure at most 1.56
    times the floor (318 fused substitutions, in bfloat16 and float16).

    A token a mixture-of-experts router sends elsewhere in the candidate where the
    original's own routing was a near-tie, and what it reaches after, is left out of the
    logits, as :func:`layerswap.verify` leaves it out (:mod:`layerswap.comparison.excused`);
    the gradients, which every token reaches, are then not compared.

    ``autocast``: the passes in ``dtype`` run under ``torch.autocast`` to it (a model
    whose weights stay float32 while Trainer's ``bf16=True`` runs its matmuls in
    bfloat16); ``dtype`` may then be ``None``. The float32 passes run with autocast off.

    ``reference_context``: what the original's passes run in (an adopted patch taken back).
    Both models are cast to ``dtype`` in place: the proof's own, discarded after."""
    judged = autocast if autocast is not None else dtype
    if judged is None:
        raise ValueError("rounding_differs takes a low-precision dtype, an autocast one, or both")
    device = batch["input_ids"].device
    exact_context = _nested(reference_context, _autocast_factory(device, None))
    exact = forward(
        reference, batch, routing=False, layer_outputs=False, context=exact_context
    ).logits
    _, exact_ends = _loss_and_ends(reference, batch, exact_context)
    if dtype is not None:
        reference.to(dtype)
        candidate.to(dtype)
    low = _autocast_factory(device, autocast)
    own = forward(reference, batch, layer_outputs=False, context=_nested(reference_context, low))
    swapped = forward(candidate, batch, layer_outputs=False, context=low)
    excused = excused_rows(own.routing, swapped.routing, batch["attention_mask"].bool())
    kept = slice(None) if excused is None else ~excused.after_last_layer.to(exact.device)
    where = regime(dtype, autocast)
    problem = _beyond_floor(
        exact[kept],
        own.logits[kept],
        swapped.logits[kept],
        judged,
        where,
        FLOOR_FACTOR,
        rowwise=True,
    )
    if problem is not None:
        return Rounding(("forward",), ("forward", problem))
    if excused is not None:  # a near-tie routed elsewhere: every gradient holds it
        return Rounding(("forward",), None)
    _, own_ends = _loss_and_ends(reference, batch, _nested(reference_context, low))
    _, swapped_ends = _loss_and_ends(candidate, batch, low)
    for label, expected in exact_ends.items():
        if label in own_ends and label in swapped_ends:
            problem = _beyond_floor(
                expected,
                own_ends[label],
                swapped_ends[label],
                judged,
                where,
                GRADIENT_FACTOR,
                rowwise=False,
            )
            if problem is not None:
                return Rounding(("forward", "backward"), ("backward", f"{label}: {problem}"))
    return Rounding(("forward", "backward"), None)


def _beyond_floor(
    exact: torch.Tensor,
    own: torch.Tensor,
    swapped: torch.Tensor,
    judged: torch.dtype,
    regime: str,
    factor: float,
    *,
    rowwise: bool,
) -> str | None:
    """How ``swapped`` is farther from ``exact`` than ``factor`` times ``own`` is, or
    ``None`` (``rowwise``: the logits, judged token by token)."""
    floor = diff(exact, own, rowwise=rowwise)
    tolerance = Tolerance.for_dtype(judged).calibrated(
        floor.max_rel_error, floor.cosine, factor, FLOOR_SLACK
    )
    difference = diff(exact, swapped, rowwise=rowwise)
    if difference.passes(tolerance):
        return None
    return (
        f"max abs difference {difference.max_abs_error:.3g} from the "
        f"original in float32 (cosine {difference.cosine:.6f}), where the original's own run "
        f"{regime} is {floor.max_abs_error:.3g} off (cosine {floor.cosine:.6f})"
    )


def regime(dtype: torch.dtype | None, autocast: torch.dtype | None) -> str:
    """``"in bfloat16"``, ``"under autocast to bfloat16"``, or both."""
    parts = [] if dtype is None else [f"in {dtype_name(dtype)}"]
    if autocast is not None:
        parts.append(f"under autocast to {dtype_name(autocast)}")
    return " ".join(parts)


def low_precision_differs(
    reference: nn.Module,
    candidate: nn.Module,
    batch: Batch,
    dtype: torch.dtype | None,
    autocast: torch.dtype | None,
    *,
    reference_context: ContextFactory = contextlib.nullcontext,
) -> Rounding | None:
    """:func:`rounding_differs` in the low-precision ``dtype`` and under ``autocast``
    (each kept where it is bfloat16 or float16), every pass named with its
    :func:`regime` (``"backward in bfloat16"``); ``None`` where neither is low precision.

    Example::

        found = low_precision_differs(reference, candidate, batch, torch.bfloat16, None)
        found.compared      # ("forward in bfloat16", "backward in bfloat16")
    """
    low = dtype if dtype in LOW_PRECISION else None
    cast = autocast if autocast in LOW_PRECISION else None
    if low is None and cast is None:
        return None
    where = regime(low, cast)
    found = rounding_differs(
        reference, candidate, batch, low, reference_context=reference_context, autocast=cast
    )
    differs = found.differs
    return Rounding(
        tuple(f"{run} {where}" for run in found.compared),
        None if differs is None else (f"{differs[0]} {where}", differs[1]),
    )


def _autocast_factory(device: torch.device, dtype: torch.dtype | None) -> ContextFactory:
    """Passes on ``device`` under ``torch.autocast`` to ``dtype``, or with it off (``None``:
    a caller's autocast region does not reach them)."""
    if dtype is None:
        return lambda: torch.autocast(device.type, enabled=False)
    return lambda: torch.autocast(device.type, dtype=dtype)


def _nested(first: ContextFactory, second: ContextFactory) -> ContextFactory:
    @contextlib.contextmanager
    def entered() -> Iterator[None]:
        with first(), second():
            yield

    return entered


#: the length of the single sequence the checks run (:func:`long_sequence`)
LONG_SEQUENCE = 64


def long_sequence(model: nn.Module, device: torch.device) -> dict[str, torch.Tensor]:
    """One sequence (a batch of 1) of :data:`LONG_SEQUENCE` tokens, no padding (the
    config's ``max_position_embeddings`` where that is shorter): what the padded batch of
    two short prompts does not reach, positions past its 11 (a rotary table, a kernel's
    block past 16 tokens) and a batch of one row (a kernel's own path for it)."""
    limit = getattr(text_config(model), "max_position_embeddings", None)
    length = min(LONG_SEQUENCE, limit) if isinstance(limit, int) and limit > 1 else LONG_SEQUENCE
    return inputs_for(model, batch=1, seq_len=length, padding=0, device=device)


#: the checks :func:`first_difference` runs, in order
CHECKS = (
    "forward on a left-padded batch",
    "forward on a batch without padding",
    "forward on one long sequence",
    "prefill and decode with a dynamic cache",
    "prefill and decode with a static cache",
    "backward",
)


def first_difference(
    reference: nn.Module,
    candidate: nn.Module,
    batch: Batch,
    tolerance: Tolerance,
    *,
    new_tokens: int,
    reference_context: ContextFactory = contextlib.nullcontext,
    candidate_context: ContextFactory = contextlib.nullcontext,
    failed: Callable[[Exception], None] | None = None,
    to_original: GradientMap | None = None,
) -> tuple[str | None, str]:
    """The first of :data:`CHECKS` that differs and how, else ``(None, "6 checks equal")``;
    a check that raises differs, with the exception as its detail (``failed`` sees the
    exception first, and may raise another: a kernel that cannot run here).
    ``reference_context``: what the reference's passes run in; ``candidate_context``: what
    the candidate's loss is computed in; ``to_original``: the candidate's gradients in the
    original's layout, for the backward check to compare every parameter's.

    Example::

        first_difference(reference, candidate, batch, Tolerance.scaled(1e-4), new_tokens=3)
        # ("prefill and decode with a static cache", "new token 2: max abs difference 2.23")
    """
    context = reference_context
    steps: tuple[Callable[[], str | None], ...] = (
        lambda: outputs_differ(reference, candidate, batch, tolerance, reference_context=context),
        # no padding: the model passes its layers no mask (SDPA's causal path, where a
        # layer's own idea of whether it is causal decides)
        lambda: outputs_differ(
            reference, candidate, unpadded(batch), tolerance, reference_context=context
        ),
        # one long sequence alone: positions past the batch's, and a batch of one row
        lambda: outputs_differ(
            reference, candidate, long_sequence(reference, batch["input_ids"].device),
            tolerance, reference_context=context,
        ),
        lambda: decoding_differs(
            reference, candidate, batch, tolerance, new_tokens=new_tokens,
            reference_context=context,
        ),
        lambda: decoding_differs(
            reference, candidate, batch, tolerance, new_tokens=new_tokens, cache="static",
            reference_context=context,
        ),
        lambda: gradients_differ(
            reference, candidate, batch, tolerance, reference_context=context,
            candidate_context=candidate_context, to_original=to_original,
        ),
    )  # fmt: skip
    for check, step in zip(CHECKS, steps, strict=True):
        try:
            problem = step()
        except Exception as exc:
            if failed is not None:
                failed(exc)
            problem = f"{type(exc).__name__}: {exc}"
        if problem is not None:
            return check, problem
    return None, f"{len(CHECKS)} checks equal"
