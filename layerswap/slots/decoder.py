"""The ``decoder`` slot: every decoder layer, swapped on a built model and undone.

Layers are converted one at a time (:func:`layerswap.layers.convert_layer`). Tensors
that only change name (or not at all) move into the replacement as the very same
``Parameter`` objects; tensors that are concatenated are computed, and the original
parameters they came from are emptied (``param.data = <empty>``) right after their
layer is swapped. Peak extra memory is therefore about one layer. The original layer
objects are kept, so ``undo()`` puts them back (identity) and converts the weights back
into their very same ``Parameter`` objects, bitwise (concatenation and splitting are
exact). Every change a swap makes is recorded on its undo log
(:class:`layerswap.patching.undo.UndoLog`) as it is made.

Example::

    handle = layerswap.swap(model, "llama.decoder.fused")   # the decoder slot's swap
    print(handle.report())
    handle.undo()
"""

from __future__ import annotations

import functools
import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from layerswap import hf_internals, zero3
from layerswap.adapter_layers import is_adapter_layer
from layerswap.config_view import ModelConfig
from layerswap.decoder_handle import LayerRecord, LayerSwapHandle
from layerswap.errors import (
    ParallelismError,
    SubstitutionError,
    UnknownSubstitutionError,
)
from layerswap.layer_edits import layer_edit
from layerswap.layers import convert_back, convert_layer, layer_index, normal_tensors
from layerswap.loading import (
    adopt_constructed,
    conversion_transforms,
    loading_transforms,
    model_attributes,
    refuse_two_layouts,
)
from layerswap.model import (
    decoder_layers,
    locate,
    pretrained_ancestors,
    pretrained_owner,
    substitution_of,
)
from layerswap.parallel import refuse_foreign_styles
from layerswap.patching import patch, wrap
from layerswap.peft_targets import hold as hold_peft_targets
from layerswap.placement import Placement
from layerswap.placement_guard import guard
from layerswap.proof import ensure_proven
from layerswap.quantized import check_quantized_load
from layerswap.slots import ModelParts, Slot, rolling_back, undo_first
from layerswap.slots.layer_call import check_layer_call

if TYPE_CHECKING:
    from transformers import PreTrainedConfig

    from layerswap.family import Family
    from layerswap.patching import Scoped
    from layerswap.substitution import Substitution

__all__ = ["SLOT", "DecoderSlot", "LayerSwapHandle"]

# forward hooks on an original layer (transformers' hidden-state capture among them)
# keep firing on its replacement
_HOOK_DICTS = (
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
)


#: the replacement layers a live swap holds: its undo puts the original layers back
_HELD: weakref.WeakSet[nn.Module] = weakref.WeakSet()


# --- per-layer work ---------------------------------------------------------------------


def _carry_state(original: nn.Module, replacement: nn.Module) -> None:
    """What the model set on ``original`` besides its weights: hooks, checkpointing, offload."""
    for attribute in _HOOK_DICTS:
        hooks = getattr(original, attribute, None)
        if hooks:
            setattr(replacement, attribute, OrderedDict(hooks))
    for attribute in ("gradient_checkpointing", "_gradient_checkpointing_func"):
        if attribute in original.__dict__:
            setattr(replacement, attribute, original.__dict__[attribute])
    accelerate_hook = getattr(original, "_hf_hook", None)
    if accelerate_hook is not None:
        from accelerate.hooks import add_hook_to_module  # type: ignore[import-not-found]

        add_hook_to_module(replacement, accelerate_hook)


def _release(done: nn.Module, keeper: nn.Module) -> None:
    """Empty the tensors of ``done`` that ``keeper`` does not hold itself.

    The ``Parameter`` objects stay (``undo`` fills them again); their storage goes, so
    a swap or an undo never holds much more than one extra layer.
    """
    kept = {id(tensor) for tensor in keeper.state_dict(keep_vars=True).values()}
    for tensor in done.state_dict(keep_vars=True).values():
        if id(tensor) not in kept:
            tensor.data = torch.empty((0,), dtype=tensor.dtype, device=tensor.device)


