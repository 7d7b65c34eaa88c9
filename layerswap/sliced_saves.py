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

So while a packed model exists (armed with :func:`layerswap.peft_targets.hold`, as the
``save_pretrained`` check is), these functions get the state dict with each group of
slices that share a storage without overlapping (:func:`separated`) as tensors of their
own: copies, so what is written is the original's layout, tensor for tensor. Tensors that
overlap (tied weights: one tensor under two names) stay as they are, deduplicated as
before. ``state_dict()`` itself is unchanged: its tensors still alias the parameters, so
what writes through them in place (an EMA's ``copy_``) still reaches the model.

Example::

    layerswap.swap(model, "llama.qkv.fused")
    accelerator.save_model(model, "out")     # q_proj, k_proj, v_proj: all written
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Callable, Mapping
from typing import Any

import torch

__all__ = ["ADVICE", "separated"]


def _range(tensor: torch.Tensor) -> tuple[int, int]:
    start = tensor.data_ptr()
    return start, start + tensor.numel() * tensor.element_size()


def _disjoint_slices(tensors: list[torch.Tensor]) -> bool:
    """Whether ``tensors`` (of one storage) are contiguous slices none of which overlaps
    another, and none covers the whole storage."""
    if not all(t.is_contiguous() for t in tensors):
        return False
    nbytes = tensors[0].untyped_storage().nbytes()
    if any(t.numel() * t.element_size() == nbytes for t in tensors):
        return False
    ranges = sorted(_range(t) for t in tensors)
    return all(end <= start for (_, end), (start, _) in itertools.pairwise(ranges))


def separated(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """``state_dict`` with every tensor of a storage that it shares with others, without
    overlapping them, as a copy of its own; every other value as it is (the same object).

    Example::

        shared = torch.zeros(6)
        out = separated({"a": shared[:2], "b": shared[2:]})
        out["a"].untyped_storage().data_ptr() != out["b"].untyped_storage().data_ptr()  # True
    """
    by_storage: dict[tuple[Any, int], list[str]] = defaultdict(list)
    for name, value in state_dict.items():
        if isinstance(value, torch.Tensor) and not value.is_meta and value.numel():
            by_storage[(value.device, value.untyped_storage().data_ptr())].append(name)
    out = dict(state_dict)
    for names in by_storage.values():
        if len(names) > 1 and _disjoint_slices([state_dict[name] for name in names]):
            for name in names:
                out[name] = state_dict[name].detach().clone()
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
