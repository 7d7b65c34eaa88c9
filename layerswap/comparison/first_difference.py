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

import torch
from torch import nn

from layerswap.comparison.compare import compare_gradients
from layerswap.comparison.distance import Diff, diff
from layerswap.comparison.forward import ContextFactory, forward, generate_tokens
from layerswap.comparison.tolerance import Tolerance

__all__ = [
    "CHECKS",
    "decoding_differs",
    "first_difference",
    "gradients_differ",
    "outputs_differ",
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
) -> tuple[float, dict[str, torch.Tensor]]:
    """The loss, and the gradients of the input embeddings and the head (one tensor where
    they are tied), by what they are; with ``to_original``, every gradient besides, by
    the original model's names."""
    run = forward(model, batch, backward=True, routing=False, layer_outputs=False, context=context)
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

    With ``to_original`` (the candidate's gradients to the original's layout,
    :func:`~layerswap.comparison.gradients.gradients_to_original`) every other parameter's
    gradient is compared too: a layer whose backward computes its own weights' gradients
    wrong can pass a right gradient down to the embeddings."""
    identity: GradientMap | None = None if to_original is None else (lambda model, grads: grads)
    loss_expected, expected = _loss_and_ends(reference, batch, reference_context, identity)
    loss_actual, actual = _loss_and_ends(candidate, batch, candidate_context, to_original)
    report = compare_gradients(expected, actual, loss_expected, loss_actual, tolerance, local=False)
    if not tolerance.allows(report.loss_abs_error, abs(report.loss_reference)):
        return f"loss: max abs difference {report.loss_abs_error:.3g}"
    for gradient in report.gradients:
        if not gradient.passed:
            return f"{gradient.name}: max abs difference {gradient.max_abs_error:.3g}"
    return None


#: the checks :func:`first_difference` runs, in order
CHECKS = (
    "forward on a left-padded batch",
    "forward on a batch without padding",
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
    """The first of :data:`CHECKS` that differs and how, else ``(None, "5 checks equal")``;
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
