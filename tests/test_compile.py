"""torch.compile sees a swapped model as whole as the original: no extra graph breaks.

Each test measures the original model in the same test and compares: the claim is
"no worse than the original", on the first call of a freshly swapped or use()-built
model, not an absolute number that a transformers release may change.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from models import family, left_padded_batch, tiny_model, tokens
from torch import nn

import layerswap
from layerswap.comparison.gradients import gradients_to_original
from layerswap.swap import rebuild_originals

pytestmark = pytest.mark.slow  # torch.compile

FAMILIES = ("llama", "qwen2", "qwen3")


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> None:
    torch._dynamo.reset()


def _swapped(model: nn.Module) -> nn.Module:
    swapped = copy.deepcopy(model)
    layerswap.swap(swapped, backend="fused")
    return swapped


def _built_in_use(name: str) -> nn.Module:
    spec = family(name)
    with layerswap.use(f"{name}.decoder.fused"):
        return spec.build(spec.tiny_config(num_hidden_layers=1))


def _breaks(model: nn.Module, *args: torch.Tensor, **kwargs: object) -> tuple[int, int, list[str]]:
    torch._dynamo.reset()
    explained = torch._dynamo.explain(model)(*args, **kwargs)
    reasons = [str(reason.reason).splitlines()[0] for reason in explained.break_reasons]
    return explained.graph_count, explained.graph_break_count, reasons


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize(
    "make",
    [pytest.param(_swapped, id="swapped"), pytest.param(None, id="built-in-use")],
)
def test_no_graph_breaks_beyond_the_originals(
    name: str, make: Callable[[nn.Module], nn.Module] | None
) -> None:
    original = tiny_model(name, num_hidden_layers=1)
    candidate = make(original) if make is not None else _built_in_use(name)
    ids = tokens(original.config.vocab_size)
    for options in ({}, {"output_hidden_states": True}):
        graphs, breaks, _ = _breaks(original, ids, **options)
        # the candidate is measured fresh: its first compiled call counts
        cand_graphs, cand_breaks, reasons = _breaks(candidate, ids, **options)
        assert (cand_graphs, cand_breaks) <= (graphs, breaks), (options, reasons)


def test_repeated_calls_compile_no_more_frames_than_the_original() -> None:
    from torch._dynamo.testing import CompileCounter  # a second import of dynamo: not at collection

    original = tiny_model("llama", num_hidden_layers=1)
    counts = {}
    for label, model in (("original", original), ("swapped", _swapped(original))):
        torch._dynamo.reset()
        counter = CompileCounter()
        compiled = torch.compile(model, backend=counter)
        with torch.no_grad():
            for length in (6, 6, 6):
                compiled(tokens(original.config.vocab_size, (2, length)))
        counts[label] = counter.frame_count
    assert counts["swapped"] <= counts["original"], counts


@pytest.mark.parametrize("name", FAMILIES)
def test_hidden_states_under_compile_equal_eager(name: str) -> None:
    original = tiny_model(name, num_hidden_layers=1)
    swapped = _swapped(original)
    ids = tokens(original.config.vocab_size)
    with torch.no_grad():
        expected = original(ids, output_hidden_states=True).hidden_states
        compiled = torch.compile(swapped, backend="eager")
        actual = compiled(ids, output_hidden_states=True).hidden_states
    assert len(actual) == len(expected) == 2
    for got, want in zip(actual, expected, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("options", [{}, {"output_hidden_states": True}], ids=["plain", "hidden"])
def test_fullgraph_works_where_it_works_for_the_original(options: dict[str, bool]) -> None:
    original = tiny_model("llama", num_hidden_layers=1)
    ids = tokens(original.config.vocab_size)
    outcomes: dict[str, object] = {}
    for label, model in (("original", original), ("swapped", _swapped(original))):
        torch._dynamo.reset()
        try:
            with torch.no_grad():
                outcomes[label] = torch.compile(model, backend="eager", fullgraph=True)(
                    ids, **options
                ).logits
        except Exception as failure:  # the original's failure is the one expected
            outcomes[label] = type(failure)
    if isinstance(outcomes["original"], torch.Tensor):
        assert isinstance(outcomes["swapped"], torch.Tensor), outcomes["swapped"]
        torch.testing.assert_close(outcomes["swapped"], outcomes["original"], atol=1e-5, rtol=0)
    else:
        assert outcomes["swapped"] is outcomes["original"]


@pytest.mark.parametrize("name", FAMILIES)
def test_fullgraph_training_step_matches_the_original(name: str) -> None:
    first = tiny_model(name, num_hidden_layers=1).train()
    batch = left_padded_batch(first.config.vocab_size)
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    use_cache = {"use_cache": False}
    sub = layerswap.get(f"{name}.decoder.fused")
    built = _built_in_use(name).train()
    # its twin with original layers holding the same weights
    built_original = copy.deepcopy(built)
    rebuild_originals(built_original, sub)
    pairs = ((first, _swapped(first)), (built_original, built))
    for original, candidate in pairs:
        losses, grads = {}, {}
        for label, model in (("original", original), ("candidate", candidate)):
            model.zero_grad(set_to_none=True)
            torch._dynamo.reset()
            step = torch.compile(model, backend="aot_eager", fullgraph=True)
            loss = step(**batch, labels=labels, **use_cache).loss
            loss.backward()
            losses[label] = loss.detach()
            grads[label] = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        torch.testing.assert_close(losses["candidate"], losses["original"], atol=1e-5, rtol=0)
        mapped = gradients_to_original(candidate, grads["candidate"], sub)
        assert mapped.keys() == grads["original"].keys()
        for key, want in grads["original"].items():
            torch.testing.assert_close(mapped[key], want, atol=1e-5, rtol=1e-4, msg=key)


@pytest.mark.parametrize("name", FAMILIES)
def test_a_layer_compiled_on_its_own_breaks_no_more_than_the_original_layer(name: str) -> None:
    original = tiny_model(name, num_hidden_layers=1)
    swapped = _swapped(original)
    hidden = torch.randn(2, 6, original.config.hidden_size)
    positions = torch.arange(6).expand(2, -1)
    rotary = original.model.rotary_emb(hidden, positions)
    counts = []
    for model in (original, swapped):
        layer = model.model.layers[0]
        counts.append(_breaks(layer, hidden, attention_mask=None, position_embeddings=rotary)[:2])
    assert counts[1] <= counts[0], counts
