"""The tiny configuration shared by the builtin families, and how an inferred one is
written (:func:`inferred`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from layerswap.family import Family

# big enough to be meaningful (several layers, grouped-query attention), small enough
# that build + forward takes well under a second on a CPU
TINY: dict[str, Any] = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "vocab_size": 512,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
}


def tiny_qwen_vl(
    vision: dict[str, Any], *, frame: str = "vision", **text_fields: Any
) -> dict[str, Any]:
    """The tiny config of a Qwen-VL wrapper: :data:`TINY` (and ``text_fields``) as its text
    config, ``vision`` as its vision tower (patches of 4 pixels over 2 frames, merged 2 x 2
    into one token).

    The text rotary embedding splits a head's 8 frequency pairs into M-RoPE sections
    (temporal, height, width: 2, 3, 3), so image tokens rotate by their position in the
    image; the image and video tokens sit at the top of the vocabulary.
    """
    text = {
        **TINY,
        "head_dim": TINY["hidden_size"] // TINY["num_attention_heads"],
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "mrope_section": [2, 3, 3],
        },
        "pad_token_id": 0,
        "bos_token_id": 1,
        "eos_token_id": 2,
        **text_fields,
    }
    tower = {"depth": 2, "num_heads": 2, "in_channels": 3, "patch_size": 4}
    tower.update(spatial_merge_size=2, temporal_patch_size=2, **vision)
    top = TINY["vocab_size"] - 1
    return {
        "text_config": text,
        "vision_config": tower,
        "image_token_id": top - 3,
        "video_token_id": top - 2,
        f"{frame}_start_token_id": top - 1,
        f"{frame}_end_token_id": top,
        "tie_word_embeddings": False,
    }


#: the tiny config inference gives every text decoder (:data:`TINY`, a head size, special
#: tokens inside the small vocabulary): what :func:`inferred` adds a family's own fields to
INFERRED_TINY: dict[str, Any] = {
    **TINY,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "head_dim": TINY["hidden_size"] // TINY["num_attention_heads"],
}


def inferred(*, tiny: Mapping[str, Any] | None = None, **fields: Any) -> Family:
    """A family as inference declares it, in the form ``_inferred.py`` writes it: its
    fields that differ from :class:`~layerswap.family.Family`'s defaults, the tiny
    config's fields beyond :data:`INFERRED_TINY`, described by the module it was read from.

    Example::

        inferred(name="olmo2", model_type="olmo2", module="transformers.models.olmo2.modeling_olmo2",
                 ..., tiny={"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}})
    """
    return Family(
        tiny={**INFERRED_TINY, **(tiny or {})},
        description=f"inferred from {fields['module']}",
        **fields,
    )
