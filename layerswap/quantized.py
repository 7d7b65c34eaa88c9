"""Quantized models and swapped layers: which quantizers load and save, and how.

``from_pretrained(..., quantization_config=...)`` inside :func:`layerswap.use`
concatenates q/k/v (gate/up) first and quantizes the fused tensor. Saving must write
every tensor the quantizer keeps for it under the original modules, and transformers'
revert step knows only the exact name each layerswap rule gave (``qkv_proj.weight``),
not the ones a quantizer adds (torchao ``_weight_qdata``, bitsandbytes ``SCB``). So a
quantizer is declared here, as data, with what it keeps beside a weight and how each
of those splits back (:class:`QuantizedLayout`):

- **torchao** — the weight is a tensor subclass quantized per output row (int8
  weight-only: ``block_size`` ``[1, in]``); its rows narrow exactly to each part, and
  torchao's own flattening then writes ``q_proj._weight_qdata``, ``_weight_scale``...
  A subclass that cannot be narrowed along its rows is refused when saving.
- **bitsandbytes 8-bit** — the int8 weight and its per-row ``SCB`` split by rows;
  ``weight_format`` is written for each part.
- **bitsandbytes 4-bit** — loads; saving is refused before anything is written: the
  packed blocks, ``absmax`` and ``quant_state`` cover the flattened fused weight, and
  layerswap does not cut them back per part (exact only where the parts end on block
  boundaries and without nested quantization).
- **optimum-quanto** and quantizers not declared here — refused when loading, before
  transformers' loader runs; so is any checkpoint already quantized (``pre_quantized``):
  layerswap fuses unquantized tensors only.

While a quantized swapped model saves, its layers' ``state_dict`` answers in the
original layout (:func:`original_layout_state`); :mod:`layerswap.saving` then checks
the names written.

Example::

    with layerswap.use("llama.decoder.fused"):
        model = LlamaForCausalLM.from_pretrained(path, quantization_config=TorchAoConfig(...))
    model.save_pretrained(out)        # q_proj._weight_qdata, ... plain transformers loads it
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from layerswap import hf_internals
from layerswap.errors import ConversionError, RequirementError
from layerswap.state import fused_modules, layer_state_hooks
from layerswap.weights import row_concats

__all__ = [
    "LAYOUTS",
    "QuantizedLayout",
    "check_quantized_load",
    "check_quantized_save",
    "original_layout_state",
]

#: splits a tensor kept for a fused module into one tensor per original module
Split = Callable[[torch.Tensor, list[int]], list[torch.Tensor]]


def by_rows(tensor: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    """One tensor per part, ``sizes`` rows each (dim 0), sharing no storage.

    ``narrow``, not ``split``: torchao's tensor subclasses implement slicing along rows
    (what tensor parallelism needs) but not ``split_with_sizes``.
    """
    if tensor.dim() == 0 or tensor.shape[0] != sum(sizes):
        raise ConversionError(
            f"a tensor of shape {tuple(tensor.shape)} does not split into rows {sizes}"
        )
    parts, start = [], 0
    for size in sizes:
        parts.append(tensor.narrow(0, start, size).clone())
        start += size
    return parts


def copied(tensor: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    """The same tensor for every part (a per-tensor flag such as bitsandbytes' ``weight_format``)."""
    return [tensor.clone() for _ in sizes]


@dataclass(frozen=True)
class QuantizedLayout:
    """How one transformers quantizer keeps a weight, and what layerswap does with it.

    ``kind`` is the quantizer as :func:`layerswap.hf_internals.quantization_kind` names
    it; ``extras`` maps each tensor the quantizer keeps beside a fused module's weight
    (``SCB`` for ``qkv_proj.SCB``) to how it splits back; ``refused_load`` /
    ``refused_save`` say why (and what to do instead) where it cannot be done exactly.
    """

    kind: str
    label: str
    extras: Mapping[str, Split] = field(default_factory=dict)
    refused_load: str | None = None
    refused_save: str | None = None


LAYOUTS: Mapping[str, QuantizedLayout] = {
    layout.kind: layout
    for layout in (
        QuantizedLayout("torchao", "torchao"),
        QuantizedLayout(
            "bitsandbytes_8bit",
            "bitsandbytes 8-bit",
            extras={"SCB": by_rows, "weight_format": copied},
        ),
        QuantizedLayout(
            "bitsandbytes_4bit",
            "bitsandbytes 4-bit",
            refused_save=(
                "layerswap does not split its packed 4-bit blocks, absmax and quant_state "
                "back to q/k/v and gate/up; save the model unquantized, or load it in "
                "4-bit without use() to save it"
            ),
        ),
        QuantizedLayout(
            "quanto",
            "optimum-quanto",
            refused_load=(
                "transformers' quanto loader (QuantoQuantize) takes the first row of a "
                "converted weight, so the fused q/k/v and gate/up would be quantized "
                "wrong; load it unquantized inside use(), or with quanto outside use()"
            ),
        ),
    )
}


def _layout(hf_quantizer: Any) -> QuantizedLayout:
    kind = hf_internals.quantization_kind(hf_quantizer)
    return LAYOUTS.get(kind) or QuantizedLayout(
        kind,
        kind,
        refused_load=(
            "layerswap knows how torchao and bitsandbytes keep a fused weight, not this "
            "quantizer; load the model unquantized inside use(), or quantized outside use()"
        ),
    )


def check_quantized_load(hf_quantizer: Any, substitution_name: str) -> None:
    """Refuse, before transformers loads anything, a quantizer whose fused weights would
    load wrong; ``hf_quantizer`` ``None`` (not quantized) passes.

    Example::

        check_quantized_load(model.hf_quantizer, "llama.decoder.fused")
        # RequirementError: llama.decoder.fused: a model quantized with optimum-quanto ...
    """
    if hf_quantizer is None:
        return
    layout = _layout(hf_quantizer)
    if hf_internals.quantized_checkpoint(hf_quantizer):
        raise RequirementError(
            f"{substitution_name}: a checkpoint already quantized with {layout.label} cannot "
            "be loaded inside use(): layerswap does not fuse its quantized tensors; load the "
            "unquantized checkpoint with quantization_config inside use(), or this one "
            "outside use()"
        )
    if layout.refused_load is not None:
        raise RequirementError(
            f"{substitution_name}: a model quantized with {layout.label} cannot be loaded "
            f"inside use(): {layout.refused_load}"
        )


def check_quantized_save(model: nn.Module) -> None:
    """Refuse, before anything is written, saving a swapped model quantized with a
    quantizer whose fused tensors do not split back exactly."""
    hf_quantizer = hf_internals.quantizer_of(model)
    if hf_quantizer is None:
        return
    layout = _layout(hf_quantizer)
    reason = layout.refused_save or layout.refused_load
    if reason is not None:
        raise ConversionError(
            f"a swapped model quantized with {layout.label} cannot be saved in the "
            f"original layout: {reason}"
        )


@contextlib.contextmanager
def original_layout_state(model: nn.Module) -> Iterator[None]:
    """While inside, the quantized swapped layers of ``model`` give ``state_dict`` in the
    original layout: each fused weight and every tensor the quantizer keeps beside it
    split back to the original modules. Nothing changes for an unquantized model (its
    transformers revert step converts it).
    """
    hf_quantizer = hf_internals.quantizer_of(model)
    if hf_quantizer is None:
        yield
        return
    layout = _layout(hf_quantizer)
    with layer_state_hooks(model, lambda hook: _SplitFused(layout, hook.substitution, hook.config)):
        yield


class _SplitFused:
    """``state_dict`` post-hook of one quantized replacement layer: fused -> original."""

    def __init__(self, layout: QuantizedLayout, substitution: Any, config: Any) -> None:
        self.layout = layout
        self.config = hf_internals.text_config_of(config)
        self.fused = fused_modules(substitution.converter)
        self.rules = row_concats(substitution.converter)

    def __call__(
        self,
        module: nn.Module,
        state_dict: MutableMapping[str, Any],
        prefix: str,
        local_metadata: Mapping[str, Any],
    ) -> None:
        for rule in self.rules:
            key = prefix + rule.target
            if key not in state_dict:
                continue
            sizes = rule.part_sizes(self.config)
            parts = self._split(state_dict.pop(key), sizes, key)
            state_dict.update(
                (prefix + source, part) for source, part in zip(rule.sources, parts, strict=True)
            )
        for fused, originals in self.fused.items():
            self._split_extras(state_dict, prefix, fused, originals)

    def _split(self, tensor: torch.Tensor, sizes: list[int], key: str) -> list[torch.Tensor]:
        try:
            return by_rows(tensor, sizes)
        except (ConversionError, NotImplementedError, RuntimeError) as exc:
            raise ConversionError(
                f"{self.layout.label}: {key!r} ({type(tensor).__name__}) does not split "
                f"back into rows {sizes} exactly ({exc}); load the model unquantized "
                "inside use(), or quantized outside use(), to save it"
            ) from exc

    def _split_extras(
        self,
        state_dict: MutableMapping[str, Any],
        prefix: str,
        fused: str,
        originals: tuple[str, ...],
    ) -> None:
        weight = next(rule for rule in self.rules if rule.target == f"{fused}.weight")
        sizes = weight.part_sizes(self.config)
        under = f"{prefix}{fused}."
        for key in [key for key in state_dict if key.startswith(under)]:
            extra = key[len(under) :]
            split = self.layout.extras.get(extra)
            if split is None:
                raise ConversionError(
                    f"{self.layout.label} keeps {key!r} beside the fused weight, which "
                    f"layerswap cannot map to {', '.join(originals)}; load the model "
                    "unquantized inside use(), or quantized outside use(), to save it"
                )
            parts = split(state_dict.pop(key), sizes)
            state_dict.update(
                (f"{prefix}{original}.{extra}", part)
                for original, part in zip(originals, parts, strict=True)
            )
