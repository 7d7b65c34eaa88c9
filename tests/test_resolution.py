"""A name is resolved once, by the registry; below it the objects a substitution holds are used."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from models import text_vocab

import layerswap
from layerswap import slots
from layerswap.catalog import REGISTRY
from layerswap.errors import SubstitutionError, UnknownSubstitutionError
from layerswap.substitution import Substitution


def test_a_substitution_from_the_registry_holds_its_family_and_slot() -> None:
    sub = layerswap.get("llama.decoder.fused")
    assert sub.parts.family is layerswap.get_family("llama")
    assert sub.parts.slot is layerswap.get_slot("decoder")
    head = layerswap.get("llama.head.fused")
    assert head.parts.slot is layerswap.get_slot("head")
    assert layerswap.get("llama.decoder.te").devices == ("cuda",)


def test_a_changed_substitution_is_resolved_again_when_it_reaches_the_registry() -> None:
    sub = layerswap.get("llama.decoder.fused")
    moved = dataclasses.replace(sub, name="qwen3.decoder.moved", family="qwen3")
    assert moved.resolution() is None  # nothing is carried over from the one it came from
    assert layerswap.get(moved).parts.family is layerswap.get_family("qwen3")
    unknown = dataclasses.replace(sub, name="nothing.decoder.fused", family="nothing")
    with pytest.raises(UnknownSubstitutionError, match="nothing"):
        layerswap.get(unknown)


def test_options_keep_the_parts_a_substitution_holds() -> None:
    sub = layerswap.get("llama.decoder.te_fp8")
    assert sub.with_options(recipe="delayed").resolution() == sub.parts


@pytest.fixture
def found(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every class name a substitution resolves from here on, in order."""
    from layerswap import substitution

    names: list[str] = []
    real = substitution.resolve

    def counting(spec: str) -> Any:
        names.append(spec)
        return real(spec)

    monkeypatch.setattr(substitution, "resolve", counting)
    return names


def test_the_classes_are_found_once(found: list[str]) -> None:
    sub = dataclasses.replace(layerswap.get("llama.decoder.fused"), name="llama.decoder.once")
    for _ in range(3):
        assert sub.original_class().__name__ == "LlamaDecoderLayer"
    assert found == [sub.original]


def test_both_classes_are_found_together_once(found: list[str]) -> None:
    sub = dataclasses.replace(layerswap.get("llama.decoder.fused"), name="llama.decoder.both")
    original, replacement = sub.classes()
    assert (original, replacement) == (sub.original_class(), sub.replacement_class())
    assert original.__name__ == "LlamaDecoderLayer"
    assert issubclass(replacement, torch.nn.Module) and replacement is not original
    specs = [spec for spec in (sub.original, sub.replacement) if isinstance(spec, str)]
    assert found == specs  # each named class found once, by the first call
    sub.classes()
    assert found == specs


def test_classes_say_first_what_the_replacement_needs(monkeypatch: pytest.MonkeyPatch) -> None:
    from layerswap import substitution
    from layerswap.errors import RequirementError

    sub = layerswap.get("llama.decoder.te")
    if sub.unmet_requirement() is None:
        pytest.skip("TransformerEngine runs here: nothing is unmet")
    monkeypatch.setattr(substitution, "resolve", lambda spec: pytest.fail(f"resolved {spec}"))
    with pytest.raises(RequirementError, match="cannot run here"):
        sub.classes()


def test_swap_by_backend_asks_the_registry_once(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib

    swapping = importlib.import_module("layerswap.swap")
    asked: list[Any] = []
    real = swapping.get

    def counting(name: Any) -> Any:
        asked.append(name)
        return real(name)

    monkeypatch.setattr(swapping, "get", counting)
    model = layerswap.get_family("llama").build(seed=0)
    with pytest.raises(TypeError, match="not both"):
        layerswap.swap(model, "llama.decoder.fused", backend="fused")
    assert asked == []  # bad input: refused before anything is looked up
    with layerswap.swap(model, backend="fused") as handle:
        assert handle.substitution.name == "llama.decoder.fused"
    assert asked == ["llama.decoder.fused"]


def test_a_swap_looks_no_name_up_below_the_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    """Once ``get`` resolved it, swapping and undoing a substitution asks neither the
    registry nor the slot registry again: the slot, the proof and the weight code take the
    objects the substitution holds."""
    family = layerswap.get_family("llama")
    model = family.build(seed=0).eval()
    ids = torch.randint(1, text_vocab(family.tiny_config()), (2, 7))
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    sub = layerswap.get("llama.decoder.fused")

    asked: list[Any] = []
    inside: list[bool] = []

    def only_at_the_top(name: str, real: Any) -> Any:
        def lookup(*args: Any, **kwargs: Any) -> Any:
            assert inside, f"{name}: a name was looked up again below the registry"
            return real(*args, **kwargs)

        return lookup

    resolved = REGISTRY.resolved

    def at_the_top(given: Substitution) -> Substitution:
        asked.append(given)
        inside.append(True)
        try:
            return resolved(given)
        finally:
            inside.pop()

    monkeypatch.setattr(slots, "get_slot", only_at_the_top("get_slot", slots.get_slot))
    for method in ("get_family", "family", "backend_of", "parts_of"):
        monkeypatch.setattr(REGISTRY, method, only_at_the_top(method, getattr(REGISTRY, method)))
    monkeypatch.setattr(REGISTRY, "resolved", at_the_top)
    handle = layerswap.swap(model, sub)
    assert asked == [sub]  # swap() hands it to the registry once, at the top
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, expected)
    handle.undo()


def test_a_substitution_nobody_resolved_says_so_without_the_registry(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from layerswap import substitution

    made = Substitution(
        name="llama.decoder.bare",
        family="llama",
        backend="bare",
        original="transformers.models.llama.modeling_llama:LlamaDecoderLayer",
        replacement="transformers.models.llama.modeling_llama:LlamaDecoderLayer",
        converter=layerswap.get("llama.decoder.fused").converter,
    )
    monkeypatch.setattr(substitution, "_RESOLVE_PARTS", None)
    with pytest.raises(SubstitutionError, match=r"llama.decoder.bare is not resolved"):
        made.parts  # noqa: B018


@pytest.mark.parametrize(
    ("name", "now"),
    [
        ("original_of", "layerswap.backend"),
        ("check_layer_call", "layerswap.slots.layer_call"),
        ("call_parameters", "layerswap.slots.layer_call"),
        ("handled_parameters", "layerswap.slots.layer_call"),
    ],
)
def test_a_name_that_moved_out_of_substitution_is_found_there_with_a_warning(
    name: str, now: str
) -> None:
    import importlib

    from layerswap import substitution

    with pytest.warns(DeprecationWarning, match=f"moved to {now}.{name}"):
        found = getattr(substitution, name)
    assert found is getattr(importlib.import_module(now), name)
    with pytest.raises(AttributeError, match="no_such_name"):
        substitution.no_such_name  # noqa: B018
