"""``safe_wraps``: ``functools.wraps`` without the attributes that bypass the wrapper.

``functools.wraps`` copies the wrapped callable's whole ``__dict__`` onto the
wrapper. On framework callables that dict holds *entry points into the wrapped
function*: a ``torch.compile`` result carries ``get_compiler_config``,
``aot_compile`` and ``_torchdynamo_orig_callable``; a ``jax.jit`` function
carries ``lower``/``trace``/``eval_shape``. Copied onto a wrapper they call the
wrapped function directly, skipping the wrapper, and ``torch.compile(wrapper)``
refuses to run at all ("already has a get_compiler_config attribute").

``safe_wraps`` copies the metadata that identifies a function (name, qualname,
module, doc, annotations, type params), sets ``__wrapped__`` so that
``inspect.signature`` shows the wrapped signature, and copies from ``__dict__``
only *data*: public, non-callable values (markers such as ``pytestmark`` or
``is_test = True``). Anything callable, and any private name, stays behind.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager, nullcontext
from typing import Any, TypeVar

__all__ = ["WRAPPER_ASSIGNMENTS", "forwarder", "safe_update_wrapper", "safe_wraps"]

F = TypeVar("F", bound=Callable[..., Any])

WRAPPER_ASSIGNMENTS: tuple[str, ...] = (
    "__module__",
    "__name__",
    "__qualname__",
    "__doc__",
    "__annotations__",
    "__type_params__",
)


def _is_safe_entry(name: str, value: Any, exclude: frozenset[str]) -> bool:
    if name in exclude or name.startswith("_"):
        return False
    # Callables hanging off a function are entry points into it (compile/lower/trace
    # helpers, bound methods of the wrapped object): copying them bypasses the wrapper.
    return not callable(value) and not isinstance(value, (staticmethod, classmethod, property))


def safe_update_wrapper(
    wrapper: F,
    wrapped: Callable[..., Any],
    assigned: Iterable[str] = WRAPPER_ASSIGNMENTS,
    *,
    exclude: Iterable[str] = (),
) -> F:
    """Make ``wrapper`` look like ``wrapped`` without copying bypassing attributes.

    Like :func:`functools.update_wrapper`, but ``__dict__`` entries are copied only
    when they are public and not callable; names in ``exclude`` are never copied.
    """
    for attr in assigned:
        try:
            value = getattr(wrapped, attr)
        except AttributeError:
            continue
        try:
            setattr(wrapper, attr, value)
        except (AttributeError, TypeError):  # read-only on some callables
            pass
    skip = frozenset(exclude)
    source = getattr(wrapped, "__dict__", None)
    if isinstance(source, dict):
        target = wrapper.__dict__
        for name, value in source.items():
            if _is_safe_entry(name, value, skip):
                target.setdefault(name, value)
    # Set last, so that a "__wrapped__" in the wrapped dict can never win.
    wrapper.__wrapped__ = wrapped  # type: ignore[attr-defined]
    return wrapper


def safe_wraps(
    wrapped: Callable[..., Any],
    assigned: Iterable[str] = WRAPPER_ASSIGNMENTS,
    *,
    exclude: Iterable[str] = (),
) -> Callable[[F], F]:
    """Decorator form of :func:`safe_update_wrapper`, a drop-in for ``functools.wraps``.

    Example::

        compiled = torch.compile(model_step)

        @layerswap.safe_wraps(compiled)
        def logged(*args, **kwargs):
            log.info("step")
            return compiled(*args, **kwargs)

        torch.compile(logged, backend="eager")  # works, and runs ``logged``
    """
    return functools.partial(  # type: ignore[return-value]
        safe_update_wrapper, wrapped=wrapped, assigned=assigned, exclude=exclude
    )


def forwarder(like: Any, call: Callable[..., Any]) -> Callable[..., Any]:
    """A plain function that passes its arguments to ``call`` and looks like ``like``.

    "Looks like" includes what ``inspect`` reports about the kind of function: a
    coroutine function gets an ``async def`` forwarder (``iscoroutinefunction`` stays
    true), a generator function a generator, an async generator function an async
    generator that relays ``asend``/``athrow``/``aclose``. Metadata and
    ``__wrapped__`` come from :func:`safe_update_wrapper`, so ``inspect.signature``
    shows ``like``'s signature.
    """
    function: Callable[..., Any]
    if inspect.iscoroutinefunction(like):

        async def function(*args: Any, **kwargs: Any) -> Any:
            result = call(*args, **kwargs)
            # around-advice may answer an async call without awaiting (a cached value)
            return (await result) if inspect.isawaitable(result) else result

    elif inspect.isasyncgenfunction(like):
        function = delegating_async_generator(call)
    elif inspect.isgeneratorfunction(like):

        def function(*args: Any, **kwargs: Any) -> Any:
            return (yield from call(*args, **kwargs))

    else:

        def function(*args: Any, **kwargs: Any) -> Any:
            return call(*args, **kwargs)

    return safe_update_wrapper(function, like)


def delegating_async_generator(
    call: Callable[..., Any], around: Callable[[], AbstractContextManager[Any]] = nullcontext
) -> Callable[..., Any]:
    """An async generator function that runs ``call(*args, **kwargs)``'s async generator
    inside ``around()``, relaying values sent and exceptions thrown in, and ``aclose``:
    what ``yield from`` does for sync generators, which async generators lack.
    """

    async def function(*args: Any, **kwargs: Any) -> Any:
        with around():
            agen = call(*args, **kwargs)
            sent: Any = None
            thrown: BaseException | None = None
            while True:
                try:
                    if thrown is not None:
                        error, thrown = thrown, None
                        item = await agen.athrow(error)
                    else:
                        item = await agen.asend(sent)
                except StopAsyncIteration:
                    return
                try:
                    sent = yield item
                except GeneratorExit:
                    await agen.aclose()
                    raise
                except BaseException as exc:
                    thrown = exc

    return function
