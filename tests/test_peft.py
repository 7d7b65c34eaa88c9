"""PEFT LoRA adapters move between the original and the swapped layout, exactly, or fail loudly."""

from __future__ import annotations

import copy
import gc
import importlib.metadata
import json
import re
import types
from pathlib import Path

import pytest
import torch
from models import tiny_model, tokens
from peft import IA3Config, LoraConfig, PeftModel, get_peft_model, inject_adapter_in_model
from peft.tuners.tuners_utils import BaseTuner, BaseTunerLayer
from safetensors.torch import load_file
from transformers import PreTrainedModel

import layerswap
from layerswap import adapters, peft_targets
from layerswap.errors import ConversionError, SubstitutionError

FAMILIES = ("llama", "qwen2", "qwen3")
FUSED_TARGETS = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
ATOL = 1e-5

pytest_plugins = ["pytester"]


def _plugin() -> tuple[str, ...]:
    # the plugin under its entry point's name (pluggy refuses a second registration)
    for entry_point in importlib.metadata.entry_points(group="pytest11"):
        if entry_point.value == "layerswap.pytest_plugin":
            return ("-p", entry_point.name)
    return ("-p", "layerswap.pytest_plugin")


_INNER = (*_plugin(), "-p", "no:cacheprovider", "-p", "no:hypothesispytest", "-p", "no:benchmark")


def _logits(model: torch.nn.Module, vocab_size: int) -> torch.Tensor:
    with torch.no_grad():
        return model(tokens(vocab_size)).logits  # type: ignore[no-any-return]


def _swapped(base: PreTrainedModel) -> PreTrainedModel:
    model = copy.deepcopy(base)
    layerswap.swap(model, backend="fused")
    return model


def _trained_on_original(base: PreTrainedModel, path: Path, **lora: object) -> torch.Tensor:
    """Save a non-trivial adapter of ``base`` (random A and B) to ``path``; its logits."""
    torch.manual_seed(1)
    config = LoraConfig(init_lora_weights=False, **lora)  # type: ignore[arg-type]
    model = get_peft_model(copy.deepcopy(base), config).eval()
    model.save_pretrained(str(path))
    return _logits(model, base.config.vocab_size)


def test_a_decoder_swap_of_a_model_an_adapter_wraps_is_refused_naming_it() -> None:
    """The decoder slot converts the layers' own weights: under a LoRA they sit inside
    PEFT's layers, and the swap failed on a "missing tensor". Refused, naming the adapter's
    layer and the order that works, and nothing changes."""
    base = tiny_model("llama")
    peft_model = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    before = {k: v.clone() for k, v in peft_model.state_dict().items()}
    with pytest.raises(
        SubstitutionError,
        match=r"q_proj is a PEFT adapter's Linear.*swap before get_peft_model",
    ):
        layerswap.swap(peft_model.base_model.model, "llama.decoder.fused")
    assert layerswap.get_slot("decoder").swapped_by(peft_model.base_model.model) is None
    assert all(torch.equal(peft_model.state_dict()[k], v) for k, v in before.items())


@pytest.mark.parametrize("name", FAMILIES)
def test_an_all_linear_adapter_from_the_original_applies_exactly_to_the_swapped_model(
    name: str, tmp_path: Path
) -> None:
    base = tiny_model(name, num_hidden_layers=2)
    expected = _trained_on_original(base, tmp_path, target_modules="all-linear", r=4)
    loaded = adapters.load_adapter(_swapped(base), tmp_path)
    assert "model.layers.0.self_attn.qkv_proj" in loaded.base_model.targeted_module_names
    torch.testing.assert_close(_logits(loaded, base.config.vocab_size), expected, atol=ATOL, rtol=0)


def test_an_adapter_with_a_module_saved_whole_and_an_embedding_lora_converts_both_ways(
    tmp_path: Path,
) -> None:
    """``modules_to_save=["lm_head"]`` (a module saved whole) and a LoRA of the embeddings
    at its own rank are no LoRA pair of a linear module: they go through as they are,
    loaded onto the swapped model and saved back for plain PEFT, numbers unchanged."""
    base = tiny_model("llama", num_hidden_layers=2)
    lora = {
        "target_modules": ["q_proj", "v_proj", "embed_tokens"],
        "r": 4,
        "rank_pattern": {"embed_tokens": 8},
        "modules_to_save": ["lm_head"],
    }
    expected = _trained_on_original(base, tmp_path / "original", **lora)
    swapped = _swapped(base)  # (swapped first: PeftModel.from_pretrained is looked up after)
    loaded = PeftModel.from_pretrained(swapped, str(tmp_path / "original")).eval()
    torch.testing.assert_close(_logits(loaded, base.config.vocab_size), expected, atol=ATOL, rtol=0)
    loaded.save_pretrained(str(tmp_path / "back"))
    written = json.loads((tmp_path / "back" / "adapter_config.json").read_text())
    assert "lm_head" not in written["target_modules"]
    assert written["rank_pattern"][re.escape("model.embed_tokens")] == 8
    plain = PeftModel.from_pretrained(copy.deepcopy(base), str(tmp_path / "back")).eval()
    torch.testing.assert_close(_logits(plain, base.config.vocab_size), expected, atol=ATOL, rtol=0)


