"""The ``qkv`` slot: the projections every attention of a model's own classes computes from
one input, packed into one matrix product.

A ``<model type>.qkv.<backend>`` substitution takes the attention modules below the
decoder layer: each module whose class is named as an attention of the model's modeling
module and holds two or more projections (:func:`~layerswap.projections.candidate_attention_classes`),
and whose ``forward`` calls two or more of them on one input
(:func:`~layerswap.projections.classify`: Llama's q/k/v, Qwen3-Next's gated query with k/v,
DeepSeek's latent ``q_a_proj`` with ``kv_a_proj_with_mqa``), gets a subclass of its class
whose projections of that input are one product (:mod:`layerswap.backends.projections`).
Everything else stays the original's: the attention core, rotary, q/k norms, MLA's latent
path, the output projection. The projections stay the module's own ``Parameter`` objects
under their names (slices of one tensor), so ``state_dict``, ``save_pretrained``, PEFT
targets and optimizers see the same objects; undo sets the classes back and gives each
projection its own storage again. Linear-attention, Mamba and convolution mixers are no
attention classes and stay as they are.

Example::

    handle = layerswap.swap(model, "qwen3_next.qkv.fused")
    print(handle.report())       # 1 attention swapped (Qwen3NextAttention -> q_proj+k_proj+v_proj)
    handle.undo()
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from torch import nn

from layerswap import hf_internals
from layerswap.backends.projections import ProjectionsReplacement, is_packed
from layerswap.errors import RequirementError
from layerswap.projections import (
    ProjectionSpec,
    candidate_attention_classes,
    classify,
)
from layerswap.slots.class_plan import ClassPlan, ClassSwapHandle
from layerswap.slots.class_swap import ClassSwapSlot, instance_forward

if TYPE_CHECKING:
    from layerswap.family import Family
    from layerswap.patching import Scoped
    from layerswap.substitution import Substitution

__all__ = ["SLOT", "QKVSlot", "QKVSwapHandle", "qkv_plan", "read_refusal"]


class QKVSwapHandle(ClassSwapHandle):
    """A ``qkv`` swap in effect; ``undo()`` sets every swapped attention's class back and
    unpacks its projections."""


class QKVSlot(ClassSwapSlot):
    """The projections the attentions of a model's own classes compute from one input: each
    group packed into one product of a backend."""

    name = "qkv"
    description = "every attention's projections from one input (q/k/v) as one product"
    noun = "attention"
    plural = "attentions"
    replacement_base = ProjectionsReplacement
    handle_class = QKVSwapHandle

    def candidates(self, model: nn.Module, module_name: str) -> dict[type, list[str]]:
        return candidate_attention_classes(model, module_name)

    def classify(self, module: nn.Module) -> ProjectionSpec | str:
        return classify(module)

    def spec_of(self, module: nn.Module) -> Any:
        # a projection whose forward is set on the instance (accelerate's hooks) runs that
        # forward whatever its class: it would never take its slice of the group's product
        # (the others, o_proj among them, keep their class: theirs may be set)
        spec = super().spec_of(module)
        if isinstance(spec, ProjectionSpec):
            for name in dict.fromkeys(name for group in spec.groups for name in group):
                reason = instance_forward(getattr(module, name))
                if reason is not None:
                    return f"{name}: {reason}"
        return spec

    def spec_label(self, spec: Any) -> str:
        return str(spec.label)

    def original(self, family: Family) -> str:
        """The first attention class the family's modeling module defines; its causal LM
        where it defines none."""
        return self.first_attention_class(family)

    def construction(self, sub: Substitution) -> list[Scoped]:
        """The class swap's, and a quantized load refused before any weight is read where
        the quantizer converted the linear layers beside the packed projections but left
        those (bitsandbytes and fine-grained FP8 convert ``nn.Linear`` itself only): they
        would stay unquantized under a config that says they are, and the checkpoint saved
        then would not run."""
        from layerswap.patching import wrap

        def refuse_skipped(
            wrapped: Callable[..., Any], instance: Any, args: Any, kwargs: Any
        ) -> Any:
            model = args[0] if args else kwargs["model"]
            hf_quantizer = hf_internals.quantizer_of_conversion_call(args, kwargs)
            skipped = None if hf_quantizer is None else _skipped_by_quantizer(model)
            if skipped is not None:
                left, converted = skipped
                raise RequirementError(
                    f"{sub.name}: {type(hf_quantizer).__name__} converted {converted} but left "
                    f"{left}, a projection the qkv slot packed (it converts nn.Linear itself "
                    "only): the projections would stay unquantized under a config that says "
                    "they are, and a checkpoint saved would not run; load it outside use(), "
                    "or keep the attentions out of quantization (modules_to_not_convert)"
                )
            return wrapped(*args, **kwargs)

        return [
            *super().construction(sub),
            wrap(hf_internals.CONVERSION_MAPPING_TARGET, refuse_skipped),
        ]


def _skipped_by_quantizer(model: nn.Module) -> tuple[str, str] | None:
    """``(packed projection, converted linear)`` of the first packed attention of ``model``
    where a quantizer converted a linear layer (a subclass of ``nn.Linear`` now) and left a
    projection the slot packed as it was; ``None`` where it converted none beside them (it
    quantizes other modules, or none: MXFP4 dequantized, ``modules_to_not_convert``) or
    replaced the packed projections too (each then computes its own product)."""
    for name, attention in model.named_modules():
        if not is_packed(attention):
            continue
        members: Any = attention._layerswap_members()
        held = {id(member) for member, _ in members.values()}
        converted = [
            child_name
            for child_name, child in attention.named_modules()
            if isinstance(child, nn.Linear)
            and type(child) is not nn.Linear
            and id(child) not in held
        ]
        left = [
            member_name
            for member_name, (member, cls) in members.items()
            if type(member) is cls and attention.get_submodule(member_name) is member
        ]
        if converted and left:
            return f"{name}.{left[0]}", f"{name}.{converted[0]}"
    return None


SLOT = QKVSlot()


def qkv_plan(model: nn.Module, sub: Substitution) -> ClassPlan:
    """Which of ``model``'s attentions ``sub`` swaps (and into which class), and which stay."""
    return SLOT.plan(model, sub)


def read_refusal(family: Family, replacement: str) -> str | None:
    """Why ``replacement`` packs none of the attentions of ``family``'s tiny model (``None``:
    it packs at least one); asked once per transformers release."""
    return SLOT.read_refusal(family, replacement)
