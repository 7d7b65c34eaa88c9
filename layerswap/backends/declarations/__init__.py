"""The builtin backends, declared: one module each, holding its ``BACKEND``.

A declaration is data: the slots a backend fills, the families it supports and why not,
what it needs installed, its variants. It names its layers, converters and contexts by
``"module:function"`` (:class:`~layerswap.backend.Lazy`), so reading it imports neither
torch nor transformers nor the layers: the registry, ``layerswap list`` and an
unknown-name error read every declaration and import none of them. The layers live in
``layerswap.backends.<name>`` (and ``head_<name>``), imported when a substitution is
made.

Adding a backend is adding its declaration here and its layers beside this package; the
registry finds the declarations by listing this package's public modules.
"""

from __future__ import annotations

import pkgutil

__all__ = ["builtin_modules"]


def builtin_modules() -> tuple[str, ...]:
    """The builtin declaration modules, by name (no list to edit)."""
    return tuple(
        f"{__name__}.{module.name}"
        for module in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name)
        if not module.name.startswith("_")
    )
