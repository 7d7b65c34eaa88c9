"""What every backend's ``experts`` replacement shares: a subclass of the model's own
experts class (:mod:`layerswap.experts`) that computes each expert's gated product, or the
whole block of experts, with a backend's kernel.

The ``experts`` slot (:mod:`layerswap.slots.experts`) gives each experts module it swaps a
class made by :meth:`~layerswap.backends.class_swap.ClassReplacement.subclass_for`: the
module keeps its 3-D weights (the same ``Parameter`` objects, under the same names), its
activation and flags; undo sets the class back. A backend names the gates it computes
(:attr:`kernels`, keys of :data:`~layerswap.mlps.ACTIVATIONS` or ``"own"``) and what else
of a layout it cannot take (:meth:`layout_refusal`).

Example::

    class FusedExperts(ExpertsReplacement):
        backend = "fused"
        kernels = {kind: True for kind in (*ACTIVATIONS, "own")}
"""

from __future__ import annotations

from typing import ClassVar

from torch import nn

from layerswap.backends.class_swap import ClassReplacement
from layerswap.experts import ExpertsSpec

__all__ = ["ExpertsReplacement", "is_replaced_experts"]


class ExpertsReplacement(ClassReplacement):
    """The base of a backend's experts replacement."""

    _layerswap_spec: ClassVar[ExpertsSpec]

    @classmethod
    def layout_refusal(cls, spec: ExpertsSpec) -> str | None:
        """Why this backend cannot take experts laid out as ``spec`` says (``None``: it can)."""
        return None

    @classmethod
    def refusal(cls, spec: ExpertsSpec) -> str | None:
        if spec.kind not in cls.kernels:
            gate = "a gate of their own" if spec.kind == "own" else f"{spec.kind}"
            return f"they are gated by {gate}, which the {cls.backend} backend has no kernel for"
        return cls.layout_refusal(spec)

    def extra_repr(self) -> str:
        return f"{self._layerswap_spec.label} ({self.backend})"


def is_replaced_experts(module: nn.Module) -> bool:
    """Whether ``module`` is an experts module the ``experts`` slot swapped."""
    return isinstance(module, ExpertsReplacement)
