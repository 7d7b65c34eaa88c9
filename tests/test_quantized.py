"""Quantized models inside use(): saved in the original layout, or refused with nothing written.

Each quantizer is run for real on CPU over a tiny Llama with random weights: an
original-layout checkpoint is saved by plain transformers, loaded quantized inside
``use()``, saved, and reloaded by plain transformers (issue 39, item 1).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from models import tiny_model
from safetensors import safe_open
from transformers import LlamaForCausalLM, PreTrainedModel

import layerswap
from layerswap.backends import fused
from layerswap.distributed import applied_substitutions
from layerswap.errors import ConversionError, RequirementError
from layerswap.model import decoder_layers
from layerswap.saving import fused_names

SUBSTITUTION = "llama.decoder.fused"


def _torchao() -> Any:
    pytest.importorskip("torchao", reason="torchao is not installed")
    from torchao.quantization import Int8WeightOnlyConfig
    from transformers import TorchAoConfig

    return TorchAoConfig(Int8WeightOnlyConfig())


def _bnb(bits: int) -> Callable[[], Any]:
    def config() -> Any:
        pytest.importorskip("bitsandbytes", reason="bitsandbytes is not installed")
        from transformers import BitsAndBytesConfig

        return BitsAndBytesConfig(load_in_8bit=bits == 8, load_in_4bit=bits == 4)

    return config


def _quanto() -> Any:
    pytest.importorskip("optimum.quanto", reason="optimum-quanto is not installed")
    from transformers import QuantoConfig

    return QuantoConfig(weights="int8")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama (hidden 128, intermediate 256: whole blocks for every quantizer),
    random weights from seed 0, saved by plain transformers in the original layout."""
    path = tmp_path_factory.mktemp("original")
    tiny_model("llama", seed=0).save_pretrained(path)
    return path


def _tokens() -> torch.Tensor:
    return torch.randint(0, 512, (2, 12), generator=torch.Generator().manual_seed(1))


def _logits(model: PreTrainedModel) -> torch.Tensor:
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # bitsandbytes: inputs cast to float16
        return model(_tokens()).logits


def _load_inside_use(path: Path, config: Any) -> PreTrainedModel:
    with layerswap.use(SUBSTITUTION):
        model = LlamaForCausalLM.from_pretrained(path, quantization_config=config, device_map="cpu")
    assert all(isinstance(layer, fused.FusedDecoderLayer) for _, layer in decoder_layers(model))
    return model


def _written(path: Path) -> set[str]:
    names: set[str] = set()
    for file in path.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as handle:
            names.update(handle.keys())
    return names


@pytest.mark.parametrize(
    ("make_config", "extras"),
    [
        pytest.param(_torchao, ("_weight_qdata", "_weight_scale"), id="torchao-int8-weight-only"),
        pytest.param(_bnb(8), ("weight", "SCB", "weight_format"), id="bitsandbytes-int8"),
    ],
)
def test_a_quantized_swapped_model_saves_what_plain_transformers_reloads(
    checkpoint: Path, tmp_path: Path, make_config: Callable[[], Any], extras: tuple[str, ...]
) -> None:
    model = _load_inside_use(checkpoint, make_config())
    swapped = _logits(model)
    model.save_pretrained(tmp_path / "saved")

    written = _written(tmp_path / "saved")
    assert not [name for name in written if "qkv_proj" in name or "gate_up_proj" in name]
    for module in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj"):
        for extra in extras:  # every tensor the quantizer writes, under the original module
            assert f"model.layers.0.{module}.{extra}" in written
    reloaded = LlamaForCausalLM.from_pretrained(tmp_path / "saved", device_map="cpu")
    assert not any(
        isinstance(layer, fused.FusedDecoderLayer) for _, layer in decoder_layers(reloaded)
    )
    # per-row quantization splits exactly: the same quantized weights, the same logits
    torch.testing.assert_close(_logits(reloaded), swapped, atol=1e-4, rtol=0)


def test_bitsandbytes_4bit_loads_inside_use_but_its_save_is_refused_before_writing(
    checkpoint: Path, tmp_path: Path
) -> None:
    model = _load_inside_use(checkpoint, _bnb(4)())
    plain = LlamaForCausalLM.from_pretrained(
        checkpoint, quantization_config=_bnb(4)(), device_map="cpu"
    )
    torch.testing.assert_close(_logits(model), _logits(plain), atol=0.05, rtol=0)
    target = tmp_path / "saved"
    with pytest.raises(ConversionError, match=r"bitsandbytes 4-bit.*save the model unquantized"):
        model.save_pretrained(target)
    assert not target.exists()
    assert list(tmp_path.iterdir()) == []  # no staging directory left beside it either


def test_quanto_is_refused_inside_use_before_transformers_loads(checkpoint: Path) -> None:
    with pytest.raises(RequirementError, match=r"optimum-quanto cannot be loaded inside use\(\)"):
        _load_inside_use(checkpoint, _quanto())


def test_a_quantized_checkpoint_is_refused_inside_use(checkpoint: Path, tmp_path: Path) -> None:
    # without the refusal torchao's flattened tensors would skip the concatenation and
    # leave qkv_proj at its initial values
    LlamaForCausalLM.from_pretrained(
        checkpoint, quantization_config=_torchao(), device_map="cpu"
    ).save_pretrained(tmp_path)
    refused = pytest.raises(RequirementError, match="already quantized with torchao")
    with refused, layerswap.use(SUBSTITUTION):
        LlamaForCausalLM.from_pretrained(tmp_path, device_map="cpu")


