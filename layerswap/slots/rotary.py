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

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from torch import nn

from layerswap.backends.rotary import RotaryReplacement, calls
from layerswap.rotaries import (
    RotarySpec,
    calls_conditionally,
    candidate_rotary_classes,
    classify,
    rotary_call,
)
from layerswap.slots import ModelParts
from layerswap.slots.class_swap import ClassPlan, ClassSwapHandle, ClassSwapSlot, settings

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

    def spec_of(self, module: nn.Module) -> Any:
        # what a module computes is its module's rotary function's, as bound now: one
        # rebound since (another library's patch) is read again
        cls = getattr(type(module), "_layerswap_original", type(module))
        found = rotary_call(cls)
        function = found[1] if isinstance(found, tuple) else None
        return self._memo((type(self), *settings(module), function), module)

    def proof_watch(self, sub: Substitution) -> Callable[[], str | None]:
        """The kernel's calls counted through the proof: a swap under which no attention
        computes its rotary by the kernel (the config selects another rotary function, or
        none; or every call had shapes it was not read on) is refused, not proven doing
        nothing."""
        entered, computed = calls()

        def idle() -> str | None:
            now_entered, now_computed = calls()
            if now_computed > computed:
                return None
            if now_entered > entered:
                return (
                    "its attentions called the kernel, but every call ran the module's own "
                    "function (shapes or dtypes the kernel was not read on)"
                )
            return _IDLE.format(function="its rotary function")

        return idle

    def read_refusal(self, family: Family, replacement: str) -> str | None:
        """The class swap's reading; where an attention calls its rotary function only under
        a condition, also a run of the family's tiny model on the CPU: one whose
        attentions never call it there (its config selects another rotary, or none) is
        refused."""
        refused = super().read_refusal(family, replacement)
        if refused is not None:
            return refused
        return _idle_on_tiny(self, family, replacement)

    def spec_label(self, spec: Any) -> str:
        return str(spec.label)

    def none_found(self, family: Family) -> str:
        return f"no attention class of {family.module} calls apply_rotary_pos_emb"

    def coverage(self, parts: ModelParts) -> tuple[tuple[str, ...], tuple[str, ...]]:
        classes = self.candidates(parts.model, parts.family.module)
        named = ", ".join(f"{cls.__name__} x{len(names)}" for cls, names in classes.items())
        return (
            (f"the rotary application of the attentions ({named or 'none'})",),
            (parts.layers_text, *parts.outside),
        )

    def original(self, family: Family) -> str:
        """The first attention class the family's modeling module defines; its causal LM
        where it defines none."""
        return self.first_attention_class(family)


SLOT = RotarySlot()

_IDLE = (
    "no attention computed its rotary by the kernel on the proof's tiny model of this "
    "config: its forward calls {function} only under a condition the config does not meet "
    "(another rotary, or none: DeepSeek V3's rope_interleave, NoPE layers)"
)


def _idle_on_tiny(slot: RotarySlot, family: Family, replacement: str) -> str | None:
    """Why the attentions of ``family``'s tiny model, run once on the CPU with their classes
    swapped for ``replacement``'s, never call their rotary function (``None``: they do, or
    none calls it conditionally)."""
    import torch

    from layerswap.family import resolve
    from layerswap.proof_run import comparing

    made: Any = resolve(replacement)
    with torch.random.fork_rng(devices=[]), torch.device("cpu"), comparing():
        torch.manual_seed(0)
        try:
            model = family.causal_lm_class()(family.tiny_config()).eval()
        except Exception:  # what does not build is the proof's to refuse, with its reason
            return None
        classes = slot.candidates(model, family.module)
        if not any(calls_conditionally(cls) for cls in classes):
            return None
        functions = set()
        for cls, names in classes.items():
            for name in names:
                module = model.get_submodule(name)
                spec = slot.spec_of(module)
                if isinstance(spec, str) or made.refusal(spec) is not None:
                    continue
                functions.add(spec.function)
                module.__class__ = made.subclass_for(cls, spec, f"{family.name}.rotary.reading")
        vocab = model.config.get_text_config().vocab_size
        entered, _ = calls()
        try:
            with torch.no_grad():
                model(input_ids=torch.randint(1, vocab, (1, 8)))
        except Exception:
            return None
        if calls()[0] > entered:
            return None
    return (
        f"its forward calls {' / '.join(sorted(functions)) or 'its rotary function'} only "
        "under a condition its default config does not meet (another rotary, or none: "
        "DeepSeek V3's rope_interleave, NoPE layers)"
    )


def rotary_plan(model: nn.Module, sub: Substitution) -> ClassPlan:
    """Which of ``model``'s attentions ``sub`` swaps (and into which class), and which stay."""
    return SLOT.plan(model, sub)


def read_refusal(family: Family, replacement: str) -> str | None:
    """Why ``replacement`` computes the rotary application of none of the attentions of
    ``family``'s tiny model (``None``: it computes at least one); asked once per
    transformers release."""
    return SLOT.read_refusal(family, replacement)
