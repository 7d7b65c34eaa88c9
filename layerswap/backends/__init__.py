"""The builtin backends, one module each with its declaration (``BACKEND``).

A backend module declares a :class:`~layerswap.backend.Backend` named ``BACKEND``: its
implementation per slot, converter, requirement, the families it supports and its
variants. The registry imports this package's public modules (:func:`builtin_modules`)
by name when first used and registers each ``BACKEND`` it finds, exactly as it loads a third-party backend from the
``layerswap.backends`` entry-point group; importing a backend module must not need its
optional dependencies (those are its ``requirement``).

Every builtin backend's decoder layer derives from ``_layer.DecoderLayer``, which holds the
transformers decoder-layer contract (forward signature, residual structure, cache update,
``extra_repr``); a backend supplies only its attention and feed-forward. Its head derives
from ``head.CausalLMHead``.
"""

from __future__ import annotations

import pkgutil

__all__ = ["builtin_modules"]


def builtin_modules() -> tuple[str, ...]:
    """The public modules of this package, by name: those holding a ``BACKEND`` are the
    builtin backends (adding one is adding its module, no list to edit)."""
    return tuple(
        f"{__name__}.{module.name}"
        for module in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name)
        if not module.name.startswith("_")
    )
