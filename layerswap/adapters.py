"""PEFT LoRA adapters across layouts: an adapter trained on either model works on the other.

A swapped layer fuses modules (``q_proj``/``k_proj``/``v_proj`` into ``qkv_proj``,
``gate_proj``/``up_proj`` into ``gate_up_proj``), so an adapter's module names depend
on the layout it was trained in. Both directions are exact:

- **original -> swapped** (:func:`load_adapter`): the LoRA pairs of a fused group
  become one pair on the fused module, ``A`` stacked (rank ``r_q + r_k + r_v``) and ``B``
  block-diagonal; a part the adapter does not target gets zero rows of ``B`` (its
  output is untouched), and a part with another scaling has its block of ``B``
  rescaled so one scaling serves the pair. ``(B_bd A) x`` is then ``[B_q A_q x; B_k A_k x;
  B_v A_v x]``, which is what the original model adds.
- **swapped -> original** (:func:`save_adapter`): every part gets the fused ``A``
  and its rows of ``B``, with the fused scaling, so ``B_q A x`` is the ``q`` rows of
  ``B A x``. Columns of ``B`` that are zero for a part are dropped with their rows of
  ``A`` (a part never trained, or an adapter that came from the original layout,
  goes back to its own rank). The result is a plain PEFT adapter under the original
  module names, loadable by transformers + PEFT without layerswap.

What has no exact fused form is refused with a :class:`~layerswap.errors.ConversionError`
naming the adapter modules: DoRA, LoRA biases, PEFT types other than LoRA, and
``modules_to_save`` on a fused-away module. Plain PEFT on a swapped model cannot see
the fused-away names: ``PeftModel.from_pretrained`` of an original-layout adapter
fails when its weights load (layerswap's load hook refuses them, see
:mod:`layerswap.state`), and a new ``LoraConfig`` targets the fused modules by their
own names (``target_modules=["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]``).

Example::

    layerswap.swap(model, backend="fused")
    peft_model = layerswap.adapters.load_adapter(model, "adapter-trained-on-original")
    ...                                           # train or run it
    layerswap.adapters.save_adapter(peft_model, "adapter-for-plain-transformers")
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from layerswap.errors import CheckpointError, ConversionError
from layerswap.model import decoder_layers, layer_config, substitution_of, unwrap
from layerswap.weights import Concat

if TYPE_CHECKING:
    from peft import PeftModel

    from layerswap.substitution import Substitution

__all__ = [
    "AdapterLayout",
    "FusedGroup",
    "adapter_layout",
    "fused_groups",
    "load_adapter",
    "read_adapter",
    "save_adapter",
    "touches_fused",
    "write_adapter",
]

# PEFT's serialized adapter keys start here (the PeftModel's base model wrapper)
_PREFIX = "base_model.model."
_LORA_LEAVES = ("lora_A.weight", "lora_B.weight")


@dataclass(frozen=True)
class FusedGroup:
    """One fused module of one swapped layer and the original modules it holds, in order.

    ``fused`` and ``parts`` are module paths in the base model
    (``"model.layers.0.self_attn.qkv_proj"``); ``sizes`` are the parts' output sizes.
    """

    fused: str
    parts: tuple[str, ...]
    sizes: tuple[int, ...]


def fused_groups(model: nn.Module) -> list[FusedGroup]:
    """Every fused module of ``model``'s swapped layers (empty for a model with none).

    Read from each layer's substitution: its converter's concatenations of ``.weight``
    tensors along the output dimension. Example::

        [g.fused for g in fused_groups(model)][:2]
        # ['model.layers.0.self_attn.qkv_proj', 'model.layers.0.mlp.gate_up_proj']
    """
    groups: list[FusedGroup] = []
    config = getattr(model, "config", None)
    for name, layer in decoder_layers(model):
        sub = substitution_of(layer)
        if sub is None or config is None:
            continue
        text_config = layer_config(config)
        for rule in getattr(sub.converter, "rules", ()):
            if not (isinstance(rule, Concat) and rule.target.endswith(".weight") and rule.dim == 0):
                continue
            groups.append(
                FusedGroup(
                    fused=f"{name}.{rule.target.removesuffix('.weight')}",
                    parts=tuple(f"{name}.{s.removesuffix('.weight')}" for s in rule.sources),
                    sizes=tuple(rule.part_sizes(text_config)),
                )
            )
    return groups


# --- what an adapter holds ---------------------------------------------------------------


def _adapted_modules(weights: Mapping[str, torch.Tensor]) -> dict[str, dict[str, str]]:
    """Module path -> {leaf after the module path: full key}, for every adapter key."""
    modules: dict[str, dict[str, str]] = {}
    for key in weights:
        path = key.removeprefix(_PREFIX)
        match = re.match(r"(.+?)\.(lora_\w+.*)$", path)
        module, leaf = (match.group(1), match.group(2)) if match else path.rpartition(".")[::2]
        modules.setdefault(module, {})[leaf] = key
    return modules


def _rank_of(weights: Mapping[str, torch.Tensor], leaves: Mapping[str, str]) -> int | None:
    """The LoRA rank of an adapted module (a linear one's ``lora_A``, an embedding's
    ``lora_embedding_A``); ``None`` for a module that is no LoRA pair (a module saved whole,
    ``modules_to_save``; trainable tokens), which goes through as it is."""
    for leaf in ("lora_A.weight", "lora_embedding_A"):
        if leaf in leaves:
            return int(weights[leaves[leaf]].shape[0])
    return None


def _scaling(alpha: float, rank: int, rslora: bool) -> float:
    return alpha / math.sqrt(rank) if rslora else alpha / rank


def _alpha_for(scaling: float, rank: int, rslora: bool) -> float:
    return scaling * math.sqrt(rank) if rslora else scaling * rank


def _pattern_value(patterns: Mapping[str, Any] | None, module: str, default: Any) -> Any:
    """PEFT's per-module value: the first pattern matching ``module``, else ``default``."""
    for pattern, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({pattern})$", module):
            return value
    return default


