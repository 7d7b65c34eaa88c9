"""The ``mlp`` slot: every gated MLP a model's own classes compute, its activation and
product swapped for one backend kernel.

A ``<model type>.mlp.<backend>`` substitution takes the MLPs below the decoder layer: each
module of the model whose class is named as an MLP of its modeling module and holds two or
three projections (:func:`~layerswap.mlps.candidate_mlp_classes`), and that computes a
gated MLP ``down(act(gate(x)) * up(x))`` (:func:`~layerswap.mlps.classify`, by running a
copy: separate or packed gate/up, any projection names, the activation it holds or applies
inline, Falcon-H1's multipliers) gets a subclass of its class whose ``act(gate) * up`` is
the backend's kernel (:mod:`layerswap.backends.mlp`): the ``fused`` backend recomputes the
activation in the backward pass instead of keeping its output, ``liger`` runs Liger's
SwiGLU/GeGLU kernel. The projections stay the module's own, called as modules: parameters,
names, ``state_dict``, ``save_pretrained``, PEFT targets and optimizers see the same
objects; undo sets the classes back. Plain MLPs (``down(act(up(x)))``: nothing to fuse),
Gemma 3n's sparse activations and mixture-of-experts blocks stay the original's, and the
handle's report says which and why.

Example::

    handle = layerswap.swap(model, "qwen3_next.mlp.fused")
    print(handle.report())       # 5 MLPs swapped (Qwen3NextMLP -> gated silu)
    handle.undo()
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import nn

from layerswap.backends.mlp import MLPReplacement
from layerswap.mlps import MLPSpec, candidate_mlp_classes, classify, is_mlp_class
from layerswap.slots.class_plan import ClassPlan, ClassSwapHandle
from layerswap.slots.class_swap import ClassSwapSlot

if TYPE_CHECKING:
    from layerswap.family import Family
    from layerswap.substitution import Substitution

__all__ = ["SLOT", "MLPSlot", "MLPSwapHandle", "mlp_plan", "read_refusal"]


class MLPSwapHandle(ClassSwapHandle):
    """An MLP swap in effect; ``undo()`` sets every swapped MLP's class back."""


class MLPSlot(ClassSwapSlot):
    """The gated MLPs a model's own classes compute: each one's activation and product
    swapped for one kernel of a backend."""

    name = "mlp"
    description = "every gated MLP of the model's own classes: act(gate) * up as one kernel"
    noun = "MLP"
    plural = "MLPs"
    replacement_base = MLPReplacement
    handle_class = MLPSwapHandle

    def candidates(self, model: nn.Module, module_name: str) -> dict[type, list[str]]:
        return candidate_mlp_classes(model, module_name)

    def classify(self, module: nn.Module) -> MLPSpec | str:
        return classify(module)

    def spec_label(self, spec: Any) -> str:
        return str(spec.label)

    def original(self, family: Family) -> str:
        """The first MLP class the family's modeling module defines; its causal LM where it
        defines none."""
        return self.first_class(
            family,
            lambda _, cls: cls.__module__ == family.module and is_mlp_class(cls, family.module),
        )


SLOT = MLPSlot()


def mlp_plan(model: nn.Module, sub: Substitution) -> ClassPlan:
    """Which of ``model``'s MLPs ``sub`` swaps (and into which class), and which stay."""
    return SLOT.plan(model, sub)


def read_refusal(family: Family, replacement: str) -> str | None:
    """Why ``replacement`` computes none of the MLPs of ``family``'s tiny model (``None``:
    it computes at least one); asked once per transformers release."""
    return SLOT.read_refusal(family, replacement)
