"""Mllama (Llama 3.2 Vision): Llama's decoder layer between cross-attention layers.

The text model interleaves two layer classes: self-attention layers, Llama's, which the
family swaps, and cross-attention layers (``cross_attention_layers``: the text attends
to the vision tower's states), which stay the original's. Every layer is called with
the cross-attention inputs; the self-attention layers never read them
(``ignored_arguments``), and the proof runs the model with cross-attention states so
both kinds of layer, and the cache they share, are exercised.
"""

from __future__ import annotations

from layerswap.families._tiny import TINY
from layerswap.family import Family

FAMILY = Family(
    name="mllama",
    model_type="mllama_text_model",
    module="transformers.models.mllama.modeling_mllama",
    decoder="MllamaSelfAttentionDecoderLayer",
    config_class="MllamaTextConfig",
    causal_lm="MllamaForCausalLM",
    qkv_bias=False,
    o_bias=False,
    mlp_bias=False,
    kept_layers=(
        "the cross-attention layers (MllamaCrossAttentionDecoderLayer, at "
        "config.cross_attention_layers)"
    ),
    ignored_arguments=(
        "cross_attention_states",
        "cross_attention_mask",
        "full_text_row_masked_out_mask",
    ),
    tiny={
        **TINY,
        # layers 0, 2, 3 self-attention (swapped), layer 1 cross-attention (kept)
        "cross_attention_layers": [1],
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "pad_token_id": 0,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
)
