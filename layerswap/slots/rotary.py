"""The ``rotary`` slot: the rotary application every attention of a model's own classes
calls, swapped for one backend kernel.

A ``<model type>.rotary.<backend>`` substitution takes the attention modules whose class is
named as an attention of the model's modeling module and whose ``forward`` calls its
module's ``apply_rotary_pos_emb`` (:func:`~layerswap.rotaries.candidate_rotary_classes`);
where that function computes the rotate-half rotation (:func:`~layerswap.rotaries.classify`,
by running it: q and k or one tensor, every channel or the leading ones, in the inputs'
dtype or in float32), each such module gets a subclass of its class whose ``forward`` calls
the backend's kernel instead (:mod:`layerswap.backends.rotary`): the ``fused`` backend's
three-kernel rotation, ``liger`` Liger's RoPE. Everything else is the original's: the
projections, q/k norms, cache, mask and attention; parameters, ``state_dict``,
``save_pretrained``, PEFT targets and optimizers see the same objects; undo sets the
classes back. Interleaved layouts (GLM, GPT-J, DeepSeek V2's complex rotation), MLA's
separate rotary function and attentions another slot swapped (``qkv``) stay as they are,
and the handle's report says which and why.

Example::

    handle = layerswap.swap(model, "qwen3_next.rotary.fused")
    print(handle.report())       # 1 attention swapped (Qwen3NextAttention -> rotate-half, q and k)
    handle.undo()
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import nn

from layerswap.backends.rotary import RotaryReplacement
from layerswap.rotaries import RotarySpec, candidate_rotary_classes, classify
from layerswap.slots import ModelParts
from layerswap.slots.class_swap import ClassPlan, ClassSwapHandle, ClassSwapSlot

if TYPE_CHECKING:
    from layerswap.family import Family
    from layerswap.substitution import Substitution

__all__ = ["SLOT", "RotarySlot", "RotarySwapHandle", "read_refusal", "rotary_plan"]


class RotarySwapHandle(ClassSwapHandle):
    """A ``rotary`` swap in effect; ``undo()`` sets every swapped attention's class back."""


class RotarySlot(ClassSwapSlot):
    """The rotary application the attentions of a model's own classes call: each swapped for
    one kernel of a backend."""

    name = "rotary"
    description = "every attention's rotary application (apply_rotary_pos_emb) as one kernel"
    noun = "attention"
    plural = "attentions"
    replacement_base = RotaryReplacement
    handle_class = RotarySwapHandle

    def candidates(self, model: nn.Module, module_name: str) -> dict[type, list[str]]:
        return candidate_rotary_classes(model, module_name)

    def classify(self, module: nn.Module) -> RotarySpec | str:
        return classify(module)

    def spec_label(self, spec: Any) -> str:
        return str(spec.label)

    def none_found(self, family: Family) -> str:
        return f"no attention class of {family.module} calls apply_rotary_pos_emb"

    def coverage(self, parts: ModelParts) -> tuple[tuple[str, ...], tuple[str, ...]]:
        classes = self.candidates(parts.model, parts.family.module)
        named = ", ".join(f"{cls.__name__} x{len(names)}" for cls, names in classes.items())
        return (
            (f"the rotary application of the attentions ({named or 'none'})",),
            (f"{parts.layers_text}, the attentions but their rotary", *parts.outside),
        )

    def original(self, family: Family) -> str:
        """The first attention class the family's modeling module defines; its causal LM
        where it defines none."""
        return self.first_attention_class(family)


SLOT = RotarySlot()


def rotary_plan(model: nn.Module, sub: Substitution) -> ClassPlan:
    """Which of ``model``'s attentions ``sub`` swaps (and into which class), and which stay."""
    return SLOT.plan(model, sub)


def read_refusal(family: Family, replacement: str) -> str | None:
    """Why ``replacement`` computes the rotary application of none of the attentions of
    ``family``'s tiny model (``None``: it computes at least one); asked once per
    transformers release."""
    return SLOT.read_refusal(family, replacement)
