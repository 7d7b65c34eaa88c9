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
  the swapped model kept its own. Around it, each checkpoint file's tensors are joined
  into the swapped layout as accelerate reads them (a group whose parts lie in two files
  is joined when the last part comes), and a group the checkpoint gives only in part is
  refused once the files are read.

Both are armed with the other checks on how weights leave and enter a swapped model (see
:mod:`layerswap.peft_targets`) and pass a model without swapped layers straight through.

Example::

    layerswap.swap(model, backend="fused")
    set_model_state_dict(model, original_state if rank == 0 else {},
                         options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    load_checkpoint_in_model(model, "original-checkpoint", device_map={"": "cpu"})
"""

from __future__ import annotations

import contextvars
import inspect
import sys
from collections.abc import Callable, Iterator, MutableMapping
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from layerswap.errors import ConversionError
from layerswap.state import convert_incoming, layout_hooks
from layerswap.weights import Converter

__all__ = ["ADVICE", "ALIASED"]

#: where torch matches a full state's names against the model's, then broadcasts or
#: distributes it, then calls ``load_state_dict`` (``set_model_state_dict``'s model part)
TORCH_FULL_STATE_TARGET = "torch.distributed.checkpoint.state_dict:_load_model_state_dict"
#: accelerate's checkpoint loading, and the function it reads each checkpoint file with
ACCELERATE_LOAD_TARGET = "accelerate.utils.modeling:load_checkpoint_in_model"
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


def _arguments(wrapped: Callable[..., Any], args: Any, kwargs: Any) -> dict[str, Any] | None:
    try:
        return dict(inspect.signature(wrapped).bind(*args, **kwargs).arguments)
    except TypeError:
        return None  # a call the function refuses itself: its error, not ours


# --- torch: set_model_state_dict with a full state -----------------------------------------


def _full_state_converted(
    wrapped: Callable[..., Any], instance: Any, args: Any, kwargs: Any
) -> Any:
    """Around torch's ``_load_model_state_dict`` (see the module docstring)."""
    import torch.distributed as dist

    arguments = _arguments(wrapped, args, kwargs)
    if arguments is None:
        return wrapped(*args, **kwargs)
    model, state, info = arguments["model"], arguments["state_dict"], arguments["info"]
    broadcast = bool(getattr(info, "broadcast_from_rank0", False))
    if not (broadcast or getattr(info, "full_state_dict", False)):
        return wrapped(*args, **kwargs)  # each rank loads its own state: the hooks convert
    if broadcast and dist.is_initialized() and dist.get_rank() != 0:
        return wrapped(*args, **kwargs)  # handed rank 0's state, converted there
    hooks = layout_hooks(model) if isinstance(model, nn.Module) else []
    if not hooks or not isinstance(state, MutableMapping):
        return wrapped(*args, **kwargs)
    converted = dict(state)
    missing: list[str] = []
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
    if missing and getattr(info, "strict", True):
        raise ConversionError(
            f"set_model_state_dict(strict=True): the state gives {len(missing)} tensor(s) "
            f"of a swapped layer in part, {missing[0]!r} missing; nothing was loaded. Give "
            "every part (q/k/v, gate/up together), or load with strict=False to keep the "
            "layer's own values of the parts left out"
        )
    result = wrapped(model, converted, info)
    if missing:
        result.missing_keys.extend(key for key in missing if key not in result.missing_keys)
    return result


# --- accelerate: load_checkpoint_in_model with a device_map --------------------------------

#: the swapped model accelerate loads in this context, and the parts of groups read so far
#: from earlier files (their other parts not read yet)
_LOADING: contextvars.ContextVar[tuple[nn.Module, dict[str, Any]] | None] = contextvars.ContextVar(
    "layerswap_placed_load", default=None
)


@contextmanager
def _loading(model: nn.Module) -> Iterator[dict[str, Any]]:
    carried: dict[str, Any] = {}
    token = _LOADING.set((model, carried))
    try:
        yield carried
    finally:
        _LOADING.reset(token)


def _checkpoint_placed(wrapped: Callable[..., Any], instance: Any, args: Any, kwargs: Any) -> Any:
    """Around accelerate's ``load_checkpoint_in_model`` (see the module docstring)."""
    arguments = _arguments(wrapped, args, kwargs)
    model = None if arguments is None else arguments.get("model")
    if (
        arguments is None
        or arguments.get("device_map") is None
        or not isinstance(model, nn.Module)
        or not layout_hooks(model)
    ):
        return wrapped(*args, **kwargs)  # no device_map: load_state_dict runs, and converts
    with _loading(model) as carried:
        result = wrapped(*args, **kwargs)
    if carried:
        first = sorted(carried)[0]
        raise ConversionError(
            f"load_checkpoint_in_model: the checkpoint gives {first!r} of a swapped layer "
            f"but not every tensor it is joined with ({len(carried)} part(s) left alone), "
            "so that joined tensor kept the model's own values; give every part (q/k/v, "
            "gate/up together)"
        )
    return result


def _file_joined(wrapped: Callable[..., Any], instance: Any, args: Any, kwargs: Any) -> Any:
    """Around accelerate's ``load_state_dict`` (one checkpoint file read): inside
    :func:`_checkpoint_placed`, the file's original-layout tensors of the swapped layers
    joined into their layout (parts whose group is not whole yet carried to the next)."""
    state = wrapped(*args, **kwargs)
    loading = _LOADING.get()
    if loading is None:
        _refuse_unseen_load()
        return state
    if not isinstance(state, MutableMapping):
        return state
    model, carried = loading
    for name, _, hook in layout_hooks(model):
        prefix = _state_name(model, name)
        _join(state, carried, f"{prefix}." if prefix else "", hook.substitution, hook.config)
    return state


def _refuse_unseen_load() -> None:
    """Raise where this file is read by a ``load_checkpoint_in_model`` whose call
    :func:`_checkpoint_placed` did not see (bound by name before the first swap: a local
    name, an attribute), placing tensors into a swapped model by a ``device_map``: its
    original-layout tensors would be skipped as unused."""
    frame = sys._getframe(1)
    for _ in range(16):  # the wrappers' frames, then accelerate's own
        frame = frame.f_back  # type: ignore[assignment]
        if frame is None:
            return
        if frame.f_code.co_name == "load_checkpoint_in_model" and frame.f_globals.get(
            "__name__", ""
        ).startswith("accelerate."):
            break
    else:
        return
    model, device_map = frame.f_locals.get("model"), frame.f_locals.get("device_map")
    if device_map is None or not isinstance(model, nn.Module) or not layout_hooks(model):
        return
    raise ConversionError(
        "load_checkpoint_in_model with a device_map places each tensor by name, and this "
        "call was bound before the model was swapped (held under another name), so "
        "layerswap cannot join the original layout's q/k/v and gate/up into the swapped "
        "layers' tensors: nothing was loaded. Import it again after the swap (from "
        "accelerate.utils import load_checkpoint_in_model), load with device_map=None, or "
        "load with from_pretrained inside layerswap.use()"
    )


def _join(
    state: MutableMapping[str, Any],
    carried: dict[str, Any],
    prefix: str,
    substitution: Any,
    config: Any,
) -> None:
    """Each of ``substitution``'s rules whose parts ``state`` and ``carried`` hold whole:
    converted in ``state`` (the parts of one not whole yet moved to ``carried``)."""
    converter = substitution.converter
    if not isinstance(converter, Converter):
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
        if like is not None and like.is_floating_point():
            tensors = [
                t.to(dtype=like.dtype)
                if isinstance(t, torch.Tensor) and t.is_floating_point()
                else t
                for t in tensors
            ]
        try:
            with torch.no_grad():
                results = rule.to_replacement(tensors, config)
        except ConversionError as exc:
            raise ConversionError(f"loading {prefix.rstrip('.')}: {exc}") from exc
        for target, result in zip(rule.targets, results, strict=True):
            state[prefix + target] = result


#: the targets a caller reaches through names bound elsewhere (``accelerate.utils``,
#: ``accelerate.big_modeling``: ``from .utils import load_checkpoint_in_model``), wrapped
#: in every module that binds them
ALIASED = frozenset({ACCELERATE_LOAD_TARGET})

#: (target, advice) armed while a swapped model exists
ADVICE = (
    (TORCH_FULL_STATE_TARGET, _full_state_converted),
    (ACCELERATE_LOAD_TARGET, _checkpoint_placed),
    (ACCELERATE_READ_TARGET, _file_joined),
)
