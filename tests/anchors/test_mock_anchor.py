"""Scenarios from CPython's ``unittest.mock`` suite (testpatch.py, testwith.py), in layerswap's API.

Each test names the case it ports. Mock-only features (autospec, spec, new_callable,
``patch.multiple``, class decoration with TEST_PREFIX) have no counterpart and are left out.
"""

from __future__ import annotations

import functools
import os
import sys
import types
from collections import OrderedDict

import pytest

import layerswap
from layerswap.errors import PatchStateError, TargetAttributeError, TargetImportError
from layerswap.patching import DictPatch


class Original:
    pass


PATCHED = object()


@pytest.fixture
def something_module():
    module = types.ModuleType("ls_mock_anchor_target")
    module.something = Original
    module.something_else = "else"
    sys.modules[module.__name__] = module
    yield module
    del sys.modules[module.__name__]


# --- patch.object / patch ----------------------------------------------------------------------


def test_single_patchobject_decorator_restores():
    class Something:
        attribute = "original"

    @layerswap.patch(Something, "attribute", "patched")
    def check():
        assert Something.attribute == "patched"

    check()
    assert Something.attribute == "original"


def test_patchobject_with_none_replacement():
    class Something:
        attribute = "original"

    with layerswap.patch(Something, "attribute", None):
        assert Something.attribute is None
    assert Something.attribute == "original"


def test_multiple_patchobject_decorators():
    class Something:
        attribute = 1
        next_attribute = 2

    @layerswap.patch(Something, "attribute", 10)
    @layerswap.patch(Something, "next_attribute", 20)
    def check():
        assert (Something.attribute, Something.next_attribute) == (10, 20)

    check()
    assert (Something.attribute, Something.next_attribute) == (1, 2)


def test_object_lookup_is_quite_lazy(something_module):
    # the value restored is the one present when the patch starts, not when it was made
    decorated = layerswap.patch(f"{something_module.__name__}.something", PATCHED)(lambda: None)
    something_module.something = "rebound later"
    decorated()
    assert something_module.something == "rebound later"


def test_patch_string_target_twice_and_again(something_module):
    name = something_module.__name__

    @layerswap.patch(f"{name}.something", PATCHED)
    @layerswap.patch(f"{name}.something_else", "other")
    def check():
        assert something_module.something is PATCHED
        assert something_module.something_else == "other"

    check()
    check()  # patching and restoring works a second time
    assert something_module.something is Original and something_module.something_else == "else"


def test_patch_builtins_open_through_the_builtins_module():
    replacement = object()

    @layerswap.patch("builtins.open", lambda *a, **k: replacement)
    def check():
        return open("no-such-file")

    assert check() is replacement
    assert open is not replacement  # restored


def test_patch_with_create_mocks_non_existent_attributes():
    with layerswap.patch("builtins.frooble", "frooble", create=True):
        assert frooble == "frooble"  # type: ignore[name-defined]  # noqa: F821
    with pytest.raises(NameError):
        frooble  # type: ignore[name-defined]  # noqa: B018, F821


def test_patchobject_with_create_mocks_non_existent_attributes():
    class SomeClass:
        pass

    with layerswap.patch(SomeClass, "frooble", 1, create=True):
        assert SomeClass.frooble == 1  # type: ignore[attr-defined]
    assert not hasattr(SomeClass, "frooble")


def test_patch_wont_create_by_default():
    with pytest.raises(AttributeError):
        layerswap.patch("builtins.frooble", 1).start()
    assert not hasattr(__import__("builtins"), "frooble")


def test_patchobject_wont_create_by_default():
    class SomeClass:
        pass

    with pytest.raises(AttributeError):
        layerswap.patch(SomeClass, "ord", 1).start()
    assert not hasattr(SomeClass, "ord")


def test_patch_builtins_without_create(something_module):
    # a module global that would shadow a builtin (ord, open) needs no create=True
    name = something_module.__name__
    code = compile("def use():\n    return ord('c')\n", name, "exec")
    exec(code, something_module.__dict__)
    with layerswap.patch(f"{name}.ord", lambda c: 101):
        assert something_module.use() == 101
    assert something_module.use() == 99
    assert "ord" not in vars(something_module)  # the shadow is removed again


