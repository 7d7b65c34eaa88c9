"""Qwen3: RMSNorm of q and k over the head dimension, and an explicit ``head_dim``."""

from __future__ import annotations

from layerswap.families._tiny import TINY
from layerswap.family import Family

FAMILY = Family(
    name="qwen3",
    model_type="qwen3",
    module="transformers.models.qwen3.modeling_qwen3",
    decoder="Qwen3DecoderLayer",
    config_class="Qwen3Config",
    causal_lm="Qwen3ForCausalLM",
    qk_norm=True,
    # head_dim * heads != hidden_size on purpose: the explicit head_dim must be honoured
    tiny={**TINY, "head_dim": 32},
)
