"""The TransformerEngine backend: requirements, weight layout, mask and rotary mapping.

Everything above the GPU section runs on any machine: TransformerEngine is only needed
to build a layer, and the weight mapping, the mask translation and the rotary formula
are plain tensor work, checked here against transformers' own layers. The GPU section
runs where CUDA and TransformerEngine are present and is skipped (with the reason)
elsewhere.
"""

from __future__ import annotations

import copy
import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import layerswap
from layerswap.backends import te
from layerswap.backends.te_layout import TELayerSpec, te_converter
from layerswap.comparison.inputs import inputs_for
from layerswap.errors import ConversionError, RequirementError, SubstitutionError
from layerswap.model import decoder_layers, layer_config
from layerswap.registry import families
from layerswap.verify import Tolerance, verify

# the families whose structure TransformerEngine's layer expresses (the others are
# refused with the reason: norms after attention or the MLP, q/k norms across heads)
FAMILIES = sorted(name for name, f in families().items() if te.BACKEND.unsupported(f) is None)

# (family, config overrides): every builtin family, plus the shapes and switches that
# move tensors around: Llama's optional biases, multi-head and multi-query attention
LAYOUTS: list[tuple[str, dict[str, Any]]] = [(name, {}) for name in FAMILIES] + [
    ("llama", {"attention_bias": True, "mlp_bias": True}),
    ("llama", {"num_key_value_heads": 8}),
    ("llama", {"num_key_value_heads": 1}),
]
LAYOUT_IDS = [
    name + "".join(f"-{key}={value}" for key, value in overrides.items())
    for name, overrides in LAYOUTS
]

te_installed = importlib.util.find_spec("transformer_engine") is not None
without_te = pytest.mark.skipif(te_installed, reason="TransformerEngine is installed here")


def _layer_state(name: str, overrides: dict[str, Any]) -> tuple[Any, Any, Any]:
    """(family, config, decoder layer 1 of a seeded model with perturbed norms and biases)."""
    family = families()[name]
    config = family.tiny_config(**overrides)
    model = family.build(config, seed=3)
    # a wrapper family's layers read its text config
    return family, layer_config(config), decoder_layers(model)[1][1]


# --- requirements ---------------------------------------------------------------------


def test_every_family_te_can_express_has_a_te_substitution_and_the_rest_a_reason() -> None:
    subs = {sub.family: sub for sub in layerswap.substitutions(backend="te", slot="decoder")}
    assert sorted(subs) == FAMILIES
    assert {"llama", "mistral", "qwen2", "qwen3", "gemma", "granite"} <= set(FAMILIES)
    for name, sub in subs.items():
        assert sub.name == f"{name}.decoder.te"
        assert sub.original.endswith(":" + families()[name].decoder)
    from layerswap.backends.te_layout import unexpressible

    assert "norms before attention and the MLP only" in str(unexpressible(families()["gemma3"]))
    assert "attn_out, mlp_out" in str(unexpressible(families()["olmo2"]))
    assert te.BACKEND.unsupported(families()["olmo2"]) is not None


@without_te
def test_unmet_requirement_says_transformer_engine_is_not_installed() -> None:
    assert layerswap.get("llama.decoder.te").unmet_requirement() == (
        "TransformerEngine is not installed (pip install 'layerswap[te]')"
    )
    assert te.fp8_unmet_requirement() == te.NOT_INSTALLED


@without_te
def test_swap_refuses_and_leaves_the_model_untouched() -> None:
    family = families()["llama"]
    model = family.build(seed=0)
    modules = dict(model.named_modules())
    tensors = {key: (value, value.clone()) for key, value in model.state_dict().items()}
    with pytest.raises(RequirementError, match=r"TransformerEngine is not installed"):
        layerswap.swap(model, "llama.decoder.te")
    assert dict(model.named_modules()) == modules
    for key, (tensor, copied) in tensors.items():
        current = model.state_dict()[key]
        assert current is tensor or current.data_ptr() == tensor.data_ptr(), key
        assert torch.equal(current, copied), key


