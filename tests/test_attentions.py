"""output_attentions=True on fused layers returns the weights the original's eager attention
returns, in every way a model is asked for them; a layer that cannot compute them warns.
"""

from __future__ import annotations

import copy
import dataclasses
import warnings
from typing import Any

import pytest
import torch
from models import family, left_padded_batch, tiny_model, tokens
from torch import nn

import layerswap
from layerswap.errors import SwapWarning
from layerswap.swap import rebuild_originals

FAMILIES = ("llama", "qwen2", "qwen3")


def _eager(model: nn.Module) -> nn.Module:
    """The original with transformers' eager attention, which returns attention weights."""
    eager = copy.deepcopy(model)
    eager.set_attn_implementation("eager")
    return eager


def _swapped(model: nn.Module) -> nn.Module:
    swapped = copy.deepcopy(model)
    layerswap.swap(swapped, backend="fused")
    return swapped


def _assert_same(actual: tuple[torch.Tensor, ...], expected: tuple[torch.Tensor, ...]) -> None:
    assert len(actual) == len(expected) > 0
    for got, want in zip(actual, expected, strict=True):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=0)


@pytest.mark.parametrize("name", FAMILIES)
def test_weights_equal_the_originals_eager_attention_with_padding(name: str) -> None:
    original = tiny_model(name, num_hidden_layers=2)
    swapped = _swapped(original)
    batch = left_padded_batch(original.config.vocab_size)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error", SwapWarning)
        expected = _eager(original)(**batch, output_attentions=True)
        actual = swapped(**batch, output_attentions=True)
        plain = swapped(**batch)
    _assert_same(actual.attentions, expected.attentions)
    valid = batch["attention_mask"].bool()
    torch.testing.assert_close(actual.logits[valid], expected.logits[valid], atol=1e-5, rtol=0)
    torch.testing.assert_close(plain.logits[valid], actual.logits[valid], atol=1e-5, rtol=0)
    assert plain.attentions is None


def test_a_model_built_inside_use_returns_the_weights() -> None:
    spec = family("llama")
    with layerswap.use("llama.decoder.fused"):
        built = spec.build(spec.tiny_config(num_hidden_layers=2), seed=1)
    reference = copy.deepcopy(built)
    rebuild_originals(reference, "llama.decoder.fused")
    ids = tokens(built.config.vocab_size)
    with torch.no_grad():
        _assert_same(
            built(ids, output_attentions=True).attentions,
            _eager(reference)(ids, output_attentions=True).attentions,
        )


def test_generate_returns_the_weights_of_every_step() -> None:
    original = tiny_model("qwen3", num_hidden_layers=2)
    settings: dict[str, Any] = {
        "max_new_tokens": 3,
        "do_sample": False,
        "pad_token_id": 0,
        "output_attentions": True,
        "return_dict_in_generate": True,
    }
    batch = left_padded_batch(original.config.vocab_size, lengths=(7, 4))
    expected = _eager(original).generate(**batch, **settings).attentions
    actual = _swapped(original).generate(**batch, **settings).attentions
    assert len(actual) == len(expected) == 3
    for got, want in zip(actual, expected, strict=True):
        _assert_same(got, want)


def test_the_configs_output_attentions_is_honoured() -> None:
    # transformers allows config.output_attentions only with eager attention
    eager = _eager(tiny_model("qwen2", num_hidden_layers=2))
    swapped = _swapped(eager)
    eager.config.output_attentions = swapped.config.output_attentions = True
    ids = tokens(eager.config.vocab_size)
    with torch.no_grad():
        _assert_same(swapped(ids).attentions, eager(ids).attentions)


@pytest.mark.slow  # torch.compile
def test_layers_compiled_one_by_one_return_the_weights() -> None:
    original = tiny_model("llama", num_hidden_layers=2)
    swapped = _swapped(original)
    for layer in swapped.model.layers:
        layer.compile(backend="eager")
    ids = tokens(original.config.vocab_size)
    with torch.no_grad():
        _assert_same(
            swapped(ids, output_attentions=True).attentions,
            _eager(original)(ids, output_attentions=True).attentions,
        )
        assert swapped(ids).attentions is None


@pytest.mark.slow  # torch.compile
def test_compiled_model_returns_the_weights_without_more_breaks_than_the_original() -> None:
    original = tiny_model("llama", num_hidden_layers=2)
    swapped = _swapped(original)
    ids = tokens(original.config.vocab_size)
    counts = []
    for model in (original, swapped):
        torch._dynamo.reset()
        counts.append(torch._dynamo.explain(model)(ids, output_attentions=True).graph_break_count)
    assert counts[1] <= counts[0], counts
    torch._dynamo.reset()
    with torch.no_grad():
        compiled = torch.compile(swapped, backend="eager")
        _assert_same(
            compiled(ids, output_attentions=True).attentions,
            _eager(original)(ids, output_attentions=True).attentions,
        )


def test_a_layer_that_computes_no_weights_warns_naming_itself() -> None:
    sub = layerswap.get("llama.decoder.fused")

    class Blind(sub.replacement_class()):  # type: ignore[misc]
        records_attention_weights = False

    blind = dataclasses.replace(sub, name="llama.decoder.blind", replacement=Blind)
    model = tiny_model("llama", num_hidden_layers=1)
    layerswap.swap(model, blind)
    ids = tokens(model.config.vocab_size)
    with pytest.warns(SwapWarning, match="Blind does not compute attention weights"):
        model(ids, output_attentions=True)
