"""What an adoption's proof reaches: the code a patch changes, wherever the tiny models run it.

Each test here is a patch that computes otherwise only where an earlier proof did not
look (a config built with it, a model built with it, a later layer, a longer prompt, a
single sequence, Trainer's loss normaliser) and was reported proven."""

from __future__ import annotations

from typing import Any

import pytest
from transformers.models.llama import configuration_llama

import layerswap
from layerswap.errors import PatchDivergenceError

_POST_INIT = configuration_llama.LlamaConfig.__post_init__


def _eps_in_config(model: Any = None) -> None:
    """A patch of the config class: every config built after it has another epsilon."""

    def __post_init__(self: Any, **kwargs: Any) -> None:
        _POST_INIT(self, **kwargs)
        self.rms_norm_eps = 0.1

    configuration_llama.LlamaConfig.__post_init__ = __post_init__


@pytest.mark.parametrize("given", ["config", "nothing"])
def test_a_patch_of_the_config_class_is_refused(given: str) -> None:
    """The original's tiny config is built with the patch taken back, the candidate's with
    it in effect (both were built with it, and every model they built differed); without
    a config, the family is found from the configuration module the patch changed."""
    family = layerswap.get_family("llama")
    where = {"config": family.tiny_config()} if given == "config" else {}
    with pytest.raises(PatchDivergenceError, match="forward on a left-padded batch") as refused:
        layerswap.adopt(_eps_in_config, **where)
    assert refused.value.layer == "model.layers.0"
    assert configuration_llama.LlamaConfig.__post_init__ is _POST_INIT
    assert family.tiny_config().rms_norm_eps != 0.1
