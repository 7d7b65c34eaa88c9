"""Reading a model: wrappers seen through, its family named or refused, never guessed."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from models import tiny_model
from peft import LoraConfig, get_peft_model

import layerswap
from layerswap.errors import UnknownSubstitutionError
from layerswap.model import decoder_layers, family_of, unwrap


@pytest.mark.slow  # torch.compile
def test_unwrap_sees_through_compile_and_data_parallel_but_peft_only_when_asked() -> None:
    model = tiny_model("llama", num_hidden_layers=1)
    assert unwrap(torch.compile(torch.nn.DataParallel(model))) is model
    assert unwrap(torch.compile(torch.nn.DataParallel(model)), parallel=False) is not model
    peft_model = get_peft_model(model, LoraConfig(target_modules=["q_proj"], r=2))
    assert unwrap(peft_model) is peft_model
    assert unwrap(peft_model, peft=True) is peft_model.get_base_model()


def test_decoder_layers_keep_the_names_the_caller_sees_through_peft() -> None:
    peft_model = get_peft_model(
        tiny_model("llama", num_hidden_layers=1), LoraConfig(target_modules=["q_proj"], r=2)
    )
    assert [name for name, _ in decoder_layers(peft_model)] == ["base_model.model.model.layers.0"]


def test_family_of_an_unknown_model_names_its_type_and_close_families() -> None:
    model = tiny_model("llama", num_hidden_layers=1)
    model.model.layers[0] = torch.nn.Identity()
    model.config.model_type = "lama"
    with pytest.raises(UnknownSubstitutionError, match=r"model_type 'lama'.*did you mean 'llama'"):
        family_of(model)


def test_family_of_an_uncovered_model_gives_coverages_reason_or_where_to_get_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from layerswap import verdicts

    monkeypatch.setenv("LAYERSWAP_CACHE", str(tmp_path))
    model = tiny_model("llama", num_hidden_layers=1)
    model.model.layers[0] = torch.nn.Identity()
    model.config.model_type = "qwen3_next"
    with pytest.raises(UnknownSubstitutionError, match=r"`layerswap coverage qwen3_next` says why"):
        family_of(model)
    # what `layerswap coverage` / `list --all` store, the error gives
    reason = "qwen3_next: decoder layers of different structure"
    key = verdicts.key_for("coverage", "qwen3_next")
    verdicts.write(key, {"model_type": "qwen3_next", "reason": reason}, kind="coverage")
    with pytest.raises(UnknownSubstitutionError) as refused:
        family_of(model)
    assert f"(model_type 'qwen3_next'): {reason}; did you mean" in str(refused.value)


def test_family_of_sees_through_data_parallel() -> None:
    model = tiny_model("qwen3", num_hidden_layers=1)
    assert family_of(torch.nn.DataParallel(model)) is layerswap.families()["qwen3"]


def test_close_names_are_decided_in_one_place() -> None:
    from layerswap.suggestions import close_names

    assert close_names("lama", ["llama", "gemma", "qwen3"]) == ["llama"]
    assert close_names("Llama", ["llama"], cutoff=0.99) == ["llama"]  # case alone
    assert close_names("llama", ["llama", "llama"]) == []  # never the name itself
    assert sorted(close_names("qwen", ["qwen2", "qwen3", "qwen3", 7, None])) == ["qwen2", "qwen3"]
    assert close_names("xyz", ["llama"]) == []
