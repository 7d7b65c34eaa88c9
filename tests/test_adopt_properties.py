"""Adoptions setting registry items and ``patch_dict``s of the same registry, and adoptions
changing one module's dict, list, set and names, started and ended in any order
(property-based): at the end each holds exactly its own items, by identity and in order,
and no adoption is left in effect."""

from __future__ import annotations

import random
import sys
import types
import warnings
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn
from transformers.activations import ACT2FN

import layerswap
from layerswap.adoption.adopting import live_adoptions
from layerswap.errors import NoChangeError, PatchError
from layerswap.patching import stack as _stack

KEYS = ["silu", "relu", "gelu", "tanh", "property_act_a", "property_act_b"]
#: a value, or None: the key removed
VALUES = [nn.Identity, nn.Tanh, nn.Sigmoid, None]


def _items() -> list[tuple[str, int]]:
    return [(key, id(value)) for key, value in dict.items(ACT2FN)]


def _end(live: Any) -> None:
    if isinstance(live, layerswap.Adoption):
        live.undo()
    else:
        live.stop()


def _end_all_shuffled(live: list[Any], seed: int) -> None:
    """End every adoption and patch in ``live``, in an order drawn from ``seed``."""
    random.Random(seed).shuffle(live)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for thing in live:
            _end(thing)


def _adopt(change: Any, live: list[Any], state: Any) -> None:
    """Adopt ``change`` into ``live``; one that changed nothing (it set what was there,
    popped what was not, moved the last key to the end) is refused, changing nothing."""
    before = state()
    try:
        live.append(layerswap.adopt(change, prove=False))
    except NoChangeError:
        assert state() == before


def _setter(items: list[tuple[str, Any]]) -> Any:
    def change() -> None:
        for key, value in items:
            if value is None:
                ACT2FN.pop(key, None)
            else:
                ACT2FN[key] = value

    change.__module__ = "transformers.activations"  # watch transformers, not this file
    return change


_STEP = st.tuples(
    st.sampled_from(["adopt", "patch_dict", "end"]),
    st.lists(st.tuples(st.sampled_from(KEYS), st.sampled_from(VALUES)), min_size=1, max_size=3),
    st.integers(0, 10),
)


@pytest.mark.slow  # a few hundred recordings
@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.lists(_STEP, min_size=1, max_size=8), st.integers(0, 2**16))
def test_adoptions_and_dict_patches_of_one_registry_end_in_any_order(
    steps: list[tuple[str, list[tuple[str, Any]], int]], seed: int
) -> None:
    before = _items()
    live: list[Any] = []
    try:
        for kind, items, pick in steps:
            if kind == "adopt":
                _adopt(_setter(items), live, _items)
            elif kind == "patch_dict":
                values = {key: value for key, value in items if value is not None}
                dict_patch = layerswap.patch_dict(ACT2FN, values)
                try:
                    dict_patch.start()
                except PatchError:  # a key an adoption holds: refused, nothing changed
                    continue
                live.append(dict_patch)
            elif live:
                _end(live.pop(pick % len(live)))
    finally:
        _end_all_shuffled(live, seed)
    assert not live_adoptions()
    assert _items() == before


# --- adoptions of one module's dict, list, set and names, ended in any order -------------------

#: a module whose dict, list and set a patch function changes in place (watched: each
#: function below is its own), and whose names it rebinds and deletes
SHARED = types.ModuleType("ls_adopt_property_shared")
sys.modules[SHARED.__name__] = SHARED
POOL = [object() for _ in range(4)]
SHARED.REGISTRY = {"a": POOL[0], "b": POOL[1], "c": POOL[2]}
SHARED.HOOKS = [POOL[0], POOL[1], POOL[0]]  # one object twice
SHARED.NAMES = {"a", "b"}
SHARED.VALUE = POOL[3]

