"""``wrap``: around-advice on a function or method, with correct binding.

The advice follows wrapt's convention, ``advice(wrapped, instance, args, kwargs)``,
where ``instance`` is what the method is bound to:

========================  =====================  ==========================
what is wrapped           ``instance``           ``wrapped``
========================  =====================  ==========================
module-level function     ``None``               the function
instance method           the instance           the bound method
classmethod               the class              the bound classmethod
staticmethod              ``None``               the function
one instance's method     that instance          the bound method
========================  =====================  ==========================

How the wrapper is built (measured, see docs/benchmarks.md):

* a module-level function gets a plain Python closure made with
  :func:`safe_update_wrapper` — a call costs one extra frame, far less than a
  generic proxy object. It has the same kind as the original: an ``async def``
  closure for a coroutine function, a generator for a generator function, so
  ``inspect.iscoroutinefunction`` and friends answer as for the original;
* a class attribute gets a ``wrapt.FunctionWrapper``: it is a descriptor, so it
  binds exactly like the function/classmethod/staticmethod/``partialmethod`` it
  wraps. A method the class *inherits* is looked up in the bases at each access
  (not captured at start), so a later patch of the base class shows through;
* one instance gets a real bound method, what ``new.__get__(obj, cls)`` gives
  (``inspect.ismethod``, ``__self__``, ``__func__``), stored in the instance
  ``__dict__`` and removed on stop so the class's method shows again.

Every wrapper keeps ``__name__``, ``__qualname__``, ``__doc__``, ``__module__``,
``__wrapped__`` and therefore ``inspect.signature`` of the original.
"""

from __future__ import annotations

import inspect
import types
from collections.abc import Callable
from typing import Any, overload

from layerswap.errors import TargetAttributeError, TargetTypeError
from layerswap.patching.patch import Patch
from layerswap.patching.sites import NOTSET, Site
from layerswap.patching.target import ParsedTarget
from layerswap.patching.wraps import delegating_async_generator, forwarder, safe_update_wrapper

__all__ = ["Advice", "bound_arguments", "wrap"]

Advice = Callable[[Callable[..., Any], Any, tuple[Any, ...], dict[str, Any]], Any]


