"""Builtin model families, one short declaration each.

A family says where transformers keeps its classes and which structural features
it has; every backend builds its replacement from that. See ``docs/substitutions.md``
for adding one.
"""

from __future__ import annotations

from layerswap.families.gemma import FAMILY as GEMMA
from layerswap.families.llama import FAMILY as LLAMA
from layerswap.families.mistral import FAMILY as MISTRAL
from layerswap.families.qwen2 import FAMILY as QWEN2
from layerswap.families.qwen3 import FAMILY as QWEN3

__all__ = ["BUILTIN_FAMILIES", "GEMMA", "LLAMA", "MISTRAL", "QWEN2", "QWEN3"]

BUILTIN_FAMILIES = (LLAMA, MISTRAL, QWEN2, QWEN3, GEMMA)
