"""Qwen2-VL: Qwen2's decoder layer inside a vision-language wrapper.

Its text decoder has no causal LM of its own, so the family builds
``Qwen2VLForConditionalGeneration``. M-RoPE (rotary sections over the temporal, height
and width position of each token) is computed by the model's rotary embedding; the
layer applies the cos/sin it is given, as Qwen2's does.
"""

from __future__ import annotations

from layerswap.families._tiny import TINY, tiny_qwen_vl
from layerswap.families.qwen2 import FAMILY as QWEN2

FAMILY = QWEN2.replace(
    name="qwen2_vl",
    model_type="qwen2_vl",
    module="transformers.models.qwen2_vl.modeling_qwen2_vl",
    decoder="Qwen2VLDecoderLayer",
    config_class="Qwen2VLConfig",
    causal_lm="Qwen2VLForConditionalGeneration",
    tiny=tiny_qwen_vl({"embed_dim": 32, "mlp_ratio": 2, "hidden_size": TINY["hidden_size"]}),
)
