"""layerswap.adopt: a patch function's changes recorded, taken back object for object, proven."""

from __future__ import annotations

import importlib
import itertools
import runpy
import sys
import types
import warnings
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from transformers.activations import ACT2FN
from transformers.models.llama import modeling_llama

import layerswap
from layerswap.adoption.record import record
from layerswap.errors import (
    AdoptionError,
    PatchConflictWarning,
    PatchDivergenceError,
    PatchError,
    UnrecordableChangeError,
    VerificationError,
)
from layerswap.patching.sites import NOTSET

# --- an independent view of "as before": every entry by identity ------------------------------


def _entries(obj: Any) -> dict[str, Any]:
    return dict(object.__getattribute__(obj, "__dict__"))


def _items(container: Any) -> list[Any]:
    # the builtin's own view: a subclass's items() may compute (transformers' lazy mappings)
    if isinstance(container, OrderedDict):
        return list(OrderedDict.items(container))
    if isinstance(container, dict):
        return list(dict.items(container))
    return (
        list(list.__iter__(container))
        if isinstance(container, list)
        else sorted(map(id, container))
    )


def _containers(entries: dict[str, Any]) -> dict[str, Any]:
    return {
        key: (value, _items(value))
        for key, value in entries.items()
        if isinstance(value, (dict, list, set))
    }


def state_of(model: nn.Module | None = None) -> dict[str, Any]:
    """Every transformers module's and class's ``__dict__`` and, for ``model``, every
    submodule's ``__dict__``, class and containers (``_modules``, ``_parameters`` ...)."""
    state: dict[str, Any] = {}
    for name, module in list(sys.modules.items()):
        if not name.startswith("transformers") or not isinstance(module, types.ModuleType):
            continue
        entries = _entries(module)
        state[name] = (module, entries, _containers(entries))
        for value in entries.values():
            if isinstance(value, type) and value.__module__ == name:
                own = dict(value.__dict__)
                state[f"{name}.{value.__qualname__}"] = (value, own, _containers(own))
    if model is not None:
        for qualname, module in model.named_modules():
            entries = _entries(module)
            state[f"model:{qualname}"] = (module, entries, _containers(entries), type(module))
    return state


def _imported_submodule(owner: Any, key: str, value: Any) -> bool:
    return (
        isinstance(owner, types.ModuleType)
        and sys.modules.get(f"{owner.__name__}.{key}") is value is not None
    )


