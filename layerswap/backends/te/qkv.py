"""The ``te`` backend's attention projections: each group an attention computes from one
input (q/k/v; MLA's q_a/kv_a) as one GEMM of a TransformerEngine ``Linear`` (GPU only).

The packing is the ``qkv`` slot's (:mod:`layerswap.backends.projections`): the
projections' weights (and biases) are slices of one tensor, each still the projection's
own ``Parameter``. What changes is who computes the group's product: a
``transformer_engine.pytorch.Linear`` built with ``parameters_split`` (one weight per
projection, by name) whose weights are those very ``Parameter`` objects, registered on
it in place of the ones it made. TE's ``Linear`` joins split weights that lie one after
another in one storage without a copy (``noop_cat``) and hands each its slice of the
weight gradient, so the group is one TE GEMM, and inside :func:`~layerswap.backends.te.runtime.fp8_autocast`
one FP8 GEMM (its input and packed weight quantized by the recipe). A call whose token
count TE's FP8 GEMM cannot take (a decode step) runs in BF16, as the te decoder layer's
do.

The ``Linear`` is made on the first call on a GPU, for the weights' device, dtype and
sizes, and never saved: ``state_dict``, ``save_pretrained``, a pickle or a deep copy of
the model hold the projections only (a copy makes its own ``Linear`` when it first runs).
It is kept outside the module tree, so ``parameters()`` lists each weight once. Proven
against the original on a GPU only.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import torch
from torch import Tensor

from layerswap.backends.projections import PackedGroup, ProjectionsReplacement
from layerswap.backends.te import runtime

__all__ = ["TEPackedGroup", "TEProjections"]


def _leave(tensor: Tensor) -> None:
    """An initialiser that leaves a tensor as it is: the ``Linear``'s own weights are
    replaced by the projections' before it runs (and drawing them would move the RNG)."""


class TEPackedGroup(PackedGroup):
    """A packed group whose product is one TransformerEngine ``Linear`` GEMM."""

    def _fresh(self) -> None:
        super()._fresh()
        #: the TE ``Linear`` for the weights' (device, dtype, input width, sizes)
        self._linear: tuple[tuple[Any, ...], Any] | None = None

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state.pop("_linear", None)
        return state

    def unpack(self) -> None:
        super().unpack()
        self._linear = None

    def _te_linear(self, weights: list[Any]) -> Any:
        """The TE ``Linear`` over the members' weights (and biases), made for their
        device, dtype and sizes and given the members' current ``Parameter`` objects."""
        first = weights[0]
        key = (first.device, first.dtype, int(first.shape[1]), self.sizes)
        made = self._linear
        if made is None or made[0] != key:
            te = runtime._te()
            # its own weights are made (uninitialised) and dropped below; never an
            # inference tensor, which could not be a Parameter outside inference_mode
            with torch.inference_mode(False), torch.no_grad():
                linear = te.Linear(
                    key[2],
                    sum(self.sizes),
                    bias=self.bias,
                    params_dtype=first.dtype,
                    device=first.device,
                    parameters_split=dict(zip(self.names, self.sizes, strict=True)),
                    init_method=_leave,
                )
            made = self._linear = (key, linear)
        linear = made[1]
        kinds: list[tuple[str, list[str]]] = [("weight", linear.weight_names)]
        if self.bias:
            kinds.append(("bias", linear.bias_names))
        for kind, names in kinds:
            for member, name in zip(self.members, names, strict=True):
                tensor = member._parameters[kind]
                if linear._parameters.get(name) is not tensor:
                    linear.register_parameter(name, tensor)
        return linear

    def product(self, x: Tensor, weights: list[Any], tracked: bool) -> Tensor:
        runtime.require_cuda(x, f"{self.substitution} (TEProjections)")
        linear = self._te_linear(weights)
        with runtime._precision_for(x.numel() // x.shape[-1]):
            out: Tensor = linear(x)
        return out


class TEProjections(ProjectionsReplacement):
    """A model's own attention whose projections from one input are one TransformerEngine
    ``Linear`` GEMM (FP8 inside ``te.fp8_autocast``)."""

    backend = "te"
    kernels: ClassVar[Mapping[str, Any]] = {"packed": "transformer_engine.pytorch.Linear"}
    group_class = TEPackedGroup
