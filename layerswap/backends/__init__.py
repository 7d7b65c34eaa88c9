"""The builtin backends: one package each, ``layerswap.backends.<name>``.

A backend's package holds its ``declaration`` (a :class:`~layerswap.backend.Backend`
named ``BACKEND``: its implementation per slot, converter, requirement, the families it
expresses as a table of :class:`~layerswap.capabilities.Capability` rows, its variants;
data, read without importing torch or transformers), its layers (``decoder``, ``head``)
and what it needs at run time (``runtime``). The registry imports the declarations by
name when first used (:func:`builtin_modules`) and registers each ``BACKEND`` it finds,
exactly as it loads a third-party backend from the ``layerswap.backends`` entry-point
group. The layers are imported when a substitution is made; importing one does not need
its optional dependencies (those are its ``requirement``).

Every builtin backend's decoder layer derives from ``_layer.DecoderLayer``, which holds the
transformers decoder-layer contract (forward signature, residual structure, cache update,
``extra_repr``); a backend supplies only its attention and feed-forward. Its head derives
from ``head.CausalLMHead``. What they share stays here: ``_layer``, ``_original``, ``norm`` (the norm slot's base),
``_runtime``, ``head``, ``per_family`` and ``declarations.head_slot``.

Adding a builtin backend is adding its package here, with a ``declaration`` module.
"""

from __future__ import annotations

import pkgutil
from pathlib import Path

__all__ = ["builtin_modules"]


def builtin_modules() -> tuple[str, ...]:
    """The builtin backends' declaration modules, by name: ``<package>.declaration`` for
    each package here that has one (no list to edit).

    Example::

        builtin_modules()   # ("layerswap.backends.fused.declaration", ...)
    """
    return tuple(
        f"{__name__}.{package.name}.declaration"
        for package in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name)
        if package.ispkg
        and not package.name.startswith("_")
        and any(
            module.name == "declaration"
            for module in pkgutil.iter_modules([str(Path(__path__[0]) / package.name)])
        )
    )
