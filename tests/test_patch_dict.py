"""``patch_dict`` and the all-or-nothing groups ``patches`` / ``patch_many`` (SPEC 1.2)."""

from __future__ import annotations

import itertools
import os
import sys

import pytest

import layerswap
from layerswap.errors import PatchStateError, TargetAttributeError, TargetTypeError


def test_added_changed_and_deleted_keys_are_all_reverted_in_order():
    data = {"a": 1, "b": 2, "c": 3}
    items = list(data.items())
    with layerswap.patch_dict(data, {"b": 20, "z": 26}):
        assert data == {"a": 1, "b": 20, "c": 3, "z": 26}
    assert list(data.items()) == items
    with layerswap.patch_dict(data, {"new": 0}, clear=True):
        assert data == {"new": 0}
    assert list(data.items()) == items


def test_same_mapping_object_is_kept():
    data = {"a": 1}
    identity = id(data)
    with layerswap.patch_dict(data, {"a": 2}, clear=True):
        pass
    assert id(data) == identity and data == {"a": 1}


def test_os_environ_round_trip():
    before = dict(os.environ)
    with layerswap.patch_dict(os.environ, {"LAYERSWAP_TEST_VAR": "1"}, clear=True):
        assert dict(os.environ) == {"LAYERSWAP_TEST_VAR": "1"}
    assert dict(os.environ) == before


def test_string_target_names_the_mapping(make_module):
    name = make_module("registry", "REGISTRY = {'x': 1}\n")
    with layerswap.patch_dict(f"{name}:REGISTRY", {"y": 2}):
        assert sys.modules[name].REGISTRY == {"x": 1, "y": 2}
    assert sys.modules[name].REGISTRY == {"x": 1}


@pytest.mark.parametrize("order", list(itertools.permutations(range(3))), ids=str)
def test_overlapping_dict_patches_stop_in_any_order(order):
    data = {"k": "orig", "other": 0}
    items = list(data.items())
    ps = [layerswap.patch_dict(data, {"k": f"v{i}", f"only{i}": i}).start() for i in range(3)]
    live = [0, 1, 2]
    for index in order:
        ps[index].stop()
        live.remove(index)
        assert data["k"] == (f"v{live[-1]}" if live else "orig")
        assert all((f"only{i}" in data) == (i in live) for i in range(3))
    assert list(data.items()) == items


def test_exception_in_block_restores_dict():
    data = {"a": 1}
    with pytest.raises(KeyboardInterrupt), layerswap.patch_dict(data, {"a": 2}, clear=True):
        raise KeyboardInterrupt
    assert data == {"a": 1}


def test_bad_input_is_a_clear_error():
    with pytest.raises(TargetTypeError, match="mutable mapping"):
        layerswap.patch_dict((1, 2), {})
    with pytest.raises(TargetTypeError, match="must be a mapping"):
        layerswap.patch_dict({}, 5)
    with pytest.raises(TargetAttributeError, match="REGISTY"):
        layerswap.patch_dict("json:REGISTY", {}).start()


# --- groups ---------------------------------------------------------------------------------------


def test_patches_group_applies_all_and_undoes_in_reverse():
    holder = type("Holder", (), {"a": 1, "b": 2})
    data = {"x": 1}
    with layerswap.patches(
        layerswap.patch(holder, "a", 10),
        layerswap.patch(holder, "b", 20),
        layerswap.patch_dict(data, {"x": 2}),
    ):
        assert (holder.a, holder.b, data["x"]) == (10, 20, 2)
    assert (holder.a, holder.b, data["x"]) == (1, 2, 1)


def test_group_is_all_or_nothing_when_the_kth_fails():
    holder = type("Holder", (), {"a": 1, "b": 2})
    group = layerswap.patch_many(
        [
            layerswap.patch(holder, "a", 10),
            layerswap.patch(holder, "b", 20),
            layerswap.patch(holder, "missing", 30),  # fails: no such attribute
            layerswap.patch(holder, "a", 40),
        ]
    )
    with pytest.raises(TargetAttributeError, match="missing"):
        group.start()
    assert (holder.a, holder.b) == (1, 2)
    assert not hasattr(holder, "missing")
    assert layerswap.active_patches() == []


def test_group_member_already_started_fails_and_rolls_back():
    holder = type("Holder", (), {"a": 1, "b": 2})
    started = layerswap.patch(holder, "b", 5).start()
    try:
        with pytest.raises(PatchStateError):
            layerswap.patches(layerswap.patch(holder, "a", 10), started).start()
        assert holder.a == 1 and holder.b == 5
    finally:
        started.stop()


def test_group_rejects_non_patches():
    with pytest.raises(TargetTypeError, match="patch objects"):
        layerswap.patches(layerswap.patch(os, "sep", "/"), "not a patch")


def test_the_very_value_objects_come_back():
    """A block that rebinds a key to an equal but other object (a registry entry
    rebuilt) leaves the original object there after, not the equal copy."""
    entry = [1, 2]
    config = {"lr": 1e-3}
    data = {"a": entry, "opt": config, "s": "x"}
    with layerswap.patch_dict(data, {"c": 1}):
        data["a"] = [1, 2]
        data["opt"] = dict(config)
    assert data["a"] is entry and data["opt"] is config
    assert list(data) == ["a", "opt", "s"]


def test_an_older_patch_of_a_computing_mapping_stopped_first_takes_back_its_value():
    """A mapping whose ``__getitem__`` builds an object (transformers' ``ACT2FN`` returns
    an instance of the class it holds): an older dict patch stopped while a newer one is
    live took its value for someone else's (the instance is not the class it wrote) and
    left it in place for good; it is taken back, and the newer one's stop restores the
    rest."""
    from torch import nn
    from transformers.activations import ACT2FN

    items = [(key, id(value)) for key, value in dict.items(ACT2FN)]
    older = layerswap.patch_dict(ACT2FN, {"relu": nn.Tanh, "dict_patch_new": nn.Tanh})
    newer = layerswap.patch_dict(ACT2FN, {"silu": nn.Identity})
    older.start()
    newer.start()
    older.stop()
    assert dict.get(ACT2FN, "relu") is not nn.Tanh and "dict_patch_new" not in ACT2FN
    newer.stop()
    assert [(key, id(value)) for key, value in dict.items(ACT2FN)] == items
