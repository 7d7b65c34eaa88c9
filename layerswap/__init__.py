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
import sys
import types
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
    "get_family": "layerswap.substitution",
    "register": "layerswap.substitution",
    "replace_decoder": "layerswap.substitution",
    "substitutions": "layerswap.substitution",
    "use": "layerswap.substitution",
    "SwapHandle": "layerswap.swap",
    "decoder_layers": "layerswap.swap",
    "swap": "layerswap.swap",
    # verification and benchmark
    "LayerReport": "layerswap.verify",
    "Tolerance": "layerswap.verify",
    "VerificationReport": "layerswap.verify",
    "assert_equivalent": "layerswap.verify",
    "verify": "layerswap.verify",
    "BenchReport": "layerswap.bench",
    "bench": "layerswap.bench",
}

__all__ = [
    "BenchReport",
    "Family",
    "LayerReport",
    "Patch",
    "PatchGroup",
    "PatchInfo",
    "Substitution",
    "SwapHandle",
    "Tolerance",
    "VerificationReport",
    "__version__",
    "active_patches",
    "assert_equivalent",
    "bench",
    "decoder_layers",
    "errors",
    "families",
    "get",
    "get_family",
    "patch",
    "patch_dict",
    "patch_many",
    "patches",
    "register",
    "replace_decoder",
    "restore_all",
    "safe_wraps",
    "substitutions",
    "swap",
    "use",
    "verify",
    "wrap",
]

if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs only
    from layerswap import errors as errors
    from layerswap.bench import BenchReport as BenchReport
    from layerswap.bench import bench as bench
    from layerswap.patching import Patch as Patch
    from layerswap.patching import PatchGroup as PatchGroup
    from layerswap.patching import PatchInfo as PatchInfo
    from layerswap.patching import active_patches as active_patches
    from layerswap.patching import patch as patch
    from layerswap.patching import patch_dict as patch_dict
    from layerswap.patching import patch_many as patch_many
    from layerswap.patching import patches as patches
    from layerswap.patching import restore_all as restore_all
    from layerswap.patching import safe_wraps as safe_wraps
    from layerswap.patching import wrap as wrap
    from layerswap.substitution import Family as Family
    from layerswap.substitution import Substitution as Substitution
    from layerswap.substitution import families as families
    from layerswap.substitution import get as get
    from layerswap.substitution import get_family as get_family
    from layerswap.substitution import register as register
    from layerswap.substitution import replace_decoder as replace_decoder
    from layerswap.substitution import substitutions as substitutions
    from layerswap.substitution import use as use
    from layerswap.swap import SwapHandle as SwapHandle
    from layerswap.swap import decoder_layers as decoder_layers
    from layerswap.swap import swap as swap
    from layerswap.verify import LayerReport as LayerReport
    from layerswap.verify import Tolerance as Tolerance
    from layerswap.verify import VerificationReport as VerificationReport
    from layerswap.verify import assert_equivalent as assert_equivalent
    from layerswap.verify import verify as verify


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


class _Package(types.ModuleType):
    """Keeps the public functions ``swap``, ``verify``, ``bench`` and ``families``.

    Each of these names is also a submodule (``layerswap/swap.py`` ...). Importing a
    submodule makes Python bind it as an attribute of this package, which would hide
    the function of the same name: ``layerswap.verify(model, ...)`` would then call a
    module. The submodules stay importable (``from layerswap.verify import Tolerance``)
    through ``sys.modules``; only that attribute binding is skipped.
    """

    def __setattr__(self, name: str, value: Any) -> None:
        if (
            name in _EXPORTS
            and isinstance(value, types.ModuleType)
            and value.__name__ == f"{__name__}.{name}"
        ):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
