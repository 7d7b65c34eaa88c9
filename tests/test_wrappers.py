"""Multimodal wrappers of covered text decoders, swapped and verified on image or audio inputs.

Each wrapper (``*ForConditionalGeneration``) is built tiny from its config class: its
text config is the family's tiny config, its vision tower two small layers on 32 x 32
images (its audio tower two small layers on 16 log-mel bins x 16 frames). The decoder
layers of its language model are swapped; the tower and the projector stay the
original's. Logits and greedy generation on prompts holding an image or a clip equal the
original's, and ``layerswap.verify`` without inputs runs on them.
"""

from __future__ import annotations

import copy
import inspect
from typing import Any

import pytest
import torch
from transformers import (
    AutoModelForImageTextToText,
    Qwen2AudioForConditionalGeneration,
    VoxtralForConditionalGeneration,
)
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

import layerswap
from layerswap.comparison.multimodal import WRAPPERS, is_multimodal, multimodal_inputs
from layerswap.model import family_of

# wrapper -> the family of its text decoder, and config fields its tiny form needs
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "aya_vision": ("cohere2", {}),
    "gemma3": ("gemma3", {"mm_tokens_per_image": 4}),  # a square number of patches
    "idefics3": ("llama", {}),
    "internvl": ("qwen2", {}),
    "llava": ("llama", {}),
    "llava_next": ("llama", {"image_grid_pinpoints": [[32, 64], [64, 32]]}),  # 32 x 32 tiles
    "mistral3": ("mistral", {}),
    "mllama": ("mllama", {}),
    "paligemma": ("gemma", {"projection_dim": 128}),  # the text width
    "qwen2_audio": ("qwen2", {"audio_token_id": 3}),
    "smolvlm": ("llama", {}),
    "voxtral": ("llama", {"audio_token_id": 3}),
}
VISION = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2}
VISION_SHAPE = {"num_attention_heads": 2, "image_size": 32, "patch_size": 8}
AUDIO = {**VISION, "num_attention_heads": 2, "num_mel_bins": 16, "max_source_positions": 8}
# what a tower needs beyond VISION: Mllama's two tiles of 32 x 32 pixels, one global layer
VISION_FIELDS: dict[str, dict[str, Any]] = {
    "mllama": {
        "attention_heads": 2,
        "num_global_layers": 1,
        "intermediate_layers_indices": [0],
        "vision_output_dim": 64,  # hidden_size x (1 + intermediate layers)
        "max_num_tiles": 2,
        "supported_aspect_ratios": [[1, 1], [1, 2], [2, 1]],
    }
}
AUDIO_CLASSES = {
    "qwen2_audio": Qwen2AudioForConditionalGeneration,
    "voxtral": VoxtralForConditionalGeneration,
}
# Mllama: layers 0 and 2 self-attention (swapped), layer 1 cross-attention (kept)
TEXT_LAYERS = {"mllama": 3}


def tiny_wrapper(model_type: str, seed: int = 0, text_family: str | None = None) -> Any:
    """The wrapper ``model_type`` with a tiny text decoder of its family (or of
    ``text_family``, another its config accepts) and a tiny tower."""
    family, fields = CASES[model_type]
    config_class = CONFIG_MAPPING[model_type]
    defaults = config_class()
    layers = TEXT_LAYERS.get(model_type, 2)
    text = (
        layerswap.get_family(text_family or family).tiny_config(num_hidden_layers=layers).to_dict()
    )
    text["model_type"] = (
        layerswap.get_family(text_family).model_type
        if text_family
        else defaults.text_config.model_type
    )
    if getattr(defaults, "audio_config", None) is not None:
        audio = {**defaults.audio_config.to_dict(), **AUDIO}
        config = config_class(text_config=text, audio_config=audio, **fields)
        # no Auto class maps audio-text yet
        build: Any = AUDIO_CLASSES[model_type]
    else:
        vision = defaults.vision_config.to_dict()
        for key, value in {**VISION, **VISION_SHAPE}.items():
            if key in vision:
                vision[key] = [value, value] if isinstance(vision[key], (list, tuple)) else value
        vision.update({key: 16 for key in ("head_dim",) if key in vision})
        vision.update(VISION_FIELDS.get(model_type, {}))
        # PaliGemma projects the vision features to projection_dim: the text width
        vision.update({key: text["hidden_size"] for key in ("projection_dim",) if key in vision})
        image_token = {
            key: 3 for key in ("image_token_id", "image_token_index") if hasattr(defaults, key)
        }
        config = config_class(text_config=text, vision_config=vision, **image_token, **fields)
        build = AutoModelForImageTextToText.from_config
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = build(config).eval()
    _open_cross_attention_gates(model)
    return model


