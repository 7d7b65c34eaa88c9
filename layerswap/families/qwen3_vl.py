"""Qwen3-VL: Qwen3's decoder layer (q/k norms) inside a vision-language wrapper.

As ``qwen2_vl``; the model adds the vision tower's intermediate features to the first
layers' outputs (DeepStack) between layers, outside the decoder layer.
"""

from __future__ import annotations

from layerswap.families._tiny import TINY, tiny_qwen_vl
from layerswap.families.qwen3 import FAMILY as QWEN3

FAMILY = QWEN3.replace(
    name="qwen3_vl",
    model_type="qwen3_vl",
    module="transformers.models.qwen3_vl.modeling_qwen3_vl",
    decoder="Qwen3VLTextDecoderLayer",
    config_class="Qwen3VLConfig",
    causal_lm="Qwen3VLForConditionalGeneration",
    tiny=tiny_qwen_vl(
        {
            "hidden_size": 32,
            "intermediate_size": 64,
            "out_hidden_size": TINY["hidden_size"],
            "num_position_embeddings": 16,
            "deepstack_visual_indexes": [0],
        }
    ),
)
