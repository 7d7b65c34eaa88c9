"""Converting one decoder layer to its replacement and back: the one place it is done.

:func:`convert_layer` builds the replacement of one original layer, holding its weights:
:func:`layerswap.swap` calls it for every layer of a model,
:func:`layerswap.swap.build_replacement_layer` for a side-by-side copy, streaming verification for one layer at a time. Its keyword
arguments are what those callers differ in (grad mode, detaching, device, how errors
read). :func:`convert_back` is the reverse: into the original's own ``Parameter``
objects (undo), or into a new original layer. :func:`adopt_layer` is what every
replacement carries, converted or constructed inside :func:`layerswap.use`.

Example::

    from layerswap.layers import convert_layer, layer_index

    fused = convert_layer(layer, sub, config, layer_idx=layer_index(layer, 0), detach=True)
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING

import torch
from torch import nn

from layerswap.errors import ConversionError, LayerswapError
from layerswap.model import decoder_layers, layer_config, locate, mark_substitution
from layerswap.packed_optim import watch_packed_layer
from layerswap.state import install_load_hook
from layerswap.substitution import Substitution
from layerswap.weights import is_extra_state

if TYPE_CHECKING:
    from transformers import PreTrainedConfig

__all__ = [
    "adopt_layer",
    "convert_back",
    "convert_layer",
    "converted_copy",
    "layer_index",
    "normal_tensors",
    "originals_in_place",
]

#: Converting runs outside inference mode: a tensor made inside torch.inference_mode()
#: can never be trained, so a swap (or an undo) made there would freeze the model for good.
normal_tensors = torch.inference_mode(False)


def layer_index(layer: nn.Module, position: int) -> int:
    """The ``layer_idx`` ``layer`` was built with (its own or its attention's), else ``position``.

    Example::

        layer_index(model.model.layers[3], 3)   # 3
    """
    for holder in (layer, getattr(layer, "self_attn", None)):
        index = getattr(holder, "layer_idx", None)
        if isinstance(index, int):
            return index
    return position


def _device_of(layer: nn.Module) -> torch.device:
    for tensor in layer.parameters():
        return tensor.device
    for buffer in layer.buffers():
        return buffer.device
    return torch.device("cpu")


def _assign(replacement: nn.Module, converted: dict[str, torch.Tensor], where: str) -> None:
    """Put converted tensors into ``replacement``: same ``Parameter`` objects where given."""
    expected = {
        key: value
        for key, value in replacement.state_dict(keep_vars=True).items()
        if not is_extra_state(key)
    }
    name = type(replacement).__name__
    for key in expected:
        if key not in converted:
            raise ConversionError(
                f"{where}: {name}'s tensor {key!r} gets no value from the converter"
            )
    for key, value in converted.items():
        if key not in expected:
            raise ConversionError(
                f"{where}: the converter produced tensor {key!r}, which {name} lacks"
            )
        if tuple(value.shape) != tuple(expected[key].shape):
            raise ConversionError(
                f"{where}: tensor {key!r} converts to shape {tuple(value.shape)}, "
                f"but {name} has {tuple(expected[key].shape)}"
            )
    for key, value in converted.items():
        owner, leaf = locate(replacement, key)
        if leaf in owner._parameters:
            if isinstance(value, nn.Parameter):
                owner._parameters[leaf] = value
            else:
                owner._parameters[leaf] = nn.Parameter(
                    value.detach(), requires_grad=value.requires_grad
                )
        else:
            owner._buffers[leaf] = value.detach()


def _build(
    cls: type[nn.Module],
    config: PreTrainedConfig,
    layer_idx: int,
    device: torch.device,
    converted: dict[str, torch.Tensor],
    where: str,
) -> nn.Module:
    """Construct the replacement without allocating its weights when possible.

    Built on the meta device, its parameters are then replaced by the converted
    tensors. A class that cannot be built there, or keeps tensors the converter does
    not provide (non-persistent buffers), is built on the layer's device instead.
    """
    replacement: nn.Module | None = None
    try:
        with torch.device("meta"):
            replacement = cls(config, layer_idx)
    except LayerswapError:
        raise
    except Exception:
        replacement = None
    if replacement is not None:
        _assign(replacement, converted, where)
        leftover = [
            tensor
            for tensor in (*replacement.parameters(), *replacement.buffers())
            if tensor.is_meta
        ]
        if not leftover or device.type == "meta":
            return replacement
    with torch.device(device):
        replacement = cls(config, layer_idx)
    _assign(replacement, converted, where)
    return replacement


def adopt_layer(layer: nn.Module, substitution: Substitution, config: PreTrainedConfig) -> None:
    """Make ``layer`` a replacement of ``substitution``'s: marked, and loading either layout.

    The mark is what :func:`layerswap.model.substitution_of` reads; the load hook converts
    original-layout state in ``load_state_dict`` (:mod:`layerswap.state`); under tensor
    parallelism its packed parameters, and their optimizers' state, give and take state
    in the fused layout (:mod:`layerswap.packed_state`, :mod:`layerswap.packed_optim`).
    ``config`` is the layer's (text) config.
    """
    mark_substitution(layer, substitution)
    install_load_hook(layer, substitution, config)
    watch_packed_layer(layer, substitution, config)


@normal_tensors
def convert_layer(
    layer: nn.Module,
    substitution: Substitution,
    config: PreTrainedConfig,
    *,
    layer_idx: int,
    where: str | None = None,
    grad: bool = True,
    detach: bool = False,
    device: torch.device | None = None,
    wrap_errors: bool = False,
) -> nn.Module:
    """The replacement of the original ``layer``, holding its weights, adopted (marked).

    ``config`` is the model's config (a composite model's text part is taken). Tensors
    that only change name move into the replacement; concatenated ones are computed. The
    replacement is in ``layer``'s train/eval mode. ``layer`` itself is only read, but
    unless ``detach`` its ``Parameter`` objects become the replacement's.

    - ``grad``: convert with autograd on, so a computed tensor requires grad iff one of
      its sources does. ``False``: nothing is recorded, and with ``detach`` every tensor
      of the replacement is frozen (``requires_grad=False``).
    - ``detach``: give the replacement new ``Parameter`` objects sharing ``layer``'s
      storage (with its ``requires_grad`` where ``grad``), leaving ``layer`` untouched.
      Off for a swap, which moves the very same ``Parameter`` objects.
    - ``device``: where a replacement that cannot be built on the meta device is built
      (default: ``layer``'s).
    - ``where``: how errors name the layer (default: its class); ``wrap_errors``: also
      turn the converter's or the class's own exceptions into a
      :class:`~layerswap.errors.ConversionError` starting with ``where`` (a swap reports
      every failure that way; layerswap's own errors pass unchanged).

    Runs outside ``torch.inference_mode`` whatever the caller's mode. Example::

        fused = convert_layer(model.model.layers[0], get("llama.decoder.fused"),
                              model.config, layer_idx=0, detach=True)
    """
    config = layer_config(config)
    where = where if where is not None else f"layer {type(layer).__name__}"
    state = layer.state_dict(keep_vars=True)
    if detach:
        state = {
            key: value.detach().requires_grad_(grad and value.requires_grad)
            for key, value in state.items()
        }
    if grad:
        _refuse_partly_frozen(state, substitution, where)
    try:
        with torch.set_grad_enabled(grad):
            converted = substitution.converter.to_replacement(state, config)
        replacement = _build(
            substitution.replacement_class(),
            config,
            layer_idx,
            device if device is not None else _device_of(layer),
            converted,
            where,
        )
    except ConversionError as exc:
        if not wrap_errors or str(exc).startswith(where):
            raise
        raise ConversionError(f"{where}: {exc}") from exc
    except LayerswapError:
        raise
    except Exception as exc:
        if not wrap_errors:
            raise
        raise ConversionError(f"{where}: {type(exc).__name__}: {exc}") from exc
    replacement.train(layer.training)
    adopt_layer(replacement, substitution, config)
    return replacement


def _refuse_partly_frozen(
    state: dict[str, torch.Tensor], substitution: Substitution, where: str
) -> None:
    """:class:`ConversionError` where a rule of the converter joins tensors of which some
    train and some are frozen: the joined tensor is one ``Parameter``, every row of which
    would train (the frozen ones moved by the optimizer, weight decay and momentum)."""
    for rule in getattr(substitution.converter, "rules", ()):
        parts = [(key, state[key]) for key in rule.sources if key in state]
        trained = [key for key, value in parts if value.requires_grad]
        frozen = [key for key, value in parts if not value.requires_grad]
        if trained and frozen and len(rule.targets) < len(parts):
            raise ConversionError(
                f"{where}: {frozen[0]!r} is frozen (requires_grad=False) and {trained[0]!r} "
                f"is not, but {substitution.name} joins them into one tensor "
                f"({', '.join(map(repr, rule.targets))}) whose every part would train: "
                "freeze or unfreeze them together before the swap, or keep the original "
                "layers (a sub-layer slot such as qkv keeps each projection's own Parameter)"
            )


@normal_tensors
def convert_back(
    replacement: nn.Module,
    substitution: Substitution,
    config: PreTrainedConfig,
    *,
    into: nn.Module | None = None,
    layer_idx: int = 0,
    where: str | None = None,
) -> nn.Module:
    """The original layer of ``replacement``'s weights, converted back exactly.

    ``into``: the original layer object to fill; its own ``Parameter`` objects get the
    converted values (undo keeps optimizers' and users' references valid), and it is
    returned. Without ``into`` a new original layer (``layer_idx``) is built on the meta
    device and takes the converted tensors, in ``replacement``'s train/eval mode.
    Errors are :class:`~layerswap.errors.ConversionError` starting with ``where``.

    Example::

        original = convert_back(fused, sub, model.config, layer_idx=0)
    """
    config = layer_config(config)
    where = where if where is not None else f"layer {type(replacement).__name__}"
    if into is None:
        state = {k: v for k, v in replacement.state_dict().items() if not is_extra_state(k)}
        converted = substitution.converter.to_original(state, config)
        with torch.device("meta"):
            original = substitution.original_class()(config, layer_idx)
        original.load_state_dict(converted, strict=True, assign=True)
        original.train(replacement.training)
        return original
    live = {
        key: value
        for key, value in replacement.state_dict(keep_vars=True).items()
        if not is_extra_state(key)
    }
    try:
        values = substitution.converter.to_original(live, config)
    except ConversionError as exc:
        raise ConversionError(f"{where}: cannot convert back: {exc}") from exc
    targets = into.state_dict(keep_vars=True)
    missing = sorted(set(targets) - set(values))
    if missing:
        raise ConversionError(f"{where}: converting back gives no value for {missing[0]!r}")
    for key, tensor in targets.items():
        value = values[key]
        if value is not tensor:
            tensor.data = value.detach()
    return into


def originals_in_place(
    model: nn.Module, original: type[nn.Module], config: PreTrainedConfig
) -> None:
    """A fresh ``original`` layer of ``config`` in the place of each decoder layer of
    ``model`` that is not one (a model built inside a :func:`layerswap.use`): for a model
    whose weights are drawn at random after, so none is converted.

    Example::

        originals_in_place(model, LlamaDecoderLayer, model.config)
    """
    for position, (name, layer) in enumerate(decoder_layers(model)):
        if type(layer) is not original:
            parent, key = locate(model, name)
            parent._modules[key] = original(layer_config(config), layer_index(layer, position))


def converted_copy(
    reference: nn.Module, substitution: Substitution, config: PreTrainedConfig
) -> nn.Module:
    """A copy of ``reference`` whose decoder layers are converted to ``substitution``'s
    (detached from the originals' tensors; no undo is kept).

    Example::

        candidate = converted_copy(reference, layerswap.get("llama.decoder.fused"), config)
    """
    candidate = copy.deepcopy(reference)
    for position, (name, layer) in enumerate(decoder_layers(candidate)):
        replacement = convert_layer(
            layer, substitution, config, layer_idx=layer_index(layer, position), detach=True
        )
        parent, key = locate(candidate, name)
        parent._modules[key] = replacement
    return candidate