def _refuse(config: Any, touched: list[str], direction: str) -> None:
    """Raise for adapters with no exact form in the other layout, naming their modules."""
    from peft import PeftType

    shown = ", ".join(touched[:4]) + (f" (+{len(touched) - 4} more)" if len(touched) > 4 else "")
    reason = None
    if config.peft_type != PeftType.LORA:
        reason = f"it is a {config.peft_type.value} adapter; only LoRA converts"
    elif getattr(config, "use_dora", False):
        reason = "it uses DoRA, whose magnitude vectors are not converted"
    elif getattr(config, "lora_bias", False):
        reason = "it has LoRA biases (lora_bias=True), which are not converted"
    elif getattr(config, "target_parameters", None):
        reason = "it targets parameters (target_parameters), which are not converted"
    if reason is not None:
        raise ConversionError(
            f"cannot move this adapter {direction}: {reason}. It adapts {shown}, which the "
            "swapped layers fuse; train it on the layout it will be used in"
        )


# --- original layout -> fused ---------------------------------------------------------------


def _to_fused(
    weights: Mapping[str, torch.Tensor], config: Any, groups: list[FusedGroup]
) -> tuple[dict[str, torch.Tensor], Any]:
    """An original-layout adapter (weights, config) for the swapped model."""
    modules = _adapted_modules(weights)
    part_to_group = {part: group for group in groups for part in group.parts}
    touched = sorted(module for module in modules if module in part_to_group)
    if not touched:
        return dict(weights), config
    _refuse(config, touched, "onto the swapped model")
    saved = set(getattr(config, "modules_to_save", None) or ())
    leaves = {part.rpartition(".")[2] for part in part_to_group}
    if saved & leaves:
        raise ConversionError(
            f"cannot move this adapter onto the swapped model: modules_to_save "
            f"{sorted(saved & leaves)} names modules the swapped layers fuse"
        )
    for module in touched:
        extra = sorted(set(modules[module]) - set(_LORA_LEAVES))
        if extra:
            raise ConversionError(
                f"cannot move adapter module {module!r} onto the swapped model: it holds "
                f"{extra}, and only plain LoRA pairs (lora_A, lora_B) convert"
            )
    rslora = bool(getattr(config, "use_rslora", False))
    converted = {
        key: value
        for module, leaves_of in modules.items()
        if module not in part_to_group
        for key, value in ((k, weights[k]) for k in leaves_of.values())
    }
    ranks: dict[str, int] = {}
    alphas: dict[str, float] = {}
    for module in modules:
        rank = None if module in part_to_group else _rank_of(weights, modules[module])
        if rank is not None:  # a LoRA module the swap keeps (not one saved whole)
            ranks[module] = rank
            alphas[module] = float(_pattern_value(config.alpha_pattern, module, config.lora_alpha))
    for group in dict.fromkeys(part_to_group[module] for module in touched):
        present = [part for part in group.parts if part in modules]
        shared = _shared_pair(weights, config, modules, group, present, rslora)
        if shared is not None:  # the parts share A (as save_adapter writes them): rank kept
            a_shared, b_stacked, scaling = shared
            converted[f"{_PREFIX}{group.fused}.lora_A.weight"] = a_shared
            converted[f"{_PREFIX}{group.fused}.lora_B.weight"] = b_stacked
            ranks[group.fused] = int(a_shared.shape[0])
            alphas[group.fused] = _alpha_for(scaling, int(a_shared.shape[0]), rslora)
            continue
        a_parts, b_blocks, scalings = [], [], []
        for part in present:
            a = weights[modules[part]["lora_A.weight"]]
            b = weights[modules[part]["lora_B.weight"]]
            rank = int(a.shape[0])
            alpha = float(_pattern_value(config.alpha_pattern, part, config.lora_alpha))
            a_parts.append(a)
            b_blocks.append(b)
            scalings.append(_scaling(alpha, rank, rslora))
        fused_rank = sum(int(a.shape[0]) for a in a_parts)
        target = scalings[0]
        b_fused = b_blocks[0].new_zeros((sum(group.sizes), fused_rank))
        row, column = 0, 0
        for part, size in zip(group.parts, group.sizes, strict=True):
            if part in present:
                index = present.index(part)
                block = b_blocks[index]
                if block.shape[0] != size:
                    raise ConversionError(
                        f"adapter module {part!r}: lora_B has {block.shape[0]} rows, but the "
                        f"model's {part.rpartition('.')[2]} has {size} outputs"
                    )
                if scalings[index] != target:
                    block = block * (scalings[index] / target)
                b_fused[row : row + size, column : column + block.shape[1]] = block
                column += block.shape[1]
            row += size
        converted[f"{_PREFIX}{group.fused}.lora_A.weight"] = torch.cat(a_parts, dim=0)
        converted[f"{_PREFIX}{group.fused}.lora_B.weight"] = b_fused
        ranks[group.fused] = fused_rank
        alphas[group.fused] = _alpha_for(target, fused_rank, rslora)
    return converted, _explicit_config(config, ranks, alphas)


