"""The ``te`` backend: NVIDIA TransformerEngine decoder layers, BF16 and FP8, GPU only.

- :mod:`~layerswap.backends.te.declaration`: what it is and the families TransformerEngine
  expresses, as data (read without torch);
- :mod:`~layerswap.backends.te.decoder`: its decoder layer, ``TEDecoderLayer``;
- :mod:`~layerswap.backends.te.layout`: where the original's tensors live in it
  (``te_converter``, ``TELayerSpec``), needing neither TransformerEngine nor a GPU;
- :mod:`~layerswap.backends.te.norm`: TE's RMSNorm kernel on a model's own norms
  (``TENorm``, the ``norm`` slot);
- :mod:`~layerswap.backends.te.qkv`: each attention's packed projections as one TE
  ``Linear`` GEMM on the model's own weights (``TEProjections``, the ``qkv`` slot);
- :mod:`~layerswap.backends.te.runtime`: what it needs at run time, and FP8 recipes.

The declaration's, the runtime's and the decoder module's names import from here too, on
first use, the per-family classes included::

    from layerswap.backends import te

    with te.fp8_autocast("current"):
        logits = model(input_ids, use_cache=False).logits
"""

from __future__ import annotations

from typing import Any

from layerswap.backends._package import exported


def __getattr__(name: str) -> Any:
    return exported(__name__, name, ("declaration", "runtime", "decoder"))
