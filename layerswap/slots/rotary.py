"""The ``rotary`` slot: the rotary application every attention of a model's own classes
calls, swapped for one backend kernel.

A ``<model type>.rotary.<backend>`` substitution takes the attention modules whose class is
named as an attention of the model's modeling module and whose ``forward`` calls one of its
module's rotary functions (:data:`~layerswap.rotaries.ROTARY_FUNCTIONS`:
``apply_rotary_pos_emb``, DeepSeek's ``apply_rotary_pos_emb_interleave``, Llama 4's
``apply_rotary_emb``; :func:`~layerswap.rotaries.candidate_rotary_classes`). What each
function computes is read by running it (:func:`~layerswap.rotaries.classify`: the
rotate-half rotation of q and k or of one tensor, of every channel or of the leading ones,
in the inputs' dtype or in float32; DeepSeek's interleaved pairs; Llama 4's complex
product); each function a backend has a kernel for is renamed in a subclass of the module's
class whose ``forward`` is the original's code otherwise (:mod:`layerswap.backends.rotary`):
the ``fused`` backend writes the rotation in place, ``liger`` runs Liger's RoPE. Everything
else is the original's: the projections, q/k norms, cache, mask and attention; parameters,
``state_dict``, ``save_pretrained``, PEFT targets and optimizers see the same objects; undo
sets the classes back. Other layouts (GLM's, Cohere's and GPT-J's interleaving, nanochat's
reversed halves, DeepSeek V2's complex rotation) and attentions another slot swapped
(``qkv``) stay as they are, and the handle's report says which and why; a swap under which
no attention runs the kernel (the config selects no rotary it computes) is refused.

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
    RotaryCalls,
    calls_conditionally,
    candidate_rotary_classes,
    classify,
    never_rotates,
    rotary_calls,
)
from layerswap.slots import ModelParts
from layerswap.slots.class_plan import ClassPlan, ClassSwapHandle
from layerswap.slots.class_swap import ClassSwapSlot, settings, tiny_on_meta

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

    def classify(self, module: nn.Module) -> RotaryCalls | str:
        # a NoPE layer's attention is kept, with the switch that makes it one: the kernel
        # would never run in it
        return never_rotates(module) or classify(module)

    def spec_of(self, module: nn.Module) -> Any:
        # what a module computes is its module's rotary function's, as bound now: one
        # rebound since (another library's patch) is read again
        cls = getattr(type(module), "_layerswap_original", type(module))
        found = rotary_calls(cls)
        functions = tuple(found) if isinstance(found, list) else None
        return self._memo((type(self), *settings(module), functions), module)

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
    "(another rotary, or none: NoPE layers)"
)


def _idle_on_tiny(slot: RotarySlot, family: Family, replacement: str) -> str | None:
    """Why the attentions of ``family``'s tiny model, run once on the CPU with their classes
    swapped for ``replacement``'s, never call their rotary function (``None``: they do, or
    none calls it conditionally)."""
    import torch

    from layerswap.family import resolve
    from layerswap.proof_run import comparing

    made: Any = resolve(replacement)
    # which classes call their rotary conditionally is read from the meta model the class
    # swap's reading built already: a model is built and run only for those
    on_meta = tiny_on_meta(family)
    if isinstance(on_meta, Exception) or not any(
        calls_conditionally(cls) for cls in slot.candidates(on_meta, family.module)
    ):
        return None
    with torch.random.fork_rng(devices=[]), torch.device("cpu"), comparing():
        torch.manual_seed(0)
        try:
            model = family.causal_lm_class()(family.tiny_config()).eval()
        except Exception:  # what does not build is the proof's to refuse, with its reason
            return None
        classes = slot.candidates(model, family.module)
        functions: set[str] = set()
        for cls, names in classes.items():
            for name in names:
                module = model.get_submodule(name)
                spec = slot.spec_of(module)
                if isinstance(spec, str) or made.refusal(spec) is not None:
                    continue
                functions.update(c.function for c in spec.calls if made.call_refusal(c) is None)
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
        "NoPE layers)"
    )


def rotary_plan(model: nn.Module, sub: Substitution) -> ClassPlan:
    """Which of ``model``'s attentions ``sub`` swaps (and into which class), and which stay."""
    return SLOT.plan(model, sub)


def read_refusal(family: Family, replacement: str) -> str | None:
    """Why ``replacement`` computes the rotary application of none of the attentions of
    ``family``'s tiny model (``None``: it computes at least one); asked once per
    transformers release."""
    return SLOT.read_refusal(family, replacement)
