"""The ``fused`` backend: pure PyTorch, every family, CPU and GPU.

- :mod:`~layerswap.backends.fused.declaration`: what it is, as data (read without torch);
- :mod:`~layerswap.backends.fused.decoder`: its decoder layer, ``FusedDecoderLayer``;
- :mod:`~layerswap.backends.fused.head`: its head, ``FusedHead``;
- :mod:`~layerswap.backends.fused.norm`: its norm (the ``norm`` slot), ``FusedNorm``.

The declaration's and the decoder module's names import from here too, on first use, the
per-family classes included::

    from layerswap.backends.fused import FusedLlamaDecoderLayer, converter_for
"""

from __future__ import annotations

from typing import Any

from layerswap.backends._package import exported


def __getattr__(name: str) -> Any:
    return exported(__name__, name, ("declaration", "decoder"))
