"""``load_state_dict`` of a swapped model: both layouts, keys reported in the caller's layout."""

from __future__ import annotations

import copy
import pickle
from pathlib import Path

import pytest
import torch
from models import tiny_model, tokens
from transformers import PreTrainedModel

import layerswap
from layerswap.errors import ConversionError

FAMILIES = ("llama", "qwen2", "qwen3")


def _pair(name: str) -> tuple[dict[str, torch.Tensor], PreTrainedModel, PreTrainedModel]:
    """An original model's state, that model, and a swapped model with other weights."""
    original = tiny_model(name, num_hidden_layers=2)
    swapped = tiny_model(name, seed=7, num_hidden_layers=2)
    layerswap.swap(swapped, backend="fused")
    return {k: v.clone() for k, v in original.state_dict().items()}, original, swapped


def _logits(model: PreTrainedModel) -> torch.Tensor:
    with torch.no_grad():
        return model(tokens(model.config.vocab_size)).logits


@pytest.mark.parametrize("name", FAMILIES)
def test_the_original_layout_loads_strictly_and_every_weight_arrives(name: str) -> None:
    state, original, swapped = _pair(name)
    result = swapped.load_state_dict(state, strict=True)
    assert result.missing_keys == [] and result.unexpected_keys == []
    torch.testing.assert_close(_logits(swapped), _logits(original), atol=1e-5, rtol=0)
    layerswap.swap(original, backend="fused")
    for key, value in original.state_dict().items():
        assert torch.equal(swapped.state_dict()[key], value), key


def test_the_swapped_layout_still_loads_as_it_is() -> None:
    _, original, swapped = _pair("qwen2")
    layerswap.swap(original, backend="fused")
    swapped.load_state_dict(original.state_dict(), strict=True)
    torch.testing.assert_close(_logits(swapped), _logits(original), atol=0, rtol=0)


def test_missing_keys_are_named_in_the_layout_the_caller_gave() -> None:
    state, _, swapped = _pair("qwen2")
    del state["model.layers.0.self_attn.k_proj.weight"]
    del state["model.layers.1.self_attn.q_proj.bias"]
    del state["model.layers.1.self_attn.k_proj.bias"]
    del state["model.layers.1.self_attn.v_proj.bias"]
    result = swapped.load_state_dict(state, strict=False)
    assert sorted(result.missing_keys) == [
        "model.layers.0.self_attn.k_proj.weight",
        "model.layers.1.self_attn.k_proj.bias",
        "model.layers.1.self_attn.q_proj.bias",
        "model.layers.1.self_attn.v_proj.bias",
    ]
    assert result.unexpected_keys == []
    with pytest.raises(RuntimeError, match=r"Missing key\(s\).*k_proj\.weight"):
        swapped.load_state_dict(state, strict=True)


def test_a_concatenation_given_in_part_loads_the_parts_given_and_keeps_the_rest() -> None:
    state, _, swapped = _pair("llama")
    fused = swapped.model.layers[0].self_attn
    q, k, _ = fused.sizes
    before = fused.qkv_proj.weight.detach().clone()
    del state["model.layers.0.self_attn.v_proj.weight"]
    swapped.load_state_dict(state, strict=False)
    after = fused.qkv_proj.weight.detach()
    assert torch.equal(after[:q], state["model.layers.0.self_attn.q_proj.weight"])
    assert torch.equal(after[q : q + k], state["model.layers.0.self_attn.k_proj.weight"])
    assert torch.equal(after[q + k :], before[q + k :])  # not given: kept, and reported missing


def test_a_part_not_given_keeps_its_exact_values_under_a_lower_precision_state() -> None:
    """A bfloat16 state missing v_proj: q and k arrive cast to the layer's float32 (as
    torch's copy_ casts), v keeps its own values, not rounded to bfloat16 and back."""
    state, _, swapped = _pair("llama")
    fused = swapped.model.layers[0].self_attn
    q, k, _ = fused.sizes
    before = fused.qkv_proj.weight.detach().clone()
    low = {key: value.to(torch.bfloat16) for key, value in state.items()}
    del low["model.layers.0.self_attn.v_proj.weight"]
    swapped.load_state_dict(low, strict=False)
    after = fused.qkv_proj.weight.detach()
    assert after.dtype == torch.float32
    assert torch.equal(after[q + k :], before[q + k :])
    expected_q = low["model.layers.0.self_attn.q_proj.weight"].float()
    assert torch.equal(after[:q], expected_q)


