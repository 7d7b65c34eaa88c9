"""The proof of an adopted patch: a tiny model, the original code against the patched code.

As a substitution is proven at first use (:mod:`layerswap.proof`), a patch function is
proven when it is adopted: a tiny model built from the user's config (its widths shrunk,
every layer and every other field kept: :func:`layerswap.shrink.shrunk_config`), with
seeded random weights (:meth:`layerswap.family.Family.build`), runs with the original
code and with the patched code, holding the same weights:

1. forward on a left-padded batch (the logits at every real token), 2. the same tokens
without padding (no mask), 3. one sequence of 64 tokens alone (positions past the batch's,
a batch of one row), 4. prefill and greedy decoding with a dynamic cache, 5. the same
with a static cache, 6. a backward pass (the loss, the gradients of the embeddings and the
head), 7. the loss given ``num_items_in_batch`` (Trainer's, under gradient accumulation),

run and judged by the verify core (:mod:`layerswap.comparison.first_difference`) within
:meth:`~layerswap.comparison.tolerance.Tolerance.scaled` ``1e-4`` on a CPU (``2e-3`` on a GPU).
The patch changes code both models run (a module's function, a class's method), so the
original model runs with the patch taken back for the time of each call
(:meth:`~layerswap.adoption.record.Recording.suspended`).

A difference raises :class:`~layerswap.errors.PatchDivergenceError` naming the check and the
first decoder layer whose output differs; kernels that cannot run here (Triton without a
GPU) raise :class:`~layerswap.errors.RequirementError` with the requirement.

Example::

    reference, candidate = family.build(tiny), patched_copy
    check_patch(recording, reference, candidate)     # raises, or returns the checks run
"""

from __future__ import annotations

import contextlib
import traceback
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from layerswap.comparison.compare import diff
from layerswap.comparison.first_difference import (
    CHECKS,
    first_difference,
    long_sequence,
    low_precision_differs,
)
from layerswap.comparison.forward import ContextFactory, evaluation, forward
from layerswap.comparison.inputs import text_config
from layerswap.comparison.judgement import NEW_TOKENS, proof_batch, proof_tolerance
from layerswap.comparison.model_classes import task_of
from layerswap.comparison.tolerance import Tolerance
from layerswap.errors import PatchDivergenceError, RequirementError, UnknownSubstitutionError
from layerswap.placement import LOW_PRECISION, without_autocast
from layerswap.registry import get_family
from layerswap.shrink import proof_config

if TYPE_CHECKING:
    from transformers import PreTrainedConfig

    from layerswap.adoption.record import Recording
    from layerswap.family import Family

__all__ = [
    "CHECKS",
    "ITEMS_CHECK",
    "check_patch",
    "family_for",
    "first_divergent_layer",
    "tiny_config",
]

#: the check of the loss given ``num_items_in_batch`` (:func:`_item_normalised_loss_differs`)
ITEMS_CHECK = "loss with num_items_in_batch"
#: ``num_items_in_batch`` as this many micro-batches of the proof's batch (gradient
#: accumulation over 3 steps)
ITEMS_FACTOR = 3
#: the check that runs :func:`~layerswap.comparison.first_difference.long_sequence`
LONG_CHECK = CHECKS[2]


def family_for(model_type: str) -> Family | None:
    """The registered family of a ``model_type`` (``"gemma3_text"``: ``"gemma3"``), or
    ``None``."""
    for name in (model_type, model_type.removesuffix("_text")):
        try:
            return get_family(name)
        except UnknownSubstitutionError:
            continue
    return None


def tiny_config(family: Family, config: PreTrainedConfig | None) -> PreTrainedConfig:
    """``config`` shrunk in width (:func:`~layerswap.shrink.shrunk_config`), every one of
    its layers kept: a patch may change a model's layers by their index (from layer 4 on),
    and the proof runs each layer the user's model has; the family's tiny config where
    there is none, or it does not shrink."""
    return proof_config(family, config, keep_layers=True)[0]


def check_patch(
    recording: Recording,
    reference: nn.Module,
    candidate: nn.Module,
    dtype: torch.dtype | None = None,
    autocast: torch.dtype | None = None,
) -> tuple[str, ...]:
    """Run :data:`CHECKS` on ``reference`` (the original code: ``recording`` taken back for
    each of its passes) and ``candidate`` (the patched code); the checks run, or
    :class:`PatchDivergenceError` at the first that differs, :class:`RequirementError`
    where the patched code cannot run here. With ``dtype`` bfloat16 or float16 (the
    user's model computes in it), or ``autocast`` (it runs under ``torch.autocast`` to
    it), the padded forward and its backward in that dtype after them, judged as the
    first-use proof judges them (both models are cast in place). The other checks run
    with ``torch.autocast`` off, in a caller's autocast region too."""
    device = next(reference.parameters()).device
    low = dtype if dtype in LOW_PRECISION else None
    cast = autocast if autocast in LOW_PRECISION else None
    with without_autocast(device):
        return _checked(recording, reference, candidate, (low, cast), device)