def test_a_save_writing_a_fused_name_is_refused_and_leaves_the_directory_unchanged(
    tmp_path: Path,
) -> None:
    model = tiny_model("llama")
    layerswap.swap(model, SUBSTITUTION)
    target = tmp_path / "saved"
    target.mkdir()
    (target / "notes.txt").write_text("kept")
    before = sorted(target.iterdir())
    # save_original_format=False skips transformers' revert step: qkv_proj would be written
    with pytest.raises(
        ConversionError, match=r"swapped layers' own names.*(qkv_proj|gate_up_proj)"
    ):
        model.save_pretrained(target, save_original_format=False)
    assert sorted(target.iterdir()) == before
    assert (target / "notes.txt").read_text() == "kept"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["saved"]


def test_a_swapped_save_replaces_the_shards_of_an_earlier_save(tmp_path: Path) -> None:
    model = tiny_model("llama")
    model.save_pretrained(tmp_path, max_shard_size="100KB")  # several shards
    assert len(list(tmp_path.glob("model-*-of-*.safetensors"))) > 1
    layerswap.swap(model, SUBSTITUTION)
    model.save_pretrained(tmp_path)
    assert sorted(p.name for p in tmp_path.glob("*.safetensors")) == ["model.safetensors"]
    reloaded = LlamaForCausalLM.from_pretrained(tmp_path)
    torch.testing.assert_close(_logits(reloaded), _logits(model), atol=1e-5, rtol=0)


def test_fused_names_are_those_of_the_swapped_layers_own_layout() -> None:
    model = tiny_model("llama")
    layerswap.swap(model, SUBSTITUTION)
    names = [
        "model.layers.0.self_attn.qkv_proj.SCB",
        "model.layers.1.mlp.gate_up_proj._weight_qdata",
        "model.layers.0.self_attn.q_proj.SCB",
        "model.layers.0.mlp.down_proj.weight",
        "lm_head.weight",
    ]
    assert fused_names(model, names) == names[:2]


def test_fused_names_are_found_under_a_wrappers_checkpoint_names() -> None:
    """A LLaVA checkpoint writes ``language_model.model.layers.0...`` for the model's
    ``model.language_model.layers.0...``: its fused names are found either way, and the
    vision tower's keys of the same layer number are not taken for them."""
    from test_wrappers import tiny_wrapper

    model = tiny_wrapper("llava")
    layerswap.swap(model, SUBSTITUTION)
    names = [
        "language_model.model.layers.0.self_attn.qkv_proj.weight",
        "model.language_model.layers.1.mlp.gate_up_proj.SCB",
        "language_model.model.layers.0.self_attn.q_proj.weight",
        "vision_tower.vision_model.encoder.layers.0.self_attn.qkv_proj.weight",
    ]
    assert fused_names(model, names) == names[:2]


def test_the_qkv_slot_refuses_a_quantized_load_that_skips_its_projections(
    checkpoint: Path,
) -> None:
    """bitsandbytes converts ``nn.Linear`` itself only: it converted o_proj and left the
    packed projections float32 under a config that says 8-bit, and the checkpoint saved
    then did not run. Refused before a weight is read, the patches gone; a plain load
    still packs, and a quantizer that converts nothing beside them (torchao quantizes the
    weights where they are) loads inside use() with the original's numbers."""
    config = _bnb(8)()
    refused = pytest.raises(
        RequirementError, match=r"converted model\.layers\.0\.self_attn\.o_proj but left"
    )
    with refused, layerswap.use("llama.qkv.fused"):
        LlamaForCausalLM.from_pretrained(checkpoint, quantization_config=config, device_map="cpu")
    assert applied_substitutions() == ()
    with layerswap.use("llama.qkv.fused"):
        model = LlamaForCausalLM.from_pretrained(checkpoint)
    plain = LlamaForCausalLM.from_pretrained(checkpoint)
    torch.testing.assert_close(_logits(model), _logits(plain), rtol=1e-5, atol=1e-5)
    groups = model.model.layers[0].self_attn._layerswap_groups
    assert groups and all(group.packed() for group in groups)
    with layerswap.use("llama.qkv.fused"):
        quantized = LlamaForCausalLM.from_pretrained(checkpoint, quantization_config=_torchao())
    reference = LlamaForCausalLM.from_pretrained(checkpoint, quantization_config=_torchao())
    torch.testing.assert_close(_logits(quantized), _logits(reference), rtol=1e-4, atol=1e-4)


def test_a_qkv_swap_of_a_torchao_model_undoes_whole(checkpoint: Path) -> None:
    """torchao's weights are wrapper tensors with no storage of their own, which the qkv
    slot leaves unpacked: undo asked their storage's address and raised half-way, one
    attention restored and the next not, and could not be undone again."""
    model = LlamaForCausalLM.from_pretrained(checkpoint, quantization_config=_torchao())
    before = _logits(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "not packed": torchao's tensors stay as they are
        handle = layerswap.swap(model, "llama.qkv.fused")
    torch.testing.assert_close(_logits(model), before, rtol=0, atol=0)
    handle.undo()
    assert {type(layer.self_attn).__name__ for layer in model.model.layers} == {"LlamaAttention"}
    torch.testing.assert_close(_logits(model), before, rtol=0, atol=0)
