"""The Liger-Kernel backend: registration, requirements, refusals, weight layout; GPU checks.

Everything above the GPU section runs on any machine: liger-kernel is only needed to run a
layer or the head's loss. Registration and refusals, the requirement messages in their
order, a refused swap leaving the model as it was, and the layer's module layout (the
original's, so no weight is converted) are checked here. The GPU section verifies every
``<family>.decoder.liger`` and ``<family>.head.liger`` against the original in float32
and bfloat16 where CUDA, Triton and liger-kernel are present, and is skipped (with the
reason) elsewhere.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

import layerswap
from layerswap.backends import head_liger, liger
from layerswap.cli import app
from layerswap.comparison.inputs import inputs_for
from layerswap.errors import RequirementError
from layerswap.model import decoder_layers, layer_config
from layerswap.registry import families, substitutions
from layerswap.verify import verify

# the families whose decoder layer Liger's kernels express; the others are refused with
# the reason (attention logit soft-capping, an activation without a gated kernel)
FAMILIES = sorted(name for name, f in families().items() if liger.unsupported(f) is None)
REFUSED = sorted(name for name, f in families().items() if liger.unsupported(f) is not None)

# (family, config overrides): every covered family, plus the switches that add tensors
LAYOUTS: list[tuple[str, dict[str, Any]]] = [(name, {}) for name in FAMILIES] + [
    ("llama", {"attention_bias": True, "mlp_bias": True}),
    ("llama", {"num_key_value_heads": 1}),
]
LAYOUT_IDS = [
    name + "".join(f"-{key}={value}" for key, value in overrides.items())
    for name, overrides in LAYOUTS
]

liger_installed = importlib.util.find_spec("liger_kernel") is not None
without_liger = pytest.mark.skipif(liger_installed, reason="liger-kernel is installed here")


@pytest.fixture
def liger_modules_restored() -> Iterator[None]:
    """Forget any ``liger_kernel`` module a test imported from a temporary package."""
    before = {name for name in sys.modules if name.split(".")[0] == "liger_kernel"}
    yield
    for name in [name for name in sys.modules if name.split(".")[0] == "liger_kernel"]:
        if name not in before:
            del sys.modules[name]


def _snapshot(model: torch.nn.Module) -> dict[str, Any]:
    return {
        "class": type(model),
        "modules": [(name, type(module)) for name, module in model.named_modules()],
        "module_ids": {name: id(module) for name, module in model.named_modules()},
        "tensors": {key: (value, value.clone()) for key, value in model.state_dict().items()},
    }


def _assert_untouched(model: torch.nn.Module, before: dict[str, Any]) -> None:
    assert type(model) is before["class"]
    assert [(name, type(module)) for name, module in model.named_modules()] == before["modules"]
    assert {name: id(module) for name, module in model.named_modules()} == before["module_ids"]
    state = model.state_dict()
    assert sorted(state) == sorted(before["tensors"])
    for key, (tensor, copied) in before["tensors"].items():
        assert state[key].data_ptr() == tensor.data_ptr(), key
        assert state[key].dtype == copied.dtype and torch.equal(state[key], copied), key


# --- registration and refusals ----------------------------------------------------------


def test_every_family_liger_expresses_has_a_decoder_substitution_and_a_head() -> None:
    decoders = {
        s.family: s for s in layerswap.substitutions(backend="liger") if s.slot == "decoder"
    }
    heads = {s.family: s for s in layerswap.substitutions(backend="liger") if s.slot == "head"}
    assert sorted(decoders) == FAMILIES
    backend = layerswap.get_backend("liger")
    # every family but those adding a loss of their own (HY-V3); the mixture-of-experts
    # ones' router loss is added as the original adds it (Mixtral)
    assert set(heads) == {n for n, f in families().items() if not backend.unsupported(f, "head")}
    assert "hy_v3" not in heads and {"llama", "mixtral"} <= set(heads)
    # sandwich norms (gemma3), q/k norms per head (qwen3) and across heads (olmo2), Gemma's
    # 1 + weight, Granite's multipliers, Qwen2's biases
    assert {"llama", "mistral", "qwen2", "qwen3", "gemma", "gemma3", "granite", "olmo2"} <= set(
        FAMILIES
    )
    for name, sub in decoders.items():
        assert sub.name == f"{name}.decoder.liger" and sub.backend == "liger"
        assert sub.original.endswith(":" + families()[name].decoder)
        assert sub.replacement is liger.layer_class(families()[name])
    for name, sub in heads.items():
        assert sub.name == f"{name}.head.liger"
        assert sub.replacement == (
            f"layerswap.backends.liger.head:Liger{families()[name].causal_lm}"
        )


#: the model types Liger-Kernel 0.8.5's ``MODEL_TYPE_TO_APPLY_LIGER_FN`` patches
LIGER_0_8_5_KEYS = (
    "deepseek_v2",
    "deepseek_v3",
    "deepseek_v4",
    "gemma",
    "gemma2",
    "gemma3_text",
    "gemma3",
    "gemma4_text",
    "gemma4",
    "glm4",
    "glm4v",
    "glm4v_moe",
    "gpt_oss",
    "internvl",
    "llama",
    "llama4_text",
    "llama4",
    "llava",
    "granite",
    "mllama",
    "mllama_text_model",
    "ministral",
    "mistral",
    "mixtral",
    "muse_glimmer",
    "nemotron",
    "olmo2",
    "pixtral",
    "olmo3",
    "qwen2",
    "qwen3",
    "qwen3_moe",
    "qwen2_vl",
    "qwen2_vl_text",
    "qwen2_5_vl",
    "qwen2_5_vl_text",
    "qwen3_next",
    "qwen3_5",
    "qwen3_5_text",
    "qwen3_5_moe",
    "qwen3_5_moe_text",
    "qwen3_vl",
    "qwen3_vl_text",
    "qwen3_vl_moe",
    "qwen3_vl_moe_text",
    "smollm3",
    "phi3",
    "paligemma",
    "falcon_h1",
    "smolvlm",
    "hunyuan_v1_dense",
    "hunyuan_v1_moe",
    "exaone4",
)
#: of those, the ones no slot can take: no causal LM in transformers, nor one for a
#: language model they wrap (Pixtral's vision encoder, MuseGlimmer's text model)
NO_CAUSAL_LM = ("muse_glimmer", "pixtral")
_SLOTS = ("decoder", "head", "norm", "mlp", "experts", "qkv")


def _liger_names(model_type: str) -> list[str]:
    found = []
    for slot in _SLOTS:
        try:
            found.append(layerswap.get(f"{model_type}.{slot}.liger").name)
        except layerswap.errors.UnknownSubstitutionError:
            pass
    return found


def test_every_model_type_liger_patches_has_liger_kernels_through_layerswap_or_a_reason() -> None:
    """Each key of Liger 0.8.5's table: a ``<key>.<slot>.liger`` substitution (Liger's norm,
    SwiGLU, experts and loss kernels, proven at first use and undone), or, for a wrapper or
    a wrapper's text model, an error naming the substitution that swaps its modules, or why
    no slot takes it. The installed Liger's table, where there is one, is this one."""
    if liger_installed:
        from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN

        assert set(LIGER_0_8_5_KEYS) <= set(MODEL_TYPE_TO_APPLY_LIGER_FN)
    direct = {key: _liger_names(key) for key in LIGER_0_8_5_KEYS}
    assert sum(bool(names) for names in direct.values()) >= 42
    for key in ("qwen3_next", "deepseek_v3", "llama4", "gemma4", "falcon_h1", "qwen3_5_moe"):
        assert f"{key}.norm.liger" in direct[key] and f"{key}.head.liger" in direct[key]
    for key in (k for k, names in direct.items() if not names):
        with pytest.raises(layerswap.errors.UnknownSubstitutionError) as refused:
            layerswap.get(f"{key}.norm.liger")
        message = str(refused.value)
        if key in NO_CAUSAL_LM:
            assert "no slot takes it" in message
            continue
        instead = message.rpartition("swap(model, '")[2].rstrip("')")
        assert instead.endswith(".norm.liger") and f"no causal LM for {key}" in message
        assert layerswap.get(instead).slot == "norm"