def _shared_pair(
    weights: Mapping[str, torch.Tensor],
    config: Any,
    modules: Mapping[str, Mapping[str, str]],
    group: FusedGroup,
    present: list[str],
    rslora: bool,
) -> tuple[torch.Tensor, torch.Tensor, float] | None:
    """(A, B, scaling) of the fused module when every part present has the same A and
    scaling: B stacks the parts' B by rows (zero rows for a part absent), rank unchanged.
    ``None`` when the parts differ (they then fuse block-diagonally)."""
    a_first = weights[modules[present[0]]["lora_A.weight"]]
    scaling: float | None = None
    blocks: list[torch.Tensor | None] = []
    for part, size in zip(group.parts, group.sizes, strict=True):
        if part not in modules:
            blocks.append(None)
            continue
        a = weights[modules[part]["lora_A.weight"]]
        b = weights[modules[part]["lora_B.weight"]]
        alpha = float(_pattern_value(config.alpha_pattern, part, config.lora_alpha))
        part_scaling = _scaling(alpha, int(a.shape[0]), rslora)
        if a.shape != a_first.shape or not torch.equal(a, a_first) or b.shape[0] != size:
            return None
        if scaling is not None and part_scaling != scaling:
            return None
        scaling = part_scaling
        blocks.append(b)
    if len(present) < 2 or scaling is None:
        return None  # one part alone: the block-diagonal form is the same and handles sizes
    rows = [
        b if b is not None else a_first.new_zeros((size, a_first.shape[0]))
        for b, size in zip(blocks, group.sizes, strict=True)
    ]
    return a_first, torch.cat(rows, dim=0), scaling


