"""Qwen3-VL-MoE: Qwen3-MoE's decoder layer (q/k norms, the original's experts block kept)
inside a vision-language wrapper (see ``qwen3_vl``)."""

from __future__ import annotations

from layerswap.families._inferred import INFERRED
from layerswap.families._tiny import TINY, tiny_qwen_vl

QWEN3_MOE = next(family for family in INFERRED if family.name == "qwen3_moe")

FAMILY = QWEN3_MOE.replace(
    name="qwen3_vl_moe",
    model_type="qwen3_vl_moe",
    module="transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe",
    decoder="Qwen3VLMoeTextDecoderLayer",
    config_class="Qwen3VLMoeConfig",
    causal_lm="Qwen3VLMoeForConditionalGeneration",
    mlp_class="Qwen3VLMoeTextSparseMoeBlock",
    description="",
    tiny=tiny_qwen_vl(
        {
            "hidden_size": 32,
            "intermediate_size": 64,
            "out_hidden_size": TINY["hidden_size"],
            "num_position_embeddings": 16,
            "deepstack_visual_indexes": [0],
        },
        # four small experts, two per token, on every layer
        moe_intermediate_size=64,
        num_experts=4,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
    ),
)
