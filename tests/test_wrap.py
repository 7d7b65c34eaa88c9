"""``layerswap.wrap`` binding and metadata, and ``safe_wraps`` (SPEC 1.3)."""

from __future__ import annotations

import functools
import inspect
import sys

import pytest
import torch

import layerswap
from layerswap.errors import TargetAttributeError, TargetTypeError

SOURCE = '''
def scale(x, factor=2):
    """Scale x."""
    return x * factor

class Thing:
    def method(self, x, y=1):
        """A method."""
        return ("method", x, y)

    @classmethod
    def build(cls, x):
        return ("build", cls.__name__, x)

    @staticmethod
    def helper(x):
        return ("helper", x)

class SubThing(Thing):
    pass
'''


@pytest.fixture
def mod(make_module):
    name = make_module("wrap", SOURCE)
    __import__(name)
    return sys.modules[name]


def recorder():
    calls = []

    def advice(wrapped, instance, args, kwargs):
        calls.append((instance, args, kwargs))
        return wrapped(*args, **kwargs)

    return advice, calls


def test_wrap_module_function_instance_is_none(mod):
    advice, calls = recorder()
    with layerswap.wrap(f"{mod.__name__}:scale", advice):
        assert mod.scale(3) == 6
    assert calls == [(None, (3,), {})]
    assert mod.scale(3) == 6 and len(calls) == 1


def test_wrap_instance_method_instance_is_the_object(mod):
    advice, calls = recorder()
    obj = mod.Thing()
    with layerswap.wrap(mod.Thing, "method", advice):
        assert obj.method(5, y=2) == ("method", 5, 2)
        assert mod.Thing.method(obj, 6) == ("method", 6, 1)  # called through the class
    assert calls[0] == (obj, (5,), {"y": 2})
    assert calls[1][0] is obj and calls[1][1] == (6,)


def test_wrap_classmethod_instance_is_the_class(mod):
    advice, calls = recorder()
    with layerswap.wrap(mod.Thing, "build", advice):
        assert mod.Thing.build(1) == ("build", "Thing", 1)
        assert mod.SubThing.build(2) == ("build", "SubThing", 2)
    assert calls[0][0] is mod.Thing and calls[1][0] is mod.SubThing
    assert isinstance(mod.Thing.__dict__["build"], classmethod)


def test_wrap_staticmethod_instance_is_none(mod):
    advice, calls = recorder()
    with layerswap.wrap(mod.Thing, "helper", advice):
        assert mod.Thing.helper(4) == ("helper", 4)
        assert mod.Thing().helper(5) == ("helper", 5)
    assert [c[0] for c in calls] == [None, None]
    assert isinstance(mod.Thing.__dict__["helper"], staticmethod)


def test_wrap_inherited_method_on_subclass_is_removed_after(mod):
    advice, calls = recorder()
    with layerswap.wrap(mod.SubThing, "method", advice):
        assert mod.SubThing().method(1) == ("method", 1, 1)
        assert mod.Thing().method(1) == ("method", 1, 1)
    assert len(calls) == 1
    assert "method" not in mod.SubThing.__dict__


def test_wrap_single_instance_only_and_removed_on_stop(mod):
    advice, calls = recorder()
    target, other = mod.Thing(), mod.Thing()
    with layerswap.wrap(target, "method", advice):
        assert "method" in vars(target)
        target.method(1)
        other.method(2)
    assert calls == [(target, (1,), {})]
    assert "method" not in vars(target)


def test_wrap_keeps_metadata_and_signature(mod):
    expected = inspect.signature(mod.scale)
    with layerswap.wrap(mod, "scale", recorder()[0]):
        wrapped = mod.scale
        assert wrapped.__name__ == "scale" and wrapped.__doc__ == "Scale x."
        assert wrapped.__qualname__ == "scale" and wrapped.__module__ == mod.__name__
        assert wrapped.__wrapped__ is not None
        assert inspect.signature(wrapped) == expected
    obj = mod.Thing()
    bound_signature = inspect.signature(obj.method)
    with layerswap.wrap(obj, "method", recorder()[0]):
        assert inspect.signature(obj.method) == bound_signature
        assert obj.method.__name__ == "method"
    with layerswap.wrap(mod.Thing, "method", recorder()[0]):
        assert inspect.signature(obj.method) == bound_signature
        assert mod.Thing.method.__doc__ == "A method."


def test_wrap_nn_module_forward_on_one_layer(mod):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    x = torch.randn(1, 2)
    expected = model(x)
    seen = []

    def advice(wrapped, instance, args, kwargs):
        seen.append(instance)
        return wrapped(*args, **kwargs)

    with layerswap.wrap(model[1], "forward", advice):
        assert torch.equal(model(x), expected)
        assert list(inspect.signature(model[1].forward).parameters) == ["input"]
    assert seen == [model[1]]
    assert "forward" not in vars(model[1])