def differences(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    found = []
    for where, (obj, entries, containers, *cls) in before.items():
        now = after.get(where)
        if now is None or now[0] is not obj:
            found.append(f"{where}: another object")
            continue
        for key in set(entries) | set(now[1]):
            if key == "__slotnames__":  # copyreg's cache, written by deepcopy (the proof's)
                continue
            if key not in entries and _imported_submodule(obj, key, now[1][key]):
                continue  # an import binds a package's new submodule: kept, as imports are
            if entries.get(key, NOTSET) is not now[1].get(key, NOTSET):
                found.append(f"{where}.{key}")
        for key, (container, items) in containers.items():
            if now[1].get(key) is not container:
                continue  # reported above
            current = _items(container)
            same = len(current) == len(items) and all(
                (a[0] == b[0] and a[1] is b[1]) if isinstance(container, dict) else a is b or a == b
                for a, b in zip(current, items, strict=True)
            )
            if not same:
                found.append(f"{where}.{key} (contents)")
        if cls and type(obj) is not cls[0]:
            found.append(f"{where}: class")
    return found


@pytest.fixture
def model() -> nn.Module:
    return layerswap.get_family("llama").build(seed=0)


# --- hand-written patches -----------------------------------------------------------------------


class EquivalentRMSNorm(nn.Module):
    """LlamaRMSNorm written with torch's own rms_norm: the same numbers."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = (hidden_states.shape[-1],)
        normed = nn.functional.rms_norm(
            hidden_states.float(), shape, self.weight.float(), self.variance_epsilon
        )
        return normed.to(hidden_states.dtype)


class WrongEpsRMSNorm(EquivalentRMSNorm):
    """A port that forgot the config's epsilon: off by far more than rounding."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__(hidden_size, eps=1e-1)


def rebind_rms_norm() -> None:
    modeling_llama.LlamaRMSNorm = EquivalentRMSNorm


def rebind_rms_norm_wrong_eps() -> None:
    modeling_llama.LlamaRMSNorm = WrongEpsRMSNorm


def _silu_mlp(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


def patch_everything(model: nn.Module | None = None) -> None:
    """A class rebound, a method, descriptors, a registry entry and, given a model, an
    instance's forward, a buffer, a parameter and an instance's class."""
    modeling_llama.LlamaRMSNorm = EquivalentRMSNorm
    modeling_llama.LlamaMLP.forward = _silu_mlp
    type.__setattr__(modeling_llama.LlamaAttention, "helper", staticmethod(len))
    modeling_llama.new_global = object()
    ACT2FN["adopted_act"] = nn.Identity
    if model is not None:
        mlp = model.model.layers[0].mlp
        mlp.forward = types.MethodType(_silu_mlp, mlp)
        mlp.register_buffer("scale", torch.ones(1))
        mlp.register_parameter("extra", nn.Parameter(torch.zeros(1)))
        model.model.norm.__class__ = EquivalentRMSNorm
        model.model.layers[1].mlp = nn.Identity()


class HalfWay(RuntimeError):
    pass


def patch_then_raise(model: nn.Module | None = None) -> None:
    patch_everything(model)
    raise HalfWay("the patch failed after changing things")


# --- the recording engine -----------------------------------------------------------------------


def test_undo_puts_every_module_class_and_instance_back(model: nn.Module) -> None:
    before = state_of(model)
    layer1_mlp = model.model.layers[1].mlp
    children = list(model.model.layers[1]._modules)
    with layerswap.adopt(patch_everything, model=model, prove=False) as adoption:
        assert modeling_llama.LlamaRMSNorm is EquivalentRMSNorm
        assert type(model.model.norm) is EquivalentRMSNorm
        assert "scale" in model.model.layers[0].mlp._buffers
        assert differences(before, state_of(model))
    assert differences(before, state_of(model)) == []
    assert model.model.layers[1].mlp is layer1_mlp
    assert list(model.model.layers[1]._modules) == children  # the mlp at its position
    assert not adoption.active


def test_undo_after_an_exception_half_way_restores_and_reraises(model: nn.Module) -> None:
    before = state_of(model)
    with pytest.raises(HalfWay):
        layerswap.adopt(patch_then_raise, model=model, prove=False)
    assert differences(before, state_of(model)) == []
    assert "adopted_act" not in ACT2FN


def test_report_lists_each_change(model: nn.Module) -> None:
    with layerswap.adopt(patch_everything, model=model, prove=False) as adoption:
        changes = adoption.changes
        report = adoption.report()
    assert "transformers.models.llama.modeling_llama.LlamaRMSNorm: rebound" in changes
    assert "transformers.models.llama.modeling_llama.LlamaMLP.forward: rebound" in changes
    assert "transformers.models.llama.modeling_llama.LlamaAttention.helper: added" in changes
    assert "model.layers.0.mlp.forward: added" in changes
    assert "model.norm: class LlamaRMSNorm -> EquivalentRMSNorm" in changes
    assert any(line.startswith("model.layers.0.mlp._buffers: added 'scale'") for line in changes)
    assert any("ACT2FN" in line and "'adopted_act'" in line for line in changes)
    assert "not proven" in report and "undone" not in report


def test_undo_twice_is_a_no_op() -> None:
    before = state_of()
    adoption = layerswap.adopt(rebind_rms_norm, prove=False)
    adoption.undo()
    adoption.undo()
    assert differences(before, state_of()) == []


def test_undo_class_descriptors_are_the_same_objects() -> None:
    cls = modeling_llama.LlamaRotaryEmbedding
    raw = dict(cls.__dict__)
    descriptors = {k: v for k, v in raw.items() if isinstance(v, (staticmethod, classmethod))}
    assert descriptors, (
        "LlamaRotaryEmbedding holds a staticmethod (compute_default_rope_parameters)"
    )

    def rebind_descriptors() -> None:
        for name in descriptors:
            type.__setattr__(cls, name, staticmethod(lambda *a: None))
        del cls.forward

    with layerswap.adopt(rebind_descriptors, prove=False):
        assert "forward" not in cls.__dict__
    for name, value in descriptors.items():
        assert cls.__dict__[name] is value
    assert cls.__dict__["forward"] is raw["forward"]


def test_registry_mutated_in_place_is_refilled_in_order() -> None:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    act_items = list(ACT2FN.items())
    attention = dict(ALL_ATTENTION_FUNCTIONS._global_mapping)

    def register() -> None:
        ACT2FN["silu"] = nn.Identity  # replaced
        del ACT2FN["relu"]
        ACT2FN["adopted_act"] = nn.Identity
        ALL_ATTENTION_FUNCTIONS.register("adopted_attention", lambda *a, **k: None)

    with layerswap.adopt(register, prove=False):
        assert "adopted_attention" in ALL_ATTENTION_FUNCTIONS
    assert list(ACT2FN.items()) == act_items
    assert all(a[1] is b[1] for a, b in zip(ACT2FN.items(), act_items, strict=True))
    assert dict(ALL_ATTENTION_FUNCTIONS._global_mapping) == attention


@pytest.mark.parametrize("order", ["newest first", "oldest first"])
def test_two_adoptions_of_one_registry_end_in_any_order(order: str) -> None:
    """Two adoptions setting, adding and removing items of one registry: while both
    are live the newest's item shows; ending either one first leaves the other's items
    in place, and once both have ended the registry holds exactly its own items, in
    order (an older adoption ended first put its own copy back, and the newer one's
    end then brought the older one's item back for good)."""
    items = list(ACT2FN.items())

    def raw(key: str) -> Any:  # ACT2FN's own lookup builds an instance of the class held
        return dict.get(ACT2FN, key)

    def first() -> None:
        ACT2FN["silu"] = nn.Identity
        ACT2FN["first_act"] = nn.Identity
        del ACT2FN["relu"]

    def second() -> None:
        ACT2FN["silu"] = nn.Tanh
        ACT2FN["second_act"] = nn.Tanh

    older = layerswap.adopt(first, prove=False)
    newer = layerswap.adopt(second, prove=False)
    try:
        assert raw("silu") is nn.Tanh and "relu" not in ACT2FN
        with older.suspended():  # the older one's items taken back, the newer one's kept
            assert raw("silu") is nn.Tanh and raw("relu") is dict(items)["relu"]
            assert "first_act" not in ACT2FN and "second_act" in ACT2FN
        # made again under the newer one, where it was
        assert raw("silu") is nn.Tanh and "relu" not in ACT2FN and "first_act" in ACT2FN
        ended, kept = (newer, older) if order == "newest first" else (older, newer)
        ended.undo()
        if kept is older:
            assert raw("silu") is nn.Identity and "first_act" in ACT2FN
            assert "second_act" not in ACT2FN and "relu" not in ACT2FN
        else:
            assert raw("silu") is nn.Tanh and "second_act" in ACT2FN
            assert "first_act" not in ACT2FN and raw("relu") is dict(items)["relu"]
        kept.undo()
    finally:
        newer.undo()
        older.undo()
    assert [key for key, _ in ACT2FN.items()] == [key for key, _ in items]
    assert all(a[1] is b[1] for a, b in zip(ACT2FN.items(), items, strict=True))


def _put_in(container: Any, item: Any) -> None:
    if isinstance(container, list):
        container.append(item)
    else:
        container.add(item)


@pytest.mark.parametrize("ended", ["oldest first", "newest first"])
@pytest.mark.parametrize("kind", ["list", "set"])
def test_two_adoptions_changing_one_list_or_set_end_in_any_order(
    make_module, kind: str, ended: str
) -> None:
    """Two adoptions changing one list (or set) of a watched module in place: the older
    one suspended or ended first takes back its own edit and keeps the newer one's item,
    and ending both, in either order, leaves the very items back, in order (each was
    refilled whole from its own copy: the older one's end dropped the newer one's item,
    and the newer one's end brought the older one's back for good)."""
    name = make_module("contents", "HOOKS = [min, max, abs]\nNAMES = {'min', 'max'}\n")
    module = importlib.import_module(name)
    held = module.HOOKS if kind == "list" else module.NAMES
    items = list(held) if kind == "list" else set(held)
    old, mine, theirs = (min, len, repr) if kind == "list" else ("min", "len", "repr")

    def watched(body: Any) -> Any:
        body.__module__ = name  # the module's contents are watched: it is the function's
        return body

    @watched
    def older_change() -> None:
        held.remove(old)
        _put_in(held, mine)

    @watched
    def newer_change() -> None:
        _put_in(held, theirs)

    older = layerswap.adopt(older_change, prove=False)
    newer = layerswap.adopt(newer_change, prove=False)
    try:
        with older.suspended():
            assert old in held and mine not in held and theirs in held
        assert old not in held and mine in held and theirs in held
        if ended == "oldest first":
            older.undo()
            assert old in held and mine not in held and theirs in held
            if kind == "list":
                assert held == [min, max, abs, repr]
        else:
            newer.undo()
            assert old not in held and mine in held and theirs not in held
    finally:
        older.undo()
        newer.undo()
    assert module.HOOKS is held or module.NAMES is held
    if kind == "list":
        assert len(held) == len(items) and all(a is b for a, b in zip(held, items, strict=True))
    else:
        assert held == items


def _registry_state() -> list[list[tuple[str, int]]]:
    # ACT2FN is an OrderedDict: its own order and the dict's underneath, both
    return [
        [(key, id(value)) for key, value in dict.items(ACT2FN)],
        [(key, id(value)) for key, value in OrderedDict.items(ACT2FN)],
    ]


def _move_gelu_and_add(key: str) -> Any:
    def change() -> None:
        ACT2FN.pop("gelu")
        ACT2FN["gelu"] = nn.Identity  # to the end
        ACT2FN[key] = nn.Tanh

    change.__module__ = "transformers.activations"
    return change


@pytest.mark.parametrize("ended", list(itertools.permutations(range(3))), ids=str)
def test_adoptions_reordering_one_registry_end_in_any_order(ended: tuple[int, ...]) -> None:
    """A pops ``gelu``, sets it again to ``nn.Identity`` (to the end) and adds an item;
    B adds another; C does what A did, which under A only reorders the registry. Ended in
    any order, the registry holds its own items, by identity and in order (a reorder was
    refilled whole from its own copy: C ended after A put A's ``gelu`` back for good)."""
    before = _registry_state()
    gelu = dict.get(ACT2FN, "gelu")

    def add_b() -> None:
        ACT2FN["property_act_b"] = nn.Tanh

    add_b.__module__ = "transformers.activations"
    adoptions = []
    try:
        adoptions.append(layerswap.adopt(_move_gelu_and_add("property_act_a"), prove=False))
        assert list(ACT2FN)[-2:] == ["gelu", "property_act_a"]  # as the function left it
        adoptions.append(layerswap.adopt(add_b, prove=False))
        adoptions.append(layerswap.adopt(_move_gelu_and_add("property_act_a"), prove=False))
        assert adoptions[2].changes == ["transformers.activations.ACT2FN: reordered"]
        assert list(ACT2FN)[-3:] == ["property_act_a", "property_act_b", "gelu"]
        for index in ended:
            adoptions[index].undo()
            # C changed no value: gelu is A's while A is in effect, its own after
            assert dict.get(ACT2FN, "gelu") is (nn.Identity if adoptions[0].active else gelu)
            assert ("property_act_b" in ACT2FN) is adoptions[1].active
    finally:
        for adoption in adoptions:
            adoption.undo()
    assert dict.get(ACT2FN, "gelu") is gelu
    assert _registry_state() == before


@pytest.mark.parametrize("first", ["adopt", "patch_dict"])
@pytest.mark.parametrize("ended", ["undo, stop", "stop, undo"])
def test_a_reordering_adoption_and_a_patch_dict_end_in_any_order(first: str, ended: str) -> None:
    """An adoption reordering a registry and a ``patch_dict`` in whose block a key is
    removed, started and ended in either order: whichever is left keeps its doing (the
    dict patch's end put its snapshot's order over the adoption's, a foreign write), and
    the registry comes back in its own order."""
    before = _registry_state()
    order = [key for key in ACT2FN if key != "relu"]
    moved = [key for key in order if key != "gelu"] + ["gelu", "property_act_a"]
    dict_patch = layerswap.patch_dict(ACT2FN)  # "relu" removed in its block, below
    adoption = None
    with warnings.catch_warnings():
        warnings.simplefilter("error", PatchConflictWarning)
        try:
            if first == "patch_dict":
                dict_patch.start()
                del ACT2FN["relu"]
            adoption = layerswap.adopt(_move_gelu_and_add("property_act_a"), prove=False)
            if first == "adopt":
                dict_patch.start()
                del ACT2FN["relu"]
            assert list(ACT2FN) == moved
            if ended == "undo, stop":
                adoption.undo()
                assert list(ACT2FN) == order
                dict_patch.stop()
            else:
                dict_patch.stop()
                assert [key for key in ACT2FN if key != "relu"] == moved and "relu" in ACT2FN
                adoption.undo()
        finally:
            if dict_patch.is_active:
                dict_patch.stop()
            if adoption is not None:
                adoption.undo()
    assert _registry_state() == before


@pytest.mark.parametrize("last", ["older first", "newer first"])
def test_a_dict_patch_after_an_ended_adoption_comes_back_whatever_stops_first(last: str) -> None:
    """An adoption of a registry entry ended while a ``patch_dict`` of the same registry
    it is older than was live, then a second ``patch_dict`` setting that entry: ended in
    either order, the entry comes back. The first patch's snapshot held the adoption's
    value and its hold of the key, and handed both to the second, whose end then left
    its own value in the registry for good."""
    before = _registry_state()
    relu = dict.get(ACT2FN, "relu")

    def sigmoid_relu() -> None:
        ACT2FN["relu"] = nn.Sigmoid

    sigmoid_relu.__module__ = "transformers.activations"
    adoption = layerswap.adopt(sigmoid_relu, prove=False)
    older = layerswap.patch_dict(ACT2FN, {"tanh": nn.Tanh})
    newer = layerswap.patch_dict(ACT2FN, {"relu": nn.ReLU6})
    try:
        older.start()
        adoption.undo()
        assert dict.get(ACT2FN, "relu") is relu
        newer.start()
        for patch in (older, newer) if last == "older first" else (newer, older):
            patch.stop()
    finally:
        for patch in (older, newer):
            if patch.is_active:
                patch.stop()
        adoption.undo()
    assert dict.get(ACT2FN, "relu") is relu
    assert _registry_state() == before


@pytest.mark.parametrize("order", list(itertools.permutations(range(3))))
def test_an_adoption_begun_after_another_ended_under_dict_patches_ends_in_any_order(
    order: tuple[int, ...],
) -> None:
    """A registry key an adoption held when a ``patch_dict`` started, that adoption ended,
    a newer dict patch, then a second adoption of that key: ended in any order, the key
    comes back (the first patch handed on the second adoption's value as the one before,
    which its stack then kept), and a key the first adoption removed comes back at its
    place."""
    before = _registry_state()

    def setting(key: str, value: Any) -> Any:
        def change() -> None:
            if value is None:
                ACT2FN.pop(key)
            else:
                ACT2FN[key] = value

        change.__module__ = "transformers.activations"
        return change

    first = layerswap.adopt(setting("relu", nn.Sigmoid), prove=False)
    removed = layerswap.adopt(setting("tanh", None), prove=False)
    older = layerswap.patch_dict(ACT2FN, {})
    older.start()
    first.undo()
    removed.undo()
    newer = layerswap.patch_dict(ACT2FN, {"tanh": nn.Identity})
    newer.start()
    second = layerswap.adopt(setting("relu", nn.Hardtanh), prove=False)
    live = [older, newer, second]
    try:
        for index in order:
            thing = live[index]
            thing.undo() if isinstance(thing, layerswap.Adoption) else thing.stop()
    finally:
        for thing in live:
            if isinstance(thing, layerswap.Adoption):
                thing.undo()
            elif thing.is_active:
                thing.stop()
    assert _registry_state() == before


@pytest.mark.parametrize(
    "case",
    [
        "adopt, patch_dict, undo, stop",
        "patch_dict, adopt, stop, undo",
        "patch_dict of the same key, adopt, stop, undo",
    ],
)
def test_an_adoption_and_a_patch_dict_of_one_registry_end_in_any_order(case: str) -> None:
    """An adoption changing registry items and a ``patch_dict`` of the same registry,
    ended in either order, leave it exactly as it was (the dict patch's snapshot put the
    ended adoption's items back for good, or the adoption's end put back the dict
    patch's value)."""
    items = list(dict.items(ACT2FN))

    def change() -> None:
        ACT2FN["silu"] = nn.Identity
        ACT2FN["adopted_act"] = nn.Identity
        del ACT2FN["gelu_new"]

    key = "silu" if case.startswith("patch_dict of the same key") else "relu"
    dict_patch = layerswap.patch_dict(ACT2FN, {key: nn.Tanh})
    try:
        if case.startswith("adopt"):
            adoption = layerswap.adopt(change, prove=False)
            dict_patch.start()
            adoption.undo()
            assert dict.get(ACT2FN, "relu") is nn.Tanh and "adopted_act" not in ACT2FN
            dict_patch.stop()
        else:
            dict_patch.start()
            adoption = layerswap.adopt(change, prove=False)
            dict_patch.stop()
            assert dict.get(ACT2FN, "silu") is nn.Identity and "gelu_new" not in ACT2FN
            adoption.undo()
    finally:
        if dict_patch.is_active:
            dict_patch.stop()
    assert [(k, id(v)) for k, v in dict.items(ACT2FN)] == [(k, id(v)) for k, v in items]


def test_a_patch_dict_setting_an_adopted_key_is_refused_changing_nothing() -> None:
    items = list(dict.items(ACT2FN))

    def change() -> None:
        ACT2FN["silu"] = nn.Identity

    with layerswap.adopt(change, prove=False):
        with pytest.raises(PatchError, match=r"'silu'.*held by live patches"):
            layerswap.patch_dict(ACT2FN, {"relu": nn.Tanh, "silu": nn.Tanh}).start()
        assert dict.get(ACT2FN, "relu") is dict(items)["relu"]
    assert [(k, id(v)) for k, v in dict.items(ACT2FN)] == [(k, id(v)) for k, v in items]


def test_two_adoptions_replacing_one_child_module_end_in_any_order(model: nn.Module) -> None:
    """A model's child replaced by two adoptions (its ``_modules`` entry): ending the
    older one first leaves the newer one's child, and the original child comes back,
    at its place among its siblings, once both have ended."""
    layer = model.model.layers[1]
    mlp, order = layer.mlp, list(layer._modules)
    first, second = nn.Identity(), nn.Identity()

    def replace_with(child: nn.Module) -> Any:
        def patch(model: nn.Module) -> None:
            model.model.layers[1].mlp = child

        return patch

    older = layerswap.adopt(replace_with(first), model=model, prove=False)
    newer = layerswap.adopt(replace_with(second), model=model, prove=False)
    try:
        older.undo()
        assert layer.mlp is second
    finally:
        newer.undo()
        older.undo()
    assert layer.mlp is mlp and list(layer._modules) == order


def test_module_first_imported_by_the_patch_is_put_back_and_stays_imported(make_module) -> None:
    name = make_module("patched_on_import", "class Norm:\n    pass\nVALUE = 1\n")

    def import_and_patch() -> None:
        module = __import__(name)
        module.Norm = EquivalentRMSNorm
        module.VALUE = 2

    with layerswap.adopt(import_and_patch, prove=False) as adoption:
        assert sys.modules[name].VALUE == 2
    module = sys.modules[name]
    assert module.VALUE == 1 and module.Norm.__name__ == "Norm"
    assert f"{name}.Norm: rebound" in adoption.changes


def test_a_modeling_module_replaced_whole_is_put_back_on_its_package_too() -> None:
    """A function that puts another module object in ``sys.modules`` and on its
    package (a patched copy of the modeling module) is undone in both places: the
    package's name for the module was left pointing at the copy."""
    import transformers.models.llama as package

    def replace_module() -> None:
        copy = types.ModuleType(modeling_llama.__name__)
        copy.__dict__.update(modeling_llama.__dict__)
        sys.modules[modeling_llama.__name__] = copy
        package.modeling_llama = copy

    adoption = layerswap.adopt(replace_module, prove=False)
    assert package.modeling_llama is not modeling_llama
    adoption.undo()
    assert sys.modules[modeling_llama.__name__] is modeling_llama
    assert package.modeling_llama is modeling_llama


def test_code_changed_inside_a_decorator_or_on_tensor_is_recorded() -> None:
    """What a decorator wraps (``inspect.unwrap(LlamaModel.forward)``, reached only
    through ``__wrapped__``) and ``torch.Tensor``'s methods are watched: a patch changing
    the inner function's defaults, or rebinding a tensor method, is listed and undone."""
    import inspect

    inner = inspect.unwrap(modeling_llama.LlamaModel.forward)
    defaults = inner.__defaults__
    assert inner is not modeling_llama.LlamaModel.forward and defaults is not None
    softmax = torch.Tensor.softmax

    def patch() -> None:
        inner.__defaults__ = tuple(list(defaults))  # equal, and another object
        torch.Tensor.softmax = lambda self, dim: softmax(self, dim)

    with layerswap.adopt(patch, prove=False) as adoption:
        assert torch.Tensor.softmax is not softmax
    assert inner.__defaults__ is defaults and torch.Tensor.softmax is softmax
    changes = "\n".join(adoption.changes)
    assert any(
        "LlamaModel.forward.__wrapped__" in line and line.endswith("__defaults__ replaced")
        for line in adoption.changes
    ), changes
    assert "torch.Tensor.softmax: added" in changes, changes  # over TensorBase's


def test_submodule_bound_by_an_import_stays(make_module, tmp_path) -> None:
    package = make_module("package", "")
    (tmp_path / f"{package}.py").unlink()
    (tmp_path / package).mkdir()
    (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / package / "modeling.py").write_text("X = 1\n")
    __import__(package)

    def import_submodule() -> None:
        __import__(f"{package}.modeling")
        sys.modules[f"{package}.modeling"].X = 2

    with layerswap.adopt(import_submodule, prove=False) as adoption:
        pass
    assert adoption.changes == [f"{package}.modeling.X: rebound"]
    assert sys.modules[package].modeling is sys.modules[f"{package}.modeling"]
    assert sys.modules[package].modeling.X == 1
    sys.modules.pop(f"{package}.modeling", None)


def test_weight_changed_in_place_is_refused_and_the_rest_taken_back(model: nn.Module) -> None:
    before = state_of(model)

    def scale_weights(model: nn.Module) -> None:
        modeling_llama.LlamaRMSNorm = EquivalentRMSNorm
        with torch.no_grad():
            model.lm_head.weight.mul_(1.0)

    with pytest.raises(UnrecordableChangeError, match=r"lm_head\.weight"):
        layerswap.adopt(scale_weights, model=model, prove=False)
    assert differences(before, state_of(model)) == []


@pytest.mark.parametrize("first", ["patch", "adoption"])
def test_nests_with_engine_patches_stopped_in_any_order(first: str) -> None:
    original = modeling_llama.LlamaRMSNorm
    patch = layerswap.patch(modeling_llama, "LlamaRMSNorm", WrongEpsRMSNorm)
    patch.start()
    adoption = layerswap.adopt(rebind_rms_norm, prove=False)
    assert modeling_llama.LlamaRMSNorm is EquivalentRMSNorm
    if first == "patch":
        patch.stop()
        assert modeling_llama.LlamaRMSNorm is EquivalentRMSNorm
        adoption.undo()
    else:
        adoption.undo()
        assert modeling_llama.LlamaRMSNorm is WrongEpsRMSNorm
        patch.stop()
    assert modeling_llama.LlamaRMSNorm is original


def test_record_takes_back_when_asked_and_can_apply_again() -> None:
    original = modeling_llama.LlamaRMSNorm
    recording, _ = record(rebind_rms_norm, (), {})
    with recording.suspended():
        assert modeling_llama.LlamaRMSNorm is original
    assert modeling_llama.LlamaRMSNorm is EquivalentRMSNorm
    recording.undo()
    assert modeling_llama.LlamaRMSNorm is original


class Descriptors:
    """Every kind of class attribute a patch may rebind, kept by identity."""

    @staticmethod
    def static() -> int:
        return 1

    @classmethod
    def klass(cls) -> int:
        return 2

    @property
    def prop(self) -> int:
        return 3

    def method(self) -> int:
        return 4


class SubDescriptors(Descriptors):
    pass


@pytest.mark.parametrize("cls", [Descriptors, SubDescriptors], ids=["class", "subclass"])
def test_undo_descriptors_of_a_class_and_its_subclass(cls: type) -> None:
    raw = dict(cls.__dict__)

    def rebind() -> None:
        cls.static = staticmethod(lambda: -1)
        cls.klass = classmethod(lambda c: -2)
        cls.prop = property(lambda self: -3)
        cls.method = lambda self: -4

    with layerswap.adopt(rebind, prove=False):
        assert (cls.static(), cls.klass(), cls().prop, cls().method()) == (-1, -2, -3, -4)
    assert dict(cls.__dict__).keys() == raw.keys()
    assert all(cls.__dict__[name] is value for name, value in raw.items())
    assert (cls.static(), cls.klass(), cls().prop, cls().method()) == (1, 2, 3, 4)


@pytest.mark.parametrize("order", ["first-first", "last-first"])
def test_two_adoptions_of_one_name_undone_in_any_order(order: str) -> None:
    original = modeling_llama.LlamaRMSNorm
    first = layerswap.adopt(rebind_rms_norm, prove=False)
    second = layerswap.adopt(rebind_rms_norm_wrong_eps, prove=False)
    assert modeling_llama.LlamaRMSNorm is WrongEpsRMSNorm
    if order == "first-first":
        first.undo()
        assert modeling_llama.LlamaRMSNorm is WrongEpsRMSNorm
        second.undo()
    else:
        second.undo()
        assert modeling_llama.LlamaRMSNorm is EquivalentRMSNorm
        first.undo()
    assert modeling_llama.LlamaRMSNorm is original


@pytest.mark.parametrize("ended", ["oldest first", "newest first"])
@pytest.mark.parametrize("first", ["delete", "rebind"])
def test_a_name_deleted_and_rebound_by_two_adoptions_comes_back_in_any_order(
    make_module, first: str, ended: str
) -> None:
    """One adoption deleting a module's name and another rebinding it (either first):
    ending the older one first leaves the newer one's doing, and ending both, in either
    order, brings the very object back (a deletion was put back raw, outside the
    engine's stack: the older one's end wrote over the newer one, and the newer one's
    end then put back what the older one had left, or removed the name)."""
    module = importlib.import_module(make_module("deleted_name", "VALUE = object()\n"))
    original = module.VALUE

    def delete() -> None:
        del module.VALUE

    def rebind() -> None:
        module.VALUE = "rebound"

    shows = {"delete": NOTSET, "rebind": "rebound"}
    second = "rebind" if first == "delete" else "delete"
    older = layerswap.adopt(delete if first == "delete" else rebind, prove=False)
    newer = layerswap.adopt(rebind if first == "delete" else delete, prove=False)
    try:
        assert module.__dict__.get("VALUE", NOTSET) == shows[second]
        if ended == "oldest first":
            older.undo()
            assert module.__dict__.get("VALUE", NOTSET) == shows[second]
        else:
            newer.undo()
            assert module.__dict__.get("VALUE", NOTSET) == shows[first]
    finally:
        older.undo()
        newer.undo()
    assert module.__dict__.get("VALUE", NOTSET) is original


def test_a_foreign_write_while_adopted_warns_and_the_original_comes_back() -> None:
    original = modeling_llama.LlamaRMSNorm
    adoption = layerswap.adopt(rebind_rms_norm, prove=False)
    modeling_llama.LlamaRMSNorm = WrongEpsRMSNorm  # someone else, behind layerswap's back
    with pytest.warns(PatchConflictWarning, match="LlamaRMSNorm"):
        adoption.undo()
    assert modeling_llama.LlamaRMSNorm is original


def test_keyboard_interrupt_half_way_is_taken_back(model: nn.Module) -> None:
    before = state_of(model)

    def interrupted(model: nn.Module) -> None:
        patch_everything(model)
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        layerswap.adopt(interrupted, model=model, prove=False)
    assert differences(before, state_of(model)) == []


def test_a_replaced_sys_modules_entry_is_put_back() -> None:
    name = "transformers.models.llama.modeling_llama"

    def replace_module() -> None:
        sys.modules[name] = types.ModuleType(name)

    with layerswap.adopt(replace_module, prove=False) as adoption:
        assert sys.modules[name] is not modeling_llama
    assert sys.modules[name] is modeling_llama
    assert f"sys.modules[{name!r}]: replaced" in adoption.changes


def test_a_function_code_replaced_in_place_is_put_back() -> None:
    forward = modeling_llama.LlamaMLP.forward
    code, defaults = forward.__code__, forward.__defaults__

    def swap_code() -> None:
        forward.__code__ = _silu_mlp.__code__

    with layerswap.adopt(swap_code, prove=False) as adoption:
        assert forward.__code__ is _silu_mlp.__code__
    assert forward.__code__ is code and forward.__defaults__ is defaults
    assert "transformers.models.llama.modeling_llama.LlamaMLP.forward: __code__ replaced" in (
        adoption.changes
    )


# --- the proof ---------------------------------------------------------------------------------


def test_an_equivalent_patch_is_proven_and_kept() -> None:
    config = layerswap.get_family("llama").tiny_config()
    with layerswap.adopt(rebind_rms_norm, config=config) as adoption:
        assert adoption.proven == "llama"
        assert modeling_llama.LlamaRMSNorm is EquivalentRMSNorm
        built = layerswap.get_family("llama").build(config)
        assert isinstance(built.model.norm, EquivalentRMSNorm)
    assert modeling_llama.LlamaRMSNorm is not EquivalentRMSNorm


def _gate_up_in_one_matmul(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    # the fused layers' MLP: gate and up as one matmul; float32 rounds it as the original
    # does to 1e-7, bfloat16 to its own last bit
    weight = torch.cat([self.gate_proj.weight, self.up_proj.weight])
    gate, up = nn.functional.linear(x, weight).chunk(2, dim=-1)
    return self.down_proj(nn.functional.silu(gate) * up)


def fuse_gate_up() -> None:
    modeling_llama.LlamaMLP.forward = _gate_up_in_one_matmul


def test_an_equivalent_patch_adopted_inside_autocast_is_proven_in_float32() -> None:
    """Adopted inside the caller's ``torch.autocast`` (a training script's bf16 region):
    the checks run with autocast off, so a patch equal to the original in float32 is
    proven, not refused for the autocast dtype's rounding."""
    config = layerswap.get_family("llama").tiny_config()
    with (
        torch.autocast("cpu", dtype=torch.bfloat16),
        layerswap.adopt(fuse_gate_up, config=config) as adoption,
    ):
        assert adoption.proven == "llama"
        assert torch.is_autocast_enabled("cpu")  # the caller's region, as it was


def test_the_family_is_found_from_the_modeling_module_the_patch_changed() -> None:
    with layerswap.adopt(rebind_rms_norm) as adoption:
        assert adoption.proven == "llama"


def test_the_family_is_found_past_changes_to_the_auto_mappings() -> None:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    def rebind_and_register() -> None:
        rebind_rms_norm()
        CONFIG_MAPPING._extra_content["adopted_kind"] = object  # as a lazy lookup caches

    with layerswap.adopt(rebind_and_register) as adoption:
        assert adoption.proven == "llama"
    assert "adopted_kind" not in CONFIG_MAPPING._extra_content


def test_a_wrong_epsilon_is_refused_naming_the_first_layer() -> None:
    before = state_of()
    config = layerswap.get_family("llama").tiny_config()
    with pytest.raises(PatchDivergenceError, match=r"model\.layers\.0") as refused:
        layerswap.adopt(rebind_rms_norm_wrong_eps, config=config)
    assert refused.value.layer == "model.layers.0"
    assert isinstance(refused.value, VerificationError)
    assert differences(before, state_of()) == []


def _norm_off_in_bfloat16(model: Any = None) -> None:
    original = modeling_llama.LlamaRMSNorm.forward

    def forward(self: Any, hidden_states: torch.Tensor) -> torch.Tensor:
        out = original(self, hidden_states)
        return out * 1.5 if hidden_states.dtype == torch.bfloat16 else out

    modeling_llama.LlamaRMSNorm.forward = forward


@pytest.mark.parametrize("given", ["model", "config"])
def test_a_patch_wrong_only_in_the_models_bfloat16_is_refused(given: str) -> None:
    """A patch computing otherwise only in bfloat16, adopted for a model in bfloat16 (or
    a config saying so), is proven in bfloat16 too and refused naming it; adopted for a
    float32 model it passes (the float32 checks cannot see it)."""
    model = layerswap.get_family("llama").build(seed=0)
    config = layerswap.get_family("llama").tiny_config()
    config.dtype = torch.bfloat16
    where = {"model": model.to(torch.bfloat16)} if given == "model" else {"config": config}
    model(input_ids=torch.arange(3, 9).reshape(1, 6))  # transformers' lazy registries filled
    before = state_of()
    with pytest.raises(PatchDivergenceError, match="forward in bfloat16") as refused:
        layerswap.adopt(_norm_off_in_bfloat16, **where)
    assert refused.value.check == "forward in bfloat16"
    assert differences(before, state_of()) == []
    adoption = layerswap.adopt(_norm_off_in_bfloat16, model=layerswap.get_family("llama").build())
    assert "forward in bfloat16" not in adoption.checks
    adoption.undo()


def _norm_off_under_autocast(model: Any = None) -> None:
    original = modeling_llama.LlamaRMSNorm.forward

    def forward(self: Any, hidden_states: torch.Tensor) -> torch.Tensor:
        out = original(self, hidden_states)
        return out * 1.5 if torch.is_autocast_enabled(hidden_states.device.type) else out

    modeling_llama.LlamaRMSNorm.forward = forward


@pytest.mark.parametrize("given", ["model", "config"])
def test_a_patch_wrong_only_under_autocast_adopted_inside_autocast_is_refused(given: str) -> None:
    """Adopted inside ``torch.autocast`` (for a model, or a config), a patch is proven
    under autocast too and refused naming it, changing nothing; adopted outside, it
    passes (the other checks run with autocast off and cannot see it)."""
    model = layerswap.get_family("llama").build(seed=0)
    where = {"model": model} if given == "model" else {"config": model.config}
    model(input_ids=torch.arange(3, 9).reshape(1, 6))  # transformers' lazy registries filled
    before = state_of()
    with (
        torch.autocast("cpu", dtype=torch.bfloat16),
        pytest.raises(PatchDivergenceError, match="under autocast to bfloat16") as refused,
    ):
        layerswap.adopt(_norm_off_under_autocast, **where)
    assert refused.value.check == "forward under autocast to bfloat16"
    assert differences(before, state_of()) == []
    adoption = layerswap.adopt(_norm_off_under_autocast, **where)
    assert not any("autocast" in check for check in adoption.checks), adoption.checks
    adoption.undo()


class _DoubledWeightGradient(torch.autograd.Function):
    """``w * x / rms(x)`` with a hand-written backward (as Liger's kernels have) whose
    weight gradient is twice what it should be; the input gradient is right."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(normed, weight, torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))
        return weight * normed

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        normed, weight, rstd = ctx.saved_tensors
        scaled = grad * weight
        grad_x = rstd * (scaled - normed * (scaled * normed).mean(-1, keepdim=True))
        grad_w = 2.0 * (grad * normed).reshape(-1, normed.shape[-1]).sum(0)
        return grad_x, grad_w, None


def test_a_patch_computing_its_weights_gradients_wrong_is_refused() -> None:
    """The proof's backward check compares every parameter's gradient, not only those of
    the embeddings and the head: an RMSNorm kernel whose weight gradient is wrong passes a
    right gradient down, and is refused all the same."""

    class WrongGradientNorm(nn.Module):
        def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.ones(hidden_size))
            self.variance_epsilon = eps

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out = _DoubledWeightGradient.apply(x.float(), self.weight, self.variance_epsilon)
            return out.to(x.dtype)  # type: ignore[no-any-return]

    def rebind_norm() -> None:
        modeling_llama.LlamaRMSNorm = WrongGradientNorm

    family = layerswap.get_family("llama")
    family.build()(torch.tensor([[1, 2, 3]]))  # transformers' own first-run caches, filled
    before = state_of()
    config = family.tiny_config()
    with pytest.raises(PatchDivergenceError, match=r"backward differs \(.*layernorm\.weight"):
        layerswap.adopt(rebind_norm, config=config)
    assert differences(before, state_of()) == []


def test_a_patch_from_layer_2_on_is_refused_naming_layer_2(model: nn.Module) -> None:
    original_forward = modeling_llama.LlamaMLP.forward
    before = state_of(model)

    def scale_from_layer_2(model: nn.Module) -> None:
        for index, layer in enumerate(model.model.layers):
            if index >= 2:
                mlp = layer.mlp
                mlp.forward = lambda x, mlp=mlp: original_forward(mlp, x) * 1.01

    with pytest.raises(PatchDivergenceError) as refused:
        layerswap.adopt(scale_from_layer_2, model=model)
    assert refused.value.layer == "model.layers.2"
    assert differences(before, state_of(model)) == []


def test_a_given_model_is_patched_after_the_proof_on_a_tiny_copy(model: nn.Module) -> None:
    def bind_forward(model: nn.Module) -> None:
        for layer in model.model.layers:
            layer.mlp.forward = types.MethodType(_silu_mlp, layer.mlp)

    with layerswap.adopt(bind_forward, model=model) as adoption:
        assert adoption.proven == "llama"
        assert all("forward" in layer.mlp.__dict__ for layer in model.model.layers)
    assert all("forward" not in layer.mlp.__dict__ for layer in model.model.layers)


def test_prove_true_without_a_family_is_refused(make_module) -> None:
    module = importlib.import_module(make_module("no_family", "VALUE = 1\n"))

    def no_modeling_module() -> None:
        module.VALUE = 2

    with pytest.raises(AdoptionError, match="config="):
        layerswap.adopt(no_modeling_module, prove=True)
    assert module.VALUE == 1


# --- verify, layer by layer --------------------------------------------------------------------


def test_verify_names_the_first_divergent_layer_of_an_adopted_model(model: nn.Module) -> None:
    original_forward = modeling_llama.LlamaMLP.forward
    before = state_of(model)

    def scale_from_layer_2(model: nn.Module) -> None:
        for layer in list(model.model.layers)[2:]:
            mlp = layer.mlp
            mlp.forward = lambda x, mlp=mlp: original_forward(mlp, x) * 1.01

    with layerswap.adopt(scale_from_layer_2, model=model, prove=False) as adoption:
        report = adoption.verify(model, backward=True)
        assert "forward" in model.model.layers[2].mlp.__dict__  # still patched after
    assert not report.passed
    assert report.first_divergent_layer == 2
    assert [layer.passed for layer in report.layers[:2]] == [True, True]
    assert differences(before, state_of(model)) == []


def test_verify_passes_an_equivalent_adopted_model(model: nn.Module) -> None:
    def bind_forward(model: nn.Module) -> None:
        for layer in model.model.layers:
            layer.mlp.forward = types.MethodType(_silu_mlp, layer.mlp)

    with layerswap.adopt(bind_forward, model=model, prove=False) as adoption:
        report = adoption.verify(model, generate=2)
    assert report.passed, report.summary()


def test_verify_refuses_a_model_built_with_the_patch_s_classes() -> None:
    from layerswap.errors import UnsupportedModelError

    with layerswap.adopt(rebind_rms_norm, prove=False) as adoption:
        built = layerswap.get_family("llama").build()
        with pytest.raises(UnsupportedModelError, match="built with the patch"):
            adoption.verify(built)


# --- transformers' kernelize -----------------------------------------------------------------


def test_kernelize_without_a_fitting_kernels_package_changes_nothing(model: nn.Module) -> None:
    from transformers.integrations.hub_kernels import kernelize
    from transformers.utils.import_utils import is_kernels_available

    if is_kernels_available():
        pytest.skip("a kernels release transformers accepts is installed: kernelize runs")
    before = state_of(model)
    with pytest.raises(ImportError):
        layerswap.adopt(kernelize, model=model, prove=False)
    assert differences(before, state_of(model)) == []


# --- the command line ----------------------------------------------------------------------------


def _patches() -> str:
    """The patch module ``docs/cli.md`` shows ``verify --adopt`` with (its generator's)."""
    script = Path(__file__).resolve().parent.parent / "scripts" / "gen_cli_docs.py"
    return str(runpy.run_path(str(script))["PATCHES"])


def test_cli_verify_adopt_proves_and_undoes(make_module, capsys) -> None:
    from command_line import run

    name = make_module("cli_patches", _patches())
    original = modeling_llama.LlamaRMSNorm
    code, out, _ = run(capsys, "verify", "--adopt", f"{name}:fast_rms_norm", "--model", "llama")
    assert code == 0, out
    assert out.startswith(f"PASSED  {name}:fast_rms_norm: proven equal to the original")
    assert "modeling_llama.LlamaRMSNorm: rebound" in out
    assert modeling_llama.LlamaRMSNorm is original


def test_cli_verify_adopt_names_the_first_divergent_layer(make_module, capsys) -> None:
    import json

    from command_line import run

    name = make_module("cli_patches", _patches())
    args = ("verify", "--adopt", f"{name}:forgot_epsilon", "--model", "llama", "--json")
    code, out, _ = run(capsys, *args)
    assert code == 1
    verdict = json.loads(out)
    assert verdict["passed"] is False and verdict["layer"] == "model.layers.0"


def test_cli_verify_adopt_refuses_a_missing_function_with_close_names(make_module, capsys):
    from command_line import run

    name = make_module("cli_patches", _patches())
    code, _, err = run(capsys, "verify", "--adopt", f"{name}:fast_rms_nrom", "--model", "llama")
    assert code == 2
    assert "fast_rms_norm" in err


def test_a_patch_is_not_proven_on_a_model_that_does_not_run_it(make_module, capsys) -> None:
    """A patch of Llama's modeling code proven on a Qwen 3 model would pass, having changed
    nothing that model runs: refused, naming the model type to prove it on, and undone."""
    from command_line import run

    name = make_module("cli_patches", _patches())
    original = modeling_llama.LlamaRMSNorm
    code, _, err = run(capsys, "verify", "--adopt", f"{name}:forgot_epsilon", "--model", "qwen3")
    assert code == 2
    assert "changes transformers' llama modeling code, which a qwen3 model does not run" in err
    assert modeling_llama.LlamaRMSNorm is original
    module = importlib.import_module(name)
    with pytest.raises(AdoptionError, match="which a qwen3 model does not run"):
        layerswap.adopt(module.forgot_epsilon, config=layerswap.get_family("qwen3").tiny_config())
    assert modeling_llama.LlamaRMSNorm is original


def test_cli_verify_adopt_refuses_what_it_would_not_use_or_cannot_run(
    make_module, capsys, tmp_path
) -> None:
    from command_line import run

    name = make_module("cli_patches", _patches() + "\n\ndef needs_arg(x):\n    return x\n")
    adopt = ("verify", "--adopt", f"{name}:fast_rms_norm", "--model", "llama")
    code, _, err = run(capsys, *adopt, "--dtype", "bfloat16", "--backward")
    assert code == 2 and "it does not use --dtype, --backward" in err
    code, _, err = run(capsys, "verify", "--adopt", f"{name}:needs_arg", "--model", "llama")
    assert code == 2 and "raised TypeError" in err and "taken back" in err
    broken = make_module("cli_broken", "raise ValueError('not at import')\n")
    code, _, err = run(capsys, "verify", "--adopt", f"{broken}:f", "--model", "llama")
    assert code == 2 and "cannot import" in err and "ValueError: not at import" in err
    layerswap.get_family("qwen3").tiny_config().save_pretrained(tmp_path)
    code, _, err = run(capsys, *adopt, "--config", str(tmp_path))
    assert code == 2 and "describes a 'qwen3' model, not llama" in err


def test_suspending_an_older_adoption_keeps_a_newer_patch_on_top() -> None:
    """An adoption taken back for a while (its proof's original side) is made again where
    it sat: a newer adoption or patch of the same attribute stays the visible one."""
    original = modeling_llama.LlamaMLP.forward

    def older() -> None:
        modeling_llama.LlamaMLP.forward = lambda self, x: original(self, x)

    def newer() -> None:
        modeling_llama.LlamaMLP.forward = lambda self, x: original(self, x) + 0.0

    a = layerswap.adopt(older, prove=False)
    b = layerswap.adopt(newer, prove=False)
    shown = modeling_llama.LlamaMLP.__dict__["forward"]
    try:
        with a.suspended():
            assert modeling_llama.LlamaMLP.__dict__["forward"] is shown
        assert modeling_llama.LlamaMLP.__dict__["forward"] is shown
        with layerswap.patch(modeling_llama.LlamaMLP, "forward", lambda self, x: x) as top:
            with b.suspended():
                assert modeling_llama.LlamaMLP.forward is top.new
            assert modeling_llama.LlamaMLP.forward is top.new
        assert modeling_llama.LlamaMLP.__dict__["forward"] is shown
    finally:
        b.undo()
        a.undo()
    assert modeling_llama.LlamaMLP.forward is original


def test_class_and_code_changes_of_two_adoptions_undo_in_any_order(model: nn.Module) -> None:
    """An instance given another class, and a function's code replaced in place, are
    engine layers as rebindings are: the older adoption undone first leaves the newer one's
    class and code in place, and undoing both restores the originals, not the older
    adoption's (it wrote back its own copy before)."""
    norm = model.model.norm
    code = modeling_llama.rotate_half.__code__

    class NormA(modeling_llama.LlamaRMSNorm):
        pass

    class NormB(modeling_llama.LlamaRMSNorm):
        pass

    def rotate_a(x: torch.Tensor) -> torch.Tensor:
        return torch.cat((-x[..., x.shape[-1] // 2 :], x[..., : x.shape[-1] // 2]), dim=-1)

    def rotate_b(x: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

    def older(model: nn.Module) -> None:
        model.model.norm.__class__ = NormA
        modeling_llama.rotate_half.__code__ = rotate_a.__code__

    def newer(model: nn.Module) -> None:
        model.model.norm.__class__ = NormB
        modeling_llama.rotate_half.__code__ = rotate_b.__code__

    a = layerswap.adopt(older, model=model, prove=False)
    b = layerswap.adopt(newer, model=model, prove=False)
    a.undo()
    assert type(norm) is NormB and modeling_llama.rotate_half.__code__ is rotate_b.__code__
    b.undo()
    assert type(norm) is modeling_llama.LlamaRMSNorm
    assert modeling_llama.rotate_half.__code__ is code


def test_suspended_windows_nest_and_two_threads_take_turns() -> None:
    """A window opened inside one of the same adoption keeps the original code until the
    outer one ends; two threads verifying one adoption take turns, each getting its
    verdict (one thread's window re-applying the patch inside another's raised)."""
    import threading

    original = modeling_llama.LlamaMLP.forward

    def scaled() -> None:
        modeling_llama.LlamaMLP.forward = lambda self, x: original(self, x) * 1.5

    adoption = layerswap.adopt(scaled, prove=False)
    try:
        with adoption.suspended():
            with adoption.suspended():
                assert modeling_llama.LlamaMLP.forward is original
            assert modeling_llama.LlamaMLP.forward is original
        assert modeling_llama.LlamaMLP.forward is not original
        results: list[Any] = []

        def verify() -> None:
            try:
                results.append(adoption.verify(layerswap.get_family("llama").build()).passed)
            except Exception as exc:  # what the test is about: none is raised
                results.append(exc)

        threads = [threading.Thread(target=verify) for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert results == [False, False]
    finally:
        adoption.undo()
    assert modeling_llama.LlamaMLP.forward is original


def test_an_undo_in_another_thread_during_a_recording_is_not_credited_to_it() -> None:
    """While a patch function is being recorded, another thread undoes an adoption: that
    waits for the recording, and is not taken for the function's own change (it was, and
    the undone adoption's items stayed for good)."""
    import threading

    items = list(dict.items(ACT2FN))

    def other_items() -> None:
        ACT2FN["relu"] = nn.Identity
        ACT2FN["other_act"] = nn.Identity

    earlier = layerswap.adopt(other_items, prove=False)
    inside, go = threading.Event(), threading.Event()

    def slow() -> None:
        ACT2FN["gelu"] = nn.Tanh
        inside.set()
        go.wait(5)

    adopted: list[Any] = []
    recorder = threading.Thread(target=lambda: adopted.append(layerswap.adopt(slow, prove=False)))
    recorder.start()
    assert inside.wait(5)
    acting = threading.Thread(target=earlier.undo)
    acting.start()
    acting.join(0.2)
    assert acting.is_alive()  # waiting for the recording
    go.set()
    recorder.join(5)
    acting.join(5)
    try:
        (change,) = adopted[0].changes  # ACT2FN's 'gelu', and nothing else
        assert "'gelu'" in str(change) and "relu" not in str(change), str(change)
    finally:
        adopted[0].undo()
        earlier.undo()
    assert [(k, id(v)) for k, v in dict.items(ACT2FN)] == [(k, id(v)) for k, v in items]


def test_a_garbage_collection_during_the_recording_is_not_credited_to_it(make_module) -> None:
    """A garbage-collector callback (a profiler's, a test runner's) rebinding a module
    global while the patch function runs is not the function's change: it was recorded,
    and the adoption's undo set the callback's global back."""
    import gc

    counter = importlib.import_module(make_module("gc_ticks", "ticks = 0"))

    def tick(phase: str, info: dict[str, Any]) -> None:
        counter.ticks += 1

    def allocates() -> None:
        ACT2FN["gc_test_act"] = nn.Identity
        for _ in range(20_000):  # enough cyclic garbage for several automatic collections
            cycle: list[Any] = []
            cycle.append(cycle)

    gc.callbacks.append(tick)
    try:
        with layerswap.adopt(allocates, prove=False) as adoption:
            assert not any("ticks" in change for change in adoption.changes), adoption.changes
            ticks = counter.ticks
        assert counter.ticks >= ticks  # the callback's global was not set back
    finally:
        gc.callbacks.remove(tick)
    assert "gc_test_act" not in ACT2FN


def test_a_patch_function_may_patch_from_a_worker_thread_and_wait_for_it(make_module) -> None:
    """A function that starts an engine patch in a worker thread and waits for it: the
    recording holds no lock the worker needs (it did, and the two waited for ever)."""
    import concurrent.futures

    module = importlib.import_module(make_module("worker_patched", "def f():\n    return 1\n"))
    started: list[Any] = []

    def patches_in_a_worker() -> None:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            started.append(pool.submit(layerswap.patch(module, "f", lambda: 2).start).result(10))

    with layerswap.adopt(patches_in_a_worker, prove=False):
        assert module.f() == 2
    started[0].stop()
    assert module.f() == 1


def test_a_patch_of_two_model_types_says_which_one_the_proof_did_not_run() -> None:
    """Proven on a Llama model, a function that also rebinds Qwen 2's norm is not proven
    for Qwen 2: adopting it says so (a wrong Qwen 2 patch was reported proven)."""
    from transformers.models.qwen2 import modeling_qwen2

    def both() -> None:
        modeling_llama.LlamaRMSNorm = type("Norm", (modeling_llama.LlamaRMSNorm,), {})
        modeling_qwen2.Qwen2RMSNorm = type("Norm", (modeling_qwen2.Qwen2RMSNorm,), {})

    config = layerswap.get_family("llama").tiny_config()
    with (
        pytest.warns(layerswap.errors.SwapWarning, match=r"qwen2 modeling code were not run"),
        layerswap.adopt(both, config=config) as adoption,
    ):
        assert adoption.proven == "llama"


def test_the_models_config_changed_by_the_patch_is_taken_back(model: nn.Module) -> None:
    """A patch pointing the given model's config at an attention it registers (as
    attention-kernel patches do): undo takes the config back with the registry entry, and
    the model runs as before (it raised a KeyError for the removed attention)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    ids = torch.randint(3, 100, (1, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = model(ids).logits
    before = model.config._attn_implementation

    def own_attention(*args: Any, **kwargs: Any) -> Any:
        return sdpa_attention_forward(*args, **kwargs)

    def patch_attention(model: nn.Module) -> None:
        ALL_ATTENTION_FUNCTIONS["own_attention"] = own_attention
        ALL_MASK_ATTENTION_FUNCTIONS["own_attention"] = sdpa_mask
        model.config._attn_implementation = "own_attention"

    adoption = layerswap.adopt(patch_attention, model=model, prove=False)
    assert model.config._attn_implementation == "own_attention"
    adoption.undo()
    assert model.config._attn_implementation == before
    with torch.no_grad():
        assert torch.equal(model(ids).logits, expected)
