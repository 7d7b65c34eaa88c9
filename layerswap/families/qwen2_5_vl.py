"""Qwen2.5-VL: Qwen2's decoder layer inside a vision-language wrapper (see ``qwen2_vl``)."""

from __future__ import annotations

from layerswap.families._tiny import TINY, tiny_qwen_vl
from layerswap.families.qwen2 import FAMILY as QWEN2

FAMILY = QWEN2.replace(
    name="qwen2_5_vl",
    model_type="qwen2_5_vl",
    module="transformers.models.qwen2_5_vl.modeling_qwen2_5_vl",
    decoder="Qwen2_5_VLDecoderLayer",
    config_class="Qwen2_5_VLConfig",
    causal_lm="Qwen2_5_VLForConditionalGeneration",
    tiny=tiny_qwen_vl(
        {
            "hidden_size": 32,
            "intermediate_size": 64,
            "out_hidden_size": TINY["hidden_size"],
            # windowed attention over 2 x 2 merged tokens, the last block attends fully
            "window_size": 16,
            "fullatt_block_indexes": [1],
        }
    ),
)
