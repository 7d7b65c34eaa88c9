"""PEFT LoRA adapters move between the original and the swapped layout, exactly, or fail loudly."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from models import tiny_model, tokens
from peft import IA3Config, LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file
from transformers import PreTrainedModel

import layerswap
from layerswap import adapters
from layerswap.errors import ConversionError

FAMILIES = ("llama", "qwen2", "qwen3")
FUSED_TARGETS = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
ATOL = 1e-5


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


@pytest.mark.parametrize("name", FAMILIES)
def test_an_all_linear_adapter_from_the_original_applies_exactly_to_the_swapped_model(
    name: str, tmp_path: Path
) -> None:
    base = tiny_model(name, num_hidden_layers=2)
    expected = _trained_on_original(base, tmp_path, target_modules="all-linear", r=4)
    loaded = adapters.load_adapter(_swapped(base), tmp_path)
    assert "model.layers.0.self_attn.qkv_proj" in loaded.base_model.targeted_module_names
    torch.testing.assert_close(_logits(loaded, base.config.vocab_size), expected, atol=ATOL, rtol=0)


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


def test_plain_peft_loading_an_original_adapter_onto_a_swapped_model_fails_loudly(
    tmp_path: Path,
) -> None:
    base = tiny_model("llama", num_hidden_layers=2)
    _trained_on_original(base, tmp_path, target_modules="all-linear", r=4)
    with pytest.raises(ConversionError, match=r"q_proj.*qkv_proj.*load_adapter"):
        PeftModel.from_pretrained(_swapped(base), str(tmp_path))


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
