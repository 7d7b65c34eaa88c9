"""The tiny configs family inference builds a model type's layers for, and what a
declaration records of them (:func:`tiny_of`)."""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

from layerswap.families._tiny import TINY

__all__ = ["config_with", "query_scaled_rope", "tiny_config_for", "tiny_of"]


#: mixture-of-experts sizes, by config field name, given to a config that has the field:
#: few small experts, two per token
_TINY_MOE: dict[str, Any] = {
    "num_local_experts": 4,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 64,
    "shared_expert_intermediate_size": 128,
}


#: multi-head latent attention sizes, given to a config that has the fields: small latent
#: ranks, rotary and value dims; every head its own keys and values (its attention has
#: no grouped-query form), and ``head_dim`` the rotary part (what its rotary embedding is
#: built for)
_TINY_MLA: dict[str, Any] = {
    "kv_lora_rank": 32,
    "q_lora_rank": 48,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 16,
    "v_head_dim": 16,
    "head_dim": 8,
}


#: the chunk of a chunked state-space scan (Mamba 2's, xLSTM's), given to a config that has
#: the field: the tiny prompt (8 tokens) spans two chunks, so the state carried from one
#: chunk to the next is computed and compared (at the default 256, a tiny prompt is one
#: chunk padded to 256 positions, and a proof of Falcon-H1 takes 27 s instead of 1 s)
_TINY_SCAN: dict[str, Any] = {"chunk_size": 4, "mamba_chunk_size": 4}


