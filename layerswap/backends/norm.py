"""What every backend's ``norm`` replacement shares: a subclass of the model's own norm
class whose ``forward`` is one kernel.

The ``norm`` slot (:mod:`layerswap.slots.norm`) gives each norm instance it swaps a class
made by :meth:`~layerswap.backends.class_swap.ClassReplacement.subclass_for`: the instance
keeps its parameters, its epsilon and every other attribute, and undo is setting the class
back. A backend's replacement names the :data:`~layerswap.norms.KINDS` it computes and how
(``kernels``).

Example::

    class FusedNorm(NormReplacement):
        backend = "fused"
        kernels = KINDS
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import ClassVar

from torch import Tensor, nn

from layerswap.backends.class_swap import ClassReplacement
from layerswap.norms import NormSpec

__all__ = ["NormReplacement", "is_replaced_norm"]


class NormReplacement(ClassReplacement):
    """The base of a backend's norm replacement."""

    #: the kinds this backend computes, and its function for each (a grouped kind's takes
    #: the group size too)
    kernels: ClassVar[Mapping[str, Callable[..., Tensor]]] = {}
    _layerswap_spec: ClassVar[NormSpec]

    def forward(self, hidden_states: Tensor) -> Tensor:
        spec = self._layerswap_spec
        arguments = (
            hidden_states,
            getattr(self, "weight", None),
            getattr(self, "bias", None),
            getattr(self, spec.eps_name),
        )
        if spec.group_name:
            return self.kernels[spec.kind](*arguments, group=getattr(self, spec.group_name))
        return self.kernels[spec.kind](*arguments)

    def extra_repr(self) -> str:
        spec = self._layerswap_spec
        return f"{spec.kind}, eps={getattr(self, spec.eps_name)} ({self.backend})"


def is_replaced_norm(module: nn.Module) -> bool:
    """Whether ``module`` is a norm the ``norm`` slot swapped."""
    return isinstance(module, NormReplacement)
