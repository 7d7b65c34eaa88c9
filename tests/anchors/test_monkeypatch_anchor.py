"""Scenarios from pytest's ``testing/test_monkeypatch.py``, in layerswap's API.

``setattr``/``setitem``/``setenv`` map to ``patch``/``patch_dict``; ``undo()`` to
stopping (or ``restore_all``). chdir/syspath and plugin-only cases have no counterpart.
"""

from __future__ import annotations

import dataclasses
import os
import os.path
from types import MappingProxyType

import pytest

import layerswap
from layerswap.errors import TargetImportError


def test_setattr():
    class A:
        x = 1

    with pytest.raises(AttributeError):
        layerswap.patch(A, "notexists", 2).start()
    with layerswap.patch(A, "y", 2, create=True):
        assert A.y == 2  # type: ignore[attr-defined]
    assert not hasattr(A, "y")

    first = layerswap.patch(A, "x", 2).start()
    second = layerswap.patch(A, "x", 3).start()
    assert A.x == 3
    layerswap.restore_all()
    assert A.x == 1
    A.x = 5
    first.stop()  # double undo changes nothing
    second.stop()
    assert A.x == 5


class TestSetattrWithImportPath:
    def test_string_expression(self):
        with layerswap.patch("os.path.abspath", lambda x: "hello2"):
            assert os.path.abspath("123") == "hello2"

    def test_string_expression_class(self):
        with layerswap.patch("_pytest.config.Config", 42):
            import _pytest.config

            assert _pytest.config.Config == 42  # type: ignore[comparison-overlap]

    def test_wrong_target(self):
        with pytest.raises(TypeError):
            layerswap.patch(None, None)  # type: ignore[call-overload]

    def test_unknown_import(self):
        with pytest.raises(ImportError):
            layerswap.patch("unkn123.classx", None).start()

    def test_unknown_attr(self):
        with pytest.raises(AttributeError):
            layerswap.patch("os.path.qweqwe", None).start()

    def test_unknown_attr_non_raising(self):
        with layerswap.patch("os.path.qweqwe", 42, create=True):
            assert os.path.qweqwe == 42  # type: ignore[attr-defined]
        assert not hasattr(os.path, "qweqwe")

    def test_setattr_failure_does_not_corrupt_undo(self):
        class Immutable:
            __slots__ = ()

        target = Immutable()
        with pytest.raises(AttributeError):  # as Python's own `target.x = 42`
            layerswap.patch(target, "x", 42, create=True).start()
        assert layerswap.active_patches() == []


def test_setitem():
    d = {"x": 1}
    with layerswap.patch_dict(d, {"x": 2, "y": 1700}):
        assert d == {"x": 2, "y": 1700}
        with layerswap.patch_dict(d, {"x": 3}):
            assert d["x"] == 3
    assert d == {"x": 1}


def test_setitem_deleted_meanwhile():
    d: dict[str, object] = {}
    with layerswap.patch_dict(d, {"x": 2}):
        del d["x"]
    assert not d


@pytest.mark.parametrize("before", [True, False])
def test_setenv_deleted_meanwhile(before):
    key = "qwpeoip123"
    if before:
        os.environ[key] = "world"
    try:
        with layerswap.patch_dict(os.environ, {key: "hello"}):
            del os.environ[key]
        if before:
            assert os.environ[key] == "world"
        else:
            assert key not in os.environ
    finally:
        os.environ.pop(key, None)


def test_delitem_and_later_changes():
    d: dict[str, object] = {"x": 1}
    with layerswap.patch_dict(d):
        del d["x"]
        d["y"] = 1700
        d["hello"] = "world"
    # deliberate difference: monkeypatch keeps keys the test set itself
    # ("hello"); patch_dict puts back exactly the state before the block
    assert d == {"x": 1}


def test_failed_setitem_changes_nothing():
    mapping = MappingProxyType({"x": 1})
    with pytest.raises(TypeError):
        layerswap.patch_dict(mapping, {"x": 2}).start()  # type: ignore[arg-type]
    assert mapping["x"] == 1 and layerswap.active_patches() == []


def test_setitem_delitem_oldval_captured_before_mutation():
    inner = {"x": 1, "y": 2}
    with layerswap.patch_dict(inner, {"x": 99}):
        del inner["y"]
    assert inner == {"x": 1, "y": 2} and list(inner) == ["x", "y"]


def test_setenv_and_delenv():
    name = "xyz1234"
    assert name not in os.environ
    os.environ[name] = "1"
    try:
        with layerswap.patch_dict(os.environ):
            del os.environ[name]
            with layerswap.patch_dict(os.environ, {name: "3"}):
                assert os.environ[name] == "3"
            assert name not in os.environ
        assert os.environ[name] == "1"
    finally:
        os.environ.pop(name, None)


