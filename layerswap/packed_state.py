"""The global view of a packed sharded parameter in state dicts: the fused layout, always.

Under tensor parallelism a fused projection is a packed column shard: rank ``r`` holds
``[q_r; k_r; v_r]`` (its heads of every part, :mod:`layerswap.parallel`), yet the
parameter is a DTensor that says ``Shard(0)``. Read by its placements -- ``full_tensor()``,
``get_model_state_dict(..., full_state_dict=True)``, ``torch.distributed.checkpoint``,
``distribute_tensor`` -- its global view is ``[q_0; k_0; v_0; q_1; k_1; v_1]``, a
permutation of the fused layout. No DTensor placement says "shard each part along its
rows" when the parts differ in size (grouped-query attention), so the parameter cannot
say it itself. Its state can:

- :class:`PackedStateHook` (a ``state_dict`` post-hook) replaces each packed sharded
  parameter by a DTensor that *is* ``Shard(0)`` of the fused layout: the rank's parts
  are gathered and the rank keeps its contiguous stretch of ``[q; k; v]``. Everything
  that reads state by its placements then reads what an unsharded swapped model holds,
  and a checkpoint moves between tensor-parallel degrees (and to one process). It is a
  collective: every rank of the tensor-parallel group calls ``state_dict()``, as every
  rank calls ``dcp.save`` and ``get_model_state_dict``.
- :class:`PackedLoadHook` (a ``load_state_dict`` pre-hook) reads what it is given for a
  packed sharded parameter by the same rule -- a DTensor by its placements, a plain
  tensor as the whole fused layout -- and hands torch the rank's packed shard. So
  ``dcp.load`` followed by ``model.load_state_dict`` (as torch's documentation asks),
  ``set_model_state_dict(..., full_state_dict=True)`` and loading an unsharded swapped
  model's state all land right. The parameter itself (or a view of it) loads as it is.

Example::

    layerswap.swap(model, "llama.decoder.fused")   # sharded by transformers: tp_size=2
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    state["model.layers.0.self_attn.qkv_proj.weight"]   # [q; k; v], as unsharded
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from layerswap import shards
from layerswap.errors import ConversionError
from layerswap.state import is_own
from layerswap.weights import row_concats

if TYPE_CHECKING:
    from transformers import PreTrainedConfig

    from layerswap.substitution import Substitution

__all__ = [
    "PackedLoadHook",
    "PackedStateHook",
    "install_packed_state_hooks",
    "packed_shard",
    "packed_sizes",
]


def packed_sizes(substitution: Substitution, config: PreTrainedConfig) -> dict[str, list[int]]:
    """Layer-relative keys of the tensors ``substitution`` concatenates along dim 0, with
    each part's extent: ``{"self_attn.qkv_proj.weight": [256, 64, 64], ...}``."""
    from layerswap import hf_internals

    config = hf_internals.text_config_of(config)
    return {rule.target: rule.part_sizes(config) for rule in row_concats(substitution.converter)}


def packed_shard(tensor: Any) -> shards.Shard | None:
    """How ``tensor`` (a parameter) is packed over ranks, or ``None`` when it is not.

    Packed: a DTensor split along dim 0 over a tensor-parallel mesh dimension of more
    than one rank. Refused: any other split besides it (FSDP2 over TP), which this module
    does not reorder.
    """
    shard = shards.parameter_shard(tensor, 0)
    if shard is None or not shard.packed or shard.ranks == 1:
        return None
    others = [p for p in tensor.placements if not p.is_replicate()]
    if len(others) > 1:
        raise ConversionError(
            f"a packed tensor-parallel parameter also split otherwise ({tensor.placements}) "
            "cannot give its state in the fused layout; shard it over the tensor-parallel "
            "mesh dimension only, or save with save_pretrained"
        )
    return shard