@normal_tensors
def _swap_layer(
    root: nn.Module,
    name: str,
    layer: nn.Module,
    position: int,
    sub: Substitution,
    config: PreTrainedConfig,
) -> LayerRecord:
    parent, key = locate(root, name)
    partitioned = next((p for p in layer.parameters() if zero3.is_partitioned(p)), None)
    # a ZeRO-3 layer is converted from its gathered tensors; the replacement's new ones
    # (concatenations) are then partitioned like the rest, on every rank
    with zero3.gathered(layer.parameters()):
        replacement = convert_layer(
            layer,
            sub,
            config,
            layer_idx=layer_index(layer, position),
            where=f"layer {name!r}",
            wrap_errors=True,
        )
    if partitioned is not None:
        zero3.partition_like(replacement, partitioned)
    _carry_state(layer, replacement)
    name_in_owner, owner = pretrained_owner(root, name)
    installed = hf_internals.output_capture_installed(owner)
    if owner is not None and not installed:
        hf_internals.capture_like_original(replacement, owner, type(layer))
    elif owner is not None:
        # the layer's own hooks came with _carry_state; its modules of the original's
        # classes (an MoE block's router, for output_router_logits) get theirs here
        for child_name, child in replacement.named_children():
            hf_internals.capture_subtree(child, f"{name_in_owner}.{child_name}", owner)
    parent._modules[key] = replacement
    _HELD.add(replacement)
    _release(layer, replacement)
    return LayerRecord(
        name, parent, key, layer, replacement, type(replacement), owner, name_in_owner, installed
    )


@normal_tensors
def _restore_layer(record: LayerRecord, sub: Substitution, config: PreTrainedConfig) -> None:
    replacement = record.replacement
    assert replacement is not None, "restored twice"
    shared = {id(param) for param in replacement.parameters()}
    own = [param for param in record.original.parameters() if id(param) not in shared]
    # under ZeRO-3: read the replacement gathered, write the original's own parameters
    # gathered, and partition them again with the values written (rank 0's, equal on all)
    with zero3.gathered(replacement.parameters()), zero3.gathered(own, modifier_rank=0):
        convert_back(replacement, sub, config, into=record.original, where=f"layer {record.name!r}")
    record.parent._modules[record.key] = record.original
    hooked_meanwhile = not record.capture_installed and hf_internals.output_capture_installed(
        record.owner
    )
    if hooked_meanwhile and record.owner is not None:
        # transformers hooked the model while this layer was out: hook it now
        hf_internals.capture_subtree(record.original, record.name_in_owner, record.owner)
    _HELD.discard(replacement)
    _release(replacement, record.original)
    record.replacement = None


def _swap_left_out(layers: list[tuple[str, nn.Module]], family: Family) -> tuple[str, str] | None:
    """A module inside the blocks a replacement layer builds anew from the original's classes
    (``mlp="original"``: a mixture-of-experts block) whose class another substitution
    swapped, and which one: the replacement's block would not carry that swap."""
    if family.feed_forward.kind != "original":
        return None
    for name, layer in layers:
        block = getattr(layer, family.feed_forward.attribute, None)
        if not isinstance(block, nn.Module):
            continue
        for inner, module in block.named_modules():
            owner = getattr(type(module), "_layerswap_swapped_by", None)
            if isinstance(owner, str):
                return ".".join(
                    part for part in (name, family.feed_forward.attribute, inner) if part
                ), owner
    return None


