"""The token batch both models run on: deterministic defaults, or the caller's."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any, TypeAlias

import torch
from torch import nn

from layerswap.comparison.multimodal import cross_attention_inputs, is_multimodal, multimodal_inputs
from layerswap.comparison.placement import DeviceLike, resolve_device
from layerswap.model import layer_config
from layerswap.tokens import avoid_tokens, media_tokens

__all__ = [
    "InputsLike",
    "default_inputs",
    "DEFAULT_LENGTH",
    "LONGEST_DEFAULT",
    "default_length",
    "inputs_for",
    "unreached_thresholds",
    "pad_token_id",
    "prepare_inputs",
    "text_config",
]

InputsLike: TypeAlias = "torch.Tensor | Mapping[str, Any] | None"


def default_inputs(
    vocab_size: int,
    *,
    batch: int = 2,
    seq_len: int = 16,
    padding: int = 4,
    seed: int = 0,
    pad_token_id: int = 0,
    device: DeviceLike = None,
    avoid: Collection[int] = (),
) -> dict[str, torch.Tensor]:
    """Deterministic random token ids with a left-padded attention mask.

    The first sequence is full; every other sequence starts with ``padding`` pad tokens
    (masked out), so the masking path of the attention is exercised as well. The same
    seed gives the same tokens on every machine (a private CPU generator is used). Ids
    in ``avoid`` (a wrapper's image or video token) are replaced by the next id that is
    not.

    Example::

        >>> batch = default_inputs(512)
        >>> batch["input_ids"].shape, int(batch["attention_mask"].sum())
        (torch.Size([2, 16]), 28)
    """
    if vocab_size < 2:
        raise ValueError(f"vocab_size must be at least 2, got {vocab_size}")
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(1, vocab_size, (batch, seq_len), generator=generator)
    input_ids = avoid_tokens(input_ids, avoid, vocab_size)
    attention_mask = torch.ones(batch, seq_len, dtype=torch.long)
    pad = min(padding, seq_len - 1)
    if pad > 0:
        attention_mask[1:, :pad] = 0
        input_ids[1:, :pad] = pad_token_id
    target = resolve_device(device)
    if target is not None:
        input_ids, attention_mask = input_ids.to(target), attention_mask.to(target)
    return {"input_ids": input_ids, "attention_mask": attention_mask}


def text_config(model: nn.Module) -> Any:
    """The model's config, or its text part for a composite (vision-language) model."""
    config = getattr(model, "config", None)
    if config is None:
        raise TypeError(f"{type(model).__name__} has no .config; pass a transformers model")
    return layer_config(config)


def pad_token_id(config: Any) -> int:
    """The config's padding token, 0 where it declares none."""
    pad = getattr(config, "pad_token_id", None)
    return pad if isinstance(pad, int) else 0


#: the default prompt's length, when no position threshold asks for more
DEFAULT_LENGTH = 16
#: the longest prompt the default inputs grow to so as to run past a position threshold
#: (a sliding window, an attention chunk); past it, :func:`unreached_thresholds` says so
LONGEST_DEFAULT = 1024


def default_length(model: nn.Module) -> int:
    """The default prompt length for ``model``: :data:`DEFAULT_LENGTH`, or longer to run
    4 tokens past each position threshold its config sets
    (:func:`~layerswap.shrink.position_thresholds`) up to :data:`LONGEST_DEFAULT`.

    Example::

        default_length(mistral_with_window_64)   # 68
    """
    return _length_for(text_config(model))


def _length_for(config: Any) -> int:
    """:func:`default_length` for a model of ``config``, its text config."""
    from layerswap.shrink import position_thresholds

    needed = [t + 4 for t in position_thresholds(config).values() if t + 4 <= LONGEST_DEFAULT]
    limit = getattr(config, "max_position_embeddings", None)
    length = max([DEFAULT_LENGTH, *needed])
    return min(length, limit) if isinstance(limit, int) and limit >= DEFAULT_LENGTH else length


def unreached_thresholds(model: nn.Module, positions: int) -> dict[str, int]:
    """The position thresholds of ``model``'s config that a run over ``positions``
    positions (prompt and decoded tokens) does not pass: what it computes past them was
    not compared."""
    from layerswap.shrink import position_thresholds

    found = position_thresholds(text_config(model))
    return {name: value for name, value in found.items() if value >= positions}


def inputs_for(model: nn.Module, **options: Any) -> dict[str, torch.Tensor]:
    """:func:`default_inputs` for ``model``'s vocabulary and padding token.

    ``options`` (``batch``, ``seq_len``, ``padding``, ``seed``, ``device``) go to
    :func:`default_inputs`; ``seq_len`` defaults to :func:`default_length`, so the prompt
    runs past the config's sliding window or attention chunk.
    """
    config = text_config(model)  # unwrapped once, for every value read below
    avoid = media_tokens(model.config)
    options.setdefault("seq_len", _length_for(config))
    return default_inputs(
        config.vocab_size, pad_token_id=pad_token_id(config), avoid=avoid, **options
    )


def prepare_inputs(
    inputs: InputsLike, model: nn.Module, device: torch.device, dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    """``inputs`` as a batch with ``input_ids`` and ``attention_mask``, on ``device``; its
    floating-point tensors (images, audio, vision states) in ``dtype`` when given: the
    precision the model runs in (Mllama's text model adds ``cross_attention_states`` to
    its activations as they come)."""
    if inputs is None:
        # a multimodal wrapper: images or audio too, so that path is compared as well;
        # a text model with cross-attention layers: states for them to attend to
        if is_multimodal(model):
            batch = multimodal_inputs(model)
        else:
            batch = inputs_for(model)
            batch.update(cross_attention_inputs(model, int(batch["input_ids"].shape[0])))
    elif isinstance(inputs, torch.Tensor):
        batch = {"input_ids": inputs}
    elif isinstance(inputs, Mapping):
        batch = dict(inputs)
    else:
        raise TypeError(
            "inputs must be None, a tensor of token ids or a mapping such as "
            f"{{'input_ids': ..., 'attention_mask': ...}}, not {type(inputs).__name__}"
        )
    if "input_ids" not in batch:
        raise ValueError("inputs must contain 'input_ids'")
    ids = batch["input_ids"]
    if ids.dim() == 1:
        ids = ids.unsqueeze(0)
    batch["input_ids"] = ids
    if batch.get("attention_mask") is None:
        batch["attention_mask"] = torch.ones_like(ids)
    return {key: _placed(value, device, dtype) for key, value in batch.items()}


def _placed(value: Any, device: torch.device, dtype: torch.dtype | None) -> Any:
    if not isinstance(value, torch.Tensor):
        return value
    if dtype is not None and value.is_floating_point():
        return value.to(device, dtype)
    return value.to(device)
