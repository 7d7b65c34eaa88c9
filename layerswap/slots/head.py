"""The ``head`` slot: a causal LM's head (and its loss), swapped on a built model and undone.

A substitution of the ``head`` slot (:mod:`layerswap.backends.head`) changes the
class of the model object to the backend's subclass of the family's ``*ForCausalLM``;
no module, parameter or buffer changes, so ``state_dict``, ``save_pretrained``, tied
embeddings, optimizers holding the parameters and PEFT keep working, and undo sets the
class back. It composes with a decoder substitution in either order; each has its
own handle.

Example::

    decoder = layerswap.swap(model, "llama.decoder.fused")
    head = layerswap.swap(model, "llama.head.fused")
    ...
    head.undo(); decoder.undo()

    with layerswap.use("llama.head.fused"):
        model = LlamaForCausalLM.from_pretrained(path)   # built with the fused head
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from torch import nn

from layerswap import hf_internals
from layerswap.backends.head import CausalLMHead
from layerswap.errors import SubstitutionError
from layerswap.handle import SwapHandle
from layerswap.patching.undo import UndoLog
from layerswap.placement import Placement
from layerswap.placement_guard import guard
from layerswap.proof import ensure_proven
from layerswap.slots import ModelParts, Slot, rolling_back, undo_first
from layerswap.slots.class_swap import instance_forward

if TYPE_CHECKING:
    from transformers import PreTrainedConfig

    from layerswap.family import Family
    from layerswap.patching import Scoped
    from layerswap.substitution import Substitution

__all__ = ["SLOT", "HeadSlot", "HeadSwapHandle", "head_substitution_of"]


#: the instance attribute naming the substitution that gave a model its head: one head
#: class serves every model type of a causal LM (``gemma3`` and ``gemma3_text``)
_HEAD_BY = "_layerswap_head_by"


def head_substitution_of(model: nn.Module) -> str | None:
    """The name of the head substitution ``model`` runs (``None`` for an original head)."""
    if isinstance(model, CausalLMHead):
        named = model.__dict__.get(_HEAD_BY)
        return (
            named if isinstance(named, str) else f"{model._layerswap_family}.head.{model.backend}"
        )
    return None


def _check_swappable(model: nn.Module, sub: Substitution) -> type[nn.Module]:
    original = sub.original_class()
    current = head_substitution_of(model)
    if current is not None:
        raise SubstitutionError(
            f"the head of this {type(model).__name__} is already swapped by {current}; "
            f"{undo_first(current)}"
        )
    if type(model) is not original:
        raise SubstitutionError(
            f"{sub.name} swaps the head of a {original.__name__}; this model is a "
            f"{type(model).__module__}.{type(model).__qualname__}, "
            + (
                "a subclass whose own forward it would drop"
                if isinstance(model, original)
                else "not one"
            )
        )
    hooked = instance_forward(model)
    if hooked is not None:  # its hook would run the original forward: a swap doing nothing
        raise SubstitutionError(f"{sub.name} cannot swap this {type(model).__name__}: {hooked}")
    config = getattr(model, "config", None)
    if config is None:
        raise SubstitutionError(f"{type(model).__name__} has no config; swap() needs one")
    sub.parts.slot.prepare(sub, config, Placement.of(model))
    return sub.replacement_class()


class HeadSwapHandle(SwapHandle):
    """A head swap in effect; ``undo()`` sets the model's class back (nothing else changed)."""

    def __init__(
        self,
        model: nn.Module,
        substitution: Substitution,
        original: type[nn.Module],
        changes: UndoLog,
    ) -> None:
        self.model = model
        self.substitution = substitution
        self._original = original
        self._replacement = type(model)
        self._changes = changes
        self._active = True

    @property
    def swapped(self) -> list[tuple[str, type[nn.Module], type[nn.Module]]]:
        """One row: ``("", original class, replacement class)`` (the model itself)."""
        return [("", self._original, self._replacement)]

    def undo(self) -> None:
        """Put the original class back (a no-op when already undone)."""
        if not self._active:
            return
        if type(self.model) is not self._replacement:
            raise SubstitutionError(
                f"cannot undo {self.substitution.name}: the model's class is now "
                f"{type(self.model).__qualname__}, not {self._replacement.__qualname__} "
                "(it was changed since)"
            )
        self._changes.undo()
        self._active = False

    def report(self) -> str:
        """A readable summary: the substitution and the class swapped."""
        state = "active" if self._active else "undone"
        return (
            f"{self.substitution.name}: head swapped ({state})\n"
            f"  {self._original.__name__} -> {self._replacement.__qualname__}"
        )

    def __len__(self) -> int:
        return 1

    def __repr__(self) -> str:
        state = "active" if self._active else "undone"
        return f"<HeadSwapHandle {self.substitution.name}: {state}>"


