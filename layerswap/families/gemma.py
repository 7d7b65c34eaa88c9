"""Gemma: RMSNorm scaling by ``1 + weight`` and a tanh-GELU gated MLP."""

from __future__ import annotations

from layerswap.families._tiny import TINY
from layerswap.family import Family

FAMILY = Family(
    name="gemma",
    model_type="gemma",
    module="transformers.models.gemma.modeling_gemma",
    decoder="GemmaDecoderLayer",
    config_class="GemmaConfig",
    causal_lm="GemmaForCausalLM",
    norm_offset=1.0,
    tiny={**TINY, "head_dim": 32, "hidden_act": "gelu_pytorch_tanh"},
)
