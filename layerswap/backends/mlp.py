"""What every backend's ``mlp`` replacement shares: a subclass of the model's own gated MLP
class whose activation-and-product is one backend kernel.

The ``mlp`` slot (:mod:`layerswap.slots.mlp`) gives each MLP it swaps a class made by
:meth:`~layerswap.backends.class_swap.ClassReplacement.subclass_for`: the module keeps its
projections (called as modules, so a LoRA or quantized projection still runs as itself),
its activation and every other attribute, and undo is setting the class back. What the
backend computes is ``act(gate) * up``, the part of a gated MLP between its projections;
a backend's replacement names the activations (:data:`~layerswap.mlps.ACTIVATIONS` keys)
it has a kernel for.

Example::

    class FusedMLP(MLPReplacement):
        backend = "fused"
        kernels = {kind: recomputed_product for kind in (*ACTIVATIONS, "other")}
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import ClassVar

from torch import Tensor, nn

from layerswap.backends.class_swap import ClassReplacement
from layerswap.mlps import MLPSpec, activation_of, gated_inputs

__all__ = ["MLPKernel", "MLPReplacement", "is_replaced_mlp"]

#: ``(gate, up, activation) -> act(gate) * up``
MLPKernel = Callable[[Tensor, Tensor, Callable[[Tensor], Tensor]], Tensor]


class MLPReplacement(ClassReplacement):
    """The base of a backend's gated MLP replacement."""

    #: the activations this backend computes, and its kernel for each
    kernels: ClassVar[Mapping[str, MLPKernel]] = {}
    _layerswap_spec: ClassVar[MLPSpec]

    @classmethod
    def refusal(cls, spec: MLPSpec) -> str | None:
        if spec.kind in cls.kernels:
            return None
        activation = "its own activation" if spec.kind == "other" else spec.kind
        return f"it is gated by {activation}, which the {cls.backend} backend has no kernel for"

    def forward(self, hidden_states: Tensor) -> Tensor:
        spec = self._layerswap_spec
        gate, up = gated_inputs(self, spec, hidden_states)
        product = self.kernels[spec.kind](gate, up, activation_of(self, spec))
        out: Tensor = getattr(self, spec.down)(product)
        return out * getattr(self, spec.down_scale) if spec.down_scale else out

    def extra_repr(self) -> str:
        return f"{self._layerswap_spec.label} ({self.backend})"


def is_replaced_mlp(module: nn.Module) -> bool:
    """Whether ``module`` is an MLP the ``mlp`` slot swapped."""
    return isinstance(module, MLPReplacement)