@without_te
def test_building_a_layer_or_entering_fp8_needs_transformer_engine() -> None:
    family = families()["qwen2"]
    with pytest.raises(RequirementError, match="not installed"):
        te.layer_class(family)(family.tiny_config(), 0)
    with pytest.raises(RequirementError, match="not installed"):
        te.fp8_autocast("current")
    with te.fp8_autocast(enabled=False):  # a switched-off autocast needs nothing
        pass


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is visible here")
def test_requirement_names_missing_cuda_once_transformer_engine_is_found(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not te_installed:
        # an importable package of that name is all the installation check looks for
        (tmp_path / "transformer_engine").mkdir()
        (tmp_path / "transformer_engine" / "__init__.py").write_text("")
        monkeypatch.syspath_prepend(str(tmp_path))
    assert te.unmet_requirement() == "needs CUDA (no CUDA device visible)"
    assert te.fp8_unmet_requirement("delayed") == te.NO_CUDA


@without_te
def test_mixed_cudnn_builds_are_named_with_the_way_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Seen on the GPU machine: TE imported after torch had run a cuDNN kernel bound the
    # system's libcudnn_cnn to torch's libcudnn_graph. An installation whose extension
    # fails the same way is reported with the reason and what to do.
    package = tmp_path / "transformer_engine"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "pytorch.py").write_text(
        "raise OSError('/lib/x86_64-linux-gnu/libcudnn_cnn.so.9: undefined symbol: "
        "_ZTVN5cudnn7backend12OperationSetE, version libcudnn_graph.so.9')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    reason = te.unmet_requirement()
    assert reason is not None
    assert reason.startswith("TransformerEngine is installed but cannot be imported")
    assert "libcudnn_graph" in reason and "LD_LIBRARY_PATH" in reason
    with pytest.raises(RequirementError, match="two cuDNN builds were mixed"):
        te.fp8_autocast("current")


def test_fp8_substitution_is_the_te_layer_with_an_fp8_requirement() -> None:
    family = families()["llama"]
    sub = te.BACKEND.substitution(family, variant="fp8").with_options(recipe="current")
    assert sub is not None
    assert sub == layerswap.get("llama.decoder.te_fp8").with_options(recipe="current")
    assert sub.name == "llama.decoder.te_fp8" and sub.backend == "te_fp8"
    assert sub.replacement is te.layer_class(family)
    assert sub.unmet_requirement() == te.fp8_unmet_requirement("current")
    if sub.unmet_requirement() is not None:
        with pytest.raises(RequirementError):
            sub.forward_context()


def test_layer_classes_are_importable_by_name() -> None:
    from layerswap.backends.te import TEQwen3DecoderLayer  # type: ignore[attr-defined]

    assert TEQwen3DecoderLayer is te.layer_class(families()["qwen3"])
    assert TEQwen3DecoderLayer.__module__ == "layerswap.backends.te.decoder"
    with pytest.raises(AttributeError):
        te.TENoSuchDecoderLayer  # noqa: B018


# --- weight layout --------------------------------------------------------------------


@pytest.mark.parametrize(("name", "overrides"), LAYOUTS, ids=LAYOUT_IDS)
def test_converter_round_trip_is_bitwise(name: str, overrides: dict[str, Any]) -> None:
    family, config, layer = _layer_state(name, overrides)
    original = layer.state_dict()
    converter = te_converter(family)
    converted = converter.to_replacement(original, config)
    back = converter.to_original(converted, config)
    assert sorted(back) == sorted(original)
    for key, value in original.items():
        assert back[key].dtype == value.dtype and torch.equal(back[key], value), key


@pytest.mark.parametrize(("name", "overrides"), LAYOUTS, ids=LAYOUT_IDS)
def test_converter_produces_te_transformer_layer_names_and_shapes(
    name: str, overrides: dict[str, Any]
) -> None:
    family, config, layer = _layer_state(name, overrides)
    spec = TELayerSpec.for_layer(family, config, 1)
    converted = te_converter(family).to_replacement(layer.state_dict(), config)
    hidden, inter = spec.hidden_size, spec.intermediate_size
    qkv_rows = spec.q_size + 2 * spec.kv_size
    expected = {
        "self_attention.layernorm_qkv.layer_norm_weight": (hidden,),
        "self_attention.layernorm_qkv.weight": (qkv_rows, hidden),
        "self_attention.proj.weight": (hidden, spec.q_size),
        "layernorm_mlp.layer_norm_weight": (hidden,),
        "layernorm_mlp.fc1_weight": (2 * inter, hidden),
        "layernorm_mlp.fc2_weight": (hidden, inter),
    }
    if spec.qkv_bias:
        expected["self_attention.layernorm_qkv.bias"] = (qkv_rows,)
    if spec.o_bias:
        expected["self_attention.proj.bias"] = (hidden,)
    if spec.mlp_bias:
        expected["layernorm_mlp.fc1_bias"] = (2 * inter,)
        expected["layernorm_mlp.fc2_bias"] = (hidden,)
    if spec.qk_norm:
        expected["self_attention.q_norm.weight"] = (spec.head_dim,)
        expected["self_attention.k_norm.weight"] = (spec.head_dim,)
    assert {key: tuple(value.shape) for key, value in converted.items()} == expected
    # q, k, v stacked in that order, gate before up: the order the layer splits in
    attn = layer.self_attn
    q, k, v = converted["self_attention.layernorm_qkv.weight"].split(
        (spec.q_size, spec.kv_size, spec.kv_size)
    )
    assert torch.equal(q, attn.q_proj.weight) and torch.equal(k, attn.k_proj.weight)
    assert torch.equal(v, attn.v_proj.weight)
    gate, up = converted["layernorm_mlp.fc1_weight"].chunk(2)
    assert torch.equal(gate, layer.mlp.gate_proj.weight) and torch.equal(
        up, layer.mlp.up_proj.weight
    )


def test_converter_names_a_missing_or_unknown_tensor() -> None:
    family, config, layer = _layer_state("llama", {})
    converter = te_converter(family)
    state = dict(layer.state_dict())
    down = state.pop("mlp.down_proj.weight")
    with pytest.raises(ConversionError, match=r"mlp\.down_proj\.weight"):
        converter.to_replacement(state, config)
    state["mlp.down_proj.weight"] = down
    state["self_attn.rotary_scale"] = torch.ones(1)
    with pytest.raises(ConversionError, match=r"self_attn\.rotary_scale"):
        converter.to_replacement(state, config)


def test_converting_back_drops_te_extra_state() -> None:
    family, config, layer = _layer_state("llama", {})
    converter = te_converter(family)
    converted = converter.to_replacement(layer.state_dict(), config)
    converted["layernorm_mlp._extra_state"] = torch.empty(0, dtype=torch.uint8)
    assert sorted(converter.to_original(converted, config)) == sorted(layer.state_dict())


def test_saved_state_leaves_out_only_empty_te_extra_state() -> None:
    # what TE's get_extra_state gives: an empty tensor, or FP8 scaling history
    history = torch.tensor([1, 2, 3], dtype=torch.uint8)
    state = {
        "model.layers.0.self_attention.proj.weight": torch.ones(2, 2),
        "model.layers.0.self_attention.proj._extra_state": torch.empty(0, dtype=torch.uint8),
        "model.layers.0.layernorm_mlp._extra_state": history,
        "model.layers.1.layernorm_mlp._extra_state": torch.empty(0, dtype=torch.uint8),
    }
    te._drop_empty_extra_state(torch.nn.Module(), state, "model.layers.0.", {})
    assert sorted(state) == [
        "model.layers.0.layernorm_mlp._extra_state",
        "model.layers.0.self_attention.proj.weight",
        "model.layers.1.layernorm_mlp._extra_state",  # another layer's: not this hook's
    ]


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool) -> torch.Tensor:
    scale = weight + 1 if zero_centered else weight
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * scale