def test_patch_with_static_methods():
    class Foo:
        @staticmethod
        def woot():
            return "static"

    with layerswap.patch(Foo, "woot", staticmethod(lambda: "patched")):
        assert Foo.woot() == "patched"
    assert Foo.woot() == "static"
    assert isinstance(Foo.__dict__["woot"], staticmethod)


def test_patch_slots():
    class Foo:
        __slots__ = ("Foo",)

    foo = Foo()
    foo.Foo = "original"
    with layerswap.patch(foo, "Foo", "Foo"):
        assert foo.Foo == "Foo"
    assert foo.Foo == "original"


def test_patchobject_twice_same_attribute():
    class Something:
        attribute = "original"

    @layerswap.patch(Something, "attribute", "patched")
    @layerswap.patch(Something, "attribute", "patched")
    def check():
        assert Something.attribute == "patched"

    check()
    assert Something.attribute == "original"


def test_patch_start_stop(something_module):
    patcher = layerswap.patch(something_module, "something", PATCHED)
    assert something_module.something is Original
    patcher.start()
    try:
        assert something_module.something is PATCHED
    finally:
        patcher.stop()
    assert something_module.something is Original


def test_stop_without_start(something_module):
    patcher = layerswap.patch(something_module, "something", PATCHED)
    assert patcher.stop() is None


def test_stop_idempotent(something_module):
    patcher = layerswap.patch(something_module, "something", PATCHED)
    patcher.start()
    patcher.stop()
    assert patcher.stop() is None
    assert something_module.something is Original


def test_exit_idempotent(something_module):
    patcher = layerswap.patch(something_module, "something", PATCHED)
    with patcher:
        patcher.__exit__(None, None, None)
    assert something_module.something is Original


def test_second_start_failure(something_module):
    patcher = layerswap.patch(something_module, "something", PATCHED)
    patcher.start()
    try:
        with pytest.raises(RuntimeError):  # PatchStateError is a RuntimeError
            patcher.start()
    finally:
        patcher.stop()


def test_second_enter_failure(something_module):
    patcher = layerswap.patch(something_module, "something", PATCHED)
    with patcher, pytest.raises(PatchStateError):
        patcher.start()


def test_second_start_after_stop(something_module):
    patcher = layerswap.patch(something_module, "something", PATCHED)
    for _ in range(2):
        patcher.start()
        assert something_module.something is PATCHED
        patcher.stop()
        assert something_module.something is Original


def test_get_only_proxy_patch_does_not_leave_a_copy():
    class Something:
        foo = "foo"

    class Proxy:
        def __init__(self, target):
            object.__setattr__(self, "_target", target)

        def __getattr__(self, name):
            return getattr(self._target, name)

    for thing in (Something, Something()):
        proxy = Proxy(thing)
        with layerswap.patch(proxy, "foo", "bar"):
            assert proxy.foo == "bar"
        assert proxy.foo == "foo" and thing.foo == "foo"
        assert "foo" not in proxy.__dict__


def test_nested_patch_failure_leaves_everything_restored():
    class Foo:
        f = 1
        g = 2

    with (
        pytest.raises(AttributeError),
        layerswap.patches(
            layerswap.patch(Foo, "g", 10),
            layerswap.patch(Foo, "missing", 1),
            layerswap.patch(Foo, "f", 10),
        ),
    ):
        pass
    assert (Foo.f, Foo.g) == (1, 2)


def test_patch_multiple_string_subclasses():
    # a str subclass instance with an attribute name is an object, not a target string
    Fish = type("Fish", (str,), {"fish": "tasty"})
    foo = Fish()
    with layerswap.patch(foo, "fish", "nearly gone"):
        assert foo.fish == "nearly gone"
    assert foo.fish == "tasty"


