"""What every backend's ``norm`` replacement shares: a subclass of the model's own norm
class whose ``forward`` is one kernel.

The ``norm`` slot (:mod:`layerswap.slots.norm`) gives each norm instance it swaps a class
made here: ``type(name, (Replacement, Original), ...)``, so that the instance keeps its
parameters (the very same ``Parameter`` objects, under the same names), its epsilon and
every other attribute, ``isinstance(module, Original)`` still holds (transformers'
``_init_weights`` asks it), and undo is setting the class back. A backend's replacement
names the :data:`~layerswap.norms.KINDS` it computes and how (``kernels``).

Example::

    class FusedNorm(NormReplacement):
        backend = "fused"
        kernels = KINDS
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any, ClassVar

from torch import Tensor, nn

from layerswap.norms import NormFunction, NormSpec

__all__ = ["NormReplacement", "is_replaced_norm"]

_MADE: dict[tuple[type, type, NormSpec, str], type[NormReplacement]] = {}
_LOCK = threading.Lock()


class NormReplacement(nn.Module):
    """The base of a backend's norm replacement; :meth:`subclass_for` makes the classes."""

    #: the backend's name
    backend: ClassVar[str] = ""
    #: the kinds this backend computes, and its function for each
    kernels: ClassVar[Mapping[str, NormFunction]] = {}
    #: set on each made class: the original class, what it computes, the substitution
    _layerswap_original: ClassVar[type]
    _layerswap_spec: ClassVar[NormSpec]
    _layerswap_norm_of: ClassVar[str]

    def forward(self, hidden_states: Tensor) -> Tensor:
        spec = self._layerswap_spec
        return self.kernels[spec.kind](
            hidden_states,
            getattr(self, "weight", None),
            getattr(self, "bias", None),
            getattr(self, spec.eps_name),
        )

    @classmethod
    def subclass_for(
        cls, original: type, spec: NormSpec, substitution: str
    ) -> type[NormReplacement]:
        """The class an ``original`` norm computing ``spec`` becomes (made once)."""
        key = (cls, original, spec, substitution)
        with _LOCK:
            made = _MADE.get(key)
            if made is None:
                namespace: dict[str, Any] = {
                    "__module__": cls.__module__,
                    "__qualname__": f"{cls.__name__}[{original.__name__}]",
                    "_layerswap_original": original,
                    "_layerswap_spec": spec,
                    "_layerswap_norm_of": substitution,
                }
                made = type(f"{cls.__name__}[{original.__name__}]", (cls, original), namespace)
                assert issubclass(made, NormReplacement)
                _MADE[key] = made
            return made

    def __reduce_ex__(self, protocol: Any) -> Any:
        # pickled as how to make its class again (a made class is not importable by name)
        # and its state: torch.save(model) and copies of a swapped model keep their norms
        made = type(self)
        base = next(c for c in made.__mro__[1:] if issubclass(c, NormReplacement))
        arguments = (base, made._layerswap_original, made._layerswap_spec, made._layerswap_norm_of)
        return (_remade, arguments, dict(self.__dict__))

    def extra_repr(self) -> str:
        spec = self._layerswap_spec
        return f"{spec.kind}, eps={getattr(self, spec.eps_name)} ({self.backend})"


def _remade(
    base: type[NormReplacement], original: type, spec: NormSpec, substitution: str
) -> NormReplacement:
    made = base.subclass_for(original, spec, substitution)
    return made.__new__(made)


def is_replaced_norm(module: nn.Module) -> bool:
    """Whether ``module`` is a norm the ``norm`` slot swapped."""
    return isinstance(module, NormReplacement)
