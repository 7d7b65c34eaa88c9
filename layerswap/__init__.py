"""layerswap: put faster layers into transformers models, safely and checkably.

The public API lives here and nowhere else. Names are imported lazily (PEP 562),
so ``import layerswap`` for the patching engine does not import torch or
transformers until a name that needs them is used.

Example::

    import layerswap
    from transformers import LlamaConfig, LlamaForCausalLM

    with layerswap.use("llama.decoder.fused"):
        model = LlamaForCausalLM(LlamaConfig(num_hidden_layers=2))
    report = layerswap.verify(model, "llama.decoder.fused")
    assert report.passed
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS: dict[str, str] = {
    # the patching engine
    "Patch": "layerswap.patching",
    "PatchGroup": "layerswap.patching",
    "PatchInfo": "layerswap.patching",
    "active_patches": "layerswap.patching",
    "patch": "layerswap.patching",
    "patch_dict": "layerswap.patching",
    "patch_many": "layerswap.patching",
    "patches": "layerswap.patching",
    "restore_all": "layerswap.patching",
    "safe_wraps": "layerswap.patching",
    "wrap": "layerswap.patching",
    # substitutions
    "Family": "layerswap.substitution",
    "Substitution": "layerswap.substitution",
    "families": "layerswap.substitution",
    "get": "layerswap.substitution",
    "register": "layerswap.substitution",
    "substitutions": "layerswap.substitution",
    "use": "layerswap.substitution",
    "replace_decoder": "layerswap.substitution",
    "SwapHandle": "layerswap.swap",
    "swap": "layerswap.swap",
    # verification and benchmark
    "LayerReport": "layerswap.verify",
    "VerificationReport": "layerswap.verify",
    "assert_equivalent": "layerswap.verify",
    "verify": "layerswap.verify",
    "BenchReport": "layerswap.bench",
    "bench": "layerswap.bench",
}

__all__ = [*sorted(_EXPORTS), "__version__", "errors"]

if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs only
    from layerswap import errors
    from layerswap.patching import (
        Patch,
        PatchGroup,
        PatchInfo,
        active_patches,
        patch,
        patch_dict,
        patch_many,
        patches,
        restore_all,
        safe_wraps,
        wrap,
    )


def __getattr__(name: str) -> Any:
    if name == "errors":
        return importlib.import_module("layerswap.errors")
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'layerswap' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