#: fields a model type's config leaves unset by default although its model cannot be built
#: without them (transformers' own default config does not build either): the tiny
#: values that let inference read the layers and give its real reason
_TINY_FIXES: dict[str, dict[str, Any]] = {
    # hybrids whose default pattern puts no attention layer among the first four: every
    # layer kind present (Mamba and attention), as a proof needs them
    "jamba": {"attn_layer_period": 2, "attn_layer_offset": 1},
    "bamba": {"attn_layer_indices": [1, 3]},
    "granitemoehybrid": {"layer_types": ["mamba", "attention"] * 2},
    "bailing_hybrid": {"layer_group_size": 2, "num_expert_group": 1, "topk_group": 1},
    # an encoder-decoder config whose decoder (the causal LM) reads its own head and layer
    # counts: 8 heads of the tiny width, and as many layers as the cache is built for
    "plbart": {
        "encoder_attention_heads": 8,
        "decoder_attention_heads": 8,
        "encoder_layers": 4,
        "decoder_layers": 4,
    },
    # Mamba 2 heads: hidden_size * expand = num_heads * head_dim
    "mamba2": {"num_heads": 8, "head_dim": 32, "n_groups": 1},
    "zamba2": {"layers_block_type": ["mamba", "hybrid"] * 2, "n_mamba_heads": 8},
    "zaya": {"num_experts_per_tok": 1},
    "longcat_flash": {"n_routed_experts": 4, "expert_ffn_hidden_size": 64},
    "gemma4_assistant": {"hidden_size_per_layer_input": 0},
    "dbrx": {"attn_config": {"rope_theta": 10000.0, "kv_n_heads": 2}},
    # GPT-Neo: a pattern of global and local attention repeated to the default 24 layers
    "gpt_neo": {"attention_types": [[["global", "local"], 2]]},
    # ModernBERT's decoder: rotary parameters per layer type (its config takes no flat
    # ones), and its special tokens inside the small vocabulary
    "modernbert-decoder": {
        "rope_parameters": {
            "full_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
        "cls_token_id": 3,
        "sep_token_id": 4,
    },
    # a layer whose MLP keeps its top activations only (the mlp slot keeps it), beside plain ones
    "gemma3n_text": {
        "num_kv_shared_layers": 2,
        "activation_sparsity_pattern": [0.95, 0.0, 0.0, 0.0],
    },
    "dots1": {"n_routed_experts": 4, "n_shared_experts": 1, "n_group": 1, "topk_group": 1},
    # mixture-of-experts models that may keep some layers dense, all sparse by default:
    # one layer dense, so that a proof compares both kinds and the mlp slot has a dense
    # MLP to take
    # (Cohere 2 MoE's dense first layer rotates although its attention is full: a fifth
    # layer, full and sparse, does not)
    "cohere2_moe": {"first_k_dense_replace": 1, "num_hidden_layers": 5},
    "inkling_text": {"dense_mlp_idx": 1},
    "mellum": {"mlp_layer_types": ["dense", "sparse", "sparse", "sparse"]},
    "beam": {"n_group": 1, "topk_group": 1},
    # a head scale other than 1, so that a proof of the head sees it
    # (and the MLP's gate and output multipliers, so that one the mlp slot drops shows)
    "falcon_h1": {"lm_head_multiplier": 0.5, "mlp_multipliers": [0.5, 0.75]},
    "hyperclovax": {"logits_scaling": 0.5},
    # a rotary dimension of 64 in 16-wide heads
    "codegen": {"rotary_dim": 8},
    "gptj": {"rotary_dim": 8},
    # BLT: hashed byte-group embeddings of 500,002 rows each, and local layers sized for a
    # 2048-wide global transformer
    "blt": {"encoder_hash_byte_group_vocab": 64, "encoder_hash_byte_group_size": [3, 4]},
    "blt_local_encoder": {"hidden_size_global": 128},
    "blt_local_decoder": {"hidden_size_global": 128},
    "lfm2_moe": {"layer_types": ["conv", "full_attention"] * 2, "num_dense_layers": 1},
    # its causal LM holds the image and audio encoders: at their default sizes 870M
    # parameters, which take a minute and a half to verify
    "phi4_multimodal": {
        "vision_config": {
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
        },
        "audio_config": {
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_blocks": 1,
            "num_attention_heads": 2,
            "ext_pw_out_channel": 32,
            "depthwise_separable_out_channel": 32,
            "nemo_conv_channels": 32,
        },
    },
    "qwen4_exp_text": {
        "indexer_budget": 8,
        "indexer_compress_ratio": 4,
        "indexer_n_heads": 2,
        "indexer_kv_heads": 1,
        "indexer_head_dim": 16,
    },
}


_PLAIN_ROPE = {"rope_type": "default", "rope_theta": 10000.0}


def _read_only(config_class: type, name: str) -> bool:
    """Whether ``name`` is a property of ``config_class`` that cannot be set."""
    found = inspect.getattr_static(config_class, name, None)
    return isinstance(found, property) and found.fset is None


def _keyed_rope(config_class: type) -> dict[str, Any] | None:
    """The plain rotary parameters per layer type, where the config's default keys them so
    (Gemma 4: ``{"sliding_attention": {...}, "full_attention": {...}}``; a type keyed to
    ``None`` stays so); ``None``: it does not."""
    try:
        default = config_class()
    except Exception:  # a config that needs arguments: nothing to read
        return None
    rope = getattr(default, "rope_parameters", None)
    if not isinstance(rope, Mapping):
        return None
    if any(isinstance(v, Mapping) for v in rope.values()) and all(
        isinstance(v, Mapping) or v is None for v in rope.values()
    ):
        # a layer type keyed to None runs without positions (Beam's full attention)
        return {key: None if value is None else dict(_PLAIN_ROPE) for key, value in rope.items()}
    if rope:
        return None
    # empty: keyed by the layer types it has (Cohere Compass)
    keys = dict.fromkeys(getattr(default, "layer_types", None) or ())
    return {key: dict(_PLAIN_ROPE) for key in keys} or None


def tiny_config_for(config_class: type, **overrides: Any) -> Any:
    """A tiny config of ``config_class``: the builtin families' sizes, nothing family-specific.

    Head size is given explicitly (some configs default it to a large constant), special
    tokens fall inside the small vocabulary, and rotary embeddings use the plain default
    (given per layer type where the config would keep it flat but its layers read it per
    layer type). A mixture-of-experts config gets four
    small experts, two per token (:data:`_TINY_MOE`, those of its fields its constructor
    names), a chunked scan chunks of 4 positions (:data:`_TINY_SCAN`); a config whose defaults cannot build its model gets :data:`_TINY_FIXES`.
    """
    sizes = {**TINY, "head_dim": TINY["hidden_size"] // TINY["num_attention_heads"]}
    # a size the config computes (Falcon's head_dim: a property without a setter) is not given
    sizes = {key: value for key, value in sizes.items() if not _read_only(config_class, key)}
    fields = inspect.signature(config_class).parameters
    sizes.update({key: value for key, value in _TINY_MOE.items() if key in fields})
    sizes.update({key: value for key, value in _TINY_SCAN.items() if key in fields})
    if "kv_lora_rank" in fields:
        sizes.update({key: value for key, value in _TINY_MLA.items() if key in fields})
        sizes["head_dim"] = _TINY_MLA["head_dim"]  # a field some configs derive, not take
        sizes["num_key_value_heads"] = sizes["num_attention_heads"]
    if "vocab_size_per_layer_input" in fields:
        # Gemma 3n's / Gemma 4's per-layer-input embeddings: a row per token of the small
        # vocabulary, not 262,144 (270M parameters in a tiny model)
        sizes["vocab_size_per_layer_input"] = TINY["vocab_size"]
    sizes.update(pad_token_id=0, bos_token_id=1, eos_token_id=2)
    sizes["rope_parameters"] = dict(_PLAIN_ROPE)
    sizes.update(_TINY_FIXES.get(getattr(config_class, "model_type", ""), {}))
    sizes.update(overrides)
    config = config_class(**sizes)
    rope = getattr(config, "rope_parameters", None)
    if "rope_parameters" not in overrides and not (
        isinstance(rope, Mapping) and any(isinstance(v, Mapping) for v in rope.values())
    ):
        # a config that keeps the plain parameters flat where its layers read them per
        # layer type: the plain parameters for each
        keyed = _keyed_rope(config_class)
        if keyed is not None:
            config = config_class(**{**sizes, "rope_parameters": keyed})
    return config


def config_with(config: Any, name: str, value: Any) -> Any:
    clone = type(config).from_dict(config.to_dict())
    setattr(clone, name, value)
    clone._attn_implementation = config._attn_implementation
    return clone


def query_scaled_rope(tiny_rope: Any, default_rope: Mapping[str, Any]) -> dict[str, Any]:
    """The tiny rotary parameters of a family scaling queries by position: its default
    ``llama_4_scaling_beta`` and an original maximum of 4 positions, so that the tiny
    inputs (8 tokens and more) are scaled, as long prompts are."""
    return {
        **(tiny_rope or {}),
        "llama_4_scaling_beta": default_rope["llama_4_scaling_beta"],
        "original_max_position_embeddings": 4,
    }


def tiny_of(config_class: type, scaled_rope: Any = None) -> dict[str, Any]:
    """The tiny config's fields a declaration records (``scaled_rope``: its rotary
    parameters where :func:`query_scaled_rope` made them)."""
    tiny = {
        key: value
        for key, value in tiny_config_for(config_class).to_diff_dict().items()
        if key in _TINY_KEYS
    }
    tiny.update(_TINY_FIXES.get(getattr(config_class, "model_type", ""), {}))
    if scaled_rope is not None:
        tiny["rope_parameters"] = dict(scaled_rope)
    return tiny


_TINY_KEYS = {
    *TINY,
    *_TINY_MOE,
    *_TINY_SCAN,
    "head_dim",
    "pad_token_id",
    "bos_token_id",
    "eos_token_id",
    "rope_parameters",
}
