"""What a swap hands back: what was swapped, and the way back.

:class:`SwapHandle` is what every slot's swap returns: the decoder slot's
(:class:`layerswap.slots.decoder.LayerSwapHandle`, layer by layer) and the head slot's
(:class:`layerswap.slots.head.HeadSwapHandle`, a class swap). Each says what it swapped and
how to undo it; being a context manager, undoing on exit, is shared here.
"""

from __future__ import annotations

from layerswap.substitution import SwapHandle

__all__ = ["SwapHandle"]