def _open_cross_attention_gates(model: Any) -> None:
    """Mllama's cross-attention layers start with their gates at zero (they add nothing):
    opened, so the image reaches the logits."""
    with torch.no_grad():
        for module in model.modules():
            for gate in ("cross_attn_attn_gate", "cross_attn_mlp_gate"):
                if isinstance(getattr(module, gate, None), torch.nn.Parameter):
                    getattr(module, gate).fill_(0.5)


# families whose model is the wrapper itself (the text decoder has no causal LM of its
# own): built tiny by the family, M-RoPE positions from the image's grid
VISION_LANGUAGE = sorted(name for name, family in layerswap.families().items() if family.composite)


def assert_same_logits_and_generation(original: Any, swapped: Any, batch: dict[str, Any]) -> None:
    """Logits on ``batch`` and 4 greedily generated tokens equal the original's."""
    with torch.no_grad():
        expected, actual = original(**batch).logits, swapped(**batch).logits
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
    generate = {"max_new_tokens": 4, "do_sample": False}
    assert torch.equal(
        swapped.generate(**batch, **generate), original.generate(**batch, **generate)
    )


def test_every_proven_wrapper_is_tested():
    assert set(CASES) | set(VISION_LANGUAGE) == set(WRAPPERS)
    assert {"qwen2_vl", "qwen2_5_vl", "qwen3_vl"} <= set(VISION_LANGUAGE)


# the fast lane runs one image wrapper and the audio one; pytest --full runs them all
FAST = ("llava", "voxtral")


@pytest.mark.parametrize(
    "model_type",
    [
        pytest.param(name, marks=() if name in FAST else pytest.mark.matrix)
        for name in sorted(CASES)
    ],
)
def test_a_swapped_wrapper_equals_the_original_on_image_or_audio_prompts(model_type):
    family, _ = CASES[model_type]
    original = tiny_wrapper(model_type)
    assert is_multimodal(original)
    batch = multimodal_inputs(original)
    placeholder = batch["input_ids"][0, 2]
    assert (batch["input_ids"] == placeholder).sum() > 0  # images (clips) are in the prompts
    swapped = copy.deepcopy(original)
    handle = layerswap.swap(swapped, f"{family}.decoder.fused")
    assert len(handle) == 2  # the language model's layers; the vision tower is kept
    tower = ("vision", "audio")
    before = {n for n, _ in original.named_parameters() if any(t in n for t in tower)}
    after = {n for n, _ in swapped.named_parameters() if any(t in n for t in tower)}
    assert before == after and before  # the tower is kept
    assert_same_logits_and_generation(original, swapped, batch)


@pytest.mark.parametrize("slot", ["norm", "mlp", "qkv"])
def test_a_slot_below_the_layer_keeps_the_wrappers_other_parts_which_its_proof_never_runs(slot):
    """``mistral.<slot>.fused`` on a Mistral3 wrapper: its first-use proof builds a tiny
    MistralForCausalLM, so the Pixtral vision tower's norms, MLPs and attentions (and the
    projector's norm), classes of other modeling modules, stay the original's and the report
    says why; the language model's are swapped, and image prompts give the original's
    logits and tokens."""
    original = tiny_wrapper("mistral3")
    batch = multimodal_inputs(original)
    swapped = copy.deepcopy(original)
    with layerswap.swap(swapped, f"mistral.{slot}.fused") as handle:
        taken = {original.__name__ for _, original, _ in handle.swapped}
        assert taken == {
            {"norm": "MistralRMSNorm", "mlp": "MistralMLP"}.get(slot, "MistralAttention")
        }
        kept = handle.kept
        assert {"PixtralRMSNorm", "PixtralMLP", "PixtralAttention"} & set(kept)
        assert set(kept) <= {"PixtralRMSNorm", "PixtralMLP", "PixtralAttention", "Mistral3RMSNorm"}
        assert all("first-use proof builds" in reason for _, reason in kept.values())
        assert "MistralForCausalLM the first-use proof builds" in handle.report()
        assert_same_logits_and_generation(original, swapped, batch)
    for name, module in swapped.named_modules():
        assert type(module) is type(original.get_submodule(name))


