"""Checkpoints keep the original layout: loading into swapped layers and saving from them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from models import FAMILIES, left_padded_batch, text_vocab, tiny_model
from safetensors.torch import load_file
from transformers import PreTrainedModel

import layerswap
from layerswap import hf_internals
from layerswap.backends import fused
from layerswap.errors import ConversionError
from layerswap.model import decoder_layers

ATOL = 1e-5


def _logits(model: PreTrainedModel, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    with torch.no_grad():
        return model(**batch).logits[batch["attention_mask"].bool()]


@pytest.mark.parametrize("name", FAMILIES)
def test_from_pretrained_inside_use_loads_an_original_checkpoint(name: str, tmp_path: Path) -> None:
    original = tiny_model(name)
    original.save_pretrained(tmp_path)  # plain transformers, original layout
    batch = left_padded_batch(text_vocab(original))
    with layerswap.use(f"{name}.decoder.fused"):
        loaded = type(original).from_pretrained(tmp_path)
    assert all(isinstance(layer, fused.FusedDecoderLayer) for _, layer in decoder_layers(loaded))
    torch.testing.assert_close(_logits(loaded, batch), _logits(original, batch), atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", FAMILIES)
def test_a_swapped_model_saves_the_original_layout(name: str, tmp_path: Path) -> None:
    model = tiny_model(name)
    model.save_pretrained(tmp_path / "plain")
    batch = left_padded_batch(text_vocab(model))
    expected = _logits(model, batch)
    layerswap.swap(model, backend="fused")
    model.save_pretrained(tmp_path / "swapped")
    plain = load_file(str(tmp_path / "plain" / "model.safetensors"))
    swapped = load_file(str(tmp_path / "swapped" / "model.safetensors"))
    assert swapped.keys() == plain.keys()
    assert all(torch.equal(swapped[key], plain[key]) for key in plain)
    reloaded = type(model).from_pretrained(tmp_path / "swapped")  # no layerswap involved
    original_class = layerswap.get(f"{name}.decoder.fused").original_class()
    assert all(type(layer) is original_class for _, layer in decoder_layers(reloaded))
    torch.testing.assert_close(_logits(reloaded, batch), expected, atol=ATOL, rtol=0)


def test_saving_after_undo_writes_what_plain_transformers_writes(tmp_path: Path) -> None:
    model = tiny_model("qwen2")
    model.save_pretrained(tmp_path / "before")
    layerswap.swap(model, backend="fused").undo()
    model.save_pretrained(tmp_path / "after")
    before, after = (
        load_file(str(tmp_path / d / "model.safetensors")) for d in ("before", "after")
    )
    assert before.keys() == after.keys()
    assert all(torch.equal(before[key], after[key]) for key in before)


def test_a_loaded_model_saves_the_original_layout_after_use_ends(tmp_path: Path) -> None:
    original = tiny_model("qwen3")
    original.save_pretrained(tmp_path / "original")
    with layerswap.use("qwen3.decoder.fused"):
        loaded = type(original).from_pretrained(tmp_path / "original")
    loaded.save_pretrained(tmp_path / "resaved")
    first = load_file(str(tmp_path / "original" / "model.safetensors"))
    second = load_file(str(tmp_path / "resaved" / "model.safetensors"))
    assert first.keys() == second.keys()
    assert all(torch.equal(first[key], second[key]) for key in first)


def test_a_model_built_inside_use_saves_a_checkpoint_plain_transformers_loads(
    tmp_path: Path,
) -> None:
    family = layerswap.families()["llama"]
    with layerswap.use("llama.decoder.fused"):
        built = family.build(family.tiny_config(attention_bias=True))
    built.save_pretrained(tmp_path)
    assert "model.layers.0.self_attn.q_proj.bias" in load_file(str(tmp_path / "model.safetensors"))
    plain = family.causal_lm_class().from_pretrained(tmp_path)
    batch = left_padded_batch(built.config.vocab_size)
    torch.testing.assert_close(_logits(plain, batch), _logits(built, batch), atol=ATOL, rtol=0)


def test_a_checkpoint_giving_a_layer_both_layouts_is_refused_before_it_loads(
    tmp_path: Path,
) -> None:
    """A checkpoint holding a layer's q/k/v and also a ``qkv_proj`` of its own: both land
    in one tensor, and ``from_pretrained`` kept one without a word (``load_state_dict``
    refuses the mix). Refused, naming the layer and both keys; a checkpoint in either
    layout alone loads."""
    from safetensors.torch import save_file

    original = tiny_model("llama", num_hidden_layers=2)
    original.save_pretrained(tmp_path)
    state = load_file(str(tmp_path / "model.safetensors"))
    stray = "model.layers.1.self_attn.qkv_proj.weight"
    save_file({**state, stray: torch.zeros(3, 3)}, str(tmp_path / "model.safetensors"))
    with (
        pytest.raises(ConversionError, match=rf"model\.layers\.1: .*_proj\.weight.*'{stray}'"),
        layerswap.use("llama.decoder.fused"),
    ):
        type(original).from_pretrained(tmp_path)
    # use()'s own patches ended with it (PEFT's and the savers' safeguards stay while a
    # swapped model lives)
    used = {
        hf_internals.POST_INIT_TARGET,
        hf_internals.CONVERSION_MAPPING_TARGET,
        hf_internals.LOAD_STATE_TARGET,
        "transformers.models.llama.modeling_llama:LlamaDecoderLayer",
    }
    assert not used & {patch.target for patch in layerswap.active_patches()}

    with layerswap.swap(tiny_model("llama", num_hidden_layers=2), "llama.decoder.fused") as handle:
        swapped_state = {k: v.contiguous() for k, v in handle.model.state_dict().items()}
    save_file(swapped_state, str(tmp_path / "model.safetensors"))
    with layerswap.use("llama.decoder.fused"):
        loaded = type(original).from_pretrained(tmp_path)
    batch = left_padded_batch(text_vocab(original))
    torch.testing.assert_close(_logits(loaded, batch), _logits(original, batch), atol=ATOL, rtol=0)


def test_nested_use_of_one_substitution_converts_once(tmp_path: Path) -> None:
    original = tiny_model("qwen2", num_hidden_layers=2)
    original.save_pretrained(tmp_path / "original")
    with layerswap.use("qwen2.decoder.fused"), layerswap.use("qwen2.decoder.fused"):
        loaded = type(original).from_pretrained(tmp_path / "original")
    batch = left_padded_batch(text_vocab(original))
    torch.testing.assert_close(_logits(loaded, batch), _logits(original, batch), atol=ATOL, rtol=0)
    loaded.save_pretrained(tmp_path / "resaved")
    first = load_file(str(tmp_path / "original" / "model.safetensors"))
    second = load_file(str(tmp_path / "resaved" / "model.safetensors"))
    assert first.keys() == second.keys()
    assert all(torch.equal(first[key], second[key]) for key in first)