def test_wrap_composes_with_an_existing_patch_and_unwinds_in_any_order(mod):
    patch = layerswap.patch(mod, "scale", lambda x, factor=2: x + factor).start()
    wrap = layerswap.wrap(mod, "scale", lambda w, i, a, k: ("wrapped", w(*a, **k))).start()
    assert mod.scale(1) == ("wrapped", 3)
    patch.stop()  # non-LIFO: the wrap stays on top, now around the original
    assert mod.scale(1) == ("wrapped", 2)
    wrap.stop()
    assert mod.scale(1) == 2
    assert mod.scale.__name__ == "scale" and not hasattr(mod.scale, "__wrapped__")


def test_stopping_the_lower_of_two_wraps_leaves_only_the_upper(mod):
    calls = []

    def tag(name):
        def advice(wrapped, instance, args, kwargs):
            calls.append(name)
            return wrapped(*args, **kwargs)

        return advice

    for owner, attribute, call in [
        (mod, "scale", lambda: mod.scale(1)),
        (mod.Thing, "method", lambda: mod.Thing().method(1)),
    ]:
        lower = layerswap.wrap(owner, attribute, tag("lower")).start()
        upper = layerswap.wrap(owner, attribute, tag("upper")).start()
        lower.stop()
        calls.clear()
        call()
        assert calls == ["upper"]
        upper.stop()
        calls.clear()
        call()
        assert calls == []


def test_wrap_accepts_objects_with_layerswap_advice(mod):
    class Doubler:
        def __layerswap_advice__(self, wrapped, instance, args, kwargs):
            return 2 * wrapped(*args, **kwargs)

    with layerswap.wrap(mod, "scale", Doubler()):
        assert mod.scale(1) == 4


def test_wrap_of_non_callable_or_missing_is_a_clear_error(mod):
    with pytest.raises(TargetTypeError, match="not callable"):
        layerswap.wrap(mod, "__name__", recorder()[0]).start()
    with pytest.raises(TargetAttributeError):
        layerswap.wrap(mod, "no_such_function", recorder()[0]).start()
    assert layerswap.active_patches() == []


# --- safe_wraps -----------------------------------------------------------------------------------


@pytest.mark.slow  # torch.compile
def test_functools_wraps_copies_compile_entry_points_safe_wraps_does_not():
    def step(x):
        return x + 1

    compiled = torch.compile(step, backend="eager")

    @functools.wraps(compiled)
    def naive(x):
        return compiled(x)

    @layerswap.safe_wraps(compiled)
    def safe(x):
        return compiled(x)

    with pytest.raises(AssertionError, match="get_compiler_config"):
        torch.compile(naive, backend="eager")(torch.ones(1))  # the pitfall safe_wraps avoids
    leaked = {k for k in vars(naive) if k != "__wrapped__"}
    assert leaked, "torch.compile results carry entry points that functools.wraps copies"
    assert not {k for k in vars(safe) if k != "__wrapped__"} & leaked
    assert safe.__name__ == "step" and inspect.signature(safe) == inspect.signature(step)


@pytest.mark.slow  # torch.compile
def test_torch_compile_of_a_safe_wraps_wrapper_runs_the_wrapper():
    calls = []

    def step(x):
        return x * 2

    compiled = torch.compile(step, backend="eager")

    @layerswap.safe_wraps(compiled)
    def logged(x):
        calls.append("wrapper")
        return compiled(x)

    recompiled = torch.compile(logged, backend="eager")
    assert torch.equal(recompiled(torch.ones(2)), torch.full((2,), 2.0))
    assert calls == ["wrapper"]


def test_safe_wraps_keeps_plain_data_markers():
    def f():
        pass

    f.is_test = True
    f._private = "hidden"
    f.helper = lambda: None

    @layerswap.safe_wraps(f)
    def g():
        pass

    assert g.is_test is True
    assert not hasattr(g, "_private") and not hasattr(g, "helper")
    assert g.__wrapped__ is f


def test_an_async_generator_method_wrapped_on_one_instance_relays_athrow_and_aclose():
    """What is thrown into (or closes) the wrapped generator reaches the method's own, as
    it does wrapped on the class: its handlers and its ``finally`` run."""
    import asyncio

    log = []

    class Stream:
        async def items(self):
            try:
                yield 1
                yield 2
            except ValueError:
                log.append("caught")
                yield 3
            finally:
                log.append("finally")

    def passthrough(wrapped, instance, args, kwargs):
        return wrapped(*args, **kwargs)

    async def run(stream):
        agen = stream.items()
        first = await agen.__anext__()
        recovered = await agen.athrow(ValueError())
        await agen.aclose()
        return first, recovered

    stream = Stream()
    with layerswap.wrap(stream, "items", passthrough):
        assert inspect.isasyncgenfunction(stream.items)
        assert asyncio.run(run(stream)) == (1, 3)
    assert log == ["caught", "finally"]
