"""What a decoder-slot swap hands back: a record per swapped layer, and the handle that
says what was swapped and puts the original layers back (:mod:`layerswap.slots.decoder`
makes both).

Example::

    handle = layerswap.swap(model, "llama.decoder.fused")   # a LayerSwapHandle
    handle.swapped[0]   # ("model.layers.0", LlamaDecoderLayer, FusedLlamaDecoderLayer)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch import nn

from layerswap.errors import SubstitutionError
from layerswap.handle import SwapHandle

if TYPE_CHECKING:
    from layerswap.patching.undo import UndoLog
    from layerswap.substitution import Substitution

__all__ = ["LayerRecord", "LayerSwapHandle"]


@dataclass
class LayerRecord:
    """One swapped layer: where it sits, the original kept for undo, and the hidden-state
    capture transformers had on its owner when it was swapped."""

    name: str
    parent: nn.Module
    key: str
    original: nn.Module
    replacement: nn.Module | None  # None once undone (its storage is released)
    replacement_cls: type[nn.Module]
    owner: nn.Module | None  # the PreTrainedModel whose forward records hidden states
    name_in_owner: str
    capture_installed: bool  # whether transformers had hooked the owner at swap time


class LayerSwapHandle(SwapHandle):
    """A decoder-slot swap in effect: the swapped layers, and the way back.

    ``undo()`` puts the original layer objects back and converts the weights back
    into their own ``Parameter`` objects (bitwise); a second ``undo()`` does
    nothing. As a context manager the swap is undone on exit, on any exception too.

    Example::

        with layerswap.swap(model, backend="fused") as handle:
            print(handle.report())
    """

    def __init__(
        self,
        model: nn.Module,
        substitution: Substitution,
        records: list[LayerRecord],
        changes: UndoLog,
    ) -> None:
        self.model = model
        self.substitution = substitution
        self._records = records
        self._changes = changes
        self._active = True

    @property
    def swapped(self) -> list[tuple[str, type[nn.Module], type[nn.Module]]]:
        """(qualified module name, original class, replacement class) per swapped layer."""
        return [
            (record.name, type(record.original), record.replacement_cls) for record in self._records
        ]

    def undo(self) -> None:
        """Put the original layers and weights back (a no-op when already undone)."""
        if not self._active:
            return
        pending = [record for record in self._records if record.replacement is not None]
        for record in pending:
            if record.parent._modules.get(record.key) is not record.replacement:
                raise SubstitutionError(
                    f"cannot undo {self.substitution.name}: layer {record.name!r} is no longer "
                    f"the swapped {record.replacement_cls.__name__} (it was replaced since)"
                )
        # layer by layer, releasing each replacement: memory stays near one extra layer
        self._changes.undo()
        self._active = False

    def report(self) -> str:
        """A readable summary: the substitution and every swapped layer."""
        state = "active" if self._active else "undone"
        lines = [f"{self.substitution.name}: {len(self._records)} layers swapped ({state})"]
        width = max((len(record.name) for record in self._records), default=0)
        for name, original, replacement in self.swapped:
            lines.append(f"  {name:<{width}}  {original.__name__} -> {replacement.__name__}")
        return "\n".join(lines)

    def __len__(self) -> int:
        return len(self._records)

    def __repr__(self) -> str:
        state = "active" if self._active else "undone"
        return f"<SwapHandle {self.substitution.name}: {len(self._records)} layers, {state}>"