def test_ministral_3_is_swapped_inside_its_mistral3_wrapper():
    """Ministral 3 ships as ``Mistral3ForConditionalGeneration`` around a ``ministral3``
    text decoder, whose queries are scaled by position: found through the wrapper, swapped,
    equal on image prompts and in greedy decoding."""
    original = tiny_wrapper("mistral3", text_family="ministral3")
    assert original.config.text_config.model_type == "ministral3"
    assert family_of(original).name == "ministral3"
    batch = multimodal_inputs(original)
    swapped = copy.deepcopy(original)
    assert len(layerswap.swap(swapped, "ministral3.decoder.fused")) == 2
    assert_same_logits_and_generation(original, swapped, batch)


@pytest.mark.parametrize(
    ("model_type", "media"),
    [
        ("llava", "pixel_values"),
        pytest.param("gemma3", "pixel_values", marks=pytest.mark.matrix),
        ("voxtral", "input_features"),
        pytest.param("mllama", "aspect_ratio_ids", marks=pytest.mark.matrix),
        pytest.param("qwen2_audio", "feature_attention_mask", marks=pytest.mark.matrix),
    ],
)
def test_verify_on_a_wrapper_runs_its_media_by_default(model_type, media):
    family, _ = CASES[model_type]
    model = tiny_wrapper(model_type)
    seen: list[set[str]] = []
    hook = model.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(set(kwargs)), with_kwargs=True
    )
    report = layerswap.verify(model, f"{family}.decoder.fused")
    hook.remove()
    assert report.passed, report.summary()
    assert any(media in keys for keys in seen)


def test_mllama_images_reach_the_text_through_the_kept_cross_attention_layers():
    """Llama 3.2 Vision: the prompt's image token opens the text's view of the image's
    tiles (the cross-attention mask); the cross-attention layer between the swapped
    self-attention layers is the original's, and the image changes the logits after it."""
    original = tiny_wrapper("mllama")
    batch = multimodal_inputs(original)
    image = batch["input_ids"] == original.config.image_token_index
    assert image.sum(dim=1).tolist() == [1, 1]  # one image token per prompt
    mask = batch["cross_attention_mask"]
    assert mask.shape == (2, batch["input_ids"].shape[1], 1, 2)  # per token, image, tile
    first = int(image[1].nonzero()[0])
    assert mask[1, :first].sum() == 0 and bool(mask[1, first:].all())  # pads and text before: 0
    # another image (the batch's own is drawn from seed 0: a global generator just seeded 0
    # by an earlier test would draw the same one)
    drawn = torch.randn(batch["pixel_values"].shape, generator=torch.Generator().manual_seed(1))
    other = dict(batch, pixel_values=drawn.to(batch["pixel_values"].dtype))
    with torch.no_grad():
        seen, unseen = original(**batch).logits, original(**other).logits
    assert (seen[:, first + 1 :] - unseen[:, first + 1 :]).abs().max() > 1e-3
    swapped = copy.deepcopy(original)
    layerswap.swap(swapped, "mllama.decoder.fused")
    kinds = [type(layer).__name__ for layer in swapped.model.language_model.layers]
    fused, cross = "FusedMllamaDecoderLayer", "MllamaCrossAttentionDecoderLayer"
    assert kinds == [fused, cross, fused]
    with torch.no_grad():
        torch.testing.assert_close(swapped(**other).logits, unseen, rtol=1e-5, atol=1e-5)


def test_a_wrapper_built_inside_use_has_the_replacement_layers():
    with layerswap.use("llama.decoder.fused"):
        model = tiny_wrapper("llava")
    layers = model.model.language_model.layers
    assert all(type(layer).__name__ == "FusedLlamaDecoderLayer" for layer in layers)


