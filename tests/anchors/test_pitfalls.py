"""Pitfalls where a patching library goes wrong, one test each (numbered as found)."""

from __future__ import annotations

import asyncio
import inspect
import sys
import threading
import warnings

import pytest

import layerswap
from layerswap.errors import PatchConflictWarning, PatchStateError, TargetReadOnlyError
from layerswap.patching.target import suggest


def test_1_patch_dict_reverts_keys_the_block_changed_itself():
    data = {1: "A", 2: "B"}
    layerswap.patch_dict(data, {3: "C"}).start()
    data[1] = "changed"
    del data[2]
    data[4] = "added"
    layerswap.restore_all()
    assert data == {1: "A", 2: "B"} and list(data) == [1, 2]


def test_1_clear_block_additions_do_not_survive():
    data = {"a": 1}
    with layerswap.patch_dict(data, clear=True):
        data["added"] = 2
    assert data == {"a": 1}


def test_1_non_lifo_dict_stops_end_in_the_original():
    data = {"k": "orig"}
    lower = layerswap.patch_dict(data, {"k": "lower", "x": 1}).start()
    data["block"] = True  # made while `lower` is the newest
    upper = layerswap.patch_dict(data, {"k": "upper"}).start()
    lower.stop()
    assert data["k"] == "upper" and "x" not in data  # lower's own values taken back
    upper.stop()
    assert data == {"k": "orig"}