def _refuse_unswappable(
    target: nn.Module,
    layers: list[tuple[str, nn.Module]],
    sub: Substitution,
    original_cls: type[nn.Module],
) -> None:
    """Raise, changing nothing, where ``target``'s decoder ``layers`` cannot take ``sub``:
    swapped already, wrapped by a PEFT adapter, holding another slot's swap the new layers
    would leave out, sharded, partitioned by ZeRO-3's engine, a subclass of the original,
    or none at all."""
    done = [name for name, layer in layers if substitution_of(layer) is not None]
    if done:
        owner = substitution_of(dict(layers)[done[0]])
        raise SubstitutionError(
            f"{len(done)} layers of this model are already swapped by "
            f"{getattr(owner, 'name', owner)}; {undo_first(owner)}"
        )
    adapted = next(
        (
            (f"{name}.{inner}", module)
            for name, layer in layers
            for inner, module in layer.named_modules()
            if inner and is_adapter_layer(module)
        ),
        None,
    )
    if adapted is not None:
        raise SubstitutionError(
            f"{sub.name}: {adapted[0]} is a PEFT adapter's {type(adapted[1]).__name__}, "
            "and this substitution converts the layers' own weights, which the adapter "
            "wraps; swap before get_peft_model (a new adapter then targets the fused "
            "modules, and one saved on the original layout loads converted), or "
            "merge_and_unload() first"
        )
    left_out = _swap_left_out(layers, sub.parts.family)
    if left_out is not None:
        where, swapper = left_out
        raise SubstitutionError(
            f"{sub.name}: {where} is swapped by {swapper}, and this substitution builds "
            f"each layer's {sub.parts.family.feed_forward.attribute} block anew from the original's "
            f"classes, which would leave {swapper} out while the layers are swapped; undo "
            f"{swapper} first, or build the model inside use() of both"
        )
    sharded = next(
        (
            f"{layer_name}.{param_name}"
            for layer_name, layer in layers
            for param_name, param in layer.named_parameters()
            if getattr(param, "placements", None) is not None
        ),
        None,
    )
    if sharded is not None:
        raise ParallelismError(
            f"{sub.name}: this model is already sharded ({sharded} is a DTensor), and a "
            "sharded parameter cannot be converted in place; swap before sharding "
            "(fully_shard after swap), or load it inside layerswap.use(...) with the "
            "distributed_config"
        )
    if zero3.engine_hooked(target):
        raise ParallelismError(
            f"{sub.name}: DeepSpeed ZeRO-3 has already taken this model "
            "(deepspeed.initialize or a Trainer's step), and its optimizer holds the "
            "partitions of the layers a swap would replace; swap before that (a model "
            "partitioned by zero.Init can be swapped), or load it inside "
            "layerswap.use(...)"
        )
    for name, layer in layers:
        if type(layer) is not original_cls:
            raise SubstitutionError(
                f"layer {name!r} is a {type(layer).__name__}, a subclass of "
                f"{original_cls.__name__}; {sub.name} replaces exact {original_cls.__name__} "
                "layers only, so it would drop that subclass's behaviour"
            )
    if not layers:
        raise SubstitutionError(f"no {original_cls.__name__} found in {type(target).__name__}")


def _refuse_edited(
    layers: list[tuple[str, nn.Module]],
    sub: Substitution,
    original_cls: type[nn.Module],
    text: PreTrainedConfig,
) -> None:
    """Raise at the first layer changed since ``text`` (the layers' config) built it,
    saying what changed (:mod:`layerswap.layer_edits`)."""
    for position, (name, layer) in enumerate(layers):
        try:
            with torch.device("meta"):
                built = original_cls(text, layer_index(layer, position))
        except Exception:  # a class that builds elsewhere only: not read
            continue
        what = layer_edit(layer, built)
        if what is not None:
            raise SubstitutionError(
                f"layer {name!r}: {what}; {sub.name} builds each layer anew from the config "
                "and the original's classes (the first-use proof too), so it would drop "
                "that change: set it in the config, or keep the original layers"
            )