def test_patch_imports_lazily():
    with pytest.raises(ImportError):
        layerswap.patch("squizz_not_installed.squozz", 1).start()
    squizz = types.ModuleType("squizz_not_installed")
    squizz.squozz = 6
    sys.modules[squizz.__name__] = squizz
    try:
        patcher = layerswap.patch("squizz_not_installed.squozz", 1)
        squizz.squozz = 3
        patcher.start()
        patcher.stop()
        assert squizz.squozz == 3
    finally:
        del sys.modules[squizz.__name__]


def test_patch_propagates_exc_on_exit(something_module):
    with pytest.raises(RuntimeError), layerswap.patch(something_module, "something", PATCHED):
        raise RuntimeError
    assert something_module.something is Original


def test_patch_stopall_leaves_with_blocks(something_module):
    unlink, chdir = os.unlink, os.chdir
    layerswap.patch(os, "unlink", PATCHED).start()
    layerswap.patch(os, "chdir", PATCHED).start()
    with layerswap.patch(something_module, "something", "in block"):
        layerswap.restore_all()
        assert something_module.something == "in block"
        assert (os.unlink, os.chdir) == (unlink, chdir)
    assert something_module.something is Original


def test_stopall_lifo():
    class Thing:
        one = two = three = None

    order: list[str] = []
    for name in ("one", "two", "three"):
        patcher = layerswap.patch(Thing, name, name).start()
        original_stop = patcher.stop

        def stop(original_stop=original_stop, name=name):
            order.append(name)
            original_stop()

        patcher.stop = stop  # type: ignore[method-assign]
    layerswap.restore_all()
    assert order == ["three", "two", "one"]


def test_special_attrs():
    def foo(x=0):
        """TEST"""
        return x

    with layerswap.patch(foo, "__defaults__", (1,)):
        assert foo() == 1
    assert foo() == 0
    with layerswap.patch(foo, "__doc__", "FUN"):
        assert foo.__doc__ == "FUN"
    assert foo.__doc__ == "TEST"
    with layerswap.patch(foo, "__module__", "testpatch2"):
        assert foo.__module__ == "testpatch2"
    assert foo.__module__ == __name__
    with layerswap.patch(foo, "__annotations__", {"s": 1}):
        assert foo.__annotations__ == {"s": 1}
    assert foo.__annotations__ == {}

    def bar(*a, x=0):
        return x

    with layerswap.patch(bar, "__kwdefaults__", {"x": 1}):
        assert bar() == 1
    assert bar() == 0


def test_dotted_but_module_not_loaded(make_module):
    name = make_module("dotted_late", "X = 1\n")
    assert name not in sys.modules
    with layerswap.patch(f"{name}.X", 2):
        assert sys.modules[name].X == 2
    assert sys.modules[name].X == 1


@pytest.mark.parametrize("target", ["", 12, object()], ids=["empty", "int", "object"])
def test_invalid_target(target):
    with pytest.raises(TypeError):
        layerswap.patch(target, PATCHED)


def test_patchobject_with_string_as_target_is_a_clear_error():
    with pytest.raises(TypeError, match="patch\\(obj, 'attr', new\\)"):
        layerswap.patch("Something", "do_something", 1)


def test_tracebacks_point_at_the_block(something_module):
    with pytest.raises(AssertionError) as info:  # noqa: SIM117 - the patch is the inner block
        with layerswap.patch(something_module, "something", PATCHED):
            raise AssertionError("in the block")
    assert info.traceback[-1].name == "test_tracebacks_point_at_the_block"


# --- patch.dict ---------------------------------------------------------------------------


def test_patch_dict():
    foo = {"initial": object(), "other": "something"}
    original = foo.copy()

    @layerswap.patch_dict(foo)
    def changes_inside():
        foo["a"] = 3
        del foo["initial"]
        foo["other"] = "something else"

    changes_inside()
    assert foo == original and list(foo) == list(original)

    with layerswap.patch_dict(foo, {"a": "b"}):
        assert len(foo) == 3 and foo["a"] == "b"
    assert foo == original

    with layerswap.patch_dict(foo, [("a", "b")]):
        assert foo["a"] == "b"
    assert foo == original
    assert foo["initial"] is original["initial"]


