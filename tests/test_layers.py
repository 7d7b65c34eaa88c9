"""Converting one layer: what its keywords promise, and the way back, exactly."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from models import tiny_model

import layerswap
from layerswap.errors import ConversionError
from layerswap.layers import convert_back, convert_layer
from layerswap.model import substitution_of

SUB = "qwen2.decoder.fused"


def _layer_and_model() -> tuple[torch.nn.Module, torch.nn.Module]:
    model = tiny_model("qwen2", num_hidden_layers=1)
    return model.model.layers[0], model


def test_a_detached_conversion_shares_storage_and_leaves_the_layer_alone() -> None:
    layer, model = _layer_and_model()
    before = {key: value.clone() for key, value in layer.state_dict().items()}
    replacement = convert_layer(layer, layerswap.get(SUB), model.config, layer_idx=0, detach=True)
    assert substitution_of(replacement) is layerswap.get(SUB)
    norm = replacement.input_layernorm.weight
    assert norm is not layer.input_layernorm.weight
    assert norm.data_ptr() == layer.input_layernorm.weight.data_ptr()
    assert norm.requires_grad
    assert all(torch.equal(layer.state_dict()[key], value) for key, value in before.items())


def test_without_grad_a_detached_replacement_is_frozen() -> None:
    layer, model = _layer_and_model()
    sub = layerswap.get(SUB)
    replacement = convert_layer(layer, sub, model.config, layer_idx=0, detach=True, grad=False)
    assert not any(param.requires_grad for param in replacement.parameters())


def test_a_swap_conversion_moves_the_same_parameters() -> None:
    layer, model = _layer_and_model()
    replacement = convert_layer(layer, layerswap.get(SUB), model.config, layer_idx=0)
    assert replacement.input_layernorm.weight is layer.input_layernorm.weight


def test_errors_are_wrapped_only_when_asked() -> None:
    layer, model = _layer_and_model()

    class Broken:
        def to_replacement(self, state: object, config: object) -> object:
            raise RuntimeError("boom")

    sub = layerswap.get(SUB)
    broken = dataclasses.replace(sub, name="qwen2.decoder.broken", converter=Broken())
    with pytest.raises(RuntimeError, match="boom"):
        convert_layer(layer, broken, model.config, layer_idx=0, detach=True)
    with pytest.raises(ConversionError, match=r"^layer 'x': RuntimeError: boom"):
        convert_layer(layer, broken, model.config, layer_idx=0, where="layer 'x'", wrap_errors=True)


def test_converting_back_gives_the_original_layer_exactly() -> None:
    layer, model = _layer_and_model()
    sub = layerswap.get(SUB)
    replacement = convert_layer(layer, sub, model.config, layer_idx=0, detach=True)
    rebuilt = convert_back(replacement, sub, model.config, layer_idx=0)
    assert type(rebuilt) is type(layer)
    for key, value in layer.state_dict().items():
        assert torch.equal(rebuilt.state_dict()[key], value), key
