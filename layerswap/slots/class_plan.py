"""A class swap's plan and its handle: the modules one swap of a class-swapping slot
changes and keeps (:class:`ClassPlan`), and the swap in effect (:class:`ClassSwapHandle`),
whose ``undo()`` sets every class back.

The slots themselves (:class:`~layerswap.slots.class_swap.ClassSwapSlot`) make the plan
and apply it under :data:`SWAP_LOCK`, which an undo holds too.
"""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from torch import nn

from layerswap.backends.class_swap import ClassReplacement
from layerswap.errors import SubstitutionError
from layerswap.handle import SwapHandle
from layerswap.patching.undo import UndoLog

if TYPE_CHECKING:
    from layerswap.substitution import Substitution

__all__ = ["SWAP_LOCK", "ClassPlan", "ClassSwapHandle", "SlotWords", "kept_text"]

#: held while a swap checks a model and changes its classes, and while one is undone
SWAP_LOCK = threading.RLock()


class SlotWords(Protocol):
    """What a handle's report asks of its slot: how it names what it swaps."""

    @property
    def name(self) -> str: ...

    @property
    def noun(self) -> str: ...

    @property
    def plural(self) -> str: ...

    def spec_label(self, spec: Any) -> str: ...


@dataclass
class ClassPlan:
    """What a swap of ``sub`` does to one model: the modules it swaps, and those it keeps."""

    #: (qualified name, module, the class it gets)
    swapped: list[tuple[str, nn.Module, type[ClassReplacement]]]
    #: original class name -> (how many, why it stays)
    kept: dict[str, tuple[int, str]]
    #: (qualified name, the substitution that swapped it): modules another swap holds
    taken: list[tuple[str, str]]
    #: (qualified name, the substitution that swapped it): modules another slot's class
    #: swap holds (kept, with the reason; inside ``use()`` the two requests are refused)
    clashing: list[tuple[str, str]] = dataclasses.field(default_factory=list)


def kept_text(plan: ClassPlan) -> str:
    return "; ".join(
        f"{name} x{count} ({reason})" if count > 1 else f"{name} ({reason})"
        for name, (count, reason) in plan.kept.items()
    )


class ClassSwapHandle(SwapHandle):
    """A class swap in effect; ``undo()`` sets every swapped module's class back."""

    def __init__(
        self,
        model: nn.Module,
        substitution: Substitution,
        plan: ClassPlan,
        changes: UndoLog,
        slot: SlotWords,
    ) -> None:
        self.model = model
        self.substitution = substitution
        self._plan = plan
        self._changes = changes
        self._slot = slot
        self._active = True

    @property
    def swapped(self) -> list[tuple[str, type[nn.Module], type[nn.Module]]]:
        """(qualified name, original class, replacement class) per swapped module."""
        return [(name, made._layerswap_original, made) for name, _, made in self._plan.swapped]

    @property
    def kept(self) -> dict[str, tuple[int, str]]:
        """The candidate classes left the original's: name -> (how many, why)."""
        return dict(self._plan.kept)

    def undo(self) -> None:
        """Put every original class back (a no-op when already undone)."""
        with SWAP_LOCK:
            if not self._active:
                return
            # each swapped module, and those inside it whose class its swap set (the
            # qkv slot's packed projections): all checked before anything is undone
            changed: list[tuple[str, nn.Module, type]] = []
            for name, module, made in self._plan.swapped:
                changed.append((name, module, made))
                if isinstance(module, ClassReplacement):
                    changed += [
                        (f"{name}.{inner}", member, cls)
                        for inner, (member, cls) in module._layerswap_members().items()
                    ]
            for name, module, made in changed:
                refused = _undo_refusal(name, module, made)
                if refused is not None:
                    raise SubstitutionError(f"cannot undo {self.substitution.name}: {refused}")
            for _, module, _ in changed:
                # what removing accelerate's hooks leaves: the class's own forward, bound on
                # the instance; the class set back, it would call the replacement's
                if "forward" in vars(module):
                    del module.__dict__["forward"]
            self._changes.undo()
            self._active = False
            self._undo_copies(changed)

    def _undo_copies(self, changed: list[tuple[str, nn.Module, type]]) -> None:
        """Give copies of swapped modules made since the swap (PEFT's ``modules_to_save``
        deep-copies a module into the model) their original class back too: of a swapped
        module, or of one inside it (a packed projection, which detaches itself)."""
        made = {cls for _, _, cls in self._plan.swapped}
        inner = {cls for _, _, cls in changed} - made
        undone = {id(module) for _, module, _ in changed}
        for module in self.model.modules():
            if id(module) in undone:
                continue
            replaced: Any = module
            if type(module) in made:
                replaced._layerswap_detach()
                replaced.__class__ = replaced._layerswap_original
            elif type(module) in inner:
                replaced._layerswap_detach()

    def report(self) -> str:
        """A readable summary: the modules swapped (per class and kind) and those kept."""
        state = "active" if self._active else "undone"
        per_class: dict[str, list[str]] = {}
        for _, _, made in self._plan.swapped:
            kinds = per_class.setdefault(made._layerswap_original.__name__, [])
            label = self._slot.spec_label(made._layerswap_spec)
            if label not in kinds:
                kinds.append(label)
        kind = self._slot.noun if len(self) == 1 else self._slot.plural
        lines = [f"{self.substitution.name}: {len(self)} {kind} swapped ({state})"]
        lines += [f"  {name} -> {', '.join(kinds)}" for name, kinds in per_class.items()]
        if self._plan.kept:
            lines.append(f"  kept: {kept_text(self._plan)}")
        return "\n".join(lines)

    def __len__(self) -> int:
        return len(self._plan.swapped)

    def __repr__(self) -> str:
        state = "active" if self._active else "undone"
        return (
            f"<{type(self).__name__} {self.substitution.name}: {len(self)} "
            f"{self._slot.plural}, {state}>"
        )


def _undo_refusal(name: str, module: nn.Module, made: type) -> str | None:
    """Why ``module`` (``name``), given class ``made`` by a swap, cannot be given its
    original class back now: its class or its ``forward`` changed since."""
    if type(module) is not made:
        return (
            f"{name} is now a {type(module).__qualname__}, not {made.__qualname__} (changed "
            "since: a parametrization registered on it, or another class set; take that "
            "back first, e.g. torch.nn.utils.parametrize.remove_parametrizations); nothing "
            "was undone"
        )
    if "forward" in vars(module) and not _own_forward_bound(module):
        # set since the swap (a module holding one is not swapped): it calls the
        # replacement's forward, which the original class does not have
        return (
            f"{name}'s forward was set on the instance since the swap (accelerate's hooks: "
            "dispatch_model, cpu_offload), and calls the replacement's; remove the hooks "
            "first (accelerate.hooks.remove_hook_from_module(model, recurse=True)), undo, "
            "then add them again; nothing was undone"
        )
    return None


def _own_forward_bound(module: nn.Module) -> bool:
    """Whether the ``forward`` set on ``module`` is its class's own, bound to it."""
    found = vars(module)["forward"]
    return getattr(found, "__self__", None) is module and getattr(
        found, "__func__", None
    ) is getattr(type(module), "forward", None)