def test_a_wrappers_text_model_is_swapped_by_the_wrappers_substitution() -> None:
    """``qwen2_vl_text`` has no causal LM: the error for ``qwen2_vl_text.norm.fused`` names
    ``qwen2_vl.norm.fused``, which swaps a ``Qwen2VLTextModel``'s norms to the same
    outputs; for a LLaVA model, the error names its language model's, which swaps it."""
    from transformers import Qwen2VLTextConfig, Qwen2VLTextModel

    with pytest.raises(layerswap.errors.UnknownSubstitutionError, match=r"qwen2_vl\.norm\.fused"):
        layerswap.get("qwen2_vl_text.norm.fused")
    with pytest.raises(layerswap.errors.UnknownSubstitutionError, match=r"'llama\.norm\.fused'"):
        layerswap.get("llava.norm.fused")
    text = layerswap.get_family("qwen2_vl").tiny_config().text_config.to_dict()
    torch.manual_seed(0)
    model = Qwen2VLTextModel(Qwen2VLTextConfig(**text)).eval()
    ids = torch.randint(0, 100, (1, 6))
    before = model(input_ids=ids).last_hidden_state
    with layerswap.swap(model, "qwen2_vl.norm.fused") as handle:
        assert len(handle) == 2 * model.config.num_hidden_layers + 1
        torch.testing.assert_close(model(input_ids=ids).last_hidden_state, before)