def _te_layer_reference(
    state: dict[str, torch.Tensor],
    spec: TELayerSpec,
    hidden: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> torch.Tensor:
    """TransformerEngine's documented computation, in plain torch, on TE-layout weights.

    LayerNormLinear: RMSNorm (``zero_centered_gamma``: scale 1 + weight) then x W^T + b;
    the q/k/v output is ``[q | k | v]`` (``qkv_weight_interleaved=False``); LayerNormMLP's
    gated activations act on the first half of fc1's output and multiply the second;
    TE's GELU is the tanh approximation.
    """
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    def get(key: str) -> torch.Tensor | None:
        return state.get(key)

    zc, eps = spec.zero_centered_norm, spec.norm_eps
    batch, length, _ = hidden.shape
    normed = _rms(hidden, state["self_attention.layernorm_qkv.layer_norm_weight"], eps, zc)
    qkv = F.linear(
        normed,
        state["self_attention.layernorm_qkv.weight"],
        get("self_attention.layernorm_qkv.bias"),
    )
    q, k, v = qkv.split((spec.q_size, spec.kv_size, spec.kv_size), dim=-1)
    q = q.view(batch, length, spec.num_heads, spec.head_dim)
    k = k.view(batch, length, spec.num_kv_heads, spec.head_dim)
    v = v.view(batch, length, spec.num_kv_heads, spec.head_dim)
    if spec.qk_norm:
        q = _rms(q, state["self_attention.q_norm.weight"], eps, zc)
        k = _rms(k, state["self_attention.k_norm.weight"], eps, zc)
    q, k = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
    groups = spec.num_heads // spec.num_kv_heads
    k = k.repeat_interleave(groups, dim=1)
    v = v.transpose(1, 2).repeat_interleave(groups, dim=1)
    attended = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=spec.softmax_scale)
    hidden = hidden + F.linear(
        attended.transpose(1, 2).reshape(batch, length, spec.q_size),
        state["self_attention.proj.weight"],
        get("self_attention.proj.bias"),
    )
    normed = _rms(hidden, state["layernorm_mlp.layer_norm_weight"], eps, zc)
    first, second = F.linear(
        normed, state["layernorm_mlp.fc1_weight"], get("layernorm_mlp.fc1_bias")
    ).chunk(2, dim=-1)
    activation = {
        "swiglu": F.silu,
        "geglu": lambda t: F.gelu(t, approximate="tanh"),
    }[spec.activation]
    return hidden + F.linear(
        activation(first) * second,
        state["layernorm_mlp.fc2_weight"],
        get("layernorm_mlp.fc2_bias"),
    )


