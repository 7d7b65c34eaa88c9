"""Mllama's text model: Llama layers between cross-attention layers that stay the original's.

The self-attention layers are swapped; the cross-attention layers (the text attending to
the vision states) are kept, objects and all, and both kinds share one cache. The tiny
model's cross-attention gates start at zero (tanh(0) = 0: the layer adds nothing), so
these tests open them, and check the vision states change the logits before comparing.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from models import tiny_model
from transformers.models.mllama.modeling_mllama import MllamaCrossAttentionDecoderLayer

import layerswap
from layerswap.comparison.inputs import prepare_inputs
from layerswap.errors import UpstreamDriftError
from layerswap.registry import get_family, register_family, unregister_family
from layerswap.substitution import check_call_contract


def _opened(seed: int = 0) -> torch.nn.Module:
    model = tiny_model("mllama", seed=seed)
    with torch.no_grad():
        for layer in model.model.layers:
            if isinstance(layer, MllamaCrossAttentionDecoderLayer):
                layer.cross_attn_attn_gate.fill_(0.7)
                layer.cross_attn_mlp_gate.fill_(-0.4)
    return model


def test_self_attention_layers_are_swapped_and_cross_attention_layers_kept() -> None:
    model = _opened()
    batch = prepare_inputs(None, model, torch.device("cpu"))
    # verification's default inputs hold vision states, so the kept layers run
    assert batch["cross_attention_states"].shape == (2, 8, model.config.hidden_size)
    with torch.no_grad():
        expected = model(**batch).logits
        text_only = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    assert (expected - text_only.logits).abs().max() > 1e-3  # the cross layer matters
    cross = model.model.layers[1]
    handle = layerswap.swap(model, "mllama.decoder.fused")
    assert len(handle) == 3
    assert [type(layer).__name__ for layer in model.model.layers] == [
        "FusedMllamaDecoderLayer",
        "MllamaCrossAttentionDecoderLayer",
        "FusedMllamaDecoderLayer",
        "FusedMllamaDecoderLayer",
    ]
    assert model.model.layers[1] is cross
    with torch.no_grad():
        torch.testing.assert_close(model(**batch).logits, expected, rtol=1e-5, atol=1e-5)
    handle.undo()
    assert type(model.model.layers[0]).__name__ == "MllamaSelfAttentionDecoderLayer"


def test_cached_generation_with_vision_states_equals_the_original() -> None:
    """Decoding reads the cache both kinds of layer write (the cross layer's vision keys
    at its own index)."""
    original, swapped = _opened(), _opened()
    layerswap.swap(swapped, "mllama.decoder.fused")
    batch = prepare_inputs(None, original, torch.device("cpu"))
    options = {"max_new_tokens": 8, "do_sample": False, "pad_token_id": 0}
    with torch.no_grad():
        expected = original.generate(**batch, **options)
        got = swapped.generate(**batch, **options)
    assert torch.equal(got, expected)


def test_verify_passes_and_compares_only_the_swapped_layers() -> None:
    model = _opened()
    report = layerswap.verify(model, "mllama.decoder.fused")
    assert report.passed, report.summary()
    assert [layer.name for layer in report.layers] == [
        "model.layers.0",
        "model.layers.2",
        "model.layers.3",
    ]


def test_verify_in_bfloat16_gives_the_vision_states_in_bfloat16() -> None:
    """Verification in a lower precision than the model's: the default vision states are
    made for the float32 model, and the text model adds them to its activations as they
    come (float32 states against bfloat16 weights failed the reference run on a GPU)."""
    report = layerswap.verify(_opened(), "mllama.decoder.fused", dtype=torch.bfloat16, generate=0)
    assert report.passed, report.summary()
    assert report.dtype == "bfloat16"


def test_the_call_contract_accepts_only_the_arguments_declared_ignored() -> None:
    """Without ``ignored_arguments`` the cross-attention inputs every layer is called with
    are arguments the fused layer does not handle: refused before any model is touched."""
    undeclared = dataclasses.replace(
        get_family("mllama"), name="mllama_undeclared", ignored_arguments=()
    )
    register_family(undeclared)
    try:
        with pytest.raises(UpstreamDriftError, match="'cross_attention_states'"):
            check_call_contract(layerswap.get("mllama_undeclared.decoder.fused"))
    finally:
        unregister_family("mllama_undeclared")


def test_coverage_names_the_kept_layers_under_the_model_type_of_the_causal_lm() -> None:
    from layerswap.coverage import _language_model_type, model_coverage

    assert _language_model_type("mllama") == "mllama_text_model"
    report = model_coverage("mllama")
    fused = next(row for row in report.rows if row.substitution == "mllama.decoder.fused")
    assert fused.replaces == ("model.layers.0, 2-3 (MllamaSelfAttentionDecoderLayer)",)
    assert "model.layers.1 (MllamaCrossAttentionDecoderLayer)" in fused.keeps
    # what the kept layer holds goes with it, not row by row
    assert not any(kept.startswith("model.layers.1.") for kept in fused.keeps)
