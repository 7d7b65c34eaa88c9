"""The one mechanism behind every decorator: around-advice, and a decorator built from it.

Each decorator in this package is an object whose logic is around-advice in wrapt's
convention ``(wrapped, instance, args, kwargs)``, written once as hooks (see
:class:`Advice`): what runs before the call, after it returned, after it ended. The
base class runs the hooks around a sync call and around an awaited one, and one
adapter picks between the two by the function, for both faces of the object:

* ``obj(func)`` returns a plain function made with :func:`layerswap.safe_wraps`.
  Being a plain function, it binds as a method like any other (``args[0]`` is then
  ``self`` and ``instance`` is ``None``), and ``inspect.signature`` sees the original.
* ``obj.__layerswap_advice__`` is what :func:`layerswap.wrap` calls, so the same
  object can be put around a method of a live model for a while and taken off again.
"""

from __future__ import annotations

import inspect
import sys
import types
from collections.abc import Callable
from typing import Any, TypeAlias, TypeVar

from layerswap.patching import safe_wraps
from layerswap.patching.wraps import delegating_async_generator
from layerswap.stacklevels import external_stacklevel

__all__ = [
    "Advice",
    "Answer",
    "Args",
    "Kwargs",
    "Wrapped",
    "describe",
    "external_stacklevel",
    "is_async_callable",
    "loaded_torch",
]

F = TypeVar("F", bound=Callable[..., Any])

#: The three arguments of advice besides ``instance``, named so hooks fit on one line.
Wrapped: TypeAlias = Callable[..., Any]
Args: TypeAlias = tuple[Any, ...]
Kwargs: TypeAlias = dict[str, Any]

_CO_COROUTINE = inspect.CO_COROUTINE


def is_async_callable(func: Callable[..., Any]) -> bool:
    """Whether calling ``func`` returns a coroutine (cheap for plain functions and methods)."""
    target = func.__func__ if type(func) is types.MethodType else func
    if type(target) is types.FunctionType:
        return bool(target.__code__.co_flags & _CO_COROUTINE)
    # partials, callable objects, wrapt proxies: let inspect decide
    return inspect.iscoroutinefunction(func)


def describe(wrapped: Callable[..., Any], instance: Any) -> str:
    """``Class.method`` for a method, the qualified name for a function.

    With an ``instance`` (the advice form) the class is the instance's own, so a
    subclass shows under its name; otherwise the function's ``__qualname__`` is used,
    without the enclosing function of a local definition.
    """
    if instance is None:
        name = getattr(wrapped, "__qualname__", None)
        if not isinstance(name, str):
            return repr(wrapped)
        # "outer.<locals>.Block.forward" -> "Block.forward": the enclosing function is noise
        return name.rpartition("<locals>.")[2] if "<locals>" in name else name
    owner = instance if isinstance(instance, type) else type(instance)
    return owner.__name__ + "." + getattr(wrapped, "__name__", "<callable>")


def loaded_torch() -> types.ModuleType | None:
    """``torch`` if something already imported it, else ``None``.

    Decorators that only *react* to tensors use this instead of importing torch:
    if torch was never imported, no argument can be a tensor and no device can hold
    memory, and ``import layerswap.decorators`` stays cheap.
    """
    return sys.modules.get("torch")


def _decoratable(obj: Any) -> bool:
    return isinstance(
        obj, (types.FunctionType, types.MethodType, classmethod, staticmethod)
    ) or inspect.isbuiltin(obj)


