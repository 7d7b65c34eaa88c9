"""The ``experts`` slot: the experts of every mixture-of-experts block, each expert's gated
product (or the whole block of experts) swapped for a backend's kernel.

A ``<model type>.experts.<backend>`` substitution takes each module of the model that
transformers' ``use_experts_implementation`` made (``Qwen3MoeExperts``: every expert's
weights as one 3-D parameter) and that the model's modeling module holds
(:func:`~layerswap.experts.candidate_experts_classes`); what its gate computes is read by
running it (:func:`~layerswap.experts.classify`). Each gets a subclass of its class
(:mod:`layerswap.backends.experts`): the ``fused`` backend recomputes the gate in the
backward pass instead of keeping its output, ``liger`` runs Liger's fused MoE kernel. The
router, the shared experts and the weights stay the module's own: parameters, names,
``state_dict``, ``save_pretrained`` and optimizers see the same objects; undo sets the
classes back. Experts that are not gated (Nemotron-H), that the model runs eagerly (for
``fused``), or that a backend's kernel does not take stay the original's, and the handle's
report says which and why.

Example::

    handle = layerswap.swap(model, "qwen3_moe.experts.fused")
    print(handle.report())       # 4 experts modules swapped (Qwen3MoeExperts -> ...)
    handle.undo()
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import nn

from layerswap.backends.experts import ExpertsReplacement
from layerswap.experts import ExpertsSpec, candidate_experts_classes, classify
from layerswap.slots.class_plan import ClassPlan, ClassSwapHandle
from layerswap.slots.class_swap import ClassSwapSlot, settings

if TYPE_CHECKING:
    from layerswap.family import Family
    from layerswap.substitution import Substitution

__all__ = ["SLOT", "ExpertsSlot", "ExpertsSwapHandle", "experts_plan", "read_refusal"]


class ExpertsSwapHandle(ClassSwapHandle):
    """An experts swap in effect; ``undo()`` sets every swapped experts module's class back."""


class ExpertsSlot(ClassSwapSlot):
    """The experts of a model's mixture-of-experts blocks: each one's gated product (or
    the whole block of experts) swapped for one kernel of a backend."""

    name = "experts"
    description = "the experts of every mixture-of-experts block: each expert's gate as one kernel"
    noun = "experts module"
    plural = "experts modules"
    replacement_base = ExpertsReplacement
    handle_class = ExpertsSwapHandle

    def candidates(self, model: nn.Module, module_name: str) -> dict[type, list[str]]:
        return candidate_experts_classes(model, module_name)

    def classify(self, module: nn.Module) -> ExpertsSpec | str:
        return classify(module)

    def spec_of(self, module: nn.Module) -> Any:
        # a gate may read its config when it runs (a clamp's limit), and the implementation
        # the model runs is the config's: both belong to what the module computes
        config = getattr(module, "config", None)
        read = repr(sorted(config.to_diff_dict().items())) if config is not None else ""
        key = (
            type(self),
            *settings(module),
            read,
            getattr(config, "_experts_implementation", None),
        )
        return self._memo(key, module)

    def spec_label(self, spec: Any) -> str:
        return str(spec.label)

    def original(self, family: Family) -> str:
        """The first experts class the family's modeling module holds; its causal LM where
        it holds none."""
        return self.first_class(
            family,
            lambda name, cls: (
                callable(getattr(cls, "_apply_gate", None)) and name.endswith("Experts")
            ),
        )

    def none_found(self, family: Family) -> str:
        return f"its model has no experts module of {family.module} (no mixture-of-experts block)"


SLOT = ExpertsSlot()


def experts_plan(model: nn.Module, sub: Substitution) -> ClassPlan:
    """Which of ``model``'s experts modules ``sub`` swaps (and into which class), and which
    stay."""
    return SLOT.plan(model, sub)


def read_refusal(family: Family, replacement: str) -> str | None:
    """Why ``replacement`` computes none of the experts of ``family``'s tiny model (``None``:
    it computes at least one); asked once per transformers release."""
    return SLOT.read_refusal(family, replacement)
