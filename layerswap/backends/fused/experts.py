"""The ``fused`` backend's experts: each expert's gate recomputed in the backward pass, so
the experts keep one ``selected tokens x intermediate`` tensor fewer for it.

transformers' grouped and batched implementations compute ``_apply_gate(gate_up)``
(``act(gate) * up``) for every (token, chosen expert) pair; autograd keeps the activation's
output for the product's gradient. Here ``_apply_gate`` runs under
``torch.utils.checkpoint`` (non-reentrant, no RNG state: the slot keeps a gate that draws
random numbers), which keeps only its input and recomputes the activation when the
gradient comes; values and gradients are the original's, bit for bit. The class's own gate
(gpt-oss's clamped, interleaved one) is recomputed the same way. Outside autograd it is the
original's computation. Experts whose implementation never reaches ``_apply_gate`` (read
by running a copy: ``experts_implementation="eager"`` runs the class's own loop, which
computes the product inline; a transformers release that inlined it in the grouped one
would show the same) are kept, with that reason, and a model switched to eager after the
swap is warned once.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any, ClassVar

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from layerswap import hf_internals
from layerswap.backends.experts import ExpertsReplacement
from layerswap.errors import SwapWarning
from layerswap.experts import ExpertsSpec
from layerswap.mlps import ACTIVATIONS

__all__ = ["FusedExperts"]

_WARNED: set[type] = set()


class FusedExperts(ExpertsReplacement):
    """A model's own experts whose gate is recomputed in the backward pass."""

    backend = "fused"
    kernels: ClassVar[Mapping[str, Any]] = {kind: True for kind in (*ACTIVATIONS, "own")}

    @classmethod
    def layout_refusal(cls, spec: ExpertsSpec) -> str | None:
        if not spec.gate_called:
            return (
                f"the model runs them with experts_implementation={spec.implementation!r}, "
                "which computes the gate inline and never calls _apply_gate; build it with "
                "experts_implementation='grouped_mm'"
            )
        return None

    def _apply_gate(self, gate_up_out: Tensor) -> Tensor:
        gate = super()._apply_gate  # type: ignore[misc]
        if torch.is_grad_enabled() and gate_up_out.requires_grad:
            out: Tensor = checkpoint(
                gate, gate_up_out, use_reentrant=False, preserve_rng_state=False
            )
            return out
        return gate(gate_up_out)  # type: ignore[no-any-return]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        implementation = hf_internals.experts_implementation(self)
        if (
            implementation == hf_internals.EAGER_EXPERTS
            # swapped while eager, its eager loop was read calling _apply_gate (DeepSeek V4)
            and implementation != self._layerswap_spec.implementation
            and type(self) not in _WARNED
        ):
            _WARNED.add(type(self))
            warnings.warn(
                f"{self._layerswap_swapped_by}: this model now runs its experts eagerly "
                "(experts_implementation='eager'), which computes the original's product "
                "inline: the fused experts save nothing until it is set back to "
                "'grouped_mm' or 'batched_mm'",
                SwapWarning,
                stacklevel=2,
            )
        return super().forward(*args, **kwargs)