class Answer:
    """What a ``_before`` hook returns to answer a call without making it (a cache hit)."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value


_HOOKS = ("_before", "_returned", "_after")
# The sets of hooks Advice documents. Another set is refused when the class is defined,
# so that a new combination is a decision, not an accident: ``_returned`` alone gets no
# token worth having, ``_returned`` with ``_after`` would need an order nobody chose.
_HOOK_SETS = frozenset({("_before",), ("_before", "_returned"), ("_after",), ("_before", "_after")})


class Advice:
    """Base class of the decorators: say what happens around a call, get both faces.

    A subclass defines the hooks it needs; the others do nothing:

    * ``_before(wrapped, instance, args, kwargs)`` runs before the call and may raise
      to stop it. What it returns is the call's token, handed to the other hooks; an
      :class:`Answer` instead answers the call without making it (a cache hit), and
      then no other hook runs.
    * ``_returned(wrapped, instance, token, result)`` runs after the call returned.
    * ``_after(wrapped, instance, token)`` runs after the call, returned or raised.

    Supported sets: ``_before``; ``_before`` and ``_returned``; ``_after``;
    ``_before`` and ``_after``. Advice of another shape (one that calls the function
    more than once, say) writes ``_advice`` and ``_async_advice`` itself, and then
    the hooks are not used.

    One adapter turns the advice into both faces, for sync and async functions alike
    (generator functions count as sync: the advice runs around the call that creates
    the generator, not around its iteration).

    Example (a subclass)::

        class counted(Advice):
            def __init__(self) -> None:
                self.calls = 0

            def _before(self, wrapped, instance, args, kwargs):
                self.calls += 1

        @counted()
        async def fetch(url): ...
    """

    __slots__ = ()

    _bare: bool = True
    """Whether ``@decorator`` without parentheses means ``@decorator()``. False where
    the first positional parameter may itself be a callable (``profiled``'s sink)."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        if len(args) == 1 and not kwargs and cls._bare and _decoratable(args[0]):
            return cls._bare_decorate(args[0])  # @nan_guard: the defaults
        return super().__new__(cls)

    @classmethod
    def _bare_decorate(cls, func: Any) -> Any:
        return cls()(func)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls._advice is not Advice._advice:
            return  # written by hand, here or in a base class: the hooks are not used
        hooks = tuple(hook for hook in _HOOKS if getattr(cls, hook) is not getattr(Advice, hook))
        if hooks and hooks not in _HOOK_SETS:
            raise TypeError(
                f"{cls.__name__} defines {', '.join(hooks)}: no advice has that shape; "
                "write _advice and _async_advice instead"
            )

    # -- the hooks: by default nothing happens -------------------------------------

    def _before(self, wrapped: Wrapped, instance: Any, args: Args, kwargs: Kwargs) -> Any:
        return None

    def _returned(self, wrapped: Wrapped, instance: Any, token: Any, result: Any) -> None:
        return None

    def _after(self, wrapped: Wrapped, instance: Any, token: Any) -> None:
        return None

    # -- the advice the hooks make, once for sync and once for async functions -----

    def _advice(self, wrapped: Wrapped, instance: Any, args: Args, kwargs: Kwargs) -> Any:
        token = self._before(wrapped, instance, args, kwargs)
        # None, the commonest token, skips the isinstance
        if token is not None and isinstance(token, Answer):
            return token.value
        try:
            result = wrapped(*args, **kwargs)
            self._returned(wrapped, instance, token, result)
        finally:
            self._after(wrapped, instance, token)
        return result

    async def _async_advice(
        self, wrapped: Wrapped, instance: Any, args: Args, kwargs: Kwargs
    ) -> Any:
        token = self._before(wrapped, instance, args, kwargs)
        # None, the commonest token, skips the isinstance
        if token is not None and isinstance(token, Answer):
            return token.value
        try:
            result = await wrapped(*args, **kwargs)
            self._returned(wrapped, instance, token, result)
        finally:
            self._after(wrapped, instance, token)
        return result

    # -- the adapter: the two faces ------------------------------------------------

    def __layerswap_advice__(
        self, wrapped: Wrapped, instance: Any, args: Args, kwargs: Kwargs
    ) -> Any:
        """Around-advice for :func:`layerswap.wrap`: returns a coroutine for async targets."""
        if is_async_callable(wrapped):
            return self._async_advice(wrapped, instance, args, kwargs)
        return self._advice(wrapped, instance, args, kwargs)

    def _decorated(self, wrapper: Callable[..., Any]) -> None:
        """Hook: called with each wrapper the decorator form builds (e.g. to attach methods)."""

    #: why a generator function cannot take this advice (the call returns the generator
    #: before any of its code runs); ``None``: it can
    refuses_generators: str | None = None

    def __call__(self, func: F) -> F:
        if isinstance(func, (classmethod, staticmethod)):
            # Decorating above @classmethod/@staticmethod: wrap the function inside and
            # rebuild the descriptor, so binding still happens in the class.
            return type(func)(self(func.__func__))  # type: ignore[return-value]
        if not callable(func):
            raise TypeError(
                f"{type(self).__name__}(...) decorates a callable, got {type(func).__name__}; "
                f"write @{type(self).__name__}(...) with the parentheses"
            )
        if self.refuses_generators is not None and (
            inspect.isgeneratorfunction(func) or inspect.isasyncgenfunction(func)
        ):
            raise TypeError(
                f"{type(self).__name__}(...) cannot decorate {getattr(func, '__qualname__', func)}"
                f", a generator function: {self.refuses_generators}"
            )
        wrapper: Callable[..., Any]
        if is_async_callable(func):
            async_advice = self._async_advice

            @safe_wraps(func)
            async def async_wrapper(*args: Any, **kwargs: Any) -> Any:
                return await async_advice(func, None, args, kwargs)

            wrapper = async_wrapper
        elif inspect.isasyncgenfunction(func):
            # the advice around the call that makes the generator (as for any function),
            # the wrapper an async generator function still (what is sent, thrown in and
            # closed reaches the function's own)
            advice = self._advice
            wrapper = safe_wraps(func)(
                delegating_async_generator(lambda *args, **kwargs: advice(func, None, args, kwargs))
            )
        elif inspect.isgeneratorfunction(func):
            advice = self._advice

            @safe_wraps(func)
            def generator_wrapper(*args: Any, **kwargs: Any) -> Any:
                return (yield from advice(func, None, args, kwargs))

            wrapper = generator_wrapper
        else:
            advice = self._advice

            @safe_wraps(func)
            def sync_wrapper(*args: Any, **kwargs: Any) -> Any:
                return advice(func, None, args, kwargs)

            wrapper = sync_wrapper
        self._decorated(wrapper)
        return wrapper  # type: ignore[return-value]
