"""Mistral: Llama's layout without biases; the tiny config enables a short sliding window.

The model builds the sliding-window mask and the cache trims to the window, so a
replacement layer that honours the mask it is given needs nothing more.
"""

from __future__ import annotations

from layerswap.families._tiny import TINY
from layerswap.family import Family

FAMILY = Family(
    name="mistral",
    model_type="mistral",
    module="transformers.models.mistral.modeling_mistral",
    decoder="MistralDecoderLayer",
    config_class="MistralConfig",
    causal_lm="MistralForCausalLM",
    qkv_bias=False,
    o_bias=False,
    tiny={**TINY, "sliding_window": 8},
)