def _rope_positions(model: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Each token's (temporal, height, width) position, as the model computes it."""
    rope_index = model.model.get_rope_index
    wanted = inspect.signature(rope_index).parameters
    extra = {key: batch[key] for key in ("mm_token_type_ids", "image_grid_thw") if key in wanted}
    positions: torch.Tensor = rope_index(
        batch["input_ids"], attention_mask=batch["attention_mask"], **extra
    )[0]
    return positions


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(name, marks=() if name == "qwen2_vl" else pytest.mark.matrix)
        for name in VISION_LANGUAGE
    ],
)
def test_a_vision_language_family_swaps_inside_its_wrapper_on_image_prompts(name):
    family = layerswap.get_family(name)
    original = family.build(family.tiny_config(num_hidden_layers=2), seed=0)
    assert is_multimodal(original) and family_of(original) is family
    batch = multimodal_inputs(original)
    positions = _rope_positions(original, batch)
    image = batch["input_ids"] == original.config.image_token_id
    # the image tokens' height and width positions differ: M-RoPE sections are exercised
    assert image.any()
    assert not torch.equal(positions[1][image], positions[2][image])
    swapped = copy.deepcopy(original)
    assert len(layerswap.swap(swapped, f"{name}.decoder.fused")) == 2
    assert not any(type(m).__name__ == family.decoder for m in swapped.modules())
    assert_same_logits_and_generation(original, swapped, batch)
    report = layerswap.verify(original, f"{name}.decoder.fused")
    assert report.passed, report.summary()


def test_m_rope_cos_sin_given_per_axis_merge_as_the_rotary_embedding_merges_them():
    """Older releases pass Qwen2-VL's layers cos/sin per axis (3 x batch x seq x dim) and
    split the sections in the attention; the installed rotary embedding merges them
    itself. The layers' merge of the per-axis form equals the installed merge."""
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLRotaryEmbedding

    from layerswap.hf_internals import merge_rotary_sections, rotary_sections

    config = layerswap.get_family("qwen2_vl").tiny_config().text_config
    sections = rotary_sections(config)
    assert sections == (2, 3, 3)
    rotary = Qwen2VLRotaryEmbedding(config)
    generator = torch.Generator().manual_seed(0)
    positions = torch.randint(0, 64, (3, 2, 7), generator=generator)  # three distinct axes
    hidden = torch.zeros(2, 7, config.hidden_size)
    merged = rotary(hidden, positions)
    per_axis = []
    for axis in range(3):
        same = positions[axis].expand(3, -1, -1)  # one axis's positions on all three
        cos, sin = rotary(hidden, same)
        per_axis.append((cos, sin))
    cos = torch.stack([pair[0] for pair in per_axis])
    sin = torch.stack([pair[1] for pair in per_axis])
    ours = merge_rotary_sections((cos, sin), sections)
    torch.testing.assert_close(ours[0], merged[0], rtol=0, atol=0)
    torch.testing.assert_close(ours[1], merged[1], rtol=0, atol=0)
    plain = (merged[0], merged[1])
    assert merge_rotary_sections(plain, sections) is plain  # merged already: left alone


def test_glm4v_layers_read_the_rotary_layout_of_the_installed_release(monkeypatch):
    """GLM-4V's rotary embedding hands its layers pairwise cos/sin from transformers 5.17;
    before, GLM-4's layout (halves, repeated pairwise in the attention). The fused layer
    built on a release reads that release's layout (proven on 5.12.1, 5.16 and 5.17)."""
    from layerswap import hf_internals

    family = layerswap.get_family("glm4v")
    assert family.rope.layout == "interleaved"
    assert hf_internals.rotary_layout("glm4v", family.rope.layout) == "interleaved"  # 5.24
    assert hf_internals.rotary_layout("llama", "half") == "half"  # no change recorded
    monkeypatch.setattr(hf_internals, "transformers_version", lambda: "5.16.1")
    assert hf_internals.rotary_layout("glm4v", family.rope.layout) == "interleaved_from_half"
    layer = layerswap.get("glm4v.decoder.fused").replacement_class()(
        family.tiny_config().text_config, 0
    )
    assert layer.self_attn.rotary == "interleaved_from_half"
