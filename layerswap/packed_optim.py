"""Optimizer state of packed sharded parameters in the fused layout, as the model's state.

An optimizer's per-parameter state (Adam's ``exp_avg``/``exp_avg_sq``, SGD's
``momentum_buffer``) of a packed sharded parameter is a DTensor placed like it: rank
``r`` holds the moments of ``[q_r; k_r; v_r]`` under a ``Shard(0)`` that is not true
(:mod:`layerswap.packed_state`). Read by its placements -- ``get_optimizer_state_dict``
with ``full_state_dict=True``, a DCP checkpoint read at another degree -- it is in
rank-major order. So each optimizer that holds a packed sharded parameter gets, on the
instance, the optimizer-side twins of the layer's hooks:

- a ``state_dict`` post-hook giving each such state tensor as ``Shard(0)`` of the fused
  layout (:func:`~layerswap.packed_state.fused_global`; a collective, as the model's is);
- a ``load_state_dict`` pre-hook reading what it is given by the same rule and handing
  torch the rank's packed shard (:func:`~layerswap.packed_state.packed_local`).

State of another shape or placement (a factored second moment) cannot be reordered by
that rule: ``state_dict()`` refuses it with :class:`~layerswap.errors.ParallelismError`
before anything is returned, and so before anything is written.

Torch has no hook on an optimizer's construction, so the hooks are attached by a global
step pre-hook when an optimizer steps for the first time (an optimizer has no state to
give before that; ``get_optimizer_state_dict`` and ``set_optimizer_state_dict`` step it
first when it has none). State loaded into an optimizer that never stepped could not be
read: its first step refuses it, unless :func:`watch_optimizer` was called before the load.

Example::

    optimizer = torch.optim.AdamW(model.parameters())   # model: swapped, tp_size=2
    ...; optimizer.step()
    osd = get_optimizer_state_dict(model, optimizer, StateDictOptions(full_state_dict=True))
    osd["state"]["model.layers.0.self_attn.qkv_proj.weight"]["exp_avg"]   # [q; k; v]
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Mapping
from itertools import chain
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from layerswap.errors import ConversionError, ParallelismError
from layerswap.packed_state import (
    PackedStateHook,
    fused_global,
    install_packed_state_hooks,
    packed_local,
    packed_shard,
)

if TYPE_CHECKING:
    from transformers import PreTrainedConfig

    from layerswap.substitution import Substitution

__all__ = ["track_packed_layer", "watch_optimizer", "watch_packed_layer"]


class _Watch:
    """The process's global step pre-hook and what it reads.

    Torch's step hooks are process-global, so this is too: one instance, registered once.
    It holds the replacement layers with packed parameters and the optimizers it has
    looked at, both weakly (neither is kept alive by being watched).
    """

    def __init__(self) -> None:
        self.layers: weakref.WeakSet[nn.Module] = weakref.WeakSet()
        self.seen: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
        self.handle: Any = None

    def __call__(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if optimizer in self.seen:
            return
        packed = _packed_parameters(optimizer)
        if packed:
            _refuse_unread_state(optimizer, packed)
            _attach(optimizer)
        self.seen.add(optimizer)


_WATCH = _Watch()


def watch_packed_layer(
    layer: nn.Module, substitution: Substitution, config: PreTrainedConfig
) -> None:
    """Give replacement ``layer`` the state hooks of its packed parameters
    (:func:`~layerswap.packed_state.install_packed_state_hooks`) and watch their
    optimizers (none when it packs none); idempotent. ``config``: the layer's (text)
    config."""
    if not install_packed_state_hooks(layer, substitution, config):
        return
    _WATCH.layers.add(layer)
    if _WATCH.handle is None:
        _WATCH.handle = register_optimizer_step_pre_hook(_WATCH)


def track_packed_layer(layer: nn.Module) -> None:
    """Watch the optimizers of ``layer``'s packed parameters (none when it packs none).

    For a layer given its packed state hooks by
    :func:`~layerswap.packed_state.install_packed_state_hooks` alone
    (:func:`watch_packed_layer` gives them and watches); idempotent.
    """
    if not any(isinstance(hook, PackedStateHook) for hook in layer._state_dict_hooks.values()):
        return
    _WATCH.layers.add(layer)
    if _WATCH.handle is None:
        _WATCH.handle = register_optimizer_step_pre_hook(_WATCH)


def watch_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """Give and take ``optimizer``'s state of packed sharded parameters in the fused layout
    now, rather than at its first step: call it before loading state into an optimizer
    that has not stepped.

    Example::

        optimizer = torch.optim.AdamW(model.parameters())
        layerswap.packed_optim.watch_optimizer(optimizer)
        optimizer.load_state_dict(torch.load(f"optimizer-rank{rank}.pt"))
    """
    if optimizer in _WATCH.seen:
        return
    if _packed_parameters(optimizer):
        _attach(optimizer)
    _WATCH.seen.add(optimizer)


def _attach(optimizer: torch.optim.Optimizer) -> None:
    optimizer.register_state_dict_post_hook(_give_fused)
    optimizer.register_load_state_dict_pre_hook(_take_fused)


def _packed_parameters(optimizer: torch.optim.Optimizer) -> dict[int, tuple[str, list[int]]]:
    """``id(param) -> (name, part sizes)`` for ``optimizer``'s packed sharded parameters."""
    held = {id(param) for group in optimizer.param_groups for param in group["params"]}
    found: dict[int, tuple[str, list[int]]] = {}
    for layer in list(_WATCH.layers):
        for hook in layer._state_dict_hooks.values():
            if not isinstance(hook, PackedStateHook):
                continue
            for key, sizes in hook.sizes.items():
                try:
                    param = layer.get_parameter(key)
                except AttributeError:
                    continue
                if id(param) in held and _is_sharded(param):
                    found[id(param)] = (f"{type(layer).__name__}.{key}", sizes)
    return found


