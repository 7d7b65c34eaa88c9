"""Scenarios from wrapt's ``tests/`` (monkey patching, function wrappers, binding), in layerswap's API.

``wrapt.wrap_function_wrapper(module, "name", wrapper)`` maps to
``layerswap.wrap(module, "name", wrapper)``; the advice convention is the same.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import sys
import types

import pytest

import layerswap

ARGS = (1, 2)
KWARGS = {"one": 1, "two": 2}


def global_function(*args, **kwargs):
    """global docstring"""
    return args, kwargs


class Class1:
    def method(self, *args, **kwargs):
        return args, kwargs


class Class2:
    @classmethod
    def method(cls, *args, **kwargs):
        return cls, args, kwargs


class Class2a1(Class2):
    pass


class Class2a2(Class2a1):
    pass


class Class3:
    @staticmethod
    def method(*args, **kwargs):
        return args, kwargs


HERE = sys.modules[__name__]


def recorder(expect_instance):
    calls = []

    def advice(wrapped, instance, args, kwargs):
        calls.append((instance, args, kwargs))
        if expect_instance is not ...:
            assert instance is expect_instance
        return wrapped(*args, **kwargs)

    return advice, calls


def test_wrap_function_module_name():
    advice, calls = recorder(None)
    original = HERE.__dict__["global_function"]
    with layerswap.wrap(f"{__name__}:global_function", advice):
        assert global_function(*ARGS, **KWARGS) == (ARGS, KWARGS)
    assert calls == [(None, ARGS, KWARGS)]
    assert HERE.__dict__["global_function"] is original


def test_wrap_function_module():
    advice, calls = recorder(None)
    original = HERE.__dict__["global_function"]
    with layerswap.wrap(HERE, "global_function", advice):
        assert global_function(*ARGS, **KWARGS) == (ARGS, KWARGS)
    assert calls and HERE.__dict__["global_function"] is original


def test_wrap_instance_method_module_name():
    instance = Class1()
    advice, calls = recorder(instance)
    with layerswap.wrap(f"{__name__}:Class1.method", advice):
        assert instance.method(*ARGS, **KWARGS) == (ARGS, KWARGS)
    assert calls == [(instance, ARGS, KWARGS)]


def test_wrap_instance_method_called_through_the_class():
    instance = Class1()
    advice, calls = recorder(instance)
    with layerswap.wrap(Class1, "method", advice):
        assert Class1.method(instance, *ARGS) == (ARGS, {})
    assert calls == [(instance, ARGS, {})]


def test_wrap_class_method_module_name():
    advice, calls = recorder(Class2)
    with layerswap.wrap(f"{__name__}:Class2.method", advice):
        assert Class2.method(*ARGS, **KWARGS) == (Class2, ARGS, KWARGS)
    assert calls


def test_wrap_class_method_inherited():
    advice, calls = recorder(...)
    with layerswap.wrap(f"{__name__}:Class2a1.method", advice):
        assert Class2a1.method(*ARGS) == (Class2a1, ARGS, {})
        assert Class2a2.method(*ARGS) == (Class2a2, ARGS, {})
    assert [instance for instance, _, _ in calls] == [Class2a1, Class2a2]
    assert "method" not in vars(Class2a1)


def test_wrap_static_method_module_name():
    advice, calls = recorder(None)
    with layerswap.wrap(f"{__name__}:Class3.method", advice):
        assert Class3.method(*ARGS, **KWARGS) == (ARGS, KWARGS)
        assert Class3().method(*ARGS) == (ARGS, {})
    assert len(calls) == 2


def test_patch_instance_method_instance():
    instance = Class1()
    advice, calls = recorder(instance)
    with layerswap.wrap(instance, "method", advice):
        assert instance.method(*ARGS, **KWARGS) == (ARGS, KWARGS)
        assert Class1().method() == ((), {})  # other instances untouched
    assert calls == [(instance, ARGS, KWARGS)]
    assert "method" not in vars(instance)


def test_wrapper_keeps_name_doc_module_and_signature():
    def advice(wrapped, instance, args, kwargs):
        return wrapped(*args, **kwargs)

    def documented(a, b=2, *, c):
        """the doc"""

    module = types.ModuleType("ls_wrapt_meta")
    module.documented = documented
    with layerswap.wrap(module, "documented", advice):
        wrapper = module.documented
        assert (wrapper.__name__, wrapper.__qualname__, wrapper.__doc__, wrapper.__module__) == (
            documented.__name__,
            documented.__qualname__,
            "the doc",
            documented.__module__,
        )
        assert inspect.signature(wrapper) == inspect.signature(documented)
        assert wrapper.__wrapped__ is documented


def test_wrapper_of_coroutine_function_is_a_coroutine_function():
    async def fetch(x):
        return x * 2

    module = types.ModuleType("ls_wrapt_async")
    module.fetch = fetch
    advice, calls = recorder(None)
    with layerswap.wrap(module, "fetch", advice):
        assert inspect.iscoroutinefunction(module.fetch)
        assert asyncio.run(module.fetch(3)) == 6
    assert len(calls) == 1


def test_wrapper_of_generator_function_is_a_generator_function():
    def count(n):
        yield from range(n)

    module = types.ModuleType("ls_wrapt_gen")
    module.count = count
    advice, _ = recorder(None)
    with layerswap.wrap(module, "count", advice):
        assert inspect.isgeneratorfunction(module.count)
        assert list(module.count(3)) == [0, 1, 2]


def test_wrapper_of_async_generator_function_relays_values():
    async def ticks(n):
        for i in range(n):
            yield i

    module = types.ModuleType("ls_wrapt_agen")
    module.ticks = ticks
    advice, _ = recorder(None)

    async def collect():
        return [i async for i in module.ticks(3)]

    with layerswap.wrap(module, "ticks", advice):
        assert inspect.isasyncgenfunction(module.ticks)
        assert asyncio.run(collect()) == [0, 1, 2]


def test_wrap_on_one_instance_is_a_real_bound_method():
    class Layer:
        def forward(self, x):
            """forward doc"""
            return x + 1

        async def aforward(self, x):
            return x + 2

    layer = Layer()
    advice, calls = recorder(layer)
    with layerswap.wrap(layer, "forward", advice), layerswap.wrap(layer, "aforward", advice):
        bound = layer.forward
        assert inspect.ismethod(bound) and bound.__self__ is layer
        assert bound.__func__.__wrapped__ is Layer.__dict__["forward"]
        assert inspect.signature(bound) == inspect.signature(Layer().forward)
        assert bound.__doc__ == "forward doc"
        assert bound(1) == 2
        assert inspect.iscoroutinefunction(layer.aforward)
        assert asyncio.run(layer.aforward(1)) == 3
    assert len(calls) == 2


def test_wrap_partialmethod_binds_it():
    class Foo:
        def method(self, a, b, c=3):
            return a, b, c

        partial_method = functools.partialmethod(method, 1)

    foo = Foo()
    advice, calls = recorder(...)
    with layerswap.wrap(Foo, "partial_method", advice):
        assert foo.partial_method(2) == (1, 2, 3)
    with layerswap.wrap(foo, "partial_method", advice):
        assert foo.partial_method(2, c=4) == (1, 2, 4)
    assert [instance for instance, _, _ in calls] == [foo, foo]


def test_wrap_inherited_method_sees_a_later_patch_of_the_base():
    class Base:
        def m(self):
            return "base"

    class Sub(Base):
        pass

    advice, calls = recorder(...)
    with layerswap.wrap(Sub, "m", advice):
        with layerswap.patch(Base, "m", lambda self: "patched base"):
            assert Sub().m() == "patched base"
        assert Sub().m() == "base"
    assert len(calls) == 2 and "m" not in vars(Sub)


def test_wrapper_chain_unwinds_in_any_order():
    module = types.ModuleType("ls_wrapt_chain")
    module.f = lambda: "f"

    def tag(label):
        def advice(wrapped, instance, args, kwargs):
            return f"{label}({wrapped(*args, **kwargs)})"

        return advice

    outer = layerswap.wrap(module, "f", tag("a")).start()
    inner = layerswap.wrap(module, "f", tag("b")).start()
    assert module.f() == "b(a(f))"
    outer.stop()
    assert module.f() == "b(f)"  # the stopped wrapper does not live on inside the other
    inner.stop()
    assert module.f() == "f"


def test_wrap_missing_method_does_not_advise_create():
    class Empty:
        pass

    with pytest.raises(AttributeError) as info:
        layerswap.wrap(Empty, "missing", lambda *a: None).start()
    assert "create=True" not in str(info.value) and "nothing to wrap" in str(info.value)


def test_wrap_non_callable_is_a_clear_error():
    class Holder:
        value = 3

    with pytest.raises(TypeError, match="not callable"):
        layerswap.wrap(Holder, "value", lambda *a: None).start()
    assert Holder.__dict__["value"] == 3
