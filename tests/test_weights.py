"""Layout converters: rules, both directions, bitwise round trips, errors naming tensors."""

from __future__ import annotations

import pytest
import torch
from models import tiny_config

from layerswap.backends.fused import CONVERTER
from layerswap.errors import ConversionError
from layerswap.weights import (
    Concat,
    Converter,
    Custom,
    Rename,
    gate_up_concat,
    head_dim,
    qkv_concat,
    qkv_sizes,
)


def _layer_state(config: object, *, bias: bool = False) -> dict[str, torch.Tensor]:
    q, k, v = qkv_sizes(config)  # type: ignore[arg-type]
    hidden, inter = config.hidden_size, config.intermediate_size  # type: ignore[attr-defined]
    state = {
        "self_attn.q_proj.weight": torch.randn(q, hidden),
        "self_attn.k_proj.weight": torch.randn(k, hidden),
        "self_attn.v_proj.weight": torch.randn(v, hidden),
        "self_attn.o_proj.weight": torch.randn(hidden, q),
        "mlp.gate_proj.weight": torch.randn(inter, hidden),
        "mlp.up_proj.weight": torch.randn(inter, hidden),
        "mlp.down_proj.weight": torch.randn(hidden, inter),
        "input_layernorm.weight": torch.randn(hidden),
    }
    if bias:
        state.update(
            {
                "self_attn.q_proj.bias": torch.randn(q),
                "self_attn.k_proj.bias": torch.randn(k),
                "self_attn.v_proj.bias": torch.randn(v),
            }
        )
    return state


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_fused_converter_round_trip_is_bitwise_with_grouped_query_attention(bias: bool) -> None:
    config = tiny_config("qwen3")  # explicit head_dim, 8 heads, 2 kv heads: unequal parts
    assert qkv_sizes(config) == (8 * 32, 2 * 32, 2 * 32)
    state = _layer_state(config, bias=bias)
    fused = CONVERTER.to_replacement(state, config)
    assert fused["self_attn.qkv_proj.weight"].shape == (sum(qkv_sizes(config)), 128)
    assert ("self_attn.qkv_proj.bias" in fused) is bias
    assert torch.equal(
        fused["mlp.gate_up_proj.weight"],
        torch.cat([state["mlp.gate_proj.weight"], state["mlp.up_proj.weight"]]),
    )
    back = CONVERTER.to_original(fused, config)
    assert back.keys() == state.keys()
    for key, value in state.items():
        assert torch.equal(back[key], value), key


def test_untouched_tensors_pass_through_as_the_same_objects() -> None:
    config = tiny_config("llama")
    state = _layer_state(config)
    fused = CONVERTER.to_replacement(state, config)
    assert fused["self_attn.o_proj.weight"] is state["self_attn.o_proj.weight"]
    assert fused["input_layernorm.weight"] is state["input_layernorm.weight"]


def test_split_parts_share_no_storage_with_the_fused_tensor_or_each_other() -> None:
    # safetensors refuses tensors that share memory; undo must not keep the fused storage
    config = tiny_config("llama")
    fused = CONVERTER.to_replacement(_layer_state(config), config)
    back = CONVERTER.to_original(fused, config)
    pointers = {
        back[f"self_attn.{name}_proj.weight"].untyped_storage().data_ptr() for name in "qkv"
    }
    assert len(pointers) == 3
    assert fused["self_attn.qkv_proj.weight"].untyped_storage().data_ptr() not in pointers


def test_concat_names_the_tensor_whose_shape_disagrees_with_the_config() -> None:
    config = tiny_config("llama")
    state = _layer_state(config)
    state["self_attn.k_proj.weight"] = torch.randn(7, config.hidden_size)
    with pytest.raises(ConversionError, match=r"'self_attn\.k_proj\.weight' has shape \(7, 128\)"):
        CONVERTER.to_replacement(state, config)


def test_split_names_the_fused_tensor_whose_shape_disagrees_with_the_config() -> None:
    config = tiny_config("llama")
    fused = CONVERTER.to_replacement(_layer_state(config), config)
    fused["mlp.gate_up_proj.weight"] = fused["mlp.gate_up_proj.weight"][:-1]
    with pytest.raises(ConversionError, match=r"'mlp\.gate_up_proj\.weight'"):
        CONVERTER.to_original(fused, config)


