"""Saving a state dict whose tensors are slices of one storage: every slice written whole.

The ``qkv`` slot packs an attention's q/k/v weights into one tensor, and each projection's
``Parameter`` becomes a slice of it (:mod:`layerswap.backends.projections`): ``state_dict``
gives the original names and values, but the tensors share one storage. Savers that look
for tensor aliasing by storage take such slices for tied weights:

- accelerate's ``clean_state_dict_for_safetensors`` (``Accelerator.save_model`` and
  ``save_state``) keeps one tensor per storage and drops the others with a log line: a
  checkpoint without ``k_proj``/``v_proj``, which loads with those freshly initialised;
- safetensors' ``save_model``/``load_model`` and huggingface_hub's ``save_torch_model``/
  ``save_torch_state_dict`` (``_remove_duplicate_names``) refuse, since no slice covers
  the storage.

So these functions get the state dict with the slices that share a storage without
overlapping (:func:`separated`) as tensors of their own: copies, so what is written is the
original's layout, tensor for tensor. One tensor under two names (tied weights, an
attention module shared by two layers) stays one tensor, deduplicated as before.
``state_dict()`` itself is unchanged: its tensors still alias the parameters, so what
writes through them in place (an EMA's ``copy_``) still reaches the model.

The advice is armed (:func:`arm`) when a group is packed or a packed group is copied or
unpickled: slices outlive the swap that made them (a state dict taken before ``undo()``, a
model given them with ``load_state_dict(assign=True)``, a model ``torch.load`` brought from
another process), and for a state dict without such slices it changes nothing.
``layerswap.active_patches()`` lists it; ``restore_all()`` leaves it on while a packed
storage made in this process lives (for good once a packed group was copied or unpickled:
its storages are not known), and takes it off once none does.

Example::

    layerswap.swap(model, "llama.qkv.fused")
    accelerator.save_model(model, "out")     # q_proj, k_proj, v_proj: all written
"""

from __future__ import annotations

import itertools
import threading
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from layerswap.patching import Patch, Scoped, wrap
from layerswap.patching.scoped import safeguard

__all__ = ["ADVICE", "arm", "is_own", "separated"]


def _extent(tensor: torch.Tensor) -> tuple[int, int]:
    start = tensor.data_ptr()
    return start, start + tensor.numel() * tensor.element_size()


def _slices(tensors: dict[str, torch.Tensor]) -> list[list[str]] | None:
    """The names of ``tensors`` (of one storage) by the extent they cover, where there are
    two extents or more, none overlapping another and none the whole storage, and the names
    of one extent name one tensor (shape, strides and dtype alike); else ``None``."""
    by_extent: dict[tuple[int, int], list[str]] = defaultdict(list)
    for name, tensor in tensors.items():
        if not tensor.is_contiguous():
            return None
        by_extent[_extent(tensor)].append(name)
    if len(by_extent) < 2:
        return None
    nbytes = next(iter(tensors.values())).untyped_storage().nbytes()
    extents = sorted(by_extent)
    if any(end - start == nbytes for start, end in extents):
        return None
    if any(end > start for (_, end), (start, _) in itertools.pairwise(extents)):
        return None
    for names in by_extent.values():
        first = tensors[names[0]]
        if any(
            (t.shape, t.stride(), t.dtype) != (first.shape, first.stride(), first.dtype)
            for t in (tensors[n] for n in names)
        ):
            return None
    return list(by_extent.values())


def separated(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """``state_dict`` with every slice of a storage shared with other slices it does not
    overlap as a copy of its own (one copy for the names of one slice); every other value
    as it is (the same object).

    Example::

        shared = torch.zeros(6)
        out = separated({"a": shared[:2], "b": shared[2:]})
        out["a"].untyped_storage().data_ptr() != out["b"].untyped_storage().data_ptr()  # True
    """
    by_storage: dict[tuple[Any, int], dict[str, torch.Tensor]] = defaultdict(dict)
    for name, value in state_dict.items():
        if isinstance(value, torch.Tensor) and not value.is_meta and value.numel():
            by_storage[(value.device, value.untyped_storage().data_ptr())][name] = value
    out = dict(state_dict)
    for tensors in by_storage.values():
        for names in _slices(tensors) or ():
            copy = tensors[names[0]].detach().clone()
            for name in names:
                out[name] = copy
    return out


def _with_separated(
    wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """Around a function whose first argument is a state dict it deduplicates by storage."""
    if args and isinstance(args[0], Mapping):
        return wrapped(separated(args[0]), *args[1:], **kwargs)
    if isinstance(kwargs.get("state_dict"), Mapping):
        return wrapped(*args, **{**kwargs, "state_dict": separated(kwargs["state_dict"])})
    return wrapped(*args, **kwargs)


#: (target, advice) armed while a packed model exists: each function that deduplicates a
#: state dict by storage, where the savers call it from
ADVICE = (
    ("accelerate.accelerator:clean_state_dict_for_safetensors", _with_separated),
    ("accelerate.utils.other:clean_state_dict_for_safetensors", _with_separated),
    ("safetensors.torch:_remove_duplicate_names", _with_separated),
    ("huggingface_hub.serialization._torch:_remove_duplicate_names", _with_separated),
)

_LOCK = threading.Lock()
_PATCHES: list[Patch] = []
#: weak references to the packed storages made in this process; ``None`` once a packed
#: group arrived whose storages are not known (a copy, or unpickled): needed for good
_PACKED: list[Any] | None = []


def arm(storages: Iterable[torch.UntypedStorage] | None = None) -> None:
    """The advice on (see the module docstring), for as long as a packed storage of
    ``storages`` lives; ``None`` (a packed group copied or unpickled, its storages not
    known): for the rest of the process. ``restore_all()`` takes it off only once none
    lives. Idempotent, thread-safe; ``lazy``: it imports none of the savers, and applies
    when one is imported.

    Example::

        arm([packed.untyped_storage()])   # what packing a group does
    """
    global _PACKED
    from torch.multiprocessing.reductions import StorageWeakRef

    with _LOCK:
        if storages is None:
            _PACKED = None
        elif _PACKED is not None:
            _PACKED[:] = [ref for ref in _PACKED if not ref.expired()]
            _PACKED.extend(StorageWeakRef(storage) for storage in storages)  # type: ignore[no-untyped-call]
        if not _PATCHES:
            _PATCHES.extend(
                safeguard(wrap(target, advice, lazy=True), _needed) for target, advice in ADVICE
            )
        for patch in _PATCHES:
            if not patch.is_active:
                patch.start()


def _needed() -> bool:
    """Whether a packed storage may still live: slices of it can reach a saver."""
    packed = _PACKED
    return packed is None or any(not ref.expired() for ref in packed)


def is_own(scoped: Scoped) -> bool:
    """Whether ``scoped`` is a patch :func:`arm` started (layerswap's own, not a leak)."""
    return any(scoped is patch for patch in _PATCHES)