def test_issue185_time_breaks():
    import time

    def broken():
        raise Exception

    with layerswap.patch(time, "time", broken):
        pass
    assert isinstance(time.time(), float)


def test_importerror(make_module):
    # a module that exists but imports a missing dependency: the real ImportError
    broken = make_module("broken", "import doesnotexist_ls\n\nx = 1\n")
    with pytest.raises(TargetImportError, match="doesnotexist_ls"):
        layerswap.patch(f"{broken}.x", 2).start()


class Sample:
    @staticmethod
    def hello() -> bool:
        return True


class SampleInherit(Sample):
    pass


@pytest.mark.parametrize("sample", [Sample, SampleInherit], ids=["new", "new-inherit"])
def test_issue156_undo_staticmethod(sample):
    with layerswap.patch(sample, "hello", None):
        assert sample.hello is None
    assert sample.hello()
    assert ("hello" in vars(sample)) == (sample is Sample)


def test_undo_class_descriptors_delattr():
    # monkeypatch.delattr has no direct counterpart; replacing with a value and
    # stopping must give back the very same descriptor objects
    class SampleParent:
        @classmethod
        def hello(cls):
            pass

        @staticmethod
        def world():
            pass

    class SampleChild(SampleParent):
        pass

    raw = dict(vars(SampleParent))
    with layerswap.patch(SampleParent, "hello", None), layerswap.patch(SampleParent, "world", None):
        assert SampleChild.hello is None and SampleChild.world is None
    assert vars(SampleParent)["hello"] is raw["hello"]
    assert vars(SampleParent)["world"] is raw["world"]


def test_undo_inherited_attribute_on_instance():
    class Parent:
        x = 1

    class Child(Parent):
        pass

    obj = Child()
    with layerswap.patch(obj, "x", 2):
        assert obj.x == 2 and vars(obj)["x"] == 2
    assert obj.x == 1 and "x" not in vars(obj)


def test_undo_inherited_non_data_descriptor_on_instance():
    class Dynamic:
        def __init__(self):
            self.calls = 0

        def __get__(self, instance, owner=None):
            self.calls += 1
            return self.calls

    class Sample:
        value = Dynamic()

    obj = Sample()
    with layerswap.patch(obj, "value", -1):
        assert obj.value == -1
    assert "value" not in vars(obj)
    assert obj.value != obj.value


def test_undo_inherited_method_on_instance():
    class Sample:
        def hello(self):
            return "hello"

    obj = Sample()
    with layerswap.patch(obj, "hello", lambda: "patched"):
        assert obj.hello() == "patched"
    assert obj.hello() == "hello" and "hello" not in vars(obj)


def test_undo_own_attribute_on_instance():
    class Sample:
        x = "class"

        def __init__(self):
            self.x = "instance"

    obj = Sample()
    with layerswap.patch(obj, "x", "patched"):
        assert obj.x == "patched"
    assert vars(obj)["x"] == "instance"


def test_undo_data_descriptor_on_instance():
    class Sample:
        def __init__(self):
            self._x = 1

        @property
        def x(self):
            return self._x

        @x.setter
        def x(self, value):
            self._x = value

    obj = Sample()
    with layerswap.patch(obj, "x", 2):
        assert obj.x == 2
    assert obj.x == 1 and "x" not in vars(obj)


def test_undo_slot_attribute_on_instance():
    class Sample:
        __slots__ = ("x",)

        def __init__(self):
            self.x = 1

    obj = Sample()
    with layerswap.patch(obj, "x", 2):
        assert obj.x == 2
    assert obj.x == 1


def test_undo_custom_setattr_on_instance():
    class Config:
        def __init__(self):
            object.__setattr__(self, "_data", {"debug": False})

        def __getattr__(self, name):
            try:
                return self._data[name]
            except KeyError:
                raise AttributeError(name) from None

        def __setattr__(self, name, value):
            self._data[name] = value

    cfg = Config()
    with layerswap.patch(cfg, "debug", True):
        assert cfg.debug is True
    assert cfg.debug is False


def test_read_only_targets_raise_attribute_error_like_python():
    @dataclasses.dataclass(frozen=True)
    class Frozen:
        x: int = 1

    class ReadOnly:
        @property
        def x(self):
            return 1

    for obj in (Frozen(), ReadOnly()):
        with pytest.raises(AttributeError):
            layerswap.patch(obj, "x", 2).start()
        assert obj.x == 1
    assert layerswap.active_patches() == []


def test_context():
    import functools
    import inspect

    with layerswap.patch(functools, "partial", 3):
        assert not inspect.isclass(functools.partial)
    assert inspect.isclass(functools.partial)
