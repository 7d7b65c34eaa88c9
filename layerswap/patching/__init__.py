"""The patching engine: scoped, exception-safe, nestable, thread-safe replacement.

One module per concern: ``target`` (resolving names), ``sites`` (where a value
really lives), ``stack`` (layered stacks per site), ``scoped`` (the start/stop
contract and the registry of live patches), ``patch``, ``dicts``, ``group``,
``wrap``, ``context`` (``scope="context"``) and ``wraps`` (``safe_wraps``).
"""

from __future__ import annotations

from layerswap.patching.dicts import DictPatch, patch_dict
from layerswap.patching.group import PatchGroup, patch_many, patches
from layerswap.patching.patch import Patch, patch
from layerswap.patching.scoped import Origin, PatchInfo, Scoped, active_patches, restore_all
from layerswap.patching.sites import NOTSET
from layerswap.patching.stack import rebases, unpatched
from layerswap.patching.wrap import wrap
from layerswap.patching.wraps import safe_update_wrapper, safe_wraps

__all__ = [
    "NOTSET",
    "DictPatch",
    "Origin",
    "Patch",
    "PatchGroup",
    "PatchInfo",
    "Scoped",
    "active_patches",
    "patch",
    "patch_dict",
    "patch_many",
    "patches",
    "restore_all",
    "safe_update_wrapper",
    "safe_wraps",
    "rebases",
    "unpatched",
    "wrap",
]