@pytest.mark.parametrize(("name", "overrides"), LAYOUTS, ids=LAYOUT_IDS)
def test_te_layout_computes_what_the_original_layer_computes(
    name: str, overrides: dict[str, Any]
) -> None:
    family = families()[name]
    model = family.build(family.tiny_config(**overrides), seed=5)
    config = layer_config(model.config)
    name, layer = decoder_layers(model)[1]
    spec = TELayerSpec.for_layer(family, config, layer.self_attn.layer_idx)
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 9, config.hidden_size, generator=generator)
    position_ids = torch.arange(9).unsqueeze(0)
    stack = model.get_submodule(name.rsplit(".", 2)[0])  # the module holding the layers
    cos, sin = stack.rotary_emb(hidden, position_ids)
    with torch.no_grad():
        expected = layer(hidden, attention_mask=None, position_embeddings=(cos, sin))
        converted = te_converter(family).to_replacement(layer.state_dict(), config)
        got = _te_layer_reference(converted, spec, hidden, cos, sin)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


# --- layer spec, masks, rotary ---------------------------------------------------------


def test_spec_reads_family_switches_and_sliding_windows() -> None:
    qwen2 = families()["qwen2"]
    spec = TELayerSpec.for_layer(qwen2, qwen2.tiny_config(), 0)
    assert (spec.qkv_bias, spec.o_bias, spec.mlp_bias, spec.qk_norm) == (True, False, False, False)
    mistral = families()["mistral"]
    assert TELayerSpec.for_layer(mistral, mistral.tiny_config(), 3).window_size == (7, 0)
    sliding = qwen2.tiny_config(use_sliding_window=True, sliding_window=16, max_window_layers=2)
    windows = [TELayerSpec.for_layer(qwen2, sliding, i).sliding_window for i in range(4)]
    assert windows == [16 if kind == "sliding_attention" else None for kind in sliding.layer_types]
    assert any(windows) and not all(windows)
    gemma = families()["gemma"]
    spec = TELayerSpec.for_layer(gemma, gemma.tiny_config(), 0)
    assert (spec.zero_centered_norm, spec.activation, spec.head_dim) == (True, "geglu", 32)


