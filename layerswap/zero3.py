"""DeepSpeed ZeRO-3: every place layerswap touches its parameter partitioning, in one module.

Under ZeRO-3 each parameter holds only this rank's slice: outside a gathering it is a
tensor of shape ``(0,)`` (its full shape is ``param.ds_shape``), and DeepSpeed gathers it
around its module's ``forward``. Models built inside ``deepspeed.zero.Init`` (what
``from_pretrained`` enters when transformers' ``HfDeepSpeedConfig`` says ZeRO-3) are
partitioned as each module finishes ``__init__``. So layerswap

- builds the layers and tiny models of its own checks (the structure probe, the proof)
  outside that context (:func:`outside_partitioning`), where they stay whole;
- converts a partitioned layer while its parameters are gathered (:func:`gathered`) and
  partitions the new tensors of the replacement like the rest (:func:`partition_like`);
- gathers ``lm_head.weight`` for the fused head's loss, which reads it outside
  ``lm_head.forward``.

DeepSpeed is never imported here unless it already is: without it nothing is
partitioned and each function is a no-op.

Example::

    from layerswap import zero3

    with zero3.outside_partitioning():
        probe = LlamaDecoderLayer(config, 0)      # whole, even inside zero.Init
    with zero3.gathered(layer.parameters()):
        ...                                       # full tensors on every rank
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from layerswap import hf_internals

__all__ = [
    "engine_hooked",
    "full_shape",
    "gathered",
    "is_partitioned",
    "is_partitioning_hook",
    "outside_partitioning",
    "partition_like",
]

_PARTITION_MODULE = "deepspeed.runtime.zero.partition_parameters"


def is_partitioned(tensor: Any) -> bool:
    """Whether ``tensor`` is a ZeRO-3 parameter (its data may be this rank's slice only)."""
    return hasattr(tensor, "ds_id") and hasattr(tensor, "ds_shape")


def full_shape(tensor: Any) -> torch.Size:
    """``tensor``'s shape, or a ZeRO-3 parameter's whole shape (its own is this rank's
    partition: ``(0,)`` outside a gather)."""
    return torch.Size(tensor.ds_shape) if is_partitioned(tensor) else tensor.shape


def engine_hooked(model: nn.Module) -> bool:
    """Whether a DeepSpeed engine has taken ``model`` (``deepspeed.initialize``): its modules
    carry the hooks that gather parameters, and its optimizer holds their partitions."""
    return any(hasattr(module, "ds_grads_remaining") for module in model.modules())


def is_partitioning_hook(hook: Any) -> bool:
    """Whether a module hook is one of the DeepSpeed engine's own (gather, release, prefetch;
    some wrapped by its profiling helpers, so told by their module, not their name)."""
    return str(getattr(hook, "__module__", "") or "").startswith("deepspeed.")


@contextlib.contextmanager
def outside_partitioning() -> Iterator[None]:
    """Modules built inside the block are whole, even inside ``deepspeed.zero.Init``.

    Pauses DeepSpeed's construction-time partitioning (``partition_parameters``'
    ``shutdown_init_context``/``restore_init_context``, the pair DeepSpeed documents for
    starting an engine inside ``zero.Init``) and transformers' ZeRO-3 switch
    (``is_deepspeed_zero3_enabled()``, read by ``PreTrainedModel`` construction), and
    restores both on exit, on an exception too.
    """
    partitioning = sys.modules.get(_PARTITION_MODULE)
    context = getattr(partitioning, "top_level_context", None)
    paused = partitioning is not None and bool(getattr(context, "patched", False))
    if paused:
        partitioning.shutdown_init_context()  # type: ignore[union-attr]
    try:
        with hf_internals.zero3_switch_off():
            yield
    finally:
        if paused:
            partitioning.restore_init_context()  # type: ignore[union-attr]


@contextlib.contextmanager
def gathered(params: Iterable[torch.Tensor], *, modifier_rank: int | None = None) -> Iterator[None]:
    """Inside the block the ZeRO-3 parameters among ``params`` hold their full tensors.

    ``deepspeed.zero.GatheredParameters``: with ``modifier_rank=None`` read-only (each
    parameter is partitioned again on exit, changes dropped); with a rank, that rank's
    values are broadcast and partitioned on exit. Nothing happens for parameters that
    are not partitioned (no DeepSpeed, ZeRO-1/2, a model loaded whole) or gathered already.
    """
    # only those not gathered already: DeepSpeed partitions every listed one on exit, also
    # one a running module's hook gathered (or a persistent one, never partitioned)
    partitioned = [param for param in params if _not_available(param)]
    if not partitioned:
        yield
        return
    import deepspeed  # type: ignore[import-untyped,import-not-found,unused-ignore]

    with deepspeed.zero.GatheredParameters(partitioned, modifier_rank=modifier_rank):
        yield


def _not_available(param: torch.Tensor) -> bool:
    status = getattr(param, "ds_status", None) if is_partitioned(param) else None
    return getattr(status, "name", None) == "NOT_AVAILABLE"


def partition_like(module: nn.Module, like: torch.Tensor) -> None:
    """Partition ``module``'s whole parameters as ZeRO-3 partitioned ``like``.

    ``deepspeed.zero.Init(module=...)``, over ``like``'s process group and in its dtype
    (a replacement layer's new tensors join the model's partitioning); parameters already
    partitioned are left as they are. Every rank must call it (it broadcasts rank 0's
    values, which are equal here: each rank converted the same gathered weights).
    """
    if not is_partitioned(like) or all(is_partitioned(p) for p in module.parameters()):
        return
    import deepspeed  # type: ignore[import-untyped,import-not-found,unused-ignore]

    deepspeed.zero.Init(
        module=module,
        data_parallel_group=getattr(like, "ds_process_group", None),
        config_dict_or_path=_deepspeed_config_dict(),
        dtype=like.dtype,
        mem_efficient_linear=False,
    )


def _deepspeed_config_dict() -> dict[str, Any] | None:
    hf_config = hf_internals.hf_deepspeed_config()
    return None if hf_config is None else dict(hf_config.config)
