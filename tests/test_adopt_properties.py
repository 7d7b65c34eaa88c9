"""Adoptions setting registry items and ``patch_dict``s of the same registry, started and
ended in any order (property-based): at the end the registry holds exactly its own
items, by identity and in order, and no adoption is left in effect."""

from __future__ import annotations

import random
import warnings
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn
from transformers.activations import ACT2FN

import layerswap
from layerswap.adoption.adopting import live_adoptions
from layerswap.errors import PatchError

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
                live.append(layerswap.adopt(_setter(items), prove=False))
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
        random.Random(seed).shuffle(live)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for thing in live:
                _end(thing)
    assert not live_adoptions()
    assert _items() == before