def test_refused_families_get_no_decoder_substitution_and_a_reason() -> None:
    for name in REFUSED:
        reason = liger.unsupported(families()[name])
        assert reason, name
        assert liger.BACKEND.unsupported(families()[name]) is not None
        with pytest.raises(layerswap.errors.UnknownSubstitutionError) as refused:
            layerswap.get(f"{name}.decoder.liger")
        # the error gives the backend's reason, not a list of close names
        assert str(refused.value).endswith(f"does not express {name}'s decoder: {reason}")
    if "gemma2" in families():
        assert "soft-capping" in str(liger.unsupported(families()["gemma2"]))


@pytest.mark.parametrize(
    ("overrides", "reason"),
    [
        ({"hidden_act": "gelu"}, r"no gated-MLP kernel for hidden_act='gelu'"),
        ({"hidden_act": "relu"}, r"no gated-MLP kernel for hidden_act='relu'"),
    ],
)
def test_a_config_liger_cannot_compute_is_refused_when_the_layer_is_built(
    overrides: dict[str, Any], reason: str
) -> None:
    family = families()["llama"]
    with pytest.raises(RequirementError, match=reason):
        liger.layer_class(family)(family.tiny_config(**overrides), 0)


def test_gated_kernels_are_silu_and_the_tanh_gelu_only() -> None:
    assert liger.gated_kernel("silu") == "liger_swiglu"
    assert liger.gated_kernel("gelu_pytorch_tanh") == "liger_geglu"
    assert liger.gated_kernel("gelu") is None  # the exact (erf) GELU: Liger has no kernel
    assert liger.gated_kernel("relu") is None


def test_head_refuses_a_scaling_after_its_soft_cap() -> None:
    assert head_liger.unreproducible([]) is None
    assert head_liger.unreproducible([("div", "config.logits_scaling")]) is None
    assert head_liger.unreproducible([("mul", "a"), ("softcap", "b")]) is None
    reason = head_liger.unreproducible([("softcap", "a"), ("div", "b")])
    assert reason is not None and "'div' step after its soft-cap" in reason


def test_layer_and_head_classes_are_importable_by_name() -> None:
    from layerswap.backends.head_liger import LigerQwen3ForCausalLM  # type: ignore[attr-defined]
    from layerswap.backends.liger import LigerQwen3DecoderLayer  # type: ignore[attr-defined]

    qwen3 = families()["qwen3"]
    assert LigerQwen3DecoderLayer is liger.layer_class(qwen3)
    assert LigerQwen3DecoderLayer.__module__ == "layerswap.backends.liger.decoder"
    assert LigerQwen3ForCausalLM is head_liger.liger_head_class(qwen3)
    assert LigerQwen3ForCausalLM.__name__ == "Qwen3ForCausalLM"  # save_pretrained's name
    with pytest.raises(AttributeError):
        liger.LigerNoSuchDecoderLayer  # noqa: B018


