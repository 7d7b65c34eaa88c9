"""The ``liger`` backend: Liger-Kernel's Triton kernels in layerswap's decoder layer and
head, GPU only.

- :mod:`~layerswap.backends.liger.declaration`: what it is and the families its layer
  expresses, as data (read without torch);
- :mod:`~layerswap.backends.liger.decoder`: its decoder layer, ``LigerDecoderLayer``;
- :mod:`~layerswap.backends.liger.head`: its head, ``LigerHead``;
- :mod:`~layerswap.backends.liger.norm`: its norm (the ``norm`` slot), ``LigerNorm``;
- :mod:`~layerswap.backends.liger.runtime`: what it needs at run time.

The declaration's, the runtime's and the decoder module's names import from here too, on
first use, the per-family classes included::

    from layerswap.backends import liger

    liger.unsupported(layerswap.get_family("gemma2"))   # "... soft-capping ..."
    liger.LigerQwen3DecoderLayer
"""

from __future__ import annotations

from typing import Any

from layerswap.backends._package import exported


def __getattr__(name: str) -> Any:
    return exported(__name__, name, ("declaration", "runtime", "decoder"))
