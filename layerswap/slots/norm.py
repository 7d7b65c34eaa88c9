"""The ``norm`` slot: every norm of a model that its own classes compute, swapped for one kernel.

A ``<model type>.norm.<backend>`` substitution takes the norms below the decoder layer:
each module of the model whose class is a norm of the model's modeling module
(:func:`~layerswap.norms.candidate_norm_classes`) and computes a kind the backend has a
kernel for (:func:`~layerswap.norms.classify`, by running a copy of it) gets a subclass of
its class whose ``forward`` is that kernel (:mod:`layerswap.backends.norm`). Nothing else
changes: parameters, names, ``state_dict``, ``save_pretrained``, PEFT targets and
optimizers see the same objects; undo sets the classes back. Norms it does not express
(a gated norm taking a second tensor, grouped norms, L2 norms) stay the original's, and
the handle's report says which and why; a model with none it expresses is refused. How a
class swap works is :mod:`layerswap.slots.class_swap`'s, shared with the ``mlp`` slot.

It needs no decoder layer it can replace: hybrids (linear attention, Mamba, convolution
mixers), multi-head latent attention and per-layer inputs keep every module but their norms.
Any causal-LM model type of the installed transformers may be named, with or without a
registered family (``qwen3_next.norm.fused``).

Example::

    handle = layerswap.swap(model, "qwen3_next.norm.fused")
    print(handle.report())       # 11 norms swapped (Qwen3NextRMSNorm: rms_offset), 3 kept
    handle.undo()
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from layerswap.backends.norm import NormReplacement
from layerswap.norms import NormSpec, candidate_norm_classes, classify
from layerswap.slots.class_plan import ClassPlan, ClassSwapHandle
from layerswap.slots.class_swap import ClassSwapSlot, check_class_structure

if TYPE_CHECKING:
    from layerswap.family import Family
    from layerswap.substitution import Substitution

__all__ = [
    "SLOT",
    "NormPlan",
    "NormSlot",
    "NormSwapHandle",
    "check_norm_structure",
    "norm_plan",
    "read_norm_refusal",
    "read_refusal",
    "spec_of",
]

#: what a norm swap does to one model (the class swap's plan)
NormPlan = ClassPlan
check_norm_structure = check_class_structure


class NormSwapHandle(ClassSwapHandle):
    """A norm swap in effect; ``undo()`` sets every swapped norm's class back."""


class NormSlot(ClassSwapSlot):
    """The norms a model's own classes compute: each swapped for one kernel of a backend."""

    name = "norm"
    description = "every norm of the model's own classes (RMSNorm, (1 + w) RMSNorm, LayerNorm)"
    noun = "norm"
    plural = "norms"
    replacement_base = NormReplacement
    handle_class = NormSwapHandle

    def candidates(self, model: nn.Module, module_name: str) -> dict[type, list[str]]:
        return candidate_norm_classes(model, module_name)

    def classify(self, module: nn.Module) -> NormSpec | str:
        return classify(module)

    def none_found(self, family: Family) -> str:
        return (
            f"its model has no norm class of {family.module} (torch's own norms are one "
            "kernel already)"
        )

    def original(self, family: Family) -> str:
        """The first norm class the family's modeling module names; its causal LM where it
        names none (its parts are another model's, built through an ``Auto`` class)."""
        from layerswap.errors import UnsupportedFamilyError
        from layerswap.model_types import norm_class_name

        try:
            return f"{family.module}:{norm_class_name(family.module)}"
        except UnsupportedFamilyError:
            return f"{family.module}:{family.causal_lm}"


SLOT = NormSlot()


def spec_of(module: nn.Module) -> NormSpec | str:
    """:func:`~layerswap.norms.classify` of ``module``, asked once per class and settings."""
    spec: NormSpec | str = SLOT.spec_of(module)
    return spec


def norm_plan(model: nn.Module, sub: Substitution) -> NormPlan:
    """Which of ``model``'s norms ``sub`` swaps (and into which class), and which stay."""
    return SLOT.plan(model, sub)


def read_norm_refusal(family: Family, replacement: str) -> str | None:
    """Why ``replacement`` (``"module:Class"``, a :class:`NormReplacement`) computes none of
    the norms of ``family``'s tiny model, built on the meta device (``None``: it computes
    at least one). The declaration asks it once per transformers release."""
    return SLOT.read_refusal(family, replacement)


read_refusal = read_norm_refusal