# --- requirements, in order ------------------------------------------------------------------


@without_liger
def test_unmet_requirement_says_liger_kernel_is_not_installed() -> None:
    expected = "liger-kernel is not installed (pip install 'layerswap[liger]')"
    assert liger.unmet_requirement() == expected
    assert layerswap.get("llama.decoder.liger").unmet_requirement() == expected
    assert layerswap.get("llama.head.liger").unmet_requirement() == expected


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is visible here")
def test_requirement_names_the_missing_gpu_once_liger_kernel_is_found(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, liger_modules_restored: None
) -> None:
    if not liger_installed:
        # an importable package of that name is all the installation check looks for
        (tmp_path / "liger_kernel").mkdir()
        (tmp_path / "liger_kernel" / "__init__.py").write_text("")
        monkeypatch.syspath_prepend(str(tmp_path))
    assert liger.unmet_requirement() == "needs a CUDA GPU (Liger's kernels are Triton)"
    assert layerswap.get("qwen3.head.liger").unmet_requirement() == liger.NO_CUDA


@without_liger
def test_an_installation_whose_kernels_fail_to_import_is_reported_with_the_reason(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, liger_modules_restored: None
) -> None:
    # what a machine with liger-kernel but without Triton gives: Liger's kernel modules
    # import triton at import time
    package = tmp_path / "liger_kernel"
    (package / "transformers").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "transformers" / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'triton'\", name='triton')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    reason = liger.unmet_requirement()
    assert reason == (
        "liger-kernel is installed but its kernels cannot be imported: No module named 'triton'"
    )
    with pytest.raises(RequirementError, match="No module named 'triton'"):
        liger.kernels()


# --- refusing on this machine leaves everything as it was -----------------------------------


@without_liger
@pytest.mark.parametrize(
    "name", ["llama.decoder.liger", "gemma3.decoder.liger", "qwen3.head.liger"]
)
def test_swap_refuses_and_leaves_the_model_untouched(name: str) -> None:
    family = layerswap.get_family(layerswap.get(name).family)
    model = family.build(seed=0)
    before = _snapshot(model)
    with pytest.raises(RequirementError, match=r"liger-kernel is not installed"):
        layerswap.swap(model, name)
    _assert_untouched(model, before)
    with pytest.raises(RequirementError, match=r"liger-kernel is not installed"):
        layerswap.swap(model, backend="liger")
    _assert_untouched(model, before)


@without_liger
def test_use_refuses_before_anything_is_built() -> None:
    family = families()["llama"]
    with (
        pytest.raises(RequirementError, match="liger-kernel is not installed"),
        layerswap.use("llama.decoder.liger"),
    ):
        family.build(seed=0)
    model = family.build(seed=0)
    assert type(model.model.layers[0]) is family.decoder_class()


@without_liger
def test_a_layer_built_by_hand_refuses_to_run_with_the_reason() -> None:
    family = families()["llama"]
    config = family.tiny_config()
    layer = liger.layer_class(family)(config, 0)
    hidden = torch.randn(1, 4, config.hidden_size)
    cos, sin = torch.ones(1, 4, 32), torch.zeros(1, 4, 32)
    with pytest.raises(RequirementError, match="liger-kernel is not installed"):
        layer(hidden, position_embeddings=(cos, sin))


@without_liger
def test_cli_list_shows_liger_with_the_reason() -> None:
    result = CliRunner().invoke(app, ["list", "--backend", "liger"])
    assert result.exit_code == 0, result.output
    assert "llama.decoder.liger" in result.stdout and "llama.head.liger" in result.stdout
    assert "liger-kernel is not installed" in result.stdout
    rows = json.loads(CliRunner().invoke(app, ["list", "--backend", "liger", "--json"]).stdout)
    assert {row["name"] for row in rows} >= {f"{name}.decoder.liger" for name in FAMILIES}
    assert all(row["usable"] is False and row["reason"] == liger.NOT_INSTALLED for row in rows)


