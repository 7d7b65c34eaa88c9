"""``warn_once``: a warning that fires once per message and key, not once per call."""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING, Any

from layerswap.decorators._advice import Advice, Answer, describe, external_stacklevel

if TYPE_CHECKING:
    from layerswap.decorators._advice import Args, Kwargs, Wrapped

__all__ = ["warn_once", "warn_once_message"]

# (message, category, key) of every warning already emitted, process-wide, so the same
# warning from a decorator and from warn_once_message() is still emitted once.
_emitted: set[tuple[str, type[Warning], Hashable]] = set()
_lock = threading.Lock()
# Bumped by reset(): decorators remember the generation they fired in, which makes
# their fast path one comparison and lets reset() re-arm them all.
_generation = [0]

_NO_KEY: Hashable = None


def warn_once_message(
    message: str,
    *,
    category: type[Warning] = UserWarning,
    key: Hashable = _NO_KEY,
    stacklevel: int | None = None,
) -> bool:
    """Warn with ``message`` unless this (message, category, key) already warned.

    Returns whether it warned. Python's own "once per location" filter does not
    help when a library warns from one place on behalf of many callers, or when
    ``-W always`` is set; this registry does not depend on the warning filters.
    ``stacklevel`` defaults to the first frame outside layerswap.

    Example::

        warn_once_message("flash attention unavailable, using sdpa")          # warns
        warn_once_message("flash attention unavailable, using sdpa")          # silent
        warn_once_message("flash attention unavailable, using sdpa", key=3)   # warns
    """
    entry = (message, category, key)
    with _lock:
        if entry in _emitted:
            return False
        _emitted.add(entry)
    # an explicit stacklevel counts from the caller, one frame above this one
    level = external_stacklevel() if stacklevel is None else stacklevel + 1
    warnings.warn(message, category, stacklevel=level)
    return True


class warn_once(Advice):
    """Warn the first time the decorated function is called, and then not again.

    Bare on a function, ``@warn_once`` is the ``@lru_cache`` warn-once idiom made
    safe: the body (which logs or warns itself) runs once per distinct arguments,
    later calls with the same arguments return ``None`` without running it. Unlike
    ``lru_cache`` it holds no reference to the arguments (non-literal arguments are
    keyed by their ``repr``), accepts unhashable ones, runs the body once even when
    threads race, and :meth:`reset` re-arms it::

        @warn_once
        def warn_fallback(kernel: str) -> None:
            logger.warning("no fused %s kernel, falling back", kernel)

    ``message`` may use ``{func}`` (the function's qualified name) and ``{key}``;
    it defaults to ``"{func}() is deprecated"``. ``key`` separates occurrences of
    the same message: a hashable value is fixed, a callable is applied to the call's
    arguments, so the warning fires once per distinct result (for a method in
    decorator form, the arguments include ``self``). Emission goes through
    :func:`warn_once_message`, so the same (message, category, key) warns once per
    process however it is reached; :meth:`reset` re-arms everything.

    Example::

        @warn_once("{func}() is deprecated, use load() instead", category=FutureWarning)
        def load_legacy(path): ...

        @warn_once("no fused kernel for {key}, falling back", key=lambda x: x.dtype)
        def fused_gelu(x): ...     # warns once per dtype seen
    """

    __slots__ = ("_category", "_fired", "_key", "_key_func", "_message")

    def __init__(
        self,
        message: str | None = None,
        *,
        category: type[Warning] = UserWarning,
        key: Hashable | Callable[..., Hashable] = _NO_KEY,
    ) -> None:
        if message is not None and not isinstance(message, str):
            raise TypeError(
                f"warn_once(message) takes a str, got {type(message).__name__}; "
                "write @warn_once() or @warn_once('...') with the parentheses"
            )
        if not (isinstance(category, type) and issubclass(category, Warning)):
            raise TypeError(f"category must be a Warning subclass, got {category!r}")
        self._message = "{func}() is deprecated" if message is None else message
        self._category = category
        self._key_func: Callable[..., Hashable] | None = key if callable(key) else None
        self._key = None if callable(key) else key
        # (function name, key) -> generation it fired in
        self._fired: dict[Hashable, int] = {}

    @classmethod
    def _bare_decorate(cls, func: Any) -> Any:
        return _OncePerArguments()(func)

    @staticmethod
    def reset() -> None:
        """Forget every warning emitted so far (decorators and :func:`warn_once_message`)."""
        with _lock:
            _emitted.clear()
            _generation[0] += 1

    def _before(self, wrapped: Wrapped, instance: Any, args: Args, kwargs: Kwargs) -> None:
        func = describe(wrapped, None)  # the defining class: the warning is about the code
        if self._key_func is None:
            key = self._key
            seen: Hashable = func
        else:
            key = self._key_func(*args, **kwargs)
            seen = (func, key)
        if self._fired.get(seen) == _generation[0]:
            return
        self._fired[seen] = _generation[0]
        message = self._message.format(func=func, key=key)
        warn_once_message(message, category=self._category, key=key)


_LITERAL = (str, int, float, bool, bytes, type(None))


def _arguments_key(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Hashable:
    def part(value: Any) -> Hashable:
        if isinstance(value, _LITERAL):
            return (type(value), value)
        if type(value) is tuple:
            return tuple(part(item) for item in value)
        return ("repr", type(value).__qualname__, repr(value))  # holds no reference

    return (tuple(part(a) for a in args), tuple(sorted((k, part(v)) for k, v in kwargs.items())))


class _OncePerArguments(Advice):
    """``@warn_once`` bare: the body runs once per distinct arguments, later calls
    with the same arguments return ``None`` without running it."""

    __slots__ = ("_armed", "_seen")

    def __init__(self) -> None:
        self._seen: set[Hashable] = set()
        self._armed = _generation[0]

    def _before(self, wrapped: Wrapped, instance: Any, args: Args, kwargs: Kwargs) -> Answer | None:
        key = _arguments_key(args, kwargs)
        with _lock:
            if self._armed != _generation[0]:  # warn_once.reset() since the last call
                self._seen.clear()
                self._armed = _generation[0]
            if key in self._seen:
                return _SKIP
            self._seen.add(key)
        return None


_SKIP = Answer(None)