def test_spec_refuses_what_te_cannot_compute() -> None:
    llama = families()["llama"]
    with pytest.raises(SubstitutionError, match="'gelu'"):
        TELayerSpec.for_layer(llama, llama.tiny_config(hidden_act="gelu"), 0)
    yarn = llama.tiny_config(
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}
    )
    assert not TELayerSpec.for_layer(llama, yarn, 0).unit_rope  # cos/sin carry a factor


def test_te_mask_translates_transformers_masks() -> None:
    llama, mistral = families()["llama"], families()["mistral"]
    plain = TELayerSpec.for_layer(llama, llama.tiny_config(), 0)
    sliding = TELayerSpec.for_layer(mistral, mistral.tiny_config(), 0)
    assert te.te_mask(None, 16, plain) == ("causal", None, None)
    assert te.te_mask(None, 1, plain) == ("no_mask", None, None)
    assert te.te_mask(None, 16, sliding) == ("causal", None, (7, 0))
    assert te.te_mask(None, 1, sliding) == ("causal_bottom_right", None, (7, 0))
    keep = torch.ones(2, 1, 4, 6, dtype=torch.bool).tril(diagonal=2)
    kind, mask, window = te.te_mask(keep, 4, plain)
    assert (kind, window) == ("arbitrary", None)
    assert mask is not None and torch.equal(mask, ~keep)
    additive = torch.zeros(2, 1, 4, 6).masked_fill(~keep, torch.finfo(torch.float32).min)
    kind, mask, _ = te.te_mask(additive, 4, plain)
    assert kind == "arbitrary" and mask is not None and torch.equal(mask, ~keep)
    with pytest.raises(RequirementError, match="4-D"):
        te.te_mask(torch.ones(2, 6, dtype=torch.long), 4, plain)


def test_elementwise_rotary_matches_transformers() -> None:
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    family = families()["qwen3"]
    model = family.build(seed=0)
    generator = torch.Generator().manual_seed(1)
    query = torch.randn(2, 7, 8, 32, generator=generator)  # bshd
    key = torch.randn(2, 7, 2, 32, generator=generator)
    position_ids = torch.tensor([[0, 1, 2, 3, 4, 5, 6], [0, 0, 0, 1, 2, 3, 4]])  # per row
    cos, sin = model.model.rotary_emb(query, position_ids)
    got_q, got_k = te.rotate(query, key, cos, sin, fused=False)
    want_q, want_k = apply_rotary_pos_emb(query.transpose(1, 2), key.transpose(1, 2), cos, sin)
    torch.testing.assert_close(got_q, want_q.transpose(1, 2), rtol=0, atol=0)
    torch.testing.assert_close(got_k, want_k.transpose(1, 2), rtol=0, atol=0)


# --- GPU: CUDA and TransformerEngine -----------------------------------------------------

_TE_REASON = te.unmet_requirement()
requires_te = pytest.mark.skipif(
    _TE_REASON is not None, reason=f"needs CUDA and TransformerEngine ({_TE_REASON})"
)


def _cuda_bf16(name: str, seed: int = 0, **overrides: Any) -> Any:
    family = families()[name]
    return family.build(family.tiny_config(**overrides), seed=seed).to("cuda", torch.bfloat16)


def _unpadded(model: Any, seq_len: int = 32) -> dict[str, torch.Tensor]:
    return inputs_for(model, batch=2, seq_len=seq_len, padding=0)


@pytest.mark.gpu
@requires_te
@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("padded", [False, True], ids=["causal", "padded"])
def test_bf16_logits_match_the_original(name: str, padded: bool) -> None:
    model = _cuda_bf16(name)
    inputs = None if padded else _unpadded(model)  # default inputs are left-padded
    report = verify(model, f"{name}.decoder.te", inputs=inputs)
    assert report.passed, report.summary()