# --- fused -> original layout ---------------------------------------------------------------


def _to_original(
    weights: Mapping[str, torch.Tensor], config: Any, groups: list[FusedGroup]
) -> tuple[dict[str, torch.Tensor], Any]:
    """A swapped-model adapter (weights, config) under the original module names."""
    modules = _adapted_modules(weights)
    by_fused = {group.fused: group for group in groups}
    touched = sorted(module for module in modules if module in by_fused)
    if not touched:
        return dict(weights), config
    _refuse(config, touched, "to the original layout")
    for module in touched:
        extra = sorted(set(modules[module]) - set(_LORA_LEAVES))
        if extra:
            raise ConversionError(
                f"cannot save adapter module {module!r} in the original layout: it holds "
                f"{extra}, and only plain LoRA pairs (lora_A, lora_B) convert"
            )
    rslora = bool(getattr(config, "use_rslora", False))
    converted: dict[str, torch.Tensor] = {}
    ranks: dict[str, int] = {}
    alphas: dict[str, float] = {}
    for module, leaves_of in modules.items():
        alpha = float(_pattern_value(config.alpha_pattern, module, config.lora_alpha))
        if module not in by_fused:
            converted.update((key, weights[key]) for key in leaves_of.values())
            found = _rank_of(weights, leaves_of)
            if found is not None:  # a LoRA module (not one saved whole): its own rank
                ranks[module], alphas[module] = found, alpha
            continue
        a = weights[leaves_of["lora_A.weight"]]
        rank = int(a.shape[0])
        b = weights[leaves_of["lora_B.weight"]]
        scaling = _scaling(alpha, rank, rslora)
        group = by_fused[module]
        blocks = torch.split(b, list(group.sizes), dim=0)
        used = [block.ne(0).any(dim=0) for block in blocks]
        anything = any(bool(columns.any()) for columns in used)
        for part, block, columns in zip(group.parts, blocks, used, strict=True):
            if anything and not bool(columns.any()):
                continue  # this part adds nothing: leave it out, as the original did
            keep = columns if bool(columns.any()) else torch.ones_like(columns)
            part_rank = int(keep.sum())
            converted[f"{_PREFIX}{part}.lora_A.weight"] = a[keep].clone()
            converted[f"{_PREFIX}{part}.lora_B.weight"] = block[:, keep].clone()
            ranks[part] = part_rank
            alphas[part] = _alpha_for(scaling, part_rank, rslora)
    return converted, _explicit_config(config, ranks, alphas)


def _explicit_config(config: Any, ranks: Mapping[str, int], alphas: Mapping[str, float]) -> Any:
    """``config`` targeting exactly ``ranks``' modules, each with its own rank and alpha."""
    import copy

    new = copy.deepcopy(config)
    new.target_modules = sorted(ranks)
    new.rank_pattern = {re.escape(module): rank for module, rank in ranks.items()}
    new.alpha_pattern = {re.escape(module): alpha for module, alpha in alphas.items()}
    new.layers_to_transform = None
    new.layers_pattern = None
    new.exclude_modules = None
    return new


