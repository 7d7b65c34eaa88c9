"""GLM-4V: GLM-4's decoder layer (norms after attention and the MLP too) inside a
vision-language wrapper (see ``qwen2_vl``).

From transformers 5.17 its rotary embedding interleaves the M-RoPE sections itself and
hands the layer cos/sin per rotated pair, applied as they come (``rotary="interleaved"``)
to the first half of each head (``partial_rotary_factor`` 0.5); before, it had GLM-4's
layout (``layerswap.hf_internals.ROTARY_LAYOUT_CHANGES``). The q/k/v projections always
have biases.
"""

from __future__ import annotations

from layerswap.families._inferred import INFERRED
from layerswap.families._tiny import TINY, tiny_qwen_vl

GLM4 = next(family for family in INFERRED if family.name == "glm4")

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
)
_TINY.update(video_start_token_id=TINY["vocab_size"] - 6, video_end_token_id=TINY["vocab_size"] - 5)

FAMILY = GLM4.replace(
    name="glm4v",
    model_type="glm4v",
    module="transformers.models.glm4v.modeling_glm4v",
    decoder="Glm4vTextDecoderLayer",
    config_class="Glm4vConfig",
    causal_lm="Glm4vForConditionalGeneration",
    qkv_bias=True,
    rotary="interleaved",
    description="",
    tiny=_TINY,
)