@without_liger
def test_check_lists_the_families_liger_refuses_with_the_reason() -> None:
    refused = sorted(set(families()) - set(FAMILIES))
    result = CliRunner().invoke(app, ["check", *refused[:2], "llama", "-b", "liger", "--json"])
    assert result.exit_code == 0, result.output
    rows = {row["family"]: row for row in json.loads(result.stdout)}
    for name in refused[:2]:
        assert rows[name]["status"] == "refused"
        assert rows[name]["detail"].endswith(str(liger.unsupported(families()[name])))
    assert rows["llama"]["status"] in ("proven", "skipped")


def test_doctor_reports_why_liger_cannot_run() -> None:
    report = json.loads(CliRunner().invoke(app, ["doctor", "--json"]).stdout)
    assert report["backends"]["liger"] == {"usable": False, "reason": liger.NOT_INSTALLED}
    rows = {row["component"]: row for row in report["environment"]}
    assert rows["Liger-Kernel"]["status"] == "not installed"


# --- weight layout: the original's, unconverted ---------------------------------------------


@pytest.mark.parametrize(("name", "overrides"), LAYOUTS, ids=LAYOUT_IDS)
def test_the_layer_has_the_original_modules_and_loads_its_weights_strictly(
    name: str, overrides: dict[str, Any]
) -> None:
    family = families()[name]
    model = family.build(family.tiny_config(**overrides), seed=3)
    config = layer_config(model.config)  # a wrapper family's layers read its text config
    original = decoder_layers(model)[1][1]
    layer = liger.layer_class(family)(config, 1)
    shapes = {key: tuple(value.shape) for key, value in layer.state_dict().items()}
    assert shapes == {key: tuple(value.shape) for key, value in original.state_dict().items()}
    converted = liger.CONVERTER.to_replacement(original.state_dict(), config)
    layer.load_state_dict(converted, strict=True)
    for key, value in original.state_dict().items():
        assert torch.equal(layer.state_dict()[key], value), key
    assert liger.CONVERTER.to_original(layer.state_dict(), config).keys() == (
        original.state_dict().keys()
    )


def test_norms_carry_the_family_offset_and_casting() -> None:
    gemma3, llama, olmo2 = families()["gemma3"], families()["llama"], families()["olmo2"]
    layer = liger.layer_class(gemma3)(gemma3.tiny_config(), 0)
    for name in ("input_layernorm", "post_attention_layernorm", "post_feedforward_layernorm"):
        norm = layer.get_submodule(name)
        assert (norm.offset, norm.casting_mode) == (1.0, "gemma")
    # a post norm joins the residual stream: its backward must not overwrite the gradient
    assert layer.get_submodule("input_layernorm").in_place
    assert not layer.get_submodule("post_feedforward_layernorm").in_place
    assert layer.mlp.kernel == "liger_geglu"
    plain = liger.layer_class(llama)(llama.tiny_config(), 0)
    assert (plain.input_layernorm.offset, plain.input_layernorm.casting_mode) == (0.0, "llama")
    assert plain.mlp.kernel == "liger_swiglu"
    across = liger.layer_class(olmo2)(olmo2.tiny_config(), 0)
    assert across.self_attn.qk_norm_across
    assert across.self_attn.q_norm.weight.shape == (olmo2.tiny_config().hidden_size,)


# --- GPU: CUDA, Triton and liger-kernel ---------------------------------------------------------

_LIGER_REASON = liger.unmet_requirement()
requires_liger = pytest.mark.skipif(
    _LIGER_REASON is not None, reason=f"needs CUDA, Triton and liger-kernel ({_LIGER_REASON})"
)
DTYPES = [torch.float32, torch.bfloat16]
DTYPE_IDS = ["float32", "bfloat16"]