def test_missing_and_partly_present_inputs_are_errors() -> None:
    config = tiny_config("qwen2")
    state = _layer_state(config, bias=True)
    del state["self_attn.q_proj.weight"]
    with pytest.raises(ConversionError, match=r"'self_attn\.q_proj\.weight' is missing"):
        CONVERTER.to_replacement(state, config)
    state = _layer_state(config, bias=True)
    del state["self_attn.v_proj.bias"]  # an optional rule must have all of its inputs or none
    with pytest.raises(ConversionError, match=r"'self_attn\.v_proj\.bias' is missing"):
        CONVERTER.to_replacement(state, config)


def test_rename_and_custom_rules_round_trip() -> None:
    config = tiny_config("llama")
    converter = Converter(
        (
            Rename("input_layernorm.weight", "layernorm_qkv.layer_norm_weight"),
            Custom(
                ("self_attn.o_proj.weight",),
                ("proj.weight_t",),
                forward=lambda ts, cfg: [ts[0].t().contiguous()],
                backward=lambda ts, cfg: [ts[0].t().contiguous()],
            ),
            qkv_concat("layernorm_qkv"),
            gate_up_concat("fc1"),
        )
    )
    state = _layer_state(config)
    converted = converter.to_replacement(state, config)
    assert set(converted) == {
        "layernorm_qkv.layer_norm_weight",
        "layernorm_qkv.weight",
        "proj.weight_t",
        "fc1.weight",
        "mlp.down_proj.weight",
    }
    assert converted["layernorm_qkv.layer_norm_weight"] is state["input_layernorm.weight"]
    back = converter.to_original(converted, config)
    assert back.keys() == state.keys()
    assert all(torch.equal(back[key], value) for key, value in state.items())


def test_a_failing_custom_rule_is_reported_with_its_tensor() -> None:
    def broken(tensors: list[torch.Tensor], config: object) -> list[torch.Tensor]:
        raise RuntimeError("boom")

    converter = Converter((Custom(("mlp.down_proj.weight",), ("down",), broken, broken),))
    with pytest.raises(ConversionError, match=r"'mlp\.down_proj\.weight'.*boom"):
        converter.to_replacement(_layer_state(tiny_config("llama")), tiny_config("llama"))


def test_strict_converter_rejects_tensors_no_rule_mentions() -> None:
    config = tiny_config("llama")
    strict = Converter(CONVERTER.rules, passthrough=False)
    with pytest.raises(ConversionError, match="no rule converts"):
        strict.to_replacement(_layer_state(config), config)


def test_a_rule_producing_a_passed_through_name_is_an_error() -> None:
    config = tiny_config("llama")
    clash = Converter((Rename("mlp.up_proj.weight", "mlp.down_proj.weight"),))
    with pytest.raises(ConversionError, match=r"'mlp\.down_proj\.weight' is both"):
        clash.to_replacement(_layer_state(config), config)


def test_concat_sizes_come_from_the_config() -> None:
    config = tiny_config("qwen3")
    rule = Concat(("a", "b"), "ab", sizes=lambda cfg: (head_dim(cfg), 2 * head_dim(cfg)))
    a, b = torch.randn(32, 4), torch.randn(64, 4)
    (ab,) = rule.to_replacement([a, b], config)
    parts = rule.to_original([ab], config)
    assert torch.equal(parts[0], a) and torch.equal(parts[1], b)


def test_derive_appends_rules_without_changing_the_original() -> None:
    derived = CONVERTER.derive(Rename("input_layernorm.weight", "norm.weight"))
    assert len(derived.rules) == len(CONVERTER.rules) + 1
    assert "norm.weight" in derived.to_replacement(
        _layer_state(tiny_config("llama")), tiny_config("llama")
    )
    assert "input_layernorm.weight" in CONVERTER.to_replacement(
        _layer_state(tiny_config("llama")), tiny_config("llama")
    )
