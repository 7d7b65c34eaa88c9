"""GLM-4V-MoE (GLM-4.5V): GLM-4-MoE's decoder layer (the original's experts block kept,
GLM-4-MoE's rotate-half rotary on the first half of each head) inside GLM-4V's
vision-language wrapper: its M-RoPE sections, q/k/v with biases, no q/k norms (see
``glm4v``)."""

from __future__ import annotations

import dataclasses

from layerswap.families._inferred import INFERRED
from layerswap.families._tiny import TINY, tiny_qwen_vl

GLM4_MOE = next(family for family in INFERRED if family.name == "glm4_moe")

_TINY = tiny_qwen_vl(
    {
        "hidden_size": 32,
        "intermediate_size": 64,
        "out_hidden_size": TINY["hidden_size"],
        "image_size": 16,
    },
    frame="image",
    # a head of 16 rotates its first 8 dims: 4 frequency pairs in sections of 1, 1, 2
    rope_parameters={
        "rope_type": "default",
        "rope_theta": 10000.0,
        "mrope_section": [1, 1, 2],
        "partial_rotary_factor": 0.5,
    },
    # four small experts, two per token and one shared, after a dense first layer
    moe_intermediate_size=64,
    n_routed_experts=4,
    num_experts_per_tok=2,
    n_shared_experts=1,
    first_k_dense_replace=1,
)
_TINY.update(video_start_token_id=TINY["vocab_size"] - 6, video_end_token_id=TINY["vocab_size"] - 5)

FAMILY = dataclasses.replace(
    GLM4_MOE,
    name="glm4v_moe",
    model_type="glm4v_moe",
    module="transformers.models.glm4v_moe.modeling_glm4v_moe",
    decoder="Glm4vMoeTextDecoderLayer",
    config_class="Glm4vMoeConfig",
    causal_lm="Glm4vMoeForConditionalGeneration",
    mlp_class="Glm4vMoeTextMoE",
    qkv_bias=True,
    qk_norm=False,
    qk_norm_switch=None,
    description="",
    tiny=_TINY,
)
