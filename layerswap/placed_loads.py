"""Loads that match a checkpoint's names against the model's before any ``load_state_dict``
runs: the original layout put into a swapped model's own first, or refused.

A swapped layer converts the original layout as it loads (its ``load_state_dict`` pre-hook,
:func:`layerswap.state.convert_incoming`). Two loaders decide what to load by the model's
own names before that hook can run, and so dropped every tensor a swapped layer joins
(q/k/v, gate/up) without a word:

- torch's ``set_model_state_dict`` with ``broadcast_from_rank0`` or ``full_state_dict``
  (``torch.distributed.checkpoint.state_dict._load_model_state_dict``; accelerate's
  ``load_checkpoint_in_model`` without a ``device_map`` too): rank 0 loaded right, while
  the other ranks, and each FSDP shard, took only the names the model has, kept their own
  fused tensors and reported every key matched. Around it, the state given (rank 0's,
  where it broadcasts) is put into the swapped layout first by that same conversion, so
  every rank and shard is handed the model's names. A part the state leaves out is
  listed among the missing keys (``strict=True``: refused, with a
  :class:`~layerswap.errors.ConversionError`, before anything loads);
- accelerate's ``load_checkpoint_in_model`` with a ``device_map`` (what
  ``load_checkpoint_and_dispatch`` calls): each tensor is placed by its name and
  ``load_state_dict`` never runs, so the original layout's q/k/v were logged as unused and
  the swapped model kept its own. Around accelerate's read of each checkpoint file
  (its ``load_state_dict``, which it looks up at every call, however the caller bound
  ``load_checkpoint_in_model``), the file's tensors are joined into the swapped layout
  (a group whose parts lie in two files when the last part comes); a checkpoint giving a
  joined tensor in part, or a layer in both layouts, is refused before any tensor is
  placed (from its index, or its one file). Without a ``device_map`` the files are joined
  the same way before each is loaded: the conversion on load would take them, but a
  group given in part was left out whole (the original loads the parts it is given) and
  accelerate logged every original-layout tensor as unused.

Both are armed with the other checks on how weights leave and enter a swapped model (see
:mod:`layerswap.peft_targets`) and pass a model without swapped layers straight through.

Example::

    layerswap.swap(model, backend="fused")
    set_model_state_dict(model, original_state if rank == 0 else {},
                         options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    load_checkpoint_in_model(model, "original-checkpoint", device_map={"": "cpu"})
"""

from __future__ import annotations

import json
import sys
import weakref
from collections.abc import Callable, MutableMapping
from typing import Any

import torch
from torch import nn

from layerswap.errors import ConversionError
from layerswap.patching.wrap import bound_arguments
from layerswap.state import cast_like, convert_incoming, layout_hooks
from layerswap.weights import Converter

__all__ = ["ACCELERATE_LOAD_LOCALS", "ADVICE"]

#: where torch matches a full state's names against the model's, then broadcasts or
#: distributes it, then calls ``load_state_dict`` (``set_model_state_dict``'s model part)
TORCH_FULL_STATE_TARGET = "torch.distributed.checkpoint.state_dict:_load_model_state_dict"
#: the function accelerate's ``load_checkpoint_in_model`` reads each checkpoint file with
ACCELERATE_READ_TARGET = "accelerate.utils.modeling:load_state_dict"

#: the segments wrappers add to a module's name that the state's names leave out (FSDP1's,
#: activation checkpointing's, ``torch.compile``'s), as torch's own name matching does
_WRAPPER_SEGMENTS = frozenset({"_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod"})


def _state_name(model: nn.Module, name: str) -> str:
    """A module's name as a state dict of ``model`` names it: the wrappers' segments out,
    and a ``DistributedDataParallel``'s ``module.`` (torch's loaders skip both)."""
    parts = [part for part in name.split(".") if part and part not in _WRAPPER_SEGMENTS]
    if isinstance(model, nn.parallel.DistributedDataParallel) and parts[:1] == ["module"]:
        parts = parts[1:]
    return ".".join(parts)


# --- torch: set_model_state_dict with a full state -----------------------------------------