class HeadSlot(Slot):
    """The causal LM's head and loss: a substitution gives the model a subclass of its class."""

    name = "head"
    description = "the causal LM's head and loss"
    #: a ``<model type>.head.*`` name needs no registered family (such a head is proven at
    #: first use: no test of layerswap's covers its model type)
    takes_any_model_type = True

    def proves(self, sub: Substitution) -> bool:
        """A model type no family covers (a bare family: no decoder layer named)."""
        return not sub.parts.family.decoder

    def proof_context(self, sub: Substitution) -> Callable[[], Any]:
        """The proof compares the fused loss (the head in eval mode takes the original's)."""
        return sub.forward_context

    def prepare(
        self, sub: Substitution, config: PreTrainedConfig, placement: Placement | None = None
    ) -> None:
        """The head contract read off the source; then, for a model type no family
        covers, the first-use proof (in the model's ``placement``)."""
        super().prepare(sub, config)
        ensure_proven(sub, config, placement)

    def original(self, family: Family) -> str:
        return f"{family.module}:{family.causal_lm}"

    def swap(self, model: nn.Module, sub: Substitution) -> HeadSwapHandle:
        """Give ``model`` (an exact ``*ForCausalLM`` of ``sub``'s family) ``sub``'s head."""
        original = type(model)
        replacement = _check_swappable(model, sub)
        with rolling_back(sub.name) as changes:
            changes.record(guard(model, sub, model.config, proven=True))
            changes.set_attribute(model, _HEAD_BY, sub.name)
            changes.set_class(model, replacement)
        return HeadSwapHandle(model, sub, original, changes)

    def rebuild_originals(self, model: nn.Module, sub: Substitution) -> int:
        """Give a model built with a swapped head its original class back (1), or 0.

        For a model built inside :func:`layerswap.use`, which has no handle to undo.
        """
        if not isinstance(model, CausalLMHead):
            return 0
        restored: Any = model
        restored.__class__ = model._layerswap_original
        model.__dict__.pop(_HEAD_BY, None)
        return 1

    def construction(self, sub: Substitution) -> list[Scoped]:
        """Every exact ``*ForCausalLM`` of the family constructed inside the block (directly,
        through an ``Auto`` class or ``from_pretrained``) gets the substitution's head when
        its ``__init__`` finishes (``post_init``), before any weight is loaded."""
        from layerswap.patching import wrap

        original = sub.original_class()
        replacement = sub.replacement_class()
        checked: list[bool] = []

        def adopt(wrapped: Callable[..., Any], instance: Any, args: Any, kwargs: Any) -> Any:
            result = wrapped(*args, **kwargs)
            if type(instance) is original:
                if not checked:
                    self.prepare(sub, instance.config, Placement.of(instance))
                    checked.append(True)
                instance.__dict__[_HEAD_BY] = sub.name
                instance.__class__ = replacement
                guard(instance, sub, instance.config, proven=False)
            return result

        return [wrap(hf_internals.POST_INIT_TARGET, adopt)]

    def swapped_by(self, model: nn.Module) -> str | None:
        return head_substitution_of(model)

    def coverage(self, parts: ModelParts) -> tuple[tuple[str, ...], tuple[str, ...]]:
        output = parts.model.get_output_embeddings()  # lm_head, or BioGPT's output_projection
        projection = next(
            (name for name, module in parts.model.named_modules() if module is output), "lm_head"
        )
        head = f"the causal LM's loss and {projection} in training ({type(parts.model).__name__})"
        return (head,), (parts.layers_text, *parts.outside)


SLOT = HeadSlot()
