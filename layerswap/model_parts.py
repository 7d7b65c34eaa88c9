"""A model as coverage describes it: its decoder layers (or, for a model type no family
covers, its language model's blocks) and the modules outside them that hold tensors, as
readable text (:class:`~layerswap.slots.ModelParts`).

Example::

    parts = model_parts(model, layerswap.get_family("qwen3"))
    parts.layers_text      # "model.layers.0-3 (Qwen3DecoderLayer)"
"""

from __future__ import annotations

from typing import Any

import torch

from layerswap.family import Family
from layerswap.model import decoder_layers
from layerswap.slots import ModelParts
from layerswap.spans import index_spans

__all__ = ["model_parts"]


def _layer_span(names: list[str]) -> str:
    """``model.layers.0-3``, or ``model.layers.0, 2-3`` where layers in between are kept."""
    if not names:
        return "-"
    prefix = names[0].rpartition(".")[0]
    indices = [int(n.rpartition(".")[2]) for n in names if n.rpartition(".")[2].isdigit()]
    if len(indices) != len(names) or any(n.rpartition(".")[0] != prefix for n in names):
        return f"{names[0]}-{names[-1].rpartition('.')[2]}"
    return f"{prefix}.{index_spans(indices)}"


def _holds_tensors(module: torch.nn.Module) -> bool:
    return bool(module._parameters) or bool(module._buffers)


def model_parts(model: torch.nn.Module, family: Family) -> ModelParts:
    """``model``'s decoder layers and the modules outside them that hold tensors."""
    layers = decoder_layers(model) if family.decoder else _repeated_blocks(model)
    layer_names = [name for name, _ in layers]
    kinds = sorted({type(layer).__name__ for _, layer in layers})
    outside: list[str] = []
    listed: list[str] = []
    for name, module in model.named_modules():
        if (
            not name
            or any(name == layer or name.startswith(layer + ".") for layer in layer_names)
            or any(name.startswith(parent + ".") for parent in listed)
            or not _holds_tensors(module)
        ):
            continue
        outside.append(f"{name} ({type(module).__name__})")
        if name.rpartition(".")[2].isdigit():  # a kept layer: its modules go with it
            listed.append(name)
    text = f"{_layer_span(layer_names)} ({', '.join(kinds)})"
    return ModelParts(model, family, layers, text, tuple(outside))


def _repeated_blocks(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The blocks of a model no family describes: the longest list of modules it holds
    (GPT-2's ``transformer.h``), by qualified name; none where it holds no list."""
    lists = [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.ModuleList) and len(module) > 0
    ]
    config: Any = getattr(model, "config", None)
    layers = getattr(config.get_text_config(), "num_hidden_layers", None) if config else None
    get_decoder: Any = getattr(model, "get_decoder", None)
    decoder = get_decoder() if callable(get_decoder) else None

    def rank(found: tuple[str, torch.nn.ModuleList]) -> tuple[bool, bool, bool, int]:
        # a list of the text config's length, inside the decoder, of modules holding more
        # than one parameter tensor (not an embedding per codebook), the longest
        blocks = found[1]
        inside = decoder is not None and any(m is blocks for m in decoder.modules())
        blocky = len(list(blocks[0].parameters())) > 1
        return len(blocks) == layers, inside, blocky, len(blocks)

    if not lists:
        return []
    name, blocks = max(lists, key=rank)
    return [(f"{name}.{index}", block) for index, block in enumerate(blocks)]
