"""The loss and gradients again, over the positions a comparison keeps, where a
mixture-of-experts near-tie left some out (:mod:`layerswap.comparison.excused`).

A token the candidate routes to other experts at a near-tie of the reference is judged as
bfloat16 is judged against float32: its rows are left out, everything else is compared.
The gradients cannot be compared as they were: the flipped token's loss term, and what
flows back through it, lands on other experts' weights and on the router. So when rows are
excused and gradients asked for, both models learn again from the same batch with the loss
terms of the output rows left out (their labels masked), and those gradients are compared.

Why that is exact under causal attention: a token flipped at layer ``L`` is left out at
``L`` and, from ``L + 1`` on, with every later position of its sequence. A loss term still
kept is read at an earlier position, which never sees the flipped token, or (a flip at the
last layer) at a later one, which sees the flipped token only through the keys and values
of the last layer's attention: computed from its input to that layer, before its experts
ran, where it is not flipped. No kept term, forwards or backwards, goes through a flipped
routing, so a correct swap's gradients match as closely as without a near-tie, and a
router computed wrong still moves them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch
from torch import nn

from layerswap.comparison.excused import Excused
from layerswap.comparison.forward import Run, forward
from layerswap.comparison.gradients import gradients_to_original
from layerswap.comparison.model_classes import task_of
from layerswap.verify.candidate import candidate_context

if TYPE_CHECKING:
    from layerswap.substitution import Substitution

__all__ = ["left_out_positions", "relearnt", "run_candidate"]


def left_out_positions(
    model: nn.Module, excused: Excused | None, batch: Mapping[str, torch.Tensor]
) -> torch.Tensor | None:
    """``[batch, seq]``: the positions whose loss terms must be left out, or ``None`` where
    nothing is excused or ``model``'s loss is not per token (a classifier's pooled loss is
    compared as before)."""
    if excused is None or not task_of(model).learns_per_token:
        return None
    left_out = excused.output_positions(batch["attention_mask"].shape)
    return left_out if bool(left_out.any()) else None


def run_candidate(
    model: nn.Module,
    batch: Mapping[str, torch.Tensor],
    substitution: Substitution | None,
    *,
    backward: bool,
    generate: int = 0,
    left_out: torch.Tensor | None = None,
) -> Run:
    """``model`` run as the candidate, its gradients mapped to the original layout."""
    run = forward(
        model,
        batch,
        backward=backward,
        generate=generate,
        context=candidate_context(substitution),
        left_out=left_out,
    )
    if substitution is not None and run.gradients is not None:
        run.gradients = gradients_to_original(model, run.gradients, substitution)
    return run


def relearnt(run: Run, again: Run) -> Run:
    """``run`` with the loss and gradients of ``again``: the same model learning again,
    from fewer positions (``forward(..., left_out=...)``)."""
    return dataclasses.replace(
        run, loss=again.loss, gradients=again.gradients, loss_left_out=again.loss_left_out
    )