def _checked(
    recording: Recording,
    reference: nn.Module,
    candidate: nn.Module,
    precision: tuple[torch.dtype | None, torch.dtype | None],
    device: torch.device,
) -> tuple[str, ...]:
    tolerance = proof_tolerance(device)
    batch = proof_batch(reference, device)
    original = recording.suspended
    check, problem = first_difference(
        reference,
        candidate,
        batch,
        tolerance,
        new_tokens=NEW_TOKENS,
        reference_context=original,
        failed=lambda exc: _refuse_requirement(recording.name, exc, str(exc)),
        # the patched copy keeps the original's parameters and names: every gradient is
        # compared as it is (a kernel computing its weights' gradients wrong is refused)
        to_original=lambda model, gradients: gradients,
    )
    checks: tuple[str, ...] = CHECKS
    if check is None:
        ran, differs = _item_normalised_loss_differs(reference, candidate, batch, original)
        checks = (*CHECKS, ITEMS_CHECK) if ran else CHECKS
        if differs is not None:
            check, problem = ITEMS_CHECK, differs
    if check is None:
        low, cast = precision
        rounding = low_precision_differs(
            reference, candidate, batch, low, cast, reference_context=original
        )
        if rounding is None:
            return checks
        if rounding.differs is None:
            return (*checks, *rounding.compared)
        failed, detail = rounding.differs
        raise PatchDivergenceError(
            f"{recording.name} differs from the original in {failed}: {detail}", check=failed
        )
    _refuse_requirement(recording.name, None, problem)
    if check == LONG_CHECK:  # the layer is looked for where the difference was seen
        batch = long_sequence(reference, device)
    layer = first_divergent_layer(reference, candidate, batch, tolerance, original)
    raise PatchDivergenceError(
        _message(recording.name, check, problem, layer, reference), layer=layer, check=check
    )


def _item_normalised_loss_differs(
    reference: nn.Module,
    candidate: nn.Module,
    batch: dict[str, torch.Tensor],
    original: ContextFactory,
) -> tuple[bool, str | None]:
    """Whether the loss given Trainer's ``num_items_in_batch`` (under gradient accumulation:
    the label tokens of every micro-batch, here :data:`ITEMS_FACTOR` times this batch's)
    was compared, and how it differs: a patched loss that ignores it averages over this
    batch alone (several times the original's loss). Not compared where the original
    takes no such argument, or has no next-token loss."""
    task = task_of(reference)
    if task.kind not in ("causal-lm", "other"):
        return False, None
    labels = task.labels(batch, text_config(reference))["labels"]
    items = torch.tensor(ITEMS_FACTOR * int((labels[:, 1:] != -100).sum()), device=labels.device)

    def loss(model: nn.Module, context: ContextFactory) -> float:
        with evaluation(model), torch.no_grad(), context():
            output = model(**batch, labels=labels, num_items_in_batch=items, use_cache=False)
        return float(output.loss)

    try:
        expected = loss(reference, original)
    except Exception:
        return False, None
    try:
        actual = loss(candidate, contextlib.nullcontext)
    except Exception as exc:
        return True, f"{type(exc).__name__}: {exc}"
    tolerance = proof_tolerance(batch["input_ids"].device)
    if tolerance.allows(abs(actual - expected), abs(expected)):
        return True, None
    return True, f"loss {actual:.4g}, the original's {expected:.4g}"


def _message(name: str, check: str, problem: str, layer: str | None, model: nn.Module) -> str:
    where = (
        f"the first decoder layer whose output differs is {layer}"
        if layer is not None
        else "every decoder layer's output agrees on the forward pass (the difference is "
        "after the last layer, in decoding, or in the backward pass)"
    )
    return (
        f"{name} changes what a tiny {type(model).__name__} computes: {check} differs "
        f"({problem}); {where}. The patch was taken back"
    )


def first_divergent_layer(
    reference: nn.Module,
    candidate: nn.Module,
    batch: dict[str, torch.Tensor],
    tolerance: Tolerance,
    reference_context: ContextFactory,
) -> str | None:
    """The name of the first decoder layer whose output (at the real tokens) differs beyond
    ``tolerance`` on a forward pass (``"model.layers.2"``), else ``None``."""
    try:
        expected = forward(reference, batch, routing=False, context=reference_context)
        actual = forward(candidate, batch, routing=False)
    except Exception:
        return None
    for (name, want), (_, got) in zip(expected.layers, actual.layers, strict=False):
        if not diff(want, got, rowwise=True).passes(tolerance):
            return name
    return None


#: what Triton says when it finds no GPU driver
_NO_DRIVER = ("active drivers", "cuda", "no gpu", "nvidia driver")


def _refuse_requirement(name: str, exc: BaseException | None, text: str) -> None:
    """:class:`RequirementError` where the patched code failed because it needs a GPU."""
    if torch.cuda.is_available():
        return
    frames: list[Any] = traceback.extract_tb(exc.__traceback__) if exc is not None else []
    from_triton = any("/triton/" in frame.filename for frame in frames)
    said = any(word in text.lower() for word in _NO_DRIVER)
    if from_triton or said:
        raise RequirementError(
            f"{name} needs CUDA: its kernels failed on this machine without a GPU ({text}). "
            "Its changes were recorded and taken back; adopt it on a machine with a CUDA GPU"
        ) from exc