@dataclass(eq=False)
class PackedStateHook:
    """``state_dict`` post-hook of one replacement layer: packed shards become Shard(0) of
    the fused layout (see the module doc). Picklable and copyable with its module."""

    #: layer-relative key of each packed parameter -> its parts' extents (:func:`packed_sizes`)
    sizes: dict[str, list[int]]

    def __call__(
        self,
        module: nn.Module,
        state_dict: MutableMapping[str, Any],
        prefix: str,
        local_metadata: Mapping[str, Any],
    ) -> None:
        for key, sizes in self.sizes.items():
            value = state_dict.get(prefix + key)
            if value is None:
                continue
            shard = packed_shard(value)
            # a placeholder on the meta device (transformers reads the keys before it
            # loads) holds nothing to reorder: no collective for it
            if shard is not None and not value.to_local().is_meta:
                state_dict[prefix + key] = fused_global(value, sizes, shard)

    def __repr__(self) -> str:
        return f"<PackedStateHook {sorted(self.sizes)}>"


@dataclass(eq=False)
class PackedLoadHook:
    """``load_state_dict`` pre-hook of one replacement layer: what is given for a packed
    sharded parameter is read as the fused layout and packed for this rank."""

    #: as :attr:`PackedStateHook.sizes`
    sizes: dict[str, list[int]]

    def __call__(
        self,
        module: nn.Module,
        state_dict: MutableMapping[str, Any],
        prefix: str,
        local_metadata: Mapping[str, Any],
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        for key, sizes in self.sizes.items():
            given = state_dict.get(prefix + key)
            if given is None:
                continue
            try:
                param = module.get_parameter(key)
            except AttributeError:
                continue
            shard = packed_shard(param)
            if shard is None or is_own(given, param):
                continue
            state_dict[prefix + key] = packed_local(given, param, sizes, shard, prefix + key)

    def __repr__(self) -> str:
        return f"<PackedLoadHook {sorted(self.sizes)}>"


def install_packed_state_hooks(
    layer: nn.Module, substitution: Substitution, config: PreTrainedConfig
) -> bool:
    """Give ``layer`` the state hooks of its packed parameters (none when it packs none);
    whether it has them.

    Idempotent. Inert unless the layer is sharded with tensor parallelism: each hook
    looks at the parameters' placements when it runs.
    """
    sizes = packed_sizes(substitution, config)
    if not sizes:
        return False
    for hook in layer._state_dict_hooks.values():
        if isinstance(hook, PackedStateHook):
            return True
    layer.register_state_dict_post_hook(PackedStateHook(sizes))  # type: ignore[no-untyped-call]
    layer.register_load_state_dict_pre_hook(PackedLoadHook(dict(sizes)))  # type: ignore[no-untyped-call]
    return True


# --- the two conversions --------------------------------------------------------------------


def fused_global(param: Any, sizes: list[int], shard: shards.Shard) -> Any:
    """A DTensor ``Shard(0)`` of the fused layout holding what packed ``param`` holds.

    A collective over ``shard.group``: each part is gathered whole, and this rank keeps
    its stretch of their concatenation.
    """
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        local = param.to_local()
        parts = torch.split(local, shards.local_part_sizes(sizes, shard), dim=0)
        whole = torch.cat(shards.gather_parts(parts, sizes, 0, shard), dim=0)
        start, length = shards.stretch(whole.shape[0], shard)
        mine = whole.narrow(0, start, length).clone()
    return DTensor.from_local(
        mine,
        param.device_mesh,
        param.placements,
        run_check=False,
        shape=param.shape,
        stride=param.stride(),
    )


def packed_local(given: Any, param: Any, sizes: list[int], shard: shards.Shard, name: str) -> Any:
    """``given`` (the fused layout: a DTensor read by its placements, or a whole tensor)
    as a DTensor holding this rank's packed shard, placed like ``param``."""
    from torch.distributed.tensor import DTensor

    whole = given.full_tensor() if isinstance(given, DTensor) else given
    if tuple(whole.shape) != tuple(param.shape):
        raise ConversionError(
            f"loading {name}: the state gives shape {tuple(whole.shape)}, but the parameter "
            f"is {tuple(param.shape)} across its {shard.ranks} tensor-parallel ranks (the "
            "fused layout, whole); give the whole tensor, or a DTensor of it"
        )
    with torch.no_grad():
        pieces = []
        for part in torch.split(whole, sizes, dim=0):
            start, length = shards.stretch(part.shape[0], shard)
            pieces.append(part.narrow(0, start, length))
        local = torch.cat(pieces, dim=0).to(device=param.to_local().device)
    return DTensor.from_local(
        local,
        param.device_mesh,
        param.placements,
        run_check=False,
        shape=param.shape,
        stride=param.stride(),
    )
