"""Llama: the reference layout; biases switched by ``attention_bias`` and ``mlp_bias``."""

from __future__ import annotations

from layerswap.families._tiny import TINY
from layerswap.family import Family

FAMILY = Family(
    name="llama",
    model_type="llama",
    module="transformers.models.llama.modeling_llama",
    decoder="LlamaDecoderLayer",
    config_class="LlamaConfig",
    causal_lm="LlamaForCausalLM",
    qkv_bias="attention_bias",
    o_bias="attention_bias",
    mlp_bias="mlp_bias",
    tiny=TINY,
)
