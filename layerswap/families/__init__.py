"""Builtin model families, one short declaration each.

A family says where transformers keeps its classes and which structural features
it has; every backend builds its replacement from that. See ``docs/substitutions.md``
for adding one.
"""

from __future__ import annotations

import sys
import types
from typing import TYPE_CHECKING

from layerswap.families.gemma import FAMILY as GEMMA
from layerswap.families.llama import FAMILY as LLAMA
from layerswap.families.mistral import FAMILY as MISTRAL
from layerswap.families.qwen2 import FAMILY as QWEN2
from layerswap.families.qwen3 import FAMILY as QWEN3

if TYPE_CHECKING:
    from layerswap.substitution import Family

__all__ = ["BUILTIN_FAMILIES", "GEMMA", "LLAMA", "MISTRAL", "QWEN2", "QWEN3"]

BUILTIN_FAMILIES = (LLAMA, MISTRAL, QWEN2, QWEN3, GEMMA)


class _CallableModule(types.ModuleType):
    """This package, callable as :func:`layerswap.families`.

    ``layerswap.families`` is both the public function and this package's name; once
    the package is imported, Python binds the package attribute to it, shadowing the
    function. Calling the package keeps ``layerswap.families()`` working either way.
    """

    def __call__(self) -> dict[str, Family]:
        from layerswap.substitution import families

        return families()


sys.modules[__name__].__class__ = _CallableModule