def _full_state_converted(
    wrapped: Callable[..., Any], instance: Any, args: Any, kwargs: Any
) -> Any:
    """Around torch's ``_load_model_state_dict`` (see the module docstring)."""
    import torch.distributed as dist

    arguments = bound_arguments(wrapped, args, kwargs)
    if arguments is None:
        return wrapped(*args, **kwargs)
    model, state, info = arguments["model"], arguments["state_dict"], arguments["info"]
    broadcast = bool(getattr(info, "broadcast_from_rank0", False))
    if not (broadcast or getattr(info, "full_state_dict", False)):
        return wrapped(*args, **kwargs)  # each rank loads its own state: the hooks convert
    hooks = layout_hooks(model) if isinstance(model, nn.Module) else []
    if not hooks:
        return wrapped(*args, **kwargs)
    if broadcast and dist.is_initialized() and dist.get_rank() != 0:
        # handed rank 0's state, converted there; refused with it where rank 0 refuses
        refusal = _agreed(None)
        if refusal is not None:
            raise ConversionError(refusal)
        return wrapped(*args, **kwargs)
    if not isinstance(state, MutableMapping):
        if broadcast and dist.is_initialized():
            _agreed(None)  # the other ranks wait for rank 0's word
        return wrapped(*args, **kwargs)
    converted = dict(state)
    missing: list[str] = []
    refusal = None
    try:
        for name, layer, hook in hooks:
            prefix = _state_name(model, name)
            convert_incoming(
                layer,
                converted,
                f"{prefix}." if prefix else "",
                hook.substitution,
                hook.config,
                missing,
            )
    except ConversionError as exc:  # two layouts for one layer: said on every rank
        refusal = str(exc)
    if refusal is None and missing and getattr(info, "strict", True):
        refusal = (
            f"set_model_state_dict(strict=True): the state gives {len(missing)} tensor(s) "
            f"of a swapped layer in part, {missing[0]!r} missing; nothing was loaded. Give "
            "every part (q/k/v, gate/up together), or load with strict=False to keep the "
            "layer's own values of the parts left out"
        )
    if broadcast and dist.is_initialized():
        refusal = _agreed(refusal)
    if refusal is not None:
        raise ConversionError(refusal)
    result = wrapped(model, converted, info)
    if missing:
        result.missing_keys.extend(key for key in missing if key not in result.missing_keys)
    return result


def _agreed(refusal: str | None) -> str | None:
    """Rank 0's ``refusal`` on every rank (one collective, before torch's broadcast): a
    state refused on rank 0 alone would leave the others waiting in that broadcast."""
    import torch.distributed as dist

    shared = [refusal]
    dist.broadcast_object_list(shared, src=0)
    return shared[0]


# --- accelerate: load_checkpoint_in_model with a device_map --------------------------------

#: the local names of accelerate's ``load_checkpoint_in_model`` read while it reads each
#: checkpoint file (``load_state_dict``, looked up in its module at every call, so found
#: however the caller bound ``load_checkpoint_in_model``): the model, the device map,
#: the files it reads in order, and the index naming every tensor's file
ACCELERATE_LOAD_LOCALS = (
    "model",
    "device_map",
    "checkpoint_files",
    "index_filename",
    "broadcast_from_rank0",
)

#: parts of joined groups read from a model's earlier checkpoint files, by model (its other
#: parts not read yet)
_CARRIED: weakref.WeakKeyDictionary[nn.Module, dict[str, Any]] = weakref.WeakKeyDictionary()


def _accelerate_load() -> dict[str, Any] | None:
    """The locals of the accelerate ``load_checkpoint_in_model`` reading a file now."""
    frame = sys._getframe(2)
    for _ in range(16):  # the wrappers' frames, then accelerate's own
        if frame is None:
            return None
        code = frame.f_code
        if code.co_name == "load_checkpoint_in_model" and frame.f_globals.get(
            "__name__", ""
        ).startswith("accelerate."):
            return {name: frame.f_locals.get(name) for name in ACCELERATE_LOAD_LOCALS}
        frame = frame.f_back  # type: ignore[assignment]
    return None


def _file_joined(wrapped: Callable[..., Any], instance: Any, args: Any, kwargs: Any) -> Any:
    """Around accelerate's ``load_state_dict`` (one checkpoint file read; see the module
    docstring): read by a ``load_checkpoint_in_model`` loading a swapped model, the file's
    original-layout tensors joined into the swapped layers' layout, before any is placed
    (by a ``device_map``) or loaded (without one: accelerate then finds every tensor of
    the file used, and a joined tensor given in part is refused rather than left out)."""
    loading = _accelerate_load()
    model = None if loading is None else loading["model"]
    if loading is None or not isinstance(model, nn.Module) or not layout_hooks(model):
        return wrapped(*args, **kwargs)
    try:
        return _read_joined(wrapped, args, kwargs, loading, model)
    except ConversionError as exc:
        if not _broadcast(loading):
            raise
        # without a device_map, broadcast_from_rank0: rank 0 alone reads the files, and the
        # other ranks wait for its word in set_model_state_dict (_full_state_converted):
        # a refusal here must reach them, or they wait there for good
        raise ConversionError(_agreed(str(exc)) or str(exc)) from exc


def _broadcast(loading: dict[str, Any]) -> bool:
    """Whether accelerate loads for a ``set_model_state_dict`` broadcast from rank 0."""
    import torch.distributed as dist

    return bool(
        loading["device_map"] is None
        and loading["broadcast_from_rank0"]
        and dist.is_available()
        and dist.is_initialized()
    )


