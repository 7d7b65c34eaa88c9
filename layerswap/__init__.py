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
import os as _os
import sys
import types
from typing import TYPE_CHECKING, Any

from layerswap.versions import __version__ as __version__

if TYPE_CHECKING:  # the public API for type checkers; _EXPORTS below for the runtime
    from layerswap import errors as errors
    from layerswap.adoption import Adoption as Adoption
    from layerswap.adoption import adopt as adopt
    from layerswap.adoption import patch_substitution as patch_substitution
    from layerswap.backend import Backend as Backend
    from layerswap.backend import Implementation as Implementation
    from layerswap.backend import Lazy as Lazy
    from layerswap.backend import Variant as Variant
    from layerswap.bench import BenchReport as BenchReport
    from layerswap.bench import bench as bench
    from layerswap.checkpoint import load_checkpoint as load_checkpoint
    from layerswap.coverage import coverage as coverage
    from layerswap.family import Family as Family
    from layerswap.handle import SwapHandle as SwapHandle
    from layerswap.hf_internals import LAYER_CALL_PARAMETERS as LAYER_CALL_PARAMETERS
    from layerswap.hf_internals import LayerCall as LayerCall
    from layerswap.hf_internals import read_layer_call as read_layer_call
    from layerswap.model import decoder_layers as decoder_layers
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
    from layerswap.registry import backends as backends
    from layerswap.registry import families as families
    from layerswap.registry import get as get
    from layerswap.registry import get_backend as get_backend
    from layerswap.registry import get_family as get_family
    from layerswap.registry import register as register
    from layerswap.registry import register_backend as register_backend
    from layerswap.registry import register_family as register_family
    from layerswap.registry import substitutions as substitutions
    from layerswap.slots import Slot as Slot
    from layerswap.slots import get_slot as get_slot
    from layerswap.slots import register_slot as register_slot
    from layerswap.substitution import Substitution as Substitution
    from layerswap.swap import swap as swap
    from layerswap.use import replace_decoder as replace_decoder
    from layerswap.use import use as use
    from layerswap.verify import LayerReport as LayerReport
    from layerswap.verify import Tolerance as Tolerance
    from layerswap.verify import VerificationReport as VerificationReport
    from layerswap.verify import assert_equivalent as assert_equivalent
    from layerswap.verify import verify as verify


#: public name -> the module that defines it, imported on first use (PEP 562), so
#: ``import layerswap`` for the patching engine imports neither torch nor transformers;
#: the ``TYPE_CHECKING`` block above says the same to type checkers (a test keeps the
#: two equal)
_EXPORTS: dict[str, str] = {
    "errors": "layerswap",
    "Adoption": "layerswap.adoption",
    "adopt": "layerswap.adoption",
    "patch_substitution": "layerswap.adoption",
    "Backend": "layerswap.backend",
    "Implementation": "layerswap.backend",
    "Lazy": "layerswap.backend",
    "Variant": "layerswap.backend",
    "BenchReport": "layerswap.bench",
    "bench": "layerswap.bench",
    "load_checkpoint": "layerswap.checkpoint",
    "coverage": "layerswap.coverage",
    "Family": "layerswap.family",
    "SwapHandle": "layerswap.handle",
    "LAYER_CALL_PARAMETERS": "layerswap.hf_internals",
    "LayerCall": "layerswap.hf_internals",
    "read_layer_call": "layerswap.hf_internals",
    "decoder_layers": "layerswap.model",
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
    "backends": "layerswap.registry",
    "families": "layerswap.registry",
    "get": "layerswap.registry",
    "get_backend": "layerswap.registry",
    "get_family": "layerswap.registry",
    "register": "layerswap.registry",
    "register_backend": "layerswap.registry",
    "register_family": "layerswap.registry",
    "substitutions": "layerswap.registry",
    "Slot": "layerswap.slots",
    "get_slot": "layerswap.slots",
    "register_slot": "layerswap.slots",
    "Substitution": "layerswap.substitution",
    "swap": "layerswap.swap",
    "replace_decoder": "layerswap.use",
    "use": "layerswap.use",
    "LayerReport": "layerswap.verify",
    "Tolerance": "layerswap.verify",
    "VerificationReport": "layerswap.verify",
    "assert_equivalent": "layerswap.verify",
    "verify": "layerswap.verify",
}
__all__ = ["__version__", *sorted(_EXPORTS)]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'layerswap' has no attribute {name!r}")
    if module == __name__:  # a submodule given as such (errors)
        value: Any = importlib.import_module(f"{__name__}.{name}")
    else:
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

# a process started by one that called layerswap.distributed.propagate(): apply its
# substitutions here too (each when its modeling module is imported)
if _os.environ.get("LAYERSWAP_SUBSTITUTIONS"):
    from layerswap.distributed import apply_from_environment as _apply_from_environment

    _apply_from_environment()
