"""A swap unwraps the user's config once, hands the unwrapped one down, and changes nothing
of it (:class:`layerswap.config_view.ModelConfig`)."""

from __future__ import annotations

import copy

import pytest
from test_wrappers import tiny_wrapper
from transformers import PretrainedConfig

import layerswap
from layerswap import proof
from layerswap.config_view import ModelConfig
from layerswap.hf_internals import text_config_of
from layerswap.model import layer_config
from layerswap.slots.decoder import DecoderSlot


def test_a_model_config_is_read_where_a_config_is_unwrapped() -> None:
    model = tiny_wrapper("llava")
    view = ModelConfig.of(model.config)
    assert view.config is model.config
    assert view.text is model.config.text_config
    assert layer_config(view) is view.text and text_config_of(view) is view.text
    assert ModelConfig.of(view) is view
    # read as the model's config is by a slot handed it (another library's prepare)
    assert view.model_type == "llava" and view.text_config is model.config.text_config
    assert copy.deepcopy(view).text.hidden_size == view.text.hidden_size


def test_a_swap_unwraps_a_composite_config_once_and_changes_nothing_of_it() -> None:
    model = tiny_wrapper("llava")
    config = model.config
    before = copy.deepcopy(config.to_dict())
    unwrapped = []
    own = config.get_text_config

    def counted(*args: object, **kwargs: object) -> object:
        unwrapped.append(args)
        return own(*args, **kwargs)

    # proven first, so the count is the swap's own (a first-use proof builds its own models)
    proof.prove("llama.decoder.fused", config)
    config.__dict__["get_text_config"] = counted
    try:
        with layerswap.swap(model, "llama.decoder.fused"):
            assert len(unwrapped) == 1, f"the config was unwrapped {len(unwrapped)} times"
    finally:
        del config.__dict__["get_text_config"]
    assert config.to_dict() == before


def test_a_slots_prepare_is_handed_the_models_config_itself(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What a slot's ``prepare`` is handed is the model's config, as a slot of another
    library overriding it reads it, though the swap unwrapped it already."""
    model = tiny_wrapper("llava")
    handed: list[object] = []
    real = DecoderSlot.prepare

    def spy(self: DecoderSlot, sub: object, config: object, placement: object = None) -> None:
        handed.append(config)
        real(self, sub, config, placement)  # type: ignore[arg-type]

    monkeypatch.setattr(DecoderSlot, "prepare", spy)
    with layerswap.swap(model, "llama.decoder.fused"):
        pass
    assert handed and handed[0] is model.config
    assert isinstance(handed[0], PretrainedConfig)