class Container:
    """Item access and iteration only: no keys(), no copy(), no MutableMapping."""

    def __init__(self):
        self.values = {}

    def __getitem__(self, name):
        return self.values[name]

    def __setitem__(self, name, value):
        self.values[name] = value

    def __delitem__(self, name):
        del self.values[name]

    def __iter__(self):
        return iter(self.values)


def test_patch_dict_with_container_object():
    foo = Container()
    foo["initial"] = object()
    foo["other"] = "something"
    original = foo.values.copy()

    with layerswap.patch_dict(foo):
        foo["a"] = 3
        del foo["initial"]
        foo["other"] = "something else"
    assert foo.values == original

    with layerswap.patch_dict(foo, {"a": "b"}):
        assert len(foo.values) == 3 and foo["a"] == "b"
    assert foo.values == original


def test_patch_dict_with_clear():
    foo = {"initial": object(), "other": "something"}
    original = foo.copy()
    with layerswap.patch_dict(foo, clear=True):
        assert foo == {}
        foo["a"] = 3
        foo["other"] = "something else"
    assert foo == original
    with layerswap.patch_dict(foo, {"a": "b"}, clear=True):
        assert foo == {"a": "b"}
    assert foo == original


def test_patch_dict_with_container_object_and_clear():
    foo = Container()
    foo["initial"] = object()
    foo["other"] = "something"
    original = foo.values.copy()
    with layerswap.patch_dict(foo, clear=True):
        assert foo.values == {}
        foo["a"] = 3
    assert foo.values == original


def test_patch_dict_keyword_args():
    original = {"foo": "bar"}
    copy = original.copy()
    patcher = layerswap.patch_dict(original, foo=3, bar=4, baz=5)
    patcher.start()
    try:
        assert original == {"foo": 3, "bar": 4, "baz": 5}
    finally:
        patcher.stop()
    assert original == copy


def test_patch_dict_as_context_manager_returns_the_patch():
    # deliberate difference: mock's ``as`` gives the dict, layerswap's the patch object
    foo = {"a": "b"}
    with layerswap.patch_dict(foo, {"a": "c"}) as patched:
        assert isinstance(patched, DictPatch) and foo == {"a": "c"}
    assert foo == {"a": "b"}


def test_patch_with_exception_restores_dict():
    foo: dict[str, str] = {}
    with pytest.raises(NameError), layerswap.patch_dict(foo, {"a": "b"}):
        raise NameError("Konrad")
    assert foo == {}


def test_patch_dict_with_string():
    @layerswap.patch_dict("os.environ", {"konrad_delong": "some value"})
    def check():
        assert "konrad_delong" in os.environ

    check()
    assert "konrad_delong" not in os.environ


def test_patch_dict_decorator_resolution(something_module):
    # a string target resolves to the mapping bound when the call starts
    something_module.target = {"foo": "BAZ"}
    name = something_module.__name__

    @layerswap.patch_dict(f"{name}.target", {"bar": "BAR"})
    def check():
        assert something_module.target == {"foo": "NEW", "bar": "BAR"}

    something_module.target = {"foo": "NEW"}
    check()
    assert something_module.target == {"foo": "NEW"}


def test_patch_dict_start_stop():
    d = {"foo": "bar"}
    original = d.copy()
    patcher = layerswap.patch_dict(d, [("spam", "eggs")], clear=True)
    assert d == original
    patcher.start()
    assert d == {"spam": "eggs"}
    patcher.stop()
    assert d == original


def test_patch_dict_stop_without_start():
    d = {"foo": "bar"}
    patcher = layerswap.patch_dict(d, [("spam", "eggs")], clear=True)
    assert not patcher.stop()
    assert d == {"foo": "bar"}


def test_patch_dict_stopall():
    dic1: dict[int, str] = {}
    dic2 = {1: "a"}
    dic3 = {1: "A", 2: "B"}
    originals = [dic1.copy(), dic2.copy(), dic3.copy()]
    layerswap.patch_dict(dic1, {1: "I", 2: "II"}).start()
    layerswap.patch_dict(dic2, {2: "b"}).start()

    @layerswap.patch_dict(dic3)
    def patched():
        del dic3[1]

    patched()
    assert dic3 == originals[2]
    layerswap.restore_all()
    assert [dic1, dic2, dic3] == originals