def _read_joined(
    wrapped: Callable[..., Any],
    args: Any,
    kwargs: Any,
    loading: dict[str, Any],
    model: nn.Module,
) -> Any:
    """:func:`_file_joined`'s work: the file read, checked and joined."""
    placed = loading["device_map"] is not None
    files = list(loading["checkpoint_files"] or [])
    current = args[0] if args else kwargs.get("checkpoint_file")
    if files and current == files[0]:
        # the first file, before any tensor is placed: the whole checkpoint's names checked
        _CARRIED[model] = {}
        if loading["index_filename"] is not None:
            _check_names(model, _indexed_names(loading["index_filename"]))
    state = wrapped(*args, **kwargs)
    if not isinstance(state, MutableMapping):
        return state
    if len(files) <= 1:
        _check_names(model, list(state))  # the whole checkpoint: refused before placing
    carried = _CARRIED.setdefault(model, {})
    for name, _, hook in layout_hooks(model):
        prefix = _state_name(model, name)
        _join(
            state, carried, f"{prefix}." if prefix else "", hook.substitution, hook.config, placed
        )
    if not files or current == files[-1]:
        left = _CARRIED.pop(model, {})
        if left:  # a file named by no index: parts never joined
            raise ConversionError(
                f"load_checkpoint_in_model: the checkpoint gives {sorted(left)[0]!r} of a "
                "swapped layer but not every tensor it is joined with; give every part"
            )
    return state


def _indexed_names(index_filename: Any) -> list[str]:
    with open(index_filename, encoding="utf-8") as handle:
        index = json.load(handle)
    return list(index.get("weight_map", index))


def _check_names(model: nn.Module, names: list[str]) -> None:
    """Raise, before any tensor is placed, where the checkpoint's ``names`` give a joined
    tensor of a swapped layer of ``model`` in part, or in both layouts."""
    given = set(names)
    for name, _, hook in layout_hooks(model):
        prefix = _state_name(model, name)
        prefix = f"{prefix}." if prefix else ""
        converter = hook.substitution.converter
        for rule in getattr(converter, "rules", ()):
            if tuple(rule.sources) == tuple(rule.targets):
                continue
            sources = [prefix + key for key in rule.sources]
            present = [key for key in sources if key in given]
            targets = [prefix + key for key in rule.targets if prefix + key in given]
            if present and targets:
                raise ConversionError(
                    f"load_checkpoint_in_model: the checkpoint gives {prefix.rstrip('.')} "
                    f"both in the original layout ({present[0]!r}) and in "
                    f"{hook.substitution.name}'s ({targets[0]!r}); nothing was loaded. Give "
                    "one layout per layer"
                )
            if present and len(present) < len(sources):
                missing = next(key for key in sources if key not in given)
                raise ConversionError(
                    f"load_checkpoint_in_model: the checkpoint gives {present[0]!r} of a "
                    f"swapped layer but not {missing!r}, which {hook.substitution.name} joins "
                    "with it into one tensor; nothing was loaded. Give every part (q/k/v, "
                    "gate/up together)"
                )


def _join(
    state: MutableMapping[str, Any],
    carried: dict[str, Any],
    prefix: str,
    substitution: Any,
    config: Any,
    placed: bool,
) -> None:
    """Each of ``substitution``'s rules whose parts ``state`` and ``carried`` hold whole:
    converted in ``state`` (the parts of one not whole yet moved to ``carried``).
    ``placed``: accelerate places the tensors one by one (a ``device_map``), so a layer
    converted as a whole cannot be; without one its load hook converts it."""
    converter = substitution.converter
    if not isinstance(converter, Converter):
        if not placed:
            return
        given = [key for key in state if key.startswith(prefix)]
        if given:
            raise ConversionError(
                f"load_checkpoint_in_model with a device_map: {substitution.name} converts a "
                f"layer's tensors as a whole ({given[0]!r}), which accelerate places one by "
                "one; load with device_map=None, or from_pretrained inside layerswap.use()"
            )
        return
    for rule in converter.rules:
        if tuple(rule.sources) == tuple(rule.targets):
            continue
        keys = [prefix + key for key in rule.sources]
        parts = {key: state.pop(key) for key in keys if key in state}
        parts.update({key: carried.pop(key) for key in keys if key in carried})
        if not parts:
            continue
        if len(parts) < len(keys):
            carried.update(parts)
            continue
        tensors = [parts[key] for key in keys]
        like = next((t for t in tensors if isinstance(t, torch.Tensor)), None)
        if like is not None:  # parts in several dtypes: each in the first one's
            tensors = cast_like(tensors, like)
        try:
            with torch.no_grad():
                results = rule.to_replacement(tensors, config)
        except ConversionError as exc:
            raise ConversionError(f"loading {prefix.rstrip('.')}: {exc}") from exc
        for target, result in zip(rule.targets, results, strict=True):
            state[prefix + target] = result


#: (target, advice) armed while a swapped model exists
ADVICE = (
    (TORCH_FULL_STATE_TARGET, _full_state_converted),
    (ACCELERATE_READ_TARGET, _file_joined),
)