@pytest.mark.gpu
@requires_te
@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_bf16_gradients_match_the_original(name: str) -> None:
    model = _cuda_bf16(name)
    report = verify(model, f"{name}.decoder.te", inputs=_unpadded(model), backward=True)
    assert report.passed, report.summary()


@pytest.mark.gpu
@requires_te
@pytest.mark.parametrize("name", ["llama", "mistral"])
def test_generate_with_the_cache_matches_the_original(name: str) -> None:
    model = _cuda_bf16(name)
    report = verify(model, f"{name}.decoder.te", generate=8)
    assert report.passed, report.summary()


@pytest.mark.gpu
@requires_te
def test_fp8_forward_stays_close_to_the_original() -> None:
    sub = layerswap.get("llama.decoder.te_fp8").with_options(recipe="current")
    assert sub is not None
    reason = sub.unmet_requirement()
    if reason is not None:
        pytest.skip(reason)
    model = _cuda_bf16("llama")
    report = verify(model, sub, inputs=_unpadded(model, 64), tolerance=Tolerance.for_dtype("fp8"))
    assert report.passed, report.summary()


@pytest.mark.gpu
@requires_te
def test_fp8_delayed_scaling_is_close_once_its_amax_history_has_filled() -> None:
    reason = te.fp8_unmet_requirement("delayed")
    if reason is not None:
        pytest.skip(reason)
    model = _cuda_bf16("llama")
    ids = _unpadded(model, 64)["input_ids"].cuda()
    with torch.no_grad():
        expected = model(ids, use_cache=False).logits.float()
    layerswap.swap(model, "llama.decoder.te")
    # scales come from earlier iterations' amax, which TE folds in when an autocast region
    # with gradients enabled closes
    for _ in range(3):
        with te.fp8_autocast("delayed", amax_history_len=4):
            got = model(ids, use_cache=False).logits.detach().float()
    cosine = F.cosine_similarity(got.flatten(0, 1), expected.flatten(0, 1), dim=-1)
    assert cosine.min().item() > 0.95


@pytest.mark.gpu
@requires_te
def test_fp8_generate_runs_decode_steps_in_bf16() -> None:
    reason = te.fp8_unmet_requirement("current")
    if reason is not None:
        pytest.skip(reason)
    model = _cuda_bf16("llama")
    reference = copy.deepcopy(model)
    layerswap.swap(model, "llama.decoder.te")
    ids = _unpadded(model, 16)["input_ids"].cuda()
    with torch.no_grad(), te.fp8_autocast("current"):
        tokens = model.generate(ids, max_new_tokens=4, do_sample=False)
    with torch.no_grad():
        expected = reference.generate(ids, max_new_tokens=4, do_sample=False)
    assert tokens.shape == expected.shape
    assert torch.equal(tokens[:, : ids.shape[1]], ids)


@pytest.mark.gpu
@requires_te
def test_swap_and_undo_on_cuda_restore_the_weights_bitwise() -> None:
    model = _cuda_bf16("qwen2")
    before = {key: value.clone() for key, value in model.state_dict().items()}
    with layerswap.swap(model, "qwen2.decoder.te"):
        assert type(model.model.layers[0]).__name__ == "TEQwen2DecoderLayer"
        with torch.no_grad():
            model(**{k: v.cuda() for k, v in _unpadded(model).items()}, use_cache=False)
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key


@pytest.mark.gpu
@requires_te
def test_use_from_pretrained_and_save_pretrained_keep_the_original_layout(
    tmp_path: Path,
) -> None:
    family = families()["llama"]
    model = family.build(seed=4)
    model.save_pretrained(tmp_path / "original")
    with layerswap.use("llama.decoder.te"):
        swapped = family.causal_lm_class().from_pretrained(
            tmp_path / "original", dtype=torch.bfloat16
        )
    assert type(swapped.model.layers[0]).__name__ == "TELlamaDecoderLayer"
    swapped.save_pretrained(tmp_path / "back")
    plain = family.causal_lm_class().from_pretrained(tmp_path / "back", dtype=torch.bfloat16)
    expected = model.to(torch.bfloat16).state_dict()
    assert sorted(plain.state_dict()) == sorted(expected)
    for key, value in plain.state_dict().items():
        assert torch.equal(value, expected[key]), key
