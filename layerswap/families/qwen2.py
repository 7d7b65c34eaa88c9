"""Qwen2: biases on the q/k/v projections (always), none on the output projection."""

from __future__ import annotations

from layerswap.families._tiny import TINY
from layerswap.family import Family

FAMILY = Family(
    name="qwen2",
    model_type="qwen2",
    module="transformers.models.qwen2.modeling_qwen2",
    decoder="Qwen2DecoderLayer",
    config_class="Qwen2Config",
    causal_lm="Qwen2ForCausalLM",
    qkv_bias=True,
    o_bias=False,
    tiny=TINY,
)
