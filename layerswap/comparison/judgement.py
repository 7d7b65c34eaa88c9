"""The proof's judgement: a tiny original and its swapped copy, compared check after check.

:func:`judge` runs what :mod:`layerswap.proof` asks of a pair, with the comparison core
:func:`layerswap.verify` runs too (:mod:`layerswap.comparison.first_difference`): every
float32 check (padded and unpadded forward, one long sequence alone, decoding with both
caches, the backward pass), then each dropout the config sets alone, then the model's low-precision dtype
and autocast. It builds nothing: a :class:`Pair` is handed to it, and ``rebuild`` makes
another for a config of the dropout check.

Example::

    check, detail = judge(pair, config, torch.device("cpu"), rebuild=build)
    check      # None: equal within the tolerance; else "backward", "decode (static cache)" ...
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from layerswap.comparison.first_difference import (
    first_difference,
    low_precision_differs,
    random_in_training,
    regime,
)
from layerswap.comparison.forward import ContextFactory
from layerswap.comparison.inputs import inputs_for
from layerswap.comparison.tolerance import Tolerance
from layerswap.model import dropout_fields, layer_config
from layerswap.placement import LOW_PRECISION

if TYPE_CHECKING:
    from transformers import PreTrainedConfig

__all__ = ["NEW_TOKENS", "Pair", "judge", "proof_batch", "proof_tolerance"]

#: greedy decoding steps after the prefill
NEW_TOKENS = 3
_SEQUENCE = 8
_PADDING = 3


@dataclass(frozen=True)
class Pair:
    """A proof's two models: the original, and a copy with the substitution in place."""

    reference: nn.Module
    candidate: nn.Module
    #: what the candidate computes its loss in (the head slot: its fused loss)
    context: ContextFactory
    #: the candidate's gradients, keyed and shaped as the original's
    to_original: Callable[[nn.Module, Mapping[str, torch.Tensor]], dict[str, torch.Tensor]]


def proof_batch(model: nn.Module, device: torch.device) -> dict[str, torch.Tensor]:
    """The proof's prompts for ``model``: :func:`~layerswap.comparison.inputs.inputs_for`
    (as :func:`layerswap.verify` draws them: its vocabulary and pad token, no media token,
    the same on every machine), two of 8 tokens, the second left-padded by 3."""
    return inputs_for(model, seq_len=_SEQUENCE, padding=_PADDING, device=device)


def proof_tolerance(device: torch.device) -> Tolerance:
    """float32 on both sides: a swap only reorders roundings, and a GPU's kernels reorder
    more, Triton's among them (``1e-4`` on a CPU, ``2e-3`` on a GPU)."""
    return Tolerance.scaled(1e-4 if device.type == "cpu" else 2e-3)


def judge(
    pair: Pair,
    config: PreTrainedConfig,
    device: torch.device,
    *,
    rebuild: Callable[[PreTrainedConfig], Pair],
    dtype: torch.dtype | None = None,
    autocast: torch.dtype | None = None,
) -> tuple[str | None, str]:
    """``(check, detail)``: the first check ``pair`` fails (``None`` where none does) and
    how, or what was compared. ``rebuild(config)`` builds the pair of another config (the
    dropout check's); ``dtype`` and ``autocast``, a low-precision regime checked last."""
    batch = proof_batch(pair.reference, device)
    check, detail = first_difference(
        pair.reference,
        pair.candidate,
        batch,
        proof_tolerance(device),
        new_tokens=NEW_TOKENS,
        candidate_context=pair.context,
        to_original=pair.to_original,
    )
    if check is None:
        check, detail = _dropout_left_out(config, batch, rebuild) or (None, detail)
    if check is None and (dtype in LOW_PRECISION or autocast in LOW_PRECISION):
        check, low = _rounding(pair, batch, dtype, autocast)
        detail = low if check is not None else f"{detail}; {low}"
    return check, detail


def _dropout_left_out(
    config: PreTrainedConfig,
    batch: dict[str, torch.Tensor],
    rebuild: Callable[[PreTrainedConfig], Pair],
) -> tuple[str, str] | None:
    """Where ``config`` sets two dropouts or more: each alone (the others at 0), the
    original random in training and the replacement not, as ``(check, detail)``. The
    backward check sees the model as a whole: one dropout the replacement keeps (a
    residual dropout) hides another it leaves out (the attention's)."""
    fields = dropout_fields(config)
    if len(fields) < 2:
        return None
    for kept in fields:
        alone = copy.deepcopy(config)
        text = layer_config(alone)
        for field in fields:
            if field != kept:
                setattr(text, field, 0.0)
        pair = rebuild(alone)
        if random_in_training(pair.reference, batch) and not random_in_training(
            pair.candidate, batch, pair.context
        ):
            return (
                "backward",
                f"with only {kept} set, the original computes at random in training and "
                "the swapped model does not: it leaves that dropout out",
            )
    return None


def _rounding(
    pair: Pair,
    batch: dict[str, torch.Tensor],
    dtype: torch.dtype | None,
    autocast: torch.dtype | None,
) -> tuple[str | None, str]:
    """The checks in the model's low-precision ``dtype`` and under its ``autocast`` (after
    the float32 checks, which they end: both models are cast), forward and backward, as
    ``(check, detail)``: the one that differs (``"forward in bfloat16"``), or ``None`` and
    the passes compared."""
    try:
        found = low_precision_differs(pair.reference, pair.candidate, batch, dtype, autocast)
    except Exception as exc:
        low = dtype if dtype in LOW_PRECISION else None
        where = regime(low, autocast if autocast in LOW_PRECISION else None)
        return f"forward and backward {where}", f"{type(exc).__name__}: {exc}"
    if found is None or found.differs is None:
        compared = () if found is None else found.compared
        return None, f"{' and '.join(compared)} within its rounding bounds"
    return found.differs