def test_q_and_v_with_different_ranks_and_scalings_fuse_exactly_and_come_back(
    tmp_path: Path,
) -> None:
    base = tiny_model("qwen2", num_hidden_layers=2)
    lora = {
        "target_modules": ["q_proj", "v_proj"],
        "r": 4,
        "lora_alpha": 8,
        "rank_pattern": {"v_proj": 2},
        "alpha_pattern": {"v_proj": 6},
    }
    expected = _trained_on_original(base, tmp_path / "original", **lora)
    loaded = adapters.load_adapter(_swapped(base), tmp_path / "original")
    logits = _logits(loaded, base.config.vocab_size)
    torch.testing.assert_close(logits, expected, atol=ATOL, rtol=0)
    # back to the original names: q and v at their own ranks, k (zero rows) left out
    adapters.save_adapter(loaded, tmp_path / "back")
    back = load_file(str(tmp_path / "back" / "adapter_model.safetensors"))
    prefix = "base_model.model.model.layers.0.self_attn"
    assert back[f"{prefix}.q_proj.lora_A.weight"].shape[0] == 4
    assert back[f"{prefix}.v_proj.lora_A.weight"].shape[0] == 2
    assert not any("k_proj" in key or "qkv_proj" in key for key in back)
    plain = PeftModel.from_pretrained(copy.deepcopy(base), str(tmp_path / "back")).eval()
    torch.testing.assert_close(_logits(plain, base.config.vocab_size), expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", FAMILIES)
def test_an_adapter_trained_on_the_swapped_model_saves_for_plain_transformers_and_peft(
    name: str, tmp_path: Path
) -> None:
    base = tiny_model(name, num_hidden_layers=2)
    torch.manual_seed(2)
    config = LoraConfig(target_modules=FUSED_TARGETS, r=4, init_lora_weights=False)
    trained = get_peft_model(_swapped(base), config).eval()
    expected = _logits(trained, base.config.vocab_size)
    adapters.save_adapter(trained, tmp_path)
    saved = json.loads((tmp_path / "adapter_config.json").read_text())
    leaves = {target.rpartition(".")[2] for target in saved["target_modules"]}
    assert leaves == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    plain = PeftModel.from_pretrained(copy.deepcopy(base), str(tmp_path)).eval()  # no layerswap
    torch.testing.assert_close(_logits(plain, base.config.vocab_size), expected, atol=ATOL, rtol=0)


# --- PEFT's own save and load on a swapped model (layerswap.peft_io) ---------------------

ADAPTERS = {
    "all-linear": {"target_modules": "all-linear"},
    "attention": {"target_modules": ["qkv_proj", "o_proj"]},
}


@pytest.mark.parametrize("adapter", sorted(ADAPTERS))
@pytest.mark.parametrize("name", FAMILIES)
def test_peft_save_pretrained_writes_the_original_layout_that_plain_peft_loads_exactly(
    name: str, adapter: str, tmp_path: Path
) -> None:
    base = tiny_model(name, num_hidden_layers=2)
    torch.manual_seed(3)
    config = LoraConfig(r=4, init_lora_weights=False, **ADAPTERS[adapter])  # type: ignore[arg-type]
    trained = get_peft_model(_swapped(base), config).eval()
    expected = _logits(trained, base.config.vocab_size)

    trained.save_pretrained(str(tmp_path))  # PEFT's own save

    saved = load_file(str(tmp_path / "adapter_model.safetensors"))
    assert not any("qkv_proj" in key or "gate_up_proj" in key for key in saved)
    targets = json.loads((tmp_path / "adapter_config.json").read_text())["target_modules"]
    leaves = {target.rpartition(".")[2] for target in targets}
    assert {"q_proj", "k_proj", "v_proj", "o_proj"} <= leaves
    assert not leaves & {"qkv_proj", "gate_up_proj"}
    plain = PeftModel.from_pretrained(copy.deepcopy(base), str(tmp_path)).eval()  # no swap
    torch.testing.assert_close(_logits(plain, base.config.vocab_size), expected, atol=ATOL, rtol=0)
    # and back onto a swapped model through PEFT's own load: the fused rank it was trained at
    swapped = _swapped(base)
    again = PeftModel.from_pretrained(swapped, str(tmp_path)).eval()
    qkv = again.base_model.model.model.layers[0].self_attn.qkv_proj
    assert qkv.lora_A["default"].weight.shape[0] == 4
    torch.testing.assert_close(_logits(again, base.config.vocab_size), expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize(
    "lora",
    [
        {"target_modules": "all-linear", "r": 4},
        {"target_modules": ["q_proj", "v_proj"], "r": 4, "rank_pattern": {"v_proj": 2}},
    ],
    ids=["all-linear", "q-and-v"],
)
@pytest.mark.parametrize("name", FAMILIES)
def test_peft_from_pretrained_on_a_swapped_model_converts_an_original_adapter_exactly(
    name: str, lora: dict[str, object], tmp_path: Path
) -> None:
    base = tiny_model(name, num_hidden_layers=2)
    expected = _trained_on_original(base, tmp_path, **lora)
    swapped = _swapped(base)  # (swapped first: PeftModel.from_pretrained is looked up after)

    loaded = PeftModel.from_pretrained(swapped, str(tmp_path)).eval()

    assert "model.layers.0.self_attn.qkv_proj" in loaded.base_model.targeted_module_names
    torch.testing.assert_close(_logits(loaded, base.config.vocab_size), expected, atol=ATOL, rtol=0)


def test_peft_load_adapter_adds_an_original_adapter_beside_another(tmp_path: Path) -> None:
    base = tiny_model("qwen3", num_hidden_layers=2)
    expected = _trained_on_original(base, tmp_path, target_modules=["k_proj", "up_proj"], r=2)
    config = LoraConfig(target_modules=["o_proj"], r=2)
    model = get_peft_model(_swapped(base), config)

    model.load_adapter(str(tmp_path), adapter_name="other")
    model.set_adapter("other")

    torch.testing.assert_close(
        _logits(model.eval(), base.config.vocab_size), expected, atol=ATOL, rtol=0
    )


def test_a_second_adapter_saves_in_its_own_directory_in_the_original_layout(
    tmp_path: Path,
) -> None:
    base = tiny_model("llama", num_hidden_layers=2)
    model = get_peft_model(_swapped(base), LoraConfig(target_modules=["qkv_proj"], r=2))
    model.add_adapter("second", LoraConfig(target_modules=["gate_up_proj"], r=2))

    model.save_pretrained(str(tmp_path))

    first = load_file(str(tmp_path / "adapter_model.safetensors"))
    second = load_file(str(tmp_path / "second" / "adapter_model.safetensors"))
    assert {key.split(".")[-3] for key in first} == {"q_proj", "k_proj", "v_proj"}
    assert {key.split(".")[-3] for key in second} == {"gate_proj", "up_proj"}


def test_peft_from_pretrained_refuses_a_dora_adapter_on_a_swapped_model(tmp_path: Path) -> None:
    base = tiny_model("llama", num_hidden_layers=2)
    _trained_on_original(base, tmp_path, target_modules=["q_proj", "v_proj"], r=4, use_dora=True)
    swapped = _swapped(base)
    with pytest.raises(ConversionError, match=r"DoRA.*self_attn\.q_proj"):
        PeftModel.from_pretrained(swapped, str(tmp_path))


def test_a_dora_adapter_is_refused_naming_its_fused_modules(tmp_path: Path) -> None:
    base = tiny_model("llama", num_hidden_layers=2)
    _trained_on_original(base, tmp_path, target_modules=["q_proj", "v_proj"], r=4, use_dora=True)
    with pytest.raises(ConversionError, match=r"DoRA.*self_attn\.q_proj"):
        adapters.load_adapter(_swapped(base), tmp_path)


def test_another_peft_type_on_fused_modules_is_refused(tmp_path: Path) -> None:
    base = tiny_model("qwen3", num_hidden_layers=2)
    ia3 = IA3Config(target_modules=["k_proj", "v_proj"], feedforward_modules=[])
    get_peft_model(copy.deepcopy(base), ia3).save_pretrained(str(tmp_path))
    with pytest.raises(ConversionError, match=r"IA3.*k_proj"):
        adapters.load_adapter(_swapped(base), tmp_path)


def test_an_adapter_on_unfused_modules_only_loads_unchanged(tmp_path: Path) -> None:
    base = tiny_model("llama", num_hidden_layers=2)
    expected = _trained_on_original(base, tmp_path, target_modules=["o_proj", "down_proj"], r=2)
    loaded = adapters.load_adapter(_swapped(base), tmp_path)
    torch.testing.assert_close(_logits(loaded, base.config.vocab_size), expected, atol=ATOL, rtol=0)


# --- a new adapter on a swapped model: target_modules naming fused-away modules ----------


def _lora_layers(model: torch.nn.Module) -> list[str]:
    return [name for name, module in model.named_modules() if isinstance(module, BaseTunerLayer)]


@pytest.mark.parametrize("name", FAMILIES)
def test_a_target_list_mixing_fused_away_and_present_modules_fails_naming_them(
    name: str,
) -> None:
    # PEFT alone adapts o_proj and skips q_proj silently
    model = _swapped(tiny_model(name, num_hidden_layers=2))
    config = LoraConfig(target_modules=["q_proj", "o_proj"], r=4)
    with pytest.raises(ConversionError) as caught:
        get_peft_model(model, config)
    message = str(caught.value)
    assert "q_proj (fused into qkv_proj)" in message
    assert "target_modules=['o_proj', 'qkv_proj']" in message
    assert "layerswap.adapters.load_adapter" in message
    assert _lora_layers(model) == []  # refused before anything was injected


@pytest.mark.parametrize(
    ("targets", "named"),
    [
        (["q_proj", "v_proj"], r"q_proj \(fused into qkv_proj\), v_proj \(fused into qkv_proj\)"),
        (["gate_proj", "up_proj"], r"gate_proj \(fused into gate_up_proj\)"),
        (r".*\.(k_proj|up_proj)", r"k_proj \(fused into qkv_proj\), up_proj"),
        (None, r"PEFT's default target_modules for llama \['q_proj', 'v_proj'\]"),
    ],
    ids=["list", "mlp", "regex", "peft-default"],
)
def test_targeting_only_fused_away_modules_fails_with_layerswaps_error(
    targets: list[str] | str | None, named: str
) -> None:
    model = _swapped(tiny_model("llama", num_hidden_layers=2))
    with pytest.raises(ConversionError, match=named):
        get_peft_model(model, LoraConfig(target_modules=targets, r=4))


def test_modules_to_save_naming_a_fused_away_module_fails() -> None:
    model = _swapped(tiny_model("qwen3", num_hidden_layers=2))
    config = LoraConfig(target_modules=["o_proj"], modules_to_save=["up_proj"], r=4)
    with pytest.raises(ConversionError, match=r"modules_to_save=\['gate_up_proj'\]"):
        get_peft_model(model, config)


def test_adapter_state_for_fused_away_modules_fails_when_injected_from_it() -> None:
    model = _swapped(tiny_model("llama", num_hidden_layers=2))
    state = {"model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(4, 64)}
    with pytest.raises(ConversionError, match=r"the adapter state .*q_proj"):
        inject_adapter_in_model(LoraConfig(target_modules=["o_proj"]), model, state_dict=state)


@pytest.mark.parametrize("name", FAMILIES)
def test_targeting_the_fused_modules_by_name_adapts_them_and_trains(name: str) -> None:
    base = tiny_model(name, num_hidden_layers=2)
    model = _swapped(base)
    torch.manual_seed(3)
    peft_model = get_peft_model(model, LoraConfig(target_modules=["qkv_proj", "o_proj"], r=4))
    assert sorted(peft_model.base_model.targeted_module_names) == [
        f"model.layers.{i}.self_attn.{leaf}" for i in (0, 1) for leaf in ("o_proj", "qkv_proj")
    ]
    peft_model.train()
    ids = tokens(base.config.vocab_size)
    frozen = {k: v.detach().clone() for k, v in peft_model.named_parameters() if "lora_" not in k}
    optimizer = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for _ in range(5):
        loss = peft_model(ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    for key, value in peft_model.named_parameters():
        if "lora_" not in key:
            assert torch.equal(value, frozen[key]), key


def test_all_linear_on_a_swapped_model_adapts_the_fused_modules() -> None:
    model = _swapped(tiny_model("qwen2", num_hidden_layers=2))
    peft_model = get_peft_model(model, LoraConfig(target_modules="all-linear", r=4))
    leaves = {name.rpartition(".")[2] for name in peft_model.base_model.targeted_module_names}
    assert leaves == {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}


def test_naming_a_fused_module_and_its_parts_passes_for_both_layouts() -> None:
    # one list for the original and the swapped model: each adapts what it has
    targets = ["q_proj", "k_proj", "v_proj", "qkv_proj"]
    base = tiny_model("llama", num_hidden_layers=2)
    swapped = get_peft_model(_swapped(base), LoraConfig(target_modules=targets))
    original = get_peft_model(copy.deepcopy(base), LoraConfig(target_modules=targets))
    assert {n.rpartition(".")[2] for n in swapped.base_model.targeted_module_names} == {"qkv_proj"}
    assert {n.rpartition(".")[2] for n in original.base_model.targeted_module_names} == {
        "q_proj",
        "k_proj",
        "v_proj",
    }


def test_the_check_is_armed_while_a_swapped_model_exists(monkeypatch: pytest.MonkeyPatch) -> None:
    """A swap holds the check until its undo, a model built under use() until it is
    collected; the last release takes it off (models of other tests held apart)."""
    monkeypatch.setattr(peft_targets, "_HOLDS", set())

    def armed() -> bool:
        return any(peft_targets.is_guard(info.patch) for info in layerswap.active_patches())

    llama = layerswap.get_family("llama")
    first = layerswap.swap(llama.build(seed=0), backend="fused")
    second = layerswap.swap(llama.build(seed=1), backend="fused")
    assert armed()
    first.undo()
    assert armed()  # the second model is still swapped
    second.undo()
    assert not armed()
    assert isinstance(BaseTuner.__dict__["inject_adapter"], types.FunctionType)
    with layerswap.use("llama.decoder.fused"):
        built = llama.build(seed=2)
    assert armed()
    third = layerswap.swap(llama.build(seed=3), backend="fused")
    third.undo()
    assert armed()  # the model built under use() is alive
    del built
    gc.collect()
    layerswap.swap(llama.build(seed=4), backend="fused").undo()
    assert not armed()


def test_the_original_model_gets_exactly_what_plain_peft_gives_it() -> None:
    base = tiny_model("llama", num_hidden_layers=2)
    _swapped(base)  # the check is armed
    assert any(peft_targets.is_guard(info.patch) for info in layerswap.active_patches())

    def adapted() -> tuple[list[str], torch.Tensor]:
        torch.manual_seed(4)
        config = LoraConfig(target_modules=["q_proj", "o_proj"], r=4, init_lora_weights=False)
        peft_model = get_peft_model(copy.deepcopy(base), config).eval()
        names = sorted(peft_model.base_model.targeted_module_names)
        return names, _logits(peft_model, base.config.vocab_size)

    names, logits = adapted()
    assert names == [
        f"model.layers.{i}.self_attn.{leaf}" for i in (0, 1) for leaf in ("o_proj", "q_proj")
    ]
    peft_targets.guard().stop()  # PEFT's injection as it was
    assert isinstance(BaseTuner.__dict__["inject_adapter"], types.FunctionType)
    plain_names, plain_logits = adapted()
    assert names == plain_names
    assert torch.equal(logits, plain_logits)


def test_the_check_is_layerswaps_own_and_ends_with_the_test_or_fixture_that_armed_it(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(
        """
        import copy
        import types

        import pytest
        from peft import LoraConfig, get_peft_model
        from peft.tuners.tuners_utils import BaseTuner

        import layerswap
        from layerswap import peft_targets
        from layerswap.errors import ConversionError

        MIXED = ["q_proj", "o_proj"]

        def armed():
            return any(peft_targets.is_guard(i.patch) for i in layerswap.active_patches())

        @pytest.fixture(scope="module")
        def swapped():
            model = layerswap.families()["llama"].build()
            layerswap.swap(model, backend="fused")
            return model

        def test_a_swap_arms_it():
            model = layerswap.families()["qwen2"].build()
            layerswap.swap(model, backend="fused")
            assert armed()
            with pytest.raises(ConversionError, match="q_proj"):
                get_peft_model(model, LoraConfig(target_modules=MIXED))

        def test_it_is_off_after_the_test_that_armed_it():
            assert not armed()
            assert isinstance(BaseTuner.__dict__["inject_adapter"], types.FunctionType)

        def test_a_module_fixture_arms_it(swapped):
            with pytest.raises(ConversionError, match="q_proj"):
                get_peft_model(copy.deepcopy(swapped), LoraConfig(target_modules=MIXED))

        def test_it_stays_for_the_fixtures_later_tests(swapped):
            assert armed()
            with pytest.raises(ConversionError, match="q_proj"):
                get_peft_model(copy.deepcopy(swapped), LoraConfig(target_modules=MIXED))
        """
    )
    result = pytester.runpytest_inprocess(*_INNER)
    result.assert_outcomes(passed=4)  # a leak would be reported as an error
    assert not any(peft_targets.is_guard(info.patch) for info in layerswap.active_patches())


# --- which layout an adapter is in: layerswap adapter DIR ---------------------------------


def _saved_with_fused_names(base: PreTrainedModel, path: Path) -> torch.Tensor:
    """An adapter of a swapped ``base`` written by hand under the fused names; its logits."""
    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file

    torch.manual_seed(4)
    config = LoraConfig(target_modules="all-linear", r=2, init_lora_weights=False)
    model = get_peft_model(_swapped(base), config).eval()
    model.peft_config["default"].save_pretrained(str(path))
    state = {key: value.contiguous() for key, value in get_peft_model_state_dict(model).items()}
    save_file(state, str(path / "adapter_model.safetensors"))
    return _logits(model, base.config.vocab_size)


def test_the_adapter_command_says_a_fused_adapter_would_be_applied_in_part(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    from command_line import run

    base = tiny_model("llama", num_hidden_layers=2)
    expected = _saved_with_fused_names(base, tmp_path / "fused")

    code, out, _ = run(capsys, "adapter", str(tmp_path / "fused"), "--model", "llama")

    assert code == 1
    assert "fused layout, adapts down_proj, gate_up_proj, o_proj, qkv_proj" in out
    assert "would apply only down_proj, o_proj and skip the rest without a word" in out
    # the documented one-line fix gives an adapter a plain model applies whole
    adapters.save_adapter(
        adapters.load_adapter(_swapped(base), tmp_path / "fused"), tmp_path / "ok"
    )
    plain = PeftModel.from_pretrained(copy.deepcopy(base), str(tmp_path / "ok")).eval()
    torch.testing.assert_close(_logits(plain, base.config.vocab_size), expected, atol=ATOL, rtol=0)
    code, out, _ = run(capsys, "adapter", str(tmp_path / "ok"), "--model", "llama", "--json")
    assert code == 0
    assert json.loads(out)["layout"] == "original"


def test_the_adapter_command_reads_the_family_from_a_local_base_checkpoint(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    from command_line import run

    base = tiny_model("qwen3", num_hidden_layers=2)
    base.save_pretrained(tmp_path / "base")
    plain = get_peft_model(
        type(base).from_pretrained(tmp_path / "base"), LoraConfig(target_modules=["q_proj"], r=2)
    )
    plain.save_pretrained(str(tmp_path / "adapter"))

    code, out, err = run(capsys, "adapter", str(tmp_path / "adapter"))

    assert code == 0, err
    assert "(qwen3): original layout, adapts q_proj" in out
    code, _, err = run(capsys, "adapter", str(tmp_path / "base"))
    assert code == 2 and "no adapter_config.json" in err


def test_a_copy_of_a_swapped_model_saves_its_adapter_in_the_original_layout_after_undo(
    tmp_path: Path,
) -> None:
    """A deep copy (TRL's reference model, an EMA copy) is swapped too, and outlives the
    swap it was copied from: PEFT's layout advice and target check stay armed for it."""
    base = tiny_model("llama", num_hidden_layers=2)
    model = copy.deepcopy(base)
    handle = layerswap.swap(model, "llama.decoder.fused")
    copied = copy.deepcopy(model)
    handle.undo()
    with pytest.raises(ConversionError, match="fused away"):
        get_peft_model(copy.deepcopy(copied), LoraConfig(target_modules=["q_proj", "o_proj"]))
    torch.manual_seed(1)
    config = LoraConfig(init_lora_weights=False, target_modules=["qkv_proj", "o_proj"])
    adapted = get_peft_model(copied, config).eval()
    expected = _logits(adapted, base.config.vocab_size)
    adapted.save_pretrained(str(tmp_path))
    written = load_file(str(tmp_path / "adapter_model.safetensors"))
    assert not any("qkv_proj" in key for key in written)
    plain = PeftModel.from_pretrained(copy.deepcopy(base), str(tmp_path)).eval()
    torch.testing.assert_close(_logits(plain, base.config.vocab_size), expected, atol=ATOL, rtol=0)