def bound_arguments(
    wrapped: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> dict[str, Any] | None:
    """The arguments of a call advice sees, by parameter name; ``None`` where ``wrapped``
    would refuse the call itself (its error is the one to raise, not the advice's).

    Example::

        def advice(wrapped, instance, args, kwargs):
            arguments = bound_arguments(wrapped, args, kwargs)
            if arguments is None:
                return wrapped(*args, **kwargs)
    """
    try:
        return dict(inspect.signature(wrapped).bind(*args, **kwargs).arguments)
    except TypeError:
        return None


def _advice_of(wrapper: Any) -> Advice:
    advice = getattr(wrapper, "__layerswap_advice__", wrapper)
    if not callable(advice):
        raise TargetTypeError(
            "wrap() needs a wrapper callable(wrapped, instance, args, kwargs) or an object with "
            f"__layerswap_advice__, got {wrapper!r}"
        )
    return advice  # type: ignore[no-any-return]


def _closure(wrapped: Callable[..., Any], instance: Any, advice: Advice) -> Callable[..., Any]:
    if _plain(wrapped):

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            return advice(wrapped, instance, args, kwargs)

        return safe_update_wrapper(wrapper, wrapped)
    return forwarder(wrapped, lambda *args, **kwargs: advice(wrapped, instance, args, kwargs))


def _plain(func: Any) -> bool:
    """A sync function that is no generator: the cheap closure fits it."""
    return not (
        inspect.iscoroutinefunction(func)
        or inspect.isgeneratorfunction(func)
        or inspect.isasyncgenfunction(func)
    )


def _bound_method(
    wrapped: Callable[..., Any], function: Any, bind_to: Any, advice: Advice
) -> types.MethodType:
    """``new.__get__(bind_to)``: a real bound method around ``wrapped`` (already bound).

    ``function`` is the unbound original (with ``self``): it gives the metadata, so
    ``inspect.signature`` of the bound method drops ``self`` as for the original.
    """
    if _plain(wrapped):

        def method(self: Any, *args: Any, **kwargs: Any) -> Any:
            return advice(wrapped, self, args, kwargs)

        new = safe_update_wrapper(method, function)
    else:
        forwarded = forwarder(
            wrapped, lambda *args, **kwargs: advice(wrapped, bind_to, args, kwargs)
        )
        # the forwarder takes the bound arguments; the method must accept self first
        new = _drop_self(forwarded, function)
    return types.MethodType(new, bind_to)


def _drop_self(forwarded: Callable[..., Any], function: Any) -> Callable[..., Any]:
    method: Callable[..., Any]
    if inspect.iscoroutinefunction(forwarded):

        async def method(self: Any, *args: Any, **kwargs: Any) -> Any:
            return await forwarded(*args, **kwargs)

    elif inspect.isasyncgenfunction(forwarded):
        # values sent, exceptions thrown (athrow) and aclose all reach the inner generator
        method = delegating_async_generator(
            lambda _self, *args, **kwargs: forwarded(*args, **kwargs)
        )

    else:

        def method(self: Any, *args: Any, **kwargs: Any) -> Any:
            return (yield from forwarded(*args, **kwargs))

    return safe_update_wrapper(method, function)


class _InheritedWrapper:
    """``wrap(Sub, "m")`` where ``Sub`` inherits ``m``: wraps whatever the bases hold *now*.

    Capturing the base's method at start would hide a later ``patch(Base, "m")``
    from ``Sub``; instead the method is looked up past ``Sub`` at each access and a
    ``wrapt.FunctionWrapper`` is built for it once per distinct object.
    """

    __slots__ = ("__weakref__", "_advice", "_cache", "_name", "_owner")

    def __init__(self, owner: type, name: str, advice: Advice) -> None:
        self._owner = owner
        self._name = name
        self._advice = advice
        self._cache: tuple[Any, Any] = (NOTSET, None)

    def _current(self) -> Any:
        import wrapt

        raw = _class_raw(self._owner, self._name, skip_self=True)
        cached_raw, wrapper = self._cache  # one tuple: read and replaced atomically
        if raw is not cached_raw:
            if raw is NOTSET:
                raise AttributeError(self._name)
            wrapper = wrapt.FunctionWrapper(raw, self._advice)
            self._cache = (raw, wrapper)
        return wrapper

    def __get__(self, instance: Any, owner: type | None = None) -> Any:
        return self._current().__get__(instance, owner)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._current()(*args, **kwargs)

    @property
    def __wrapped__(self) -> Any:
        return self._current().__wrapped__

    def __repr__(self) -> str:
        return f"<wrap of {self._owner.__qualname__}.{self._name}, inherited>"


def _class_raw(klass: type, name: str, skip_self: bool) -> Any:
    for base in klass.__mro__[1:] if skip_self else klass.__mro__:
        if name in base.__dict__:
            return base.__dict__[name]
    return NOTSET


def _make_wrapper(advice: Advice, label: Callable[[], str]) -> Callable[[Site, Any], Any]:
    import wrapt

    def build(site: Site, below: Any) -> Any:
        owner, name = site.owner, site.name
        if isinstance(owner, type):
            if below is NOTSET:
                _require_wrappable(_class_raw(owner, name, skip_self=True), label)
                return _InheritedWrapper(owner, name, advice)
            _require_wrappable(below, label)
            return wrapt.FunctionWrapper(below, advice)
        if isinstance(owner, types.ModuleType):
            raw = below if below is not NOTSET else getattr(owner, name, NOTSET)
            _require_wrappable(raw, label)
            return _closure(raw, None, advice)
        if below is not NOTSET:  # a value in the instance's own __dict__
            _require_wrappable(below, label)
            if type(below) is types.MethodType and below.__self__ is owner:
                return _bound_method(below, below.__func__, owner, advice)  # a wrap below
            return _closure(below, owner, advice)
        # One instance, method from its class: bind as the class's method would.
        klass = type(owner)
        raw = _class_raw(klass, name, skip_self=False)
        if raw is NOTSET:  # provided by __getattr__
            raw = getattr(owner, name, NOTSET)
            _require_wrappable(raw, label)
            return _closure(raw, owner, advice)
        _require_wrappable(raw, label)
        if isinstance(raw, types.FunctionType):
            return _bound_method(raw.__get__(owner, klass), raw, owner, advice)
        if isinstance(raw, staticmethod):
            return _closure(raw.__func__, None, advice)
        if isinstance(raw, classmethod):
            return _bound_method(raw.__get__(owner, klass), raw.__func__, klass, advice)
        bind = getattr(type(raw), "__get__", None)
        bound = raw if bind is None else bind(raw, owner, klass)
        return _closure(bound, owner, advice)  # partialmethod, callable objects

    return build


def _require_wrappable(raw: Any, label: Callable[[], str]) -> None:
    if raw is NOTSET:
        raise TargetAttributeError(f"cannot wrap {label()}: there is nothing to wrap")
    kind = type(raw)
    binds = hasattr(kind, "__get__") and not (
        hasattr(kind, "__set__") or hasattr(kind, "__delete__")
    )
    if not (callable(raw) or binds):  # a partialmethod is not callable, but binds to one
        raise TargetTypeError(f"cannot wrap {label()}: {raw!r} is not callable")


@overload
def wrap(target: str, wrapper: Any, /, *, lazy: bool = ..., aliases: bool = ...) -> Patch: ...


@overload
def wrap(
    target: object, attribute: str, wrapper: Any, /, *, lazy: bool = ..., aliases: bool = ...
) -> Patch: ...


def wrap(target: Any, *args: Any, lazy: bool = False, aliases: bool = False) -> Patch:
    """Wrap a function or method with around-advice; a patch like any other.

    ``wrapper(wrapped, instance, args, kwargs)`` is called instead of the original;
    it decides whether and how to call ``wrapped``. An object with a
    ``__layerswap_advice__`` attribute (every decorator in
    :mod:`layerswap.decorators`) is accepted too.

    Example::

        def timed(wrapped, instance, args, kwargs):
            start = time.perf_counter()
            try:
                return wrapped(*args, **kwargs)
            finally:
                print(type(instance).__name__, time.perf_counter() - start)

        with layerswap.wrap("transformers.models.llama.modeling_llama:LlamaMLP.forward", timed):
            model(input_ids)
        with layerswap.wrap(model.model.layers[0], "forward", timed):  # this layer only
            model(input_ids)
    """
    if isinstance(target, str):
        if len(args) != 1:
            raise TargetTypeError(
                f"wrap({target!r}, wrapper) takes the wrapper as its second argument"
            )
        parsed = ParsedTarget(target)
        patch = Patch(None, None, args[0], lazy=lazy, aliases=aliases, _parsed=parsed)
    else:
        if len(args) != 2 or not isinstance(args[0], str) or not args[0]:
            raise TargetTypeError(
                "wrap() takes 'pkg.mod:Name' and a wrapper, or an object, an attribute name "
                "and a wrapper: wrap(obj, 'method', wrapper)"
            )
        patch = Patch(target, args[0], args[1], lazy=lazy, aliases=aliases)
    patch._set_factory(_make_wrapper(_advice_of(args[-1]), patch._label))
    return patch