def test_2_one_patch_started_from_two_threads_is_refused_once():
    class Target:
        value = "original"

    shared = layerswap.patch(Target, "value", "patched")
    barrier = threading.Barrier(2)
    outcomes: list[str] = []

    def start() -> None:
        barrier.wait()
        try:
            shared.start()
            outcomes.append("started")
        except PatchStateError:
            outcomes.append("refused")

    threads = [threading.Thread(target=start) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert sorted(outcomes) == ["refused", "started"]
    shared.stop()
    assert Target.__dict__["value"] == "original" and layerswap.active_patches() == []


def test_4_aliases_module_imported_during_patch_gives_the_replacement_back(make_module):
    source = make_module("alias_source", "class Y:\n    pass\n")
    __import__(source)
    original = sys.modules[source].Y
    replacement = type("Replacement", (), {})
    with layerswap.patch(f"{source}:Y", replacement, aliases=True):
        late = make_module("alias_late", f"from {source} import Y\n")
        __import__(late)
        assert sys.modules[late].Y is replacement
    assert sys.modules[late].Y is original
    assert sys.modules[source].Y is original


def test_4_aliases_leaves_the_replacements_own_module_alone(make_module):
    source = make_module("alias_source2", "def f():\n    return 1\n")
    home = make_module("alias_home", "def g():\n    return 2\n")
    __import__(source)
    __import__(home)
    g = sys.modules[home].g
    with layerswap.patch(f"{source}:f", g, aliases=True):
        pass
    assert sys.modules[home].g is g


def test_5_resolution_waits_for_an_import_in_progress(make_module):
    started, release = threading.Event(), threading.Event()
    gate = f"_ls_gate_{id(started)}"
    setattr(sys.modules["builtins"], gate, (started, release))
    try:
        name = make_module(
            "slow_import",
            f"import builtins\nstarted, release = builtins.{gate}\n"
            "started.set()\nrelease.wait(10)\nVALUE = 'done'\n",
        )
        importer = threading.Thread(target=__import__, args=(name,))
        importer.start()
        assert started.wait(10)
        result: list[object] = []

        def patch_it() -> None:
            with layerswap.patch(f"{name}:VALUE", "patched"):
                result.append(sys.modules[name].VALUE)

        patcher = threading.Thread(target=patch_it)
        patcher.start()
        patcher.join(timeout=0.2)
        assert patcher.is_alive()  # waiting for the import, not failing on a half module
        release.set()
        importer.join(timeout=10)
        patcher.join(timeout=10)
        assert not patcher.is_alive() and result == ["patched"]
        assert sys.modules[name].VALUE == "done"
    finally:
        delattr(sys.modules["builtins"], gate)


def test_6_wrap_of_inherited_method_sees_a_later_base_patch():
    class Base:
        def m(self):
            return "base"

    class Sub(Base):
        pass

    wrapped = layerswap.wrap(Sub, "m", lambda w, i, a, k: "wrapped:" + w(*a, **k))
    with wrapped, layerswap.patch(Base, "m", lambda self: "later"):
        assert Sub().m() == "wrapped:later"


def test_7_wrap_keeps_coroutine_kind_at_module_level_and_on_one_instance():
    mod = type(sys)("ls_pitfall_async")

    async def fetch():
        return 1

    mod.fetch = fetch

    class Client:
        async def get(self):
            return 2

    client = Client()
    advice = lambda w, i, a, k: w(*a, **k)  # noqa: E731
    with layerswap.wrap(mod, "fetch", advice), layerswap.wrap(client, "get", advice):
        assert inspect.iscoroutinefunction(mod.fetch)
        assert inspect.iscoroutinefunction(client.get)
        assert asyncio.run(mod.fetch()) == 1 and asyncio.run(client.get()) == 2


def test_8_wrap_on_one_instance_gives_a_bound_method():
    class Thing:
        def m(self):
            return self

    thing = Thing()
    with layerswap.wrap(thing, "m", lambda w, i, a, k: w(*a, **k)):
        assert inspect.ismethod(thing.m) and thing.m.__self__ is thing
        assert thing.m() is thing


def test_9_context_scope_keeps_the_functions_metadata():
    mod = type(sys)("ls_pitfall_ctx")

    def original(x: int) -> int:
        """original doc"""
        return x

    async def coro() -> int:
        return 1

    mod.f, mod.c = original, coro
    with layerswap.patch(mod, "f", lambda x: -x, scope="context"):
        assert (mod.f.__name__, mod.f.__doc__, mod.f.__module__) == (
            "original",
            "original doc",
            original.__module__,
        )
        assert inspect.signature(mod.f) == inspect.signature(original)
        assert mod.f(2) == -2
    with layerswap.patch(mod, "c", coro, scope="context"):
        assert inspect.iscoroutinefunction(mod.c)


def test_11_patch_dict_accepts_item_access_and_iteration_only():
    class Registry:
        def __init__(self):
            self._d = {"a": 1}

        def __getitem__(self, k):
            return self._d[k]

        def __setitem__(self, k, v):
            self._d[k] = v

        def __delitem__(self, k):
            del self._d[k]

        def __iter__(self):
            return iter(self._d)

    registry = Registry()
    with layerswap.patch_dict(registry, {"b": 2}):
        assert registry["b"] == 2
    assert registry._d == {"a": 1}


def test_14_read_only_targets_raise_an_attribute_error():
    class Slotless:
        __slots__ = ()

    with pytest.raises(TargetReadOnlyError) as info:
        layerswap.patch(Slotless(), "x", 1, create=True).start()
    assert isinstance(info.value, AttributeError)


@pytest.mark.parametrize(
    ("stored", "given"), [(2.0, 2), ([9], [9])], ids=["int-to-float", "list-copy"]
)
def test_15_a_normalising_property_setter_is_no_foreign_write(stored, given):
    class Box:
        def __init__(self):
            self._v = stored

        @property
        def v(self):
            return list(self._v) if isinstance(self._v, list) else self._v

        @v.setter
        def v(self, value):
            self._v = list(value) if isinstance(value, list) else float(value)

    box = Box()
    with warnings.catch_warnings():
        warnings.simplefilter("error", PatchConflictWarning)
        with layerswap.patch(box, "v", given):
            pass
    assert box.v == stored


def test_15_a_real_foreign_write_through_a_property_still_warns():
    class Box:
        _v = 1.0

        @property
        def v(self):
            return self._v

        @v.setter
        def v(self, value):
            self._v = float(value)

    box = Box()
    with pytest.warns(PatchConflictWarning, match="found 7.0"), layerswap.patch(box, "v", 2):
        box.v = 7
    assert box.v == 1.0


def test_17_suggestions_never_repeat_or_name_the_missing_name():
    assert suggest("abc", ["abc", "abd", "abd"]) == " (did you mean `abd`?)"
    assert suggest("x", ["x"]) == ""


def test_17_unset_slot_does_not_suggest_itself():
    class Slotted:
        __slots__ = ("x",)

    with pytest.raises(AttributeError) as info:
        layerswap.patch(Slotted(), "x", 1).start()
    assert "did you mean `x`" not in str(info.value)
