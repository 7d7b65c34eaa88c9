"""GLM-4V-MoE (GLM-4.5V): GLM-4-MoE's decoder layer (the original's experts block kept,
GLM-4-MoE's rotate-half rotary on the first half of each head) inside GLM-4V's
vision-language wrapper: its M-RoPE sections, q/k/v with biases, no q/k norms (see
``glm4v``)."""

from __future__ import annotations

from layerswap.families import glm4v
from layerswap.families._inferred import INFERRED

GLM4_MOE = next(family for family in INFERRED if family.name == "glm4_moe")

# GLM-4V's tiny wrapper (its tower, M-RoPE sections, image and video tokens), its text
# decoder with four small experts, two per token and one shared, after a dense first layer
_TINY = {
    **glm4v.FAMILY.tiny,
    "text_config": {
        **glm4v.FAMILY.tiny["text_config"],
        "moe_intermediate_size": 64,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "n_shared_experts": 1,
        "first_k_dense_replace": 1,
    },
}

FAMILY = GLM4_MOE.replace(
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