def _unpadded(model: Any, seq_len: int = 32) -> dict[str, torch.Tensor]:
    return inputs_for(model, batch=2, seq_len=seq_len, padding=0)


@pytest.mark.gpu
@requires_liger
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("name", FAMILIES)
def test_decoder_logits_and_gradients_match_the_original(name: str, dtype: torch.dtype) -> None:
    model = families()[name].build(seed=0)
    # default inputs are left-padded: the 4-D mask path
    report = verify(model, f"{name}.decoder.liger", dtype=dtype, device="cuda")
    assert report.passed, report.summary()
    report = verify(
        model,
        f"{name}.decoder.liger",
        inputs=_unpadded(model),
        dtype=dtype,
        device="cuda",
        backward=True,
    )
    assert report.passed, report.summary()


@pytest.mark.gpu
@requires_liger
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize(
    "name", [sub.family for sub in substitutions(backend="liger", slot="head")]
)
def test_head_loss_and_gradients_match_the_original(name: str, dtype: torch.dtype) -> None:
    model = families()[name].build(seed=0)
    report = verify(model, f"{name}.head.liger", dtype=dtype, device="cuda", backward=True)
    assert report.passed, report.summary()


@pytest.mark.gpu
@requires_liger
@pytest.mark.parametrize("name", ["llama", "mistral", "qwen3"])
def test_generate_with_the_cache_matches_the_original(name: str) -> None:
    model = families()[name].build(seed=0)
    report = verify(model, f"{name}.decoder.liger", dtype=torch.bfloat16, device="cuda", generate=8)
    assert report.passed, report.summary()


@pytest.mark.gpu
@requires_liger
@pytest.mark.parametrize("name", ["llama", "gemma3", "granite"])
def test_a_training_step_with_decoder_and_head_swapped_matches_the_original(name: str) -> None:
    family = families()[name]
    reference = family.build(seed=1).to("cuda").train()
    model = copy.deepcopy(reference)
    decoder = layerswap.swap(model, f"{name}.decoder.liger")
    head = layerswap.swap(model, f"{name}.head.liger")
    batch = {k: v.cuda() for k, v in _unpadded(model).items()}
    torch.manual_seed(0)
    expected = reference(**batch, labels=batch["input_ids"], use_cache=False)
    expected.loss.backward()
    torch.manual_seed(0)
    got = model(**batch, labels=batch["input_ids"], use_cache=False)
    got.loss.backward()
    assert got.logits is None
    torch.testing.assert_close(got.loss, expected.loss, rtol=1e-4, atol=1e-5)
    wanted = dict(reference.named_parameters())
    assert sorted(wanted) == sorted(name for name, _ in model.named_parameters())
    for key, param in model.named_parameters():
        want = wanted[key]
        assert param.grad is not None and want.grad is not None, key
        scale = want.grad.abs().max().item()
        assert (param.grad - want.grad).abs().max().item() <= 1e-4 * scale + 1e-6, key
    head.undo()
    decoder.undo()


@pytest.mark.gpu
@requires_liger
def test_swap_and_undo_on_cuda_restore_the_weights_bitwise() -> None:
    model = families()["qwen2"].build(seed=2).to("cuda", torch.bfloat16)
    before = {key: value.clone() for key, value in model.state_dict().items()}
    with layerswap.swap(model, "qwen2.decoder.liger"):
        assert type(model.model.layers[0]).__name__ == "LigerQwen2DecoderLayer"
        with torch.no_grad():
            model(**{k: v.cuda() for k, v in _unpadded(model).items()}, use_cache=False)
    assert type(model.model.layers[0]) is families()["qwen2"].decoder_class()
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key


@pytest.mark.gpu
@requires_liger
def test_a_cpu_tensor_is_refused_by_name() -> None:
    family = families()["llama"]
    config = family.tiny_config()
    layer = liger.layer_class(family)(config, 0)
    cos, sin = torch.ones(1, 4, 32), torch.zeros(1, 4, 32)
    with pytest.raises(RequirementError, match=r"model\.cuda\(\)"):
        layer(torch.randn(1, 4, config.hidden_size), position_embeddings=(cos, sin))