def test_parts_given_in_several_dtypes_load_as_torch_loads_them() -> None:
    state, original, swapped = _pair("llama")
    state["model.layers.0.self_attn.q_proj.weight"] = state[
        "model.layers.0.self_attn.q_proj.weight"
    ].half()
    original.load_state_dict(state)
    swapped.load_state_dict(state)
    torch.testing.assert_close(_logits(swapped), _logits(original), rtol=1e-5, atol=1e-5)


def test_torchs_full_state_dict_loading_and_accelerates_checkpoint_loading_convert(
    tmp_path: Path,
) -> None:
    """torch's set_model_state_dict(full_state_dict=True) adds the model's own tensors, under
    their names, beside the original-layout state given (accelerate's checkpoint loading
    takes that path too): no mixed layout, every tensor given arrives."""
    from accelerate.utils import load_checkpoint_in_model
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    state, original, swapped = _pair("llama")
    set_model_state_dict(swapped, dict(state), options=StateDictOptions(full_state_dict=True))
    torch.testing.assert_close(_logits(swapped), _logits(original), rtol=0, atol=0)

    original.save_pretrained(tmp_path)
    _, _, other = _pair("llama")
    load_checkpoint_in_model(other, str(tmp_path))
    torch.testing.assert_close(_logits(other), _logits(original), rtol=0, atol=0)


def test_unexpected_keys_keep_the_callers_names() -> None:
    state, _, swapped = _pair("llama")  # llama has no q/k/v biases
    state["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(256)
    state["model.layers.0.self_attn.k_proj.bias"] = torch.zeros(64)
    state["model.layers.0.self_attn.v_proj.bias"] = torch.zeros(64)
    result = swapped.load_state_dict(state, strict=False)
    assert sorted(result.unexpected_keys) == [
        "model.layers.0.self_attn.k_proj.bias",
        "model.layers.0.self_attn.q_proj.bias",
        "model.layers.0.self_attn.v_proj.bias",
    ]


def test_a_layer_given_both_layouts_is_an_error_naming_both_keys() -> None:
    state, _, swapped = _pair("llama")
    state["model.layers.1.self_attn.qkv_proj.weight"] = torch.zeros(384, 128)
    with pytest.raises(
        ConversionError, match=r"mixes the original layout.*_proj\.weight.*qkv_proj\.weight"
    ):
        swapped.load_state_dict(state, strict=False)


def test_adapter_state_for_a_fused_away_module_is_an_error_never_ignored() -> None:
    state, _, swapped = _pair("qwen3")
    state["model.layers.0.mlp.up_proj.lora_A.default.weight"] = torch.zeros(4, 128)
    with pytest.raises(
        ConversionError, match=r"mlp\.up_proj, which.*gate_up_proj.*up_proj\.lora_A.*load_adapter"
    ):
        swapped.load_state_dict(state, strict=False)


def test_a_wrong_shape_is_an_error_naming_the_tensor() -> None:
    state, _, swapped = _pair("llama")
    state["model.layers.0.mlp.gate_proj.weight"] = torch.zeros(3, 128)
    with pytest.raises(ConversionError, match=r"model\.layers\.0.*mlp\.gate_proj\.weight"):
        swapped.load_state_dict(state)


def test_a_model_built_inside_use_loads_the_original_layout() -> None:
    state, original, _ = _pair("qwen3")
    family = layerswap.families()["qwen3"]
    with layerswap.use("qwen3.decoder.fused"):
        built = family.build(family.tiny_config(num_hidden_layers=2), seed=3)
    built.load_state_dict(state, strict=True)
    torch.testing.assert_close(_logits(built), _logits(original), atol=1e-5, rtol=0)


@pytest.mark.parametrize("clone", [copy.deepcopy, lambda m: pickle.loads(pickle.dumps(m))])
def test_copies_of_a_swapped_model_convert_on_load_too(clone: object) -> None:
    state, original, swapped = _pair("llama")
    twin = clone(swapped)  # type: ignore[operator]
    twin.load_state_dict(state, strict=True)
    torch.testing.assert_close(_logits(twin), _logits(original), atol=1e-5, rtol=0)


def test_after_undo_the_original_layers_load_the_original_layout_as_before() -> None:
    state, original, _ = _pair("llama")
    model = tiny_model("llama", seed=7, num_hidden_layers=2)
    layerswap.swap(model, backend="fused").undo()
    model.load_state_dict(state, strict=True)
    torch.testing.assert_close(_logits(model), _logits(original), atol=0, rtol=0)
