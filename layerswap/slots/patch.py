"""The ``patch`` slot: another library's patch function, adopted as a substitution.

A substitution of this slot (made by :func:`layerswap.adoption.patch_substitution`) names
a patch function, ``"package.module:function"``, and the keyword arguments it is called
with (its variant's options). What it replaces is what the function rebinds: the modules
and functions of transformers' modeling code, and, given a model, that model's modules.
Every use goes through :func:`layerswap.adopt`, so the changes are recorded, proven
against the original code and taken back object for object:

* ``swap(model, sub)``: :meth:`PatchSlot.prepare` proves the function on a tiny model of
  the model's config, then the function is adopted with the model (``model=``, Liger's
  convention, where the function takes it); the :class:`PatchSwapHandle` undoes it;
* ``use(sub)``: the function adopted (proven on the family's tiny config) for the
  block (:class:`PatchUse`), so that models built inside are patched; transformers is as
  before when the block ends, also if it raised;
* :func:`layerswap.verify`: the working copy is patched, and every pass of the reference
  after that runs with the patch suspended (:meth:`PatchSwapHandle.original_code`); the
  patch is undone when the comparison ends (:meth:`PatchSwapHandle.release`).

The weights keep their names (the converter is the identity). A model patched by a swap,
or built inside ``use()``, carries the substitution's name (:data:`PATCHED_BY`), which
:meth:`PatchSlot.swapped_by` reads.

Example::

    sub = layerswap.register(patch_substitution(apply_fast_norm, "llama", name="llama.patch.mine"))
    with layerswap.swap(model, "llama.patch.mine") as handle:
        print(handle.report())
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

from torch import nn

from layerswap import hf_internals
from layerswap.adoption.adopting import Adoption, adopt
from layerswap.adoption.changes import ClassChange, Rebinding
from layerswap.errors import RequirementError, SubstitutionError
from layerswap.family import resolve
from layerswap.handle import SwapHandle
from layerswap.patching import Scoped, wrap
from layerswap.patching.undo import UndoLog
from layerswap.proof import proving
from layerswap.slots import ModelParts, Slot

if TYPE_CHECKING:
    from transformers import PreTrainedConfig

    from layerswap.family import Family
    from layerswap.placement import Placement
    from layerswap.substitution import Substitution

__all__ = [
    "PATCHED_BY",
    "SLOT",
    "PatchSlot",
    "PatchSwapHandle",
    "PatchUse",
    "patch_function",
    "patch_options",
    "patched_by",
]

#: the attribute a model patched by a substitution of this slot holds: the substitution's name
PATCHED_BY = "_layerswap_patched_by"


def patch_function(sub: Substitution) -> Callable[..., Any]:
    """The patch function ``sub`` names (``"package.module:function"``), imported.

    Raises :class:`~layerswap.errors.RequirementError` where it cannot be imported here.
    """
    if not isinstance(sub.replacement, str):
        raise SubstitutionError(
            f"{sub.name} is a patch substitution: its replacement names the patch function "
            f"as 'package.module:function', not {sub.replacement!r}"
        )
    try:
        found = resolve(sub.replacement)
    except (ImportError, AttributeError) as exc:
        raise RequirementError(
            f"{sub.name} cannot run here: {sub.replacement} cannot be imported ({exc})"
        ) from exc
    if not callable(found):
        raise SubstitutionError(f"{sub.name}: {sub.replacement} is not a function")
    return found  # type: ignore[no-any-return]


def patch_options(sub: Substitution) -> dict[str, Any]:
    """The keyword arguments ``sub`` calls its patch function with (its variant's options)."""
    return dict(sub.variant.options) if sub.variant is not None else {}


def patched_by(model: nn.Module) -> str | None:
    """The name of the patch substitution ``model`` was patched by, or built under, else ``None``."""
    name = getattr(model, "__dict__", {}).get(PATCHED_BY)
    return name if isinstance(name, str) else None


def _takes_model(function: Callable[..., Any]) -> bool:
    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: Liger's convention
        return True
    return any(p.name == "model" or p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)


class PatchSwapHandle(SwapHandle):
    """A patch function adopted with a model: ``undo()`` takes every change back (the
    adoption's :meth:`~layerswap.adoption.Adoption.undo`) and the model's mark.

    ``swapped`` lists the classes it changed: a class rebound in a module, a module of the
    model given another class; :attr:`adoption` reports every change.
    """

    def __init__(
        self, model: nn.Module, substitution: Substitution, adoption: Adoption, mark: UndoLog
    ) -> None:
        self.model = model
        self.substitution = substitution
        self._adoption = adoption
        self._mark = mark
        self._active = True

    @property
    def adoption(self) -> Adoption:
        """The adoption: its changes, its report, :meth:`~layerswap.adoption.Adoption.verify`."""
        return self._adoption

    @property
    def swapped(self) -> list[tuple[str, type[nn.Module], type[nn.Module]]]:
        """(where, class before, class after) per class the patch changed."""
        rows: list[tuple[str, type[nn.Module], type[nn.Module]]] = []
        for change in self._adoption.records:
            if not isinstance(change, (ClassChange, Rebinding)):
                continue
            if isinstance(change.old, type) and isinstance(change.new, type):
                rows.append((change.where, change.old, change.new))
        return rows

    def undo(self) -> None:
        """Take every change of the patch function back (a no-op when already undone)."""
        if not self._active:
            return
        try:
            self._adoption.undo()
        finally:
            self._mark.undo()
            self._active = False

    def original_code(self) -> AbstractContextManager[Any]:
        """Inside, the patch is suspended: the original code runs (the changes taken back,
        made again on exit)."""
        return self._adoption.suspended()

    def release(self) -> None:
        """The patch changes code every model runs: undone with the model it was made on."""
        self.undo()

    def report(self) -> str:
        """The substitution, and every change the patch function made."""
        return f"{self.substitution.name}: {self._adoption.report()}"

    def __repr__(self) -> str:
        state = "active" if self._active else "undone"
        count = len(self._adoption.changes)
        return f"<PatchSwapHandle {self.substitution.name}: {count} changes, {state}>"


class PatchUse(Scoped):
    """The patch function adopted while started (what :func:`layerswap.use` starts), proven
    on the family's tiny config; stopping undoes it."""

    def __init__(self, substitution: Substitution) -> None:
        self.substitution = substitution
        self._adoption: Adoption | None = None

    @property
    def adoption(self) -> Adoption | None:
        """The adoption while started, else ``None``."""
        return self._adoption

    def _apply(self) -> None:
        sub = self.substitution
        # adopt takes back what it changed when it raises: nothing is left to stop
        if proving():
            self._adoption = adopt(patch_function(sub), prove=False, **patch_options(sub))
        else:
            tiny = sub.parts.family.tiny_config()
            self._adoption = adopt(
                patch_function(sub), config=tiny, prove=True, **patch_options(sub)
            )

    def _revert(self) -> None:
        adoption, self._adoption = self._adoption, None
        if adoption is not None:
            adoption.undo()

    def _copy(self) -> PatchUse:
        return PatchUse(self.substitution)

    def _label(self) -> str:
        return f"adopt({self.substitution.replacement})"

    def _new_text(self) -> str:
        return self.substitution.name


class PatchSlot(Slot):
    """What a patch function rebinds: a substitution adopts the function (:func:`layerswap.adopt`)."""

    name = "patch"
    description = "the modules and functions a patch function rebinds"

    def original(self, family: Family) -> str:
        return f"{family.module}:{family.causal_lm}"

    def swap(self, model: nn.Module, sub: Substitution) -> PatchSwapHandle:
        """Prove ``sub``'s function on a tiny model of ``model``'s config, then adopt it with
        ``model`` (passed as ``model=`` where the function takes it)."""
        config = getattr(model, "config", None)
        if config is None:
            raise SubstitutionError(f"{type(model).__name__} has no config; swap() needs one")
        current = patched_by(model)
        if current is not None:
            raise SubstitutionError(
                f"this {type(model).__name__} is already patched by {current}; undo that first"
            )
        self.prepare(sub, config)  # a wrong patch is refused here, naming the first layer
        function, options = patch_function(sub), patch_options(sub)
        if _takes_model(function):
            # proven again on a tiny copy, where the function changes the model it is given
            prove = False if proving() else None
            adoption = adopt(function, model=model, prove=prove, **options)
        else:
            adoption = adopt(function, prove=False, **options)  # proven by prepare
        mark = UndoLog()
        try:
            mark.set_attribute(model, PATCHED_BY, sub.name)
        except BaseException:
            adoption.undo()
            raise
        return PatchSwapHandle(model, sub, adoption, mark)

    def rebuild_originals(self, model: nn.Module, sub: Substitution) -> int:
        """Nothing to rebuild (0) for a model the patch did not touch; refused for one it
        did: the original code's modules cannot be made from the patch's."""
        current = patched_by(model)
        if current is None:
            return 0
        raise SubstitutionError(
            f"this {type(model).__name__} was patched by {current} (built inside use(), or "
            "swapped): its modules are the patch's, and the original ones cannot be rebuilt "
            "from them. Verify a model built without the patch (verify patches a copy of it), "
            "or the swap's handle: handle.adoption.verify(model)"
        )

    def construction(self, sub: Substitution) -> list[Scoped]:
        """The function adopted for the block (proven when it starts), and each model of the
        family built inside marked as patched by ``sub``."""
        family_module = sub.parts.family.module

        def mark(wrapped: Callable[..., Any], instance: Any, args: Any, kwargs: Any) -> Any:
            result = wrapped(*args, **kwargs)
            if type(instance).__module__ == family_module:
                instance.__dict__[PATCHED_BY] = sub.name
            return result

        return [PatchUse(sub), wrap(hf_internals.POST_INIT_TARGET, mark)]

    def swapped_by(self, model: nn.Module) -> str | None:
        return patched_by(model)

    def prepare(
        self, sub: Substitution, config: PreTrainedConfig, placement: Placement | None = None
    ) -> None:
        """The upstream checks, then the function adopted on a tiny model of ``config``
        (:func:`layerswap.adopt` with ``prove=True``) and undone: a patch that changes the
        numbers raises :class:`~layerswap.errors.PatchDivergenceError` naming the first
        divergent decoder layer. Inside a comparison that is itself the proof
        (:func:`layerswap.proof.comparing`), nothing is proven. The adoption proof runs
        in float32 on the CPU wherever the model computes (``placement``)."""
        super().prepare(sub, config)
        if proving():
            return
        text = hf_internals.text_config_of(config)
        adopt(patch_function(sub), config=text, prove=True, **patch_options(sub)).undo()

    def coverage(self, parts: ModelParts) -> tuple[tuple[str, ...], tuple[str, ...]]:
        return ("the modules and functions the patch rebinds",), ()


SLOT = PatchSlot()