def test_patch_and_patch_dict_stopall():
    unlink, chdir = os.unlink, os.chdir
    dic1: dict[int, str] = {}
    dic2 = {1: "A", 2: "B"}
    layerswap.patch(os, "unlink", PATCHED).start()
    layerswap.patch(os, "chdir", PATCHED).start()
    layerswap.patch_dict(dic1, {1: "I", 2: "II"}).start()
    layerswap.patch_dict(dic2).start()
    del dic2[1]  # changed inside the (still running) patch
    layerswap.restore_all()
    assert (os.unlink, os.chdir) == (unlink, chdir)
    assert dic1 == {} and dic2 == {1: "A", 2: "B"}
    assert list(dic2) == [1, 2]


def test_patch_orderdict():
    foo: OrderedDict[str, object] = OrderedDict()
    foo["a"] = object()
    foo["b"] = "python"
    original = foo.copy()
    update_values = list(zip("cdefghijklmnopqrstuvwxyz", range(24), strict=True))
    with layerswap.patch_dict(foo, OrderedDict(update_values)):
        assert list(foo.items()) == list(original.items()) + update_values
    assert list(foo.items()) == list(original.items())


def test_patch_dict_sys_modules_keeps_module_objects():
    before = dict(sys.modules)
    victim = "json"
    import json  # noqa: F401 - make sure it is there

    with layerswap.patch_dict("sys.modules", {}):
        del sys.modules[victim]
        sys.modules["ls_fake_module_added_inside"] = types.ModuleType("x")
    assert "ls_fake_module_added_inside" not in sys.modules
    assert all(sys.modules[name] is module for name, module in before.items())


# --- testwith.py: nested and sequential with-statements -------------------------------------


def test_with_statement_nested(something_module):
    with layerswap.patch(something_module, "something", "a"):  # noqa: SIM117 - nesting is the case
        with layerswap.patch(something_module, "something_else", "b"):
            assert (something_module.something, something_module.something_else) == ("a", "b")
    assert something_module.something is Original and something_module.something_else == "else"


def test_with_statement_same_attribute(something_module):
    with layerswap.patch(something_module, "something", "outer"):
        with layerswap.patch(something_module, "something", "inner"):
            assert something_module.something == "inner"
        assert something_module.something == "outer"
    assert something_module.something is Original


def test_with_statement_exception_restores(something_module):
    with pytest.raises(ValueError), layerswap.patch(something_module, "something", "x"):
        raise ValueError
    assert something_module.something is Original


def test_with_statement_imbricated_non_lifo_stop(something_module):
    # mock leaks here (stopping the outer patch first); layerswap restores exactly
    outer = layerswap.patch(something_module, "something", "outer").start()
    inner = layerswap.patch(something_module, "something", "inner").start()
    outer.stop()
    assert something_module.something == "inner"
    inner.stop()
    assert something_module.something is Original


def test_with_statement_as_patch_object_is_reported(something_module):
    with layerswap.patch(something_module, "something", "x") as active:
        assert active.is_active and active.new == "x"
    assert not active.is_active


def test_partialmethod_attribute_can_be_patched_and_restored():
    class Foo:
        def method(self, a, b, c=3):
            return a, b, c

        partial_method = functools.partialmethod(method, 1)

    raw = Foo.__dict__["partial_method"]
    with layerswap.patch(Foo, "partial_method", lambda self, b: ("patched", b)):
        assert Foo().partial_method(2) == ("patched", 2)
    assert Foo.__dict__["partial_method"] is raw and Foo().partial_method(2) == (1, 2, 3)


def test_error_names_the_missing_attribute_and_import(something_module):
    with pytest.raises(TargetAttributeError, match="no attribute 'nope'"):
        layerswap.patch(f"{something_module.__name__}:nope", 1).start()
    with pytest.raises(TargetImportError):
        layerswap.patch("ls_no_such_module_x:attr", 1).start()
