"""What a swap hands back: what was swapped, and the way back.

:class:`SwapHandle` is what every slot's swap returns: the decoder slot's
(:class:`layerswap.slots.decoder.LayerSwapHandle`, layer by layer) and the head slot's
(:class:`layerswap.slots.head.HeadSwapHandle`, a class swap). Each says what it swapped and
how to undo it; being a context manager, undoing on exit, is shared here.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from types import TracebackType

    from torch import nn

    from layerswap.substitution import Substitution

__all__ = ["SwapHandle"]


class SwapHandle:
    """A swap in effect: what was swapped, and the way back.

    ``undo()`` puts the originals back; a second ``undo()`` does nothing. As a context
    manager the swap is undone on exit, on any exception too.

    Example::

        with layerswap.swap(model, backend="fused") as handle:
            print(handle.report())
    """

    model: nn.Module
    substitution: Substitution
    _active: bool

    @property
    def active(self) -> bool:
        """Whether the swap is still in effect."""
        return self._active

    @property
    def swapped(self) -> list[tuple[str, type[nn.Module], type[nn.Module]]]:
        """(qualified module name, original class, replacement class) per swapped module."""
        raise NotImplementedError

    def undo(self) -> None:
        """Put the originals back (a no-op when already undone)."""
        raise NotImplementedError

    def report(self) -> str:
        """A readable summary: the substitution and what it swapped."""
        raise NotImplementedError

    def __iter__(self) -> Iterator[tuple[str, type[nn.Module], type[nn.Module]]]:
        return iter(self.swapped)

    def __len__(self) -> int:
        return len(self.swapped)

    def __enter__(self) -> SwapHandle:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.undo()