# --- adapter directories --------------------------------------------------------------------


def touches_fused(weights: Mapping[str, torch.Tensor], groups: list[FusedGroup]) -> str | None:
    """The layout an adapter's weights are in where it differs: ``"original"`` when it adapts
    a module the swapped layers fused away, ``"fused"`` when it adapts a fused module,
    ``None`` when it adapts neither (it loads the same in both)."""
    modules = set(_adapted_modules(weights))
    if modules & {part for group in groups for part in group.parts}:
        return "original"
    if modules & {group.fused for group in groups}:
        return "fused"
    return None


def read_adapter(directory: str | Path) -> tuple[dict[str, torch.Tensor], Any]:
    """(weights, config) of a PEFT adapter directory, as PEFT reads them.

    The directory is read as one (never looked up on the Hub): an
    ``adapter_config.json`` holding a ``peft_type``, and a weights file beside it; else
    :class:`~layerswap.errors.CheckpointError` says what is missing.
    """
    import json

    from peft import PeftConfig
    from peft.utils import load_peft_weights
    from peft.utils.constants import SAFETENSORS_WEIGHTS_NAME, WEIGHTS_NAME

    root = Path(directory)
    config_file = root / "adapter_config.json"
    if not config_file.is_file():
        raise CheckpointError(f"adapter {root}: no adapter_config.json there")
    try:
        declared = json.loads(config_file.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as error:
        raise CheckpointError(f"adapter {config_file}: not readable JSON ({error})") from error
    if not isinstance(declared, dict) or "peft_type" not in declared:
        raise CheckpointError(
            f"adapter {config_file}: no PEFT adapter config (a JSON object with a peft_type)"
        )
    if not any((root / name).is_file() for name in (SAFETENSORS_WEIGHTS_NAME, WEIGHTS_NAME)):
        raise CheckpointError(
            f"adapter {root}: no weights file ({SAFETENSORS_WEIGHTS_NAME} or {WEIGHTS_NAME})"
        )
    try:
        config = PeftConfig.from_pretrained(str(root))
        weights = dict(load_peft_weights(str(root), device="cpu"))
    except (OSError, TypeError, ValueError, KeyError) as error:
        raise CheckpointError(f"adapter {root}: {' '.join(str(error).split())}") from error
    return weights, config


def write_adapter(
    directory: str | Path, weights: Mapping[str, torch.Tensor], config: Any, *, safe: bool = True
) -> None:
    """Write a PEFT adapter directory: ``adapter_config.json`` and the weights file."""
    from peft.utils.constants import SAFETENSORS_WEIGHTS_NAME, WEIGHTS_NAME

    target = Path(directory)
    target.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(str(target))
    tensors = {key: value.detach().contiguous().cpu() for key, value in weights.items()}
    if safe:
        from safetensors.torch import save_file

        save_file(tensors, str(target / SAFETENSORS_WEIGHTS_NAME), metadata={"format": "pt"})
    else:
        torch.save(tensors, str(target / WEIGHTS_NAME))


@dataclass(frozen=True)
class AdapterLayout:
    """Which layout an adapter directory is in, for a family's swapped layers.

    ``layout`` is ``"original"`` (it adapts modules a swap fuses: plain transformers + PEFT
    load it whole), ``"fused"`` (it adapts fused modules a plain model does not have:
    plain PEFT would apply the rest and skip these silently), ``"mixed"`` (both) or
    ``"either"`` (neither kind: it loads the same onto both).
    """

    layout: str
    #: module names (the leaf, e.g. ``qkv_proj``) that only the swapped layers have
    fused: tuple[str, ...]
    #: module names the swap fuses away (``q_proj``, ...)
    original: tuple[str, ...]
    #: every adapted module name (leaf)
    adapted: tuple[str, ...]

    @property
    def plain_model_misses(self) -> tuple[str, ...]:
        """The adapted modules a plain (unswapped) model would silently skip."""
        return self.fused


def adapter_layout(directory: str | Path, substitution: Substitution) -> AdapterLayout:
    """The layout of the adapter at ``directory`` for a family's fused ``substitution``
    (the modules it fuses say which names are whose).

    Example::

        adapter_layout("my-adapter", layerswap.get("llama.decoder.fused")).layout  # "original"
    """
    rules = [
        rule
        for rule in getattr(substitution.converter, "rules", ())
        if isinstance(rule, Concat) and rule.target.endswith(".weight") and rule.dim == 0
    ]
    fused_leaves = {rule.target.removesuffix(".weight").rpartition(".")[2] for rule in rules}
    part_leaves = {
        source.removesuffix(".weight").rpartition(".")[2]
        for rule in rules
        for source in rule.sources
    }
    weights, _ = read_adapter(directory)
    adapted = sorted({module.rpartition(".")[2] for module in _adapted_modules(weights)})
    fused = tuple(leaf for leaf in adapted if leaf in fused_leaves)
    original = tuple(leaf for leaf in adapted if leaf in part_leaves)
    layout = {(True, True): "mixed", (True, False): "fused", (False, True): "original"}.get(
        (bool(fused), bool(original)), "either"
    )
    return AdapterLayout(layout, fused, original, tuple(adapted))


# --- public API -----------------------------------------------------------------------------


def load_adapter(
    model: nn.Module,
    adapter: str | Path,
    adapter_name: str = "default",
    *,
    is_trainable: bool = False,
) -> PeftModel:
    """``PeftModel.from_pretrained(model, adapter)`` that also takes the other layout.

    An adapter saved from the original model is converted for ``model``'s swapped
    layers (exactly, see the module docstring); any other adapter loads as PEFT loads
    it. Every LoRA weight of the adapter must land in the model, or
    :class:`~layerswap.errors.ConversionError` names what did not.

    Example::

        layerswap.swap(model, backend="fused")
        peft_model = load_adapter(model, "path/to/adapter", is_trainable=True)
    """
    from peft import get_peft_model, set_peft_model_state_dict

    weights, config = read_adapter(adapter)
    weights, config = _to_fused(weights, config, fused_groups(model))
    config.inference_mode = not is_trainable
    peft_model = get_peft_model(model, config, adapter_name=adapter_name)  # type: ignore[arg-type]
    result = set_peft_model_state_dict(peft_model, weights, adapter_name=adapter_name)
    lost = [key for key in result.missing_keys if ".lora_" in key and adapter_name in key]
    lost += [key for key in result.unexpected_keys if ".lora_" in key]
    if lost:
        raise ConversionError(
            f"adapter {str(adapter)!r}: {len(lost)} LoRA tensors did not load into "
            f"{type(model).__name__}, e.g. {lost[0]!r}"
        )
    if not is_trainable:
        peft_model.eval()
    return peft_model


def save_adapter(
    peft_model: PeftModel, directory: str | Path, adapter_name: str = "default"
) -> None:
    """Save an adapter of a swapped model under the original module names.

    The directory holds a plain PEFT adapter (``adapter_config.json``,
    ``adapter_model.safetensors``) that transformers + PEFT load onto the original
    model, no layerswap needed, computing what the swapped model computes.

    Example::

        save_adapter(peft_model, "out/adapter")
        PeftModel.from_pretrained(LlamaForCausalLM.from_pretrained(base), "out/adapter")
    """
    from peft import get_peft_model_state_dict

    config = peft_model.peft_config[adapter_name]
    weights = get_peft_model_state_dict(peft_model, adapter_name=adapter_name)
    weights, config = _to_original(weights, config, fused_groups(unwrap(peft_model, peft=True)))
    config.inference_mode = True
    write_adapter(directory, weights, config)