_KEYS = ["a", "b", "c", "d"]
_OPS = st.one_of(
    st.tuples(st.just("dict set"), st.sampled_from(_KEYS), st.integers(0, 3)),
    st.tuples(st.just("dict pop"), st.sampled_from(_KEYS), st.just(0)),
    st.tuples(st.just("dict move"), st.sampled_from(_KEYS), st.just(0)),  # to the end
    st.tuples(st.just("list insert"), st.integers(0, 4), st.integers(0, 3)),
    st.tuples(st.just("list pop"), st.integers(0, 4), st.just(0)),
    st.tuples(st.just("list move"), st.integers(0, 4), st.just(0)),  # to the end
    st.tuples(st.just("set add"), st.sampled_from(_KEYS), st.just(0)),
    st.tuples(st.just("set discard"), st.sampled_from(_KEYS), st.just(0)),
    st.tuples(st.just("name set"), st.sampled_from(["VALUE", "OTHER"]), st.integers(0, 3)),
    st.tuples(st.just("name delete"), st.sampled_from(["VALUE", "OTHER"]), st.just(0)),
)


def _shared_state() -> tuple[Any, ...]:
    """Every item by identity and in order, and the containers themselves."""
    entries = {key: id(value) for key, value in vars(SHARED).items() if key.isupper()}
    registry = [(key, id(value)) for key, value in dict.items(SHARED.REGISTRY)]
    hooks = [id(hook) for hook in SHARED.HOOKS]
    return entries, registry, hooks, set(SHARED.NAMES)


def _operate(op: str, where: Any, value: int) -> None:
    registry, hooks = SHARED.REGISTRY, SHARED.HOOKS
    if op == "dict set":
        registry[where] = POOL[value]
    elif op == "dict pop":
        registry.pop(where, None)
    elif op == "dict move" and where in registry:
        registry[where] = registry.pop(where)
    elif op == "list insert":
        hooks.insert(where, POOL[value])
    elif op in ("list pop", "list move") and hooks:
        hook = hooks.pop(where % len(hooks))
        if op == "list move":
            hooks.append(hook)
    elif op == "set add":
        SHARED.NAMES.add(where)
    elif op == "set discard":
        SHARED.NAMES.discard(where)
    elif op == "name set":
        setattr(SHARED, where, POOL[value])
    elif op == "name delete" and where in vars(SHARED):
        delattr(SHARED, where)


def _patch_function(ops: list[tuple[str, Any, int]]) -> Any:
    def change() -> None:
        for op in ops:
            _operate(*op)

    change.__module__ = SHARED.__name__  # its module's containers are watched
    return change


_SHARED_STEP = st.tuples(
    st.sampled_from(["adopt", "adopt", "end", "suspend", "patch_dict"]),
    st.lists(_OPS, min_size=1, max_size=4),
    st.integers(0, 10),
)


@pytest.mark.slow  # a few hundred recordings
@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.lists(_SHARED_STEP, min_size=1, max_size=8), st.integers(0, 2**16))
def test_adoptions_of_shared_containers_and_names_end_in_any_order(
    steps: list[tuple[str, list[tuple[str, Any, int]], int]], seed: int
) -> None:
    """Adoptions adding, removing, rebinding and reordering the items of one dict, list
    and set and a module's names (one suspended now and then, a ``patch_dict`` of the
    dict among them), ended in any order: the module holds its very objects again, each
    container its own items by identity and in order, and nothing is left on the
    engine's stacks."""
    before = _shared_state()
    containers = (SHARED.REGISTRY, SHARED.HOOKS, SHARED.NAMES)
    live: list[Any] = []
    try:
        for kind, ops, pick in steps:
            if kind == "adopt":
                _adopt(_patch_function(ops), live, _shared_state)
            elif kind == "patch_dict":
                values = {key: POOL[value] for op, key, value in ops if op == "dict set"}
                dict_patch = layerswap.patch_dict(SHARED.REGISTRY, values)
                try:
                    dict_patch.start()
                except PatchError:  # a key an adoption holds: refused, nothing changed
                    continue
                live.append(dict_patch)
            elif kind == "suspend" and live:
                chosen = live[pick % len(live)]
                if isinstance(chosen, layerswap.Adoption):
                    state = _shared_state()
                    with chosen.suspended():
                        pass
                    assert _shared_state() == state  # made again as it was
            elif kind == "end" and live:
                _end(live.pop(pick % len(live)))
    finally:
        _end_all_shuffled(live, seed)
    assert not live_adoptions()
    assert _shared_state() == before
    assert containers == (SHARED.REGISTRY, SHARED.HOOKS, SHARED.NAMES)
    now = (SHARED.REGISTRY, SHARED.HOOKS, SHARED.NAMES)
    assert all(a is b for a, b in zip(containers, now, strict=True))
    assert not any(key[0] in map(id, (*containers, SHARED)) for key in _stack._STACKS)
