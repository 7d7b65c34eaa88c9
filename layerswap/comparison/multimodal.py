"""Image- or audio-and-text inputs for the multimodal wrappers of a covered text decoder.

A ``*ForConditionalGeneration`` model (Llava, Gemma 3, Mistral 3, Voxtral, ...) runs a
vision or audio tower and puts its features where the prompt holds image (audio) tokens;
its language model is a text decoder layerswap swaps (the family is read from
``config.text_config``). Verifying such a model on text alone would leave that path
untested, so :func:`verify`'s default inputs for a wrapper listed in :data:`WRAPPERS`
hold an image or a clip: random pixels (log-mel features), and as many placeholder
tokens per prompt as the model's own ``get_image_features`` (``get_audio_features``)
returns features, placed after the padding.

Example::

    batch = multimodal_inputs(model)   # input_ids, attention_mask, pixel_values, ...
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from layerswap.tokens import special_tokens

__all__ = ["WRAPPERS", "cross_attention_inputs", "is_multimodal", "multimodal_inputs"]

#: the wrappers proven with image inputs, by ``model_type``, with what their processor
#: adds to the pixels: ``image_sizes`` (each image's height and width), ``images_axis``
#: (pixels as batch x images x channels x height x width), ``anyres`` (batch x crops x
#: channels x height x width: the whole image and its tiles, LLaVA-NeXT),
#: ``token_type_ids`` (1 on image tokens); ``audio``: a clip of log-mel features instead
#: of an image; ``grid_thw`` (Qwen-VL: the image as a row of flattened patches per
#: temporal x height x width cell, its grid in ``image_grid_thw``, and
#: ``mm_token_type_ids``, 1 on image tokens, from which the model computes each token's
#: M-RoPE position); ``tiles`` (Mllama: the image as ``max_num_tiles`` tiles with their
#: ``aspect_ratio_ids`` and ``aspect_ratio_mask``, one image token per image, and the
#: ``cross_attention_mask`` by which the text from that token on attends to its tiles);
#: ``feature_mask`` (Qwen2-Audio: a ``feature_attention_mask`` over the clip's frames,
#: and as many audio tokens as its encoder's ``_get_feat_extract_output_lengths`` gives)
WRAPPERS: Mapping[str, frozenset[str]] = {
    "aya_vision": frozenset(),
    "gemma3": frozenset({"token_type_ids"}),
    "glm4v": frozenset({"grid_thw"}),
    "glm4v_moe": frozenset({"grid_thw"}),
    "idefics3": frozenset({"images_axis"}),
    "internvl": frozenset(),
    "llava": frozenset(),
    "llava_next": frozenset({"image_sizes", "anyres"}),
    "mistral3": frozenset({"image_sizes"}),
    "mllama": frozenset({"tiles"}),
    "paligemma": frozenset({"token_type_ids"}),
    "qwen2_audio": frozenset({"audio", "feature_mask"}),
    "qwen2_5_vl": frozenset({"grid_thw"}),
    "qwen2_vl": frozenset({"grid_thw"}),
    "qwen3_vl": frozenset({"grid_thw"}),
    "qwen3_vl_moe": frozenset({"grid_thw"}),
    "smolvlm": frozenset({"images_axis"}),
    "voxtral": frozenset({"audio"}),
}


def _config(model: nn.Module) -> Any:
    return getattr(model, "config", None)


def is_multimodal(model: nn.Module) -> bool:
    """Whether ``model`` is a wrapper whose default verification inputs hold images or audio."""
    config = _config(model)
    kind = WRAPPERS.get(getattr(config, "model_type", None) or "")
    if kind is None:
        return False
    if "tiles" in kind:  # no feature function: the text cross-attends to the tiles
        return getattr(config, "vision_config", None) is not None
    if "feature_mask" in kind:  # no feature function: the encoder says how many tokens
        return getattr(config, "audio_config", None) is not None and _encoder(model) is not None
    tower, features = (
        ("audio_config", "get_audio_features")
        if "audio" in kind
        else ("vision_config", "get_image_features")
    )
    return getattr(config, tower, None) is not None and callable(getattr(model, features, None))


def _placeholder_token(config: Any, media: str) -> int:
    for field in (f"{media}_token_id", f"{media}_token_index"):
        value = getattr(config, field, None)
        if isinstance(value, int):
            return value
    raise ValueError(f"{config.model_type}: the config names no {media} token")


def _anyres_crops(model: nn.Module, size: int) -> int:
    """How many crops LLaVA-NeXT's processor makes of one ``size`` x ``size`` image: the
    whole image and its tiles at the best of ``config.image_grid_pinpoints`` (the
    modeling module's own ``image_size_to_num_patches``)."""
    import sys

    module = sys.modules[type(model).__module__]
    crops: int = module.image_size_to_num_patches(
        image_size=(size, size),
        grid_pinpoints=_config(model).image_grid_pinpoints,
        patch_size=size,
    )
    return crops


def _media(
    model: nn.Module, kind: frozenset[str], batch: int, generator: torch.Generator
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(the media tensors for ``batch`` prompts, the extras their features need)."""
    config = _config(model)
    if "audio" in kind:
        audio = config.audio_config
        frames = 2 * int(audio.max_source_positions)  # the encoder's whole window
        clip = torch.randn(batch, int(audio.num_mel_bins), frames, generator=generator)
        if "feature_mask" in kind:  # every frame of the clip is audio
            return {"input_features": clip}, {
                "feature_attention_mask": torch.ones(batch, frames, dtype=torch.long)
            }
        return {"input_features": clip}, {}
    vision = config.vision_config
    if "grid_thw" in kind:
        return _patch_rows(vision, batch, generator)
    if "tiles" in kind:
        return _tiles(vision, batch, generator)
    size = vision.image_size
    size = int(size[0] if isinstance(size, (list, tuple)) else size)
    channels = int(getattr(vision, "num_channels", 3))
    pixels = torch.randn(batch, channels, size, size, generator=generator)
    extra: dict[str, torch.Tensor] = {}
    if "image_sizes" in kind:
        extra["image_sizes"] = torch.tensor([[size, size]] * batch)
    if "images_axis" in kind:
        pixels = pixels[:, None]
    if "anyres" in kind:
        crops = _anyres_crops(model, size)
        pixels = torch.randn(batch, crops, channels, size, size, generator=generator)
    return {"pixel_values": pixels}, extra


#: the image side in pixels for the Qwen-VL wrappers (a 4 x 4 grid of the tiny configs'
#: 4-pixel patches, merged 2 x 2 into 4 image tokens)
_GRID_IMAGE = 16


def _frame_token(config: Any, end: str) -> int:
    """The token opening (``end="start"``) or closing an image: Qwen's ``vision_*``,
    GLM-4V's ``image_*``."""
    for field in (f"vision_{end}_token_id", f"image_{end}_token_id"):
        value = getattr(config, field, None)
        if isinstance(value, int):
            return value
    raise ValueError(f"{config.model_type}: the config names no image {end} token")


def _patch_rows(
    vision: Any, batch: int, generator: torch.Generator
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """One image per prompt as its processor gives it: a row of ``channels x frames x patch
    x patch`` values per grid cell, the images' rows one after the other."""
    patch, frames = int(vision.patch_size), int(vision.temporal_patch_size)
    side = max(_GRID_IMAGE // patch, int(vision.spatial_merge_size))
    width = int(vision.in_channels) * frames * patch * patch
    pixels = torch.randn(batch * side * side, width, generator=generator)
    return {"pixel_values": pixels}, {"image_grid_thw": torch.tensor([[1, side, side]] * batch)}


def _tiles(
    vision: Any, batch: int, generator: torch.Generator
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """One image per prompt as Mllama's processor gives it: ``max_num_tiles`` tiles
    (batch x images x tiles x channels x height x width), at the aspect ratio that uses
    them all."""
    tiles, size = int(vision.max_num_tiles), int(vision.image_size)
    channels = int(getattr(vision, "num_channels", 3))
    pixels = torch.randn(batch, 1, tiles, channels, size, size, generator=generator)
    ratios = [tuple(ratio) for ratio in vision.supported_aspect_ratios]
    ratio = next(i for i, (h, w) in enumerate(ratios) if h * w == tiles) + 1  # 0: padding
    extra = {
        "aspect_ratio_ids": torch.full((batch, 1), ratio),
        "aspect_ratio_mask": torch.ones(batch, 1, tiles, dtype=torch.long),
    }
    return {"pixel_values": pixels}, extra


def _first_item(
    kind: frozenset[str], media: dict[str, torch.Tensor], extra: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """The media (and extras) of the first prompt alone."""
    if "grid_thw" in kind:
        grid = extra["image_grid_thw"][:1]
        return {"pixel_values": media["pixel_values"][: int(grid.prod())], "image_grid_thw": grid}
    return {key: value[:1] for key, value in {**media, **extra}.items()}


def _encoder(model: nn.Module) -> nn.Module | None:
    """The audio encoder that says how long a clip's encoding is (Qwen2-Audio's)."""
    return next(
        (
            m
            for m in model.modules()
            if callable(getattr(m, "_get_feat_extract_output_lengths", None))
        ),
        None,
    )


def _encoded_length(model: nn.Module, frames: int) -> int:
    """How many audio tokens a clip of ``frames`` frames takes: its encoder's output length."""
    encoder: Any = _encoder(model)  # is_multimodal found it
    lengths = encoder._get_feat_extract_output_lengths(torch.tensor([frames]))
    output = lengths[-1] if isinstance(lengths, tuple) else lengths
    return int(output[0])


def _feature_count(
    model: nn.Module,
    kind: frozenset[str],
    media: dict[str, torch.Tensor],
    extra: dict[str, torch.Tensor],
    media_name: str,
) -> int:
    """How many placeholder tokens one item takes: the features the model's own
    ``get_image_features`` (``get_audio_features``) returns for it."""
    parameter = next(model.parameters())
    features_of: Any = getattr(model, f"get_{media_name}_features")
    first = _first_item(kind, media, extra)
    with torch.no_grad():
        features = features_of(
            **{
                key: value.to(parameter.device, parameter.dtype if key in media else None)
                for key, value in first.items()
            }
        )
    pooled = getattr(features, "pooler_output", None)
    pooled = features if pooled is None else pooled
    parts = pooled if isinstance(pooled, (list, tuple)) else [pooled]
    return sum(part.reshape(-1, part.shape[-1]).shape[0] for part in parts)


def multimodal_inputs(
    model: nn.Module,
    *,
    batch: int = 2,
    text: int = 6,
    padding: int = 2,
    seed: int = 0,
    device: torch.device | str | None = None,
) -> dict[str, torch.Tensor]:
    """A batch of ``batch`` prompts, each one image (or audio clip) and ``text`` text tokens.

    Every row after the first starts with ``padding`` pad tokens (masked out); then two
    text tokens, the placeholder tokens, the rest of the text. The media and the text are
    drawn from ``seed`` (special tokens avoided); the placeholder count is what the
    model's ``get_image_features`` (``get_audio_features``) returns for one item (one
    image token for Mllama, whose text cross-attends to the tiles instead).
    """
    config = _config(model)
    kind = WRAPPERS[config.model_type]
    media_name = "audio" if "audio" in kind else "image"
    generator = torch.Generator().manual_seed(seed)
    media, extra = _media(model, kind, batch, generator)
    if "tiles" in kind:
        count = 1
    elif "feature_mask" in kind:
        count = _encoded_length(model, int(media["input_features"].shape[-1]))
    else:
        count = _feature_count(model, kind, media, extra, media_name)
    text_config = config.get_text_config()
    placeholder = _placeholder_token(config, media_name)
    pad = getattr(text_config, "pad_token_id", None)
    pad = pad if isinstance(pad, int) else 0
    allowed = torch.tensor(
        sorted(set(range(text_config.vocab_size)) - special_tokens(config) - {pad})
    )
    width = padding + text + count
    drawn = torch.randint(0, len(allowed), (batch, width), generator=generator)
    input_ids = allowed[drawn]
    attention_mask = torch.ones(batch, width, dtype=torch.long)
    for row in range(batch):
        start = 0 if row == 0 else padding
        if row:
            input_ids[row, :padding] = pad
            attention_mask[row, :padding] = 0
        input_ids[row, start + 2 : start + 2 + count] = placeholder
        if "grid_thw" in kind:  # as the processor frames an image
            input_ids[row, start + 1] = _frame_token(config, "start")
            input_ids[row, start + 2 + count] = _frame_token(config, "end")
    out = {"input_ids": input_ids, "attention_mask": attention_mask, **media}
    if "token_type_ids" in kind:
        out["token_type_ids"] = (input_ids == placeholder).long()
    if "grid_thw" in kind:
        out["mm_token_type_ids"] = (input_ids == placeholder).long()
    if "tiles" in kind:  # the text from the image token on attends to the image's tiles
        seen = (input_ids == placeholder).long().cumsum(dim=1).clamp(max=1) * attention_mask
        tiles = int(media["pixel_values"].shape[2])
        out["cross_attention_mask"] = seen[:, :, None, None].expand(-1, -1, 1, tiles).clone()
    out.update(extra)
    if device is not None:
        out = {key: value.to(device) for key, value in out.items()}
    return out


#: how many vision states the text attends to in :func:`cross_attention_inputs`
CROSS_ATTENTION_TOKENS = 8


def cross_attention_inputs(model: nn.Module, batch: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random vision states for a text model with cross-attention layers (Mllama's
    ``MllamaForCausalLM``: ``cross_attention_states``, batch x tokens x hidden), so that
    verification runs those layers too -- on text alone the model skips them. Empty for
    every other model.

    Example::

        cross_attention_inputs(mllama_text_model, batch=2)["cross_attention_states"].shape
        # torch.Size([2, 8, 128])
    """
    import inspect

    config = getattr(_config(model), "get_text_config", lambda: None)()
    forward = getattr(model, "forward", None)
    if (
        config is None
        or not getattr(config, "cross_attention_layers", None)
        or forward is None
        or "cross_attention_states" not in inspect.signature(forward).parameters
    ):
        return {}
    parameter = next(model.parameters())
    generator = torch.Generator().manual_seed(seed)
    states = torch.randn(
        batch, CROSS_ATTENTION_TOKENS, int(config.hidden_size), generator=generator
    )
    return {"cross_attention_states": states.to(parameter.device, parameter.dtype)}
