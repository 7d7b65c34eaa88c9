"""PEFT's own save and load on a swapped model, in the original layout, exactly.

A LoRA adapter trained on a swapped model adapts fused modules (``qkv_proj``,
``gate_up_proj``); plain transformers + PEFT know only the original ones. Saved as PEFT
saves it, such an adapter would load into a plain model with its fused parts silently
left out. So, on a model with swapped layers:

- **save** — ``PeftModel.save_pretrained`` (which Trainer's checkpoints and
  ``push_to_hub`` call) writes what PEFT writes, then rewrites each adapter directory in
  the original layout with :mod:`layerswap.adapters`' exact conversion: a fused LoRA
  becomes one LoRA per original module, sharing ``A``, ``B`` split by rows, and
  ``adapter_config.json`` names the original modules.
- **load** — ``PeftModel.from_pretrained`` and ``PeftModel.load_adapter`` (which Trainer
  calls to resume and for the best model) given an original-layout adapter directory
  load a converted copy of it: parts that share ``A`` (as saved above) fuse back at the
  same rank, so a resumed run finds the shapes it saved; other parts fuse
  block-diagonally. What has no exact form (DoRA, LoRA biases, other PEFT types) is
  refused with a :class:`~layerswap.errors.ConversionError`, as before.

``get_peft_model_state_dict`` keeps answering in the model's own layout, like
``state_dict()``: it is the in-memory state PEFT's own loading reads back. An adapter
named by a hub id loads as PEFT loads it; its original-layout tensors are refused by
the swapped layers' load hook, loudly.

Why patches: PEFT has no extension point for a layout conversion of a dense layer (its
weight conversion is for mixture-of-experts checkpoints, load only), and both paths
choose the modules to inject from ``adapter_config.json`` before any weight is seen.
The advice is armed with the target check of :mod:`layerswap.peft_targets` (the first
swap in a process, ``lazy``: applied when PEFT is imported) and passes every call on a
model without swapped layers straight through.

Example::

    layerswap.swap(model, backend="fused")
    peft_model = get_peft_model(model, LoraConfig(target_modules="all-linear"))
    peft_model.save_pretrained("adapter")            # q_proj, k_proj, ... on disk
    PeftModel.from_pretrained(LlamaForCausalLM.from_pretrained(base), "adapter")  # plain
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from torch import nn

from layerswap.adapters import (
    _to_fused,
    _to_original,
    fused_groups,
    read_adapter,
    touches_fused,
    write_adapter,
)
from layerswap.model import unwrap
from layerswap.patching.wrap import bound_arguments

__all__ = ["ADVICE"]

SAVE = "peft.peft_model:PeftModel.save_pretrained"
LOAD = "peft.peft_model:PeftModel.load_adapter"
FROM_PRETRAINED = "peft.peft_model:PeftModel.from_pretrained"


def _save_in_original_layout(
    wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """Around ``PeftModel.save_pretrained``: PEFT saves, then each adapter is rewritten."""
    result = wrapped(*args, **kwargs)
    arguments = bound_arguments(wrapped, args, kwargs)
    if arguments is None or not arguments.get("is_main_process", True):
        return result
    groups = fused_groups(unwrap(instance, peft=True))
    if not groups:
        return result
    directory = Path(arguments["save_directory"])
    names = arguments.get("selected_adapters") or list(instance.peft_config)
    for name in names:
        where = directory if name == "default" else directory / name
        weights, config = read_adapter(where)
        if touches_fused(weights, groups) != "fused":
            continue
        weights, config = _to_original(weights, config, groups)
        write_adapter(where, weights, config, safe=arguments.get("safe_serialization", True))
    return result


@contextlib.contextmanager
def _fused_copy(model: nn.Module, source: Path) -> Iterator[Path | None]:
    """A temporary copy of the adapter at ``source`` in ``model``'s fused layout, or
    ``None`` when it needs none (no swapped layers, or not in the original layout)."""
    groups = fused_groups(unwrap(model, peft=True))
    if not groups or not (source / "adapter_config.json").is_file():
        yield None
        return
    weights, config = read_adapter(source)
    if touches_fused(weights, groups) != "original":
        yield None
        return
    weights, config = _to_fused(weights, config, groups)
    with tempfile.TemporaryDirectory(prefix="layerswap-adapter-") as copy:
        write_adapter(copy, weights, config)
        yield Path(copy)


def _source(arguments: dict[str, Any]) -> Path:
    extra = arguments.get("kwargs") or {}
    subfolder = extra.get("subfolder")
    root = Path(str(arguments["model_id"]))
    return root / subfolder if subfolder else root


def _load_converted(
    wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """Around ``PeftModel.from_pretrained`` and ``.load_adapter``: an original-layout
    adapter on a swapped model loads from a converted copy."""
    arguments = bound_arguments(wrapped, args, kwargs)
    if arguments is None:
        return wrapped(*args, **kwargs)
    model = arguments.get("model", instance)
    if not isinstance(model, nn.Module):
        return wrapped(*args, **kwargs)
    with _fused_copy(model, _source(arguments)) as copy:
        if copy is None:
            return wrapped(*args, **kwargs)
        arguments["model_id"] = str(copy)
        extra = dict(arguments.pop("kwargs", None) or {})
        extra.pop("subfolder", None)
        return wrapped(**arguments, **extra)


#: (target, advice) pairs armed beside PEFT's target check
ADVICE = (
    (SAVE, _save_in_original_layout),
    (LOAD, _load_converted),
    (FROM_PRETRAINED, _load_converted),
)
