"""A builtin backend's package: the names of its modules, imported when first asked for.

Each builtin backend is a package, ``layerswap.backends.<name>``: its ``declaration``
(data, read by the registry without torch or transformers), its layers (``decoder``,
``head``) and what it needs at run time (``runtime``). Reading the declaration runs the
package's ``__init__``, so that imports nothing of the rest; a name asked of the package
itself (``fused.FusedDecoderLayer``, a per-family ``fused.FusedLlamaDecoderLayer``) is
looked up in its modules then, by its ``__getattr__``::

    def __getattr__(name: str) -> Any:
        return exported(__name__, name, ("declaration", "decoder"))
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Sequence
from typing import Any

__all__ = ["exported"]


def exported(package: str, name: str, modules: Sequence[str]) -> Any:
    """``package``'s submodule called ``name``, else ``name`` from the first of ``modules``
    (relative names) that defines it; the last is asked with ``getattr``, so its own
    ``__getattr__`` answers too (a decoder module makes its per-family classes on demand).

    Raises :class:`AttributeError` as a module does when none has it.
    """
    if name.startswith("__"):  # never import the layers for a module protocol's probe
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    if importlib.util.find_spec(f"{package}.{name}") is not None:
        return importlib.import_module(f"{package}.{name}")
    *first, last = modules
    for module in first:
        found = vars(importlib.import_module(f"{package}.{module}"))
        if name in found:
            return found[name]
    return getattr(importlib.import_module(f"{package}.{last}"), name)