def _is_sharded(param: Any) -> bool:
    """Whether ``param`` is packed over ranks; a layout :func:`packed_shard` refuses counts,
    so that the refusal comes when its state is read rather than never."""
    try:
        return packed_shard(param) is not None
    except ConversionError:
        return True


def _by_saved_id(
    saved_groups: Iterable[Mapping[str, Any]], optimizer: torch.optim.Optimizer
) -> dict[Any, Any]:
    """The parameter each id of a state dict's ``param_groups`` stands for: torch pairs
    them in order (``Optimizer.load_state_dict``; ``state_dict`` numbers them so)."""
    return dict(
        zip(
            chain.from_iterable(group["params"] for group in saved_groups),
            chain.from_iterable(group["params"] for group in optimizer.param_groups),
            strict=False,
        )
    )


def _packed_entries(
    optimizer: torch.optim.Optimizer, state_dict: Mapping[str, Any]
) -> list[tuple[Any, Any, str, list[int]]]:
    """``(saved id, parameter, name, sizes)`` of each state entry of a packed parameter."""
    packed = _packed_parameters(optimizer)
    if not packed:
        return []
    params = _by_saved_id(state_dict["param_groups"], optimizer)
    entries = []
    for saved_id in state_dict["state"]:
        param = params.get(saved_id)
        if param is not None and id(param) in packed:
            entries.append((saved_id, param, *packed[id(param)]))
    return entries


def _give_fused(optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
    """``state_dict`` post-hook: state of packed parameters as Shard(0) of the fused layout."""
    entries = _packed_entries(optimizer, state_dict)
    # every check before the first collective: a refusal on one rank is a refusal on all
    plans = []
    for saved_id, param, name, sizes in entries:
        shard = packed_shard(param)
        if shard is None:
            continue
        entry = state_dict["state"][saved_id]
        keys = [key for key, value in entry.items() if _is_moment(value, param, name, key)]
        plans.append((saved_id, shard, sizes, keys))
    if not plans:
        return state_dict
    state = dict(state_dict["state"])
    for saved_id, shard, sizes, keys in plans:
        # a new entry: the one given is the optimizer's own (state_dict() copies shallowly)
        entry = dict(state[saved_id])
        for key in keys:
            if not entry[key].to_local().is_meta:
                entry[key] = fused_global(entry[key], sizes, shard)
        state[saved_id] = entry
    return {**state_dict, "state": state}


def _take_fused(optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
    """``load_state_dict`` pre-hook: state given for packed parameters is read as the fused
    layout (a DTensor by its placements, a plain tensor whole) and packed for this rank."""
    entries = _packed_entries(optimizer, state_dict)
    if not entries:
        return state_dict
    state = dict(state_dict["state"])
    for saved_id, param, name, sizes in entries:
        shard = packed_shard(param)
        if shard is None:
            continue
        entry = dict(state[saved_id])
        for key, value in entry.items():
            if isinstance(value, torch.Tensor) and value.ndim > 0:
                where = f"optimizer state {key!r} of {name}"
                entry[key] = packed_local(value, param, sizes, shard, where)
        state[saved_id] = entry
    return {**state_dict, "state": state}


def _is_moment(value: Any, param: Any, name: str, key: str) -> bool:
    """Whether ``value`` is per-element state of ``param`` to reorder; refuses state that
    is split along with it but cannot be reordered by the parameter's rule."""
    if not isinstance(value, torch.Tensor) or value.ndim == 0:
        return False
    if (
        tuple(value.shape) == tuple(param.shape)
        and getattr(value, "placements", None) == param.placements
        and getattr(value, "device_mesh", None) == param.device_mesh
    ):
        return True
    raise ParallelismError(
        f"optimizer state {key!r} of the packed tensor-parallel parameter {name} has shape "
        f"{tuple(value.shape)} and placements {getattr(value, 'placements', None)}, not "
        f"those of the parameter ({tuple(param.shape)}, {param.placements}): layerswap gives "
        "in the fused layout only state shaped and placed like its parameter (Adam, AdamW, "
        "SGD with momentum); use such an optimizer, or save the model with save_pretrained"
    )


def _refuse_unread_state(optimizer: torch.optim.Optimizer, packed: Mapping[int, Any]) -> None:
    """At the first step of an optimizer not watched before: state of a packed parameter
    that is already there was loaded without the hooks, in a layout nobody can tell."""
    for param, entry in optimizer.state.items():
        if id(param) not in packed:
            continue
        if any(isinstance(value, torch.Tensor) and value.ndim > 0 for value in entry.values()):
            name = packed[id(param)][0]
            raise ParallelismError(
                f"the optimizer holds state of the packed tensor-parallel parameter {name} "
                "loaded before its first step, so layerswap could not read it in the fused "
                "layout; load optimizer state with torch.distributed.checkpoint.state_dict."
                "set_optimizer_state_dict, or call layerswap.packed_optim.watch_optimizer("
                "optimizer) before optimizer.load_state_dict"
            )