class DecoderSlot(Slot):
    """Every decoder layer: a substitution puts its replacement layer in each one's place."""

    name = "decoder"
    description = "every decoder layer"
    proven_at_first_use = True
    replaces_layers = True

    def original(self, family: Family) -> str:
        return f"{family.module}:{family.decoder}"

    def swap(self, target: nn.Module, sub: Substitution) -> LayerSwapHandle:
        original_cls, replacement_cls = sub.classes()
        config = getattr(target, "config", None)
        if config is None:
            raise SubstitutionError(f"{type(target).__name__} has no config; swap() needs one")
        view = ModelConfig.of(config)  # unwrapped here, once: every step below is handed it
        layers = decoder_layers(target)
        _refuse_unswappable(target, layers, sub, original_cls)
        # before any layer changes: a drifted contract refuses here
        with view.current():  # prepare is handed the config itself, unwrapped already
            self.prepare(sub, config, Placement.of(target))
        _refuse_edited(layers, sub, original_cls, view.text)
        names = [name for name, _ in layers]
        records: list[LayerRecord] = []
        with rolling_back(sub.name) as changes:
            changes.record(guard(target, sub, view, proven=True))
            for position, (name, layer) in enumerate(layers):
                record = _swap_layer(target, name, layer, position, sub, view.text)
                records.append(record)
                changes.record(functools.partial(_restore_layer, record, sub, view.text))
            for _, ancestor in pretrained_ancestors(target, names):
                transforms = conversion_transforms(ancestor, sub, view=view)
                attributes = model_attributes(ancestor, sub, replacement_cls, transforms)
                for attribute, value in attributes.items():
                    changes.set_attribute(ancestor, attribute, value)
            # until undo, a new PEFT adapter cannot silently miss fused modules
            changes.record(hold_peft_targets(target))
        return LayerSwapHandle(target, sub, records, changes)

    @torch.no_grad()
    @normal_tensors
    def rebuild_originals(self, target: nn.Module, sub: Substitution) -> int:
        rebuilt = 0
        for position, (name, layer) in enumerate(decoder_layers(target)):
            owner = substitution_of(layer)
            if owner is None:
                continue
            if owner.name != sub.name:
                raise SubstitutionError(
                    f"layer {name!r} was swapped by {owner.name}, not by {sub.name}"
                )
            original = convert_back(
                layer, sub, target.config, layer_idx=layer_index(layer, position)
            )
            parent, key = locate(target, name)
            parent._modules[key] = original
            rebuilt += 1
        return rebuilt

    def construction(self, sub: Substitution) -> list[Scoped]:
        """The original class name patched to the replacement, the replacement adopted when
        its model finishes ``__init__``, and the checkpoint conversions added to loading."""
        replacement = sub.replacement_class()
        # fails now, not at construction, if transformers lost the class or calls it with a
        # parameter the replacement does not handle
        from layerswap.substitution import check_call_contract

        check_call_contract(sub)

        def adopt(wrapped: Callable[..., Any], instance: Any, args: Any, kwargs: Any) -> Any:
            result = wrapped(*args, **kwargs)
            adopt_constructed(instance, sub, replacement)
            return result

        def with_conversions(
            wrapped: Callable[..., Any], instance: Any, args: Any, kwargs: Any
        ) -> Any:
            model = args[0] if args else kwargs["model"]
            if any(type(module) is replacement for module in model.modules()):
                # a quantizer that would load the fused weights wrong: refused before it runs
                hf_quantizer = hf_internals.quantizer_of_conversion_call(args, kwargs)
                check_quantized_load(hf_quantizer, sub.name)
            transforms = list(wrapped(*args, **kwargs))
            return transforms + loading_transforms(model, sub, replacement, transforms)

        def checked_load(wrapped: Callable[..., Any], instance: Any, args: Any, kwargs: Any) -> Any:
            # before any tensor loads: the checkpoint's names, and the plan as resolved
            model, state, transforms = hf_internals.load_call_parts(args, kwargs)
            refuse_two_layouts(model, list(state), transforms, sub, replacement)
            layers = [name for name, m in model.named_modules() if type(m) is replacement]
            refuse_foreign_styles(model, sub, layers)
            return wrapped(*args, **kwargs)

        return [
            patch(sub.original, replacement),
            wrap(hf_internals.POST_INIT_TARGET, adopt),
            wrap(hf_internals.CONVERSION_MAPPING_TARGET, with_conversions),
            wrap(hf_internals.LOAD_STATE_TARGET, checked_load),
            wrap(hf_internals.ZERO3_LOAD_STATE_TARGET, checked_load),
        ]

    def held(self, model: nn.Module) -> list[tuple[str, str]]:
        found = []
        for name, module in model.named_modules():
            owner = substitution_of(module)
            if owner is not None and module in _HELD:
                found.append((name, owner.name))
        return found

    def swapped_by(self, model: nn.Module) -> str | None:
        try:
            layers = decoder_layers(model)
        except UnknownSubstitutionError:  # no family fits: no decoder swap can hold it
            return None
        for _, layer in layers:
            owner = substitution_of(layer)
            if owner is not None:
                return owner.name
        return None

    def prepare(
        self,
        sub: Substitution,
        config: PreTrainedConfig,
        placement: Placement | None = None,
    ) -> None:
        """The call contract and structure, then the first-use proof for ``config`` (in
        the model's ``placement``: its dtype too where it is bfloat16 or float16, on its
        device where the substitution runs there)."""
        view = ModelConfig.of(config)  # a swap's, unwrapped already
        super().prepare(sub, view)
        ensure_proven(sub, view, placement)

    def check_call(self, sub: Substitution, config: PreTrainedConfig | None) -> None:
        check_layer_call(sub, config)

    def coverage(self, parts: ModelParts) -> tuple[tuple[str, ...], tuple[str, ...]]:
        family, layers = parts.family, parts.layers
        if family.feed_forward.kind != "original":
            return (parts.layers_text,), parts.outside
        # a mixture-of-experts block stays the original's module inside the replacement
        blocks = sorted(
            {
                type(layer.get_submodule(family.feed_forward.attribute)).__name__
                for _, layer in layers
            }
        )
        span = parts.layers_text.partition(" (")[0]
        kept = f"{span}.{family.feed_forward.attribute} ({', '.join(blocks)}, the original's, inside the replacement)"
        return (f"{parts.layers_text}: attention and norms",), (kept, *parts.outside)


SLOT = DecoderSlot()
