"""The start/stop contract shared by every patch object, and the registry of live ones.

A scoped object is usable three ways, with one contract:

* ``with p: ...`` — started on entry, stopped on every exit, ``BaseException``
  included, and the exception is never swallowed;
* ``p.start()`` / ``p.stop()`` — ``start()`` on a started object raises
  :class:`PatchStateError`, ``stop()`` twice is a no-op, start → stop → start works.
  One object is started at most once at a time, also from many threads: a start
  claims the object with one atomic dictionary operation before applying, so a
  concurrent second ``start()`` raises, and of two concurrent ``stop()`` calls
  exactly one undoes;
* ``@p`` — a decorator for sync, async, generator and async-generator functions. Each
  call runs under a *fresh copy*, so a decorated function may recurse or run in many
  threads at once; a generator is patched for as long as it is being iterated.
"""

from __future__ import annotations

import inspect
import itertools
import os
import sys
import threading
from collections.abc import AsyncGenerator, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeAlias, TypeVar

from layerswap.errors import PatchStateError, TargetTypeError
from layerswap.patching.wraps import delegating_async_generator, safe_update_wrapper

__all__ = [
    "Origin",
    "PatchInfo",
    "Scoped",
    "active_patches",
    "caller_outside",
    "restore_all",
    "safeguard",
]

F = TypeVar("F", bound=Callable[..., Any])
S = TypeVar("S", bound="Scoped")

#: Where a patch was started: ``(file, line, function)``.
Origin: TypeAlias = tuple[str, int, str]

_HERE = os.path.dirname(os.path.abspath(__file__))
# Registry of live objects. Single dict operations are atomic under the GIL, and
# the stacks (not this registry) are what must stay consistent, so no lock here.
_ACTIVE: dict[int, Scoped] = {}
_SEQUENCE = itertools.count(1)


def caller_outside(root: str) -> Origin:
    """(file, line, function) of the innermost frame of the caller's stack whose file is not
    under ``root`` (a package's folder: the first frame of the code that called into it)."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(root):
        frame = frame.f_back  # type: ignore[assignment]
    if frame is None:  # pragma: no cover - only the package on the stack
        return ("<unknown>", 0, "<unknown>")
    code = frame.f_code
    return (code.co_filename, frame.f_lineno, code.co_name)


def _caller_origin() -> Origin:
    """(file, line, function) of the first frame outside the patching engine."""
    return caller_outside(_HERE)


@dataclass(frozen=True)
class PatchInfo:
    """One live patch, as :func:`active_patches` reports it."""

    target: str
    """What is patched, as the user named it."""
    sites: tuple[str, ...]
    """Every place written (more than one with ``aliases=True`` or ``patch_dict``)."""
    new: str
    """Short repr of the replacement."""
    origin: str
    """``file:line in function`` of the code that started the patch."""
    thread: str
    """Name of the thread that started it."""
    started_with_start: bool
    """True if started by ``start()`` (so :func:`restore_all` stops it)."""
    pending: bool
    """True for a ``lazy=True`` patch whose module is not imported yet."""
    patch: Scoped
    """The patch object itself."""

    def __str__(self) -> str:
        state = " (pending import)" if self.pending else ""
        return f"{self.target} -> {self.new}{state}, started at {self.origin}"


class Scoped:
    """Base of :class:`Patch`, :class:`DictPatch` and :class:`PatchGroup`.

    State lives in the instance ``__dict__`` under two keys: ``_claim`` from the
    moment a start begins until the stop has finished (taken with ``setdefault``,
    so only one start wins), and ``_started``, ``(origin, thread, sequence,
    manual)``, while the change is applied (removed with ``pop``, so only one stop
    undoes it).
    """

    @property
    def _active(self) -> bool:
        return "_started" in self.__dict__

    @property
    def _origin(self) -> Origin | None:
        started = self.__dict__.get("_started")
        return None if started is None else started[0]  # type: ignore[no-any-return]

    @property
    def _thread(self) -> int:
        return self.__dict__.get("_started", (None, 0))[1]  # type: ignore[no-any-return]

    @property
    def _seq(self) -> int:
        return self.__dict__.get("_started", (None, 0, 0))[2]  # type: ignore[no-any-return]

    @property
    def _manual(self) -> bool:
        return self.__dict__.get("_started", (None, 0, 0, False))[3]  # type: ignore[no-any-return]

    # -- subclasses implement ---------------------------------------------------------
    def _apply(self) -> None:
        """Make the change; on failure change nothing and raise."""
        raise NotImplementedError

    def _revert(self) -> None:
        """Undo the change (always completes; may warn afterwards)."""
        raise NotImplementedError

    def _copy(self: S) -> S:
        """A fresh, unstarted object with the same settings (for decorator calls)."""
        raise NotImplementedError

    def _label(self) -> str:
        raise NotImplementedError

    def _site_texts(self) -> tuple[str, ...]:
        return ()

    def _new_text(self) -> str:
        return ""

    def _pending(self) -> bool:
        return False

    # -- the contract ----------------------------------------------------------------
    @property
    def is_active(self) -> bool:
        """True between a successful start and the matching stop."""
        return self._active

    @property
    def origin(self) -> str | None:
        """``file:line in function`` that started this object, while it is active."""
        if self._origin is None:
            return None
        file, line, func = self._origin
        return f"{file}:{line} in {func}"

    def start(self: S, *, origin: Origin | None = None) -> S:
        """Apply the change now. Raises :class:`PatchStateError` if already started.

        ``origin`` is the ``(file, line, function)`` that :func:`active_patches`,
        ``repr`` and leak reports name as the place that started it; by default, the
        caller. Code that starts patches on a user's behalf (a test fixture, a
        helper) passes the user's line, so reports point there and not at itself.
        Either way the object counts as started with ``start()``: :func:`restore_all`
        stops it.

        Example::

            p = layerswap.patch(mod, "VALUE", 1).start()
            p.stop()

            # on behalf of the caller's caller:
            frame = sys._getframe(2)
            p.start(origin=(frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name))
        """
        self._start(manual=True, origin=_caller_origin() if origin is None else origin)
        return self

    def stop(self) -> None:
        """Undo the change. A no-op when not started (so calling it twice is safe)."""
        # pop() is atomic: of two threads stopping at once, one gets True.
        if self.__dict__.pop("_started", None) is None:
            return
        _ACTIVE.pop(id(self), None)
        try:
            self._revert()
        finally:
            self.__dict__.pop("_claim", None)  # startable again

    def _start(self, *, manual: bool, origin: Origin) -> None:
        claim = object()
        if self.__dict__.setdefault("_claim", claim) is not claim:
            self._refuse_start()
        try:
            self._apply()
        except BaseException:
            del self.__dict__["_claim"]
            raise
        _ACTIVE[id(self)] = self
        self._started = (origin, threading.get_ident(), next(_SEQUENCE), manual)

    def _refuse_start(self) -> None:
        where = f" (at {self.origin})" if self._origin is not None else " (in another thread)"
        raise PatchStateError(
            f"{self._label()} is already started{where}; stop() it first, "
            "or create a new patch to layer another replacement on top"
        )

    def _end(self) -> None:
        """Mark as stopped without undoing anything (a lazy patch that never applied)."""
        self.__dict__.pop("_started", None)
        _ACTIVE.pop(id(self), None)
        self.__dict__.pop("_claim", None)

    def __enter__(self: S) -> S:
        frame = sys._getframe(1)
        code = frame.f_code
        if code.co_filename.startswith(_HERE):  # entered by the engine itself (a group)
            self._start(manual=False, origin=_caller_origin())
        else:
            self._start(manual=False, origin=(code.co_filename, frame.f_lineno, code.co_name))
        return self

    def __exit__(self, exc_type: object, *exc_info: object) -> None:
        if exc_type is None:
            self.stop()
            return
        try:
            self.stop()  # restores first; only a warning turned error can raise here
        except Exception:
            pass  # the block's own exception is the one that propagates
        # returns None: the exception propagates unchanged

    # -- decorator ---------------------------------------------------------------------
    def __call__(self, func: F) -> F:
        if isinstance(func, (classmethod, staticmethod)):
            # above @classmethod/@staticmethod: the function inside is decorated and the
            # descriptor rebuilt, so binding still happens in the class (and an async
            # function stays one, patched while it runs)
            return type(func)(self(func.__func__))  # type: ignore[return-value]
        if isinstance(func, type):
            raise TargetTypeError(
                f"{self._label()} can decorate functions, not classes; decorate the methods "
                "or use it as a context manager"
            )
        if not callable(func):
            raise TargetTypeError(f"{self._label()} can only decorate a callable, got {func!r}")
        make = self._copy
        wrapper: Callable[..., Any]
        if inspect.isasyncgenfunction(func):
            wrapper = _async_generator_wrapper(func, make)
        elif inspect.isgeneratorfunction(func):

            def wrapper(*args: Any, **kwargs: Any) -> Any:
                scoped = make()
                scoped._start(manual=False, origin=_origin_of(func))
                try:
                    return (yield from func(*args, **kwargs))
                finally:
                    scoped.stop()

        elif inspect.iscoroutinefunction(func):

            async def wrapper(*args: Any, **kwargs: Any) -> Any:
                scoped = make()
                scoped._start(manual=False, origin=_origin_of(func))
                try:
                    return await func(*args, **kwargs)
                finally:
                    scoped.stop()

        else:

            def wrapper(*args: Any, **kwargs: Any) -> Any:
                scoped = make()
                scoped._start(manual=False, origin=_origin_of(func))
                try:
                    return func(*args, **kwargs)
                finally:
                    scoped.stop()

        return safe_update_wrapper(wrapper, func)  # type: ignore[return-value]

    def __repr__(self) -> str:
        if self._pending():
            state = "pending import"
        else:
            state = "active" if self._active else "inactive"
        where = f" started at {self.origin}" if self._origin else ""
        return f"<{type(self).__name__} {self._label()} {state}{where}>"

    def info(self) -> PatchInfo:
        return PatchInfo(
            target=self._label(),
            sites=self._site_texts(),
            new=self._new_text(),
            origin=self.origin or "<unknown>",
            thread=_thread_name(self._thread),
            started_with_start=self._manual,
            pending=self._pending(),
            patch=self,
        )


def _thread_name(ident: int) -> str:
    for thread in threading.enumerate():
        if thread.ident == ident:
            return thread.name
    return f"thread {ident} (ended)"


def _origin_of(func: Callable[..., Any]) -> Origin:
    code = getattr(func, "__code__", None)
    if code is None:
        return ("<unknown>", 0, getattr(func, "__qualname__", "<callable>"))
    return (code.co_filename, code.co_firstlineno, code.co_name)


def _async_generator_wrapper(
    func: Callable[..., AsyncGenerator[Any, Any]], make: Callable[[], Scoped]
) -> Callable[..., AsyncGenerator[Any, Any]]:
    @contextmanager
    def started() -> Iterator[None]:
        scoped = make()
        scoped._start(manual=False, origin=_origin_of(func))
        try:
            yield
        finally:
            scoped.stop()

    wrapper: Callable[..., AsyncGenerator[Any, Any]] = delegating_async_generator(func, started)
    return wrapper


def active_patches() -> list[PatchInfo]:
    """Every live patch, oldest first: what is patched, where, and who started it.

    Example::

        for info in layerswap.active_patches():
            print(info.target, "started at", info.origin)
    """
    live = sorted(list(_ACTIVE.values()), key=lambda s: s._seq)
    return [s.info() for s in live]


def safeguard(scoped: S, needed: Callable[[], bool] = lambda: True) -> S:
    """Mark ``scoped`` as a safeguard its owner stops: :func:`restore_all` leaves it on
    while ``needed()`` says so. layerswap's save and PEFT advice are such: a swapped model
    outlives any cleanup of patches, and without them it would write its own layout.
    Returns ``scoped``."""
    scoped.__dict__["_safeguard"] = needed
    return scoped


def _guarding(scoped: Scoped) -> bool:
    needed = scoped.__dict__.get("_safeguard")
    return needed is not None and bool(needed())


def restore_all() -> int:
    """Stop every patch started with ``start()``, newest first. Returns how many.

    Patches entered with ``with`` or applied by a decorator are left to their own
    scope, as they will stop when it ends; safeguards (:func:`safeguard`) to their owner.
    """
    manual = sorted(
        (s for s in list(_ACTIVE.values()) if s._manual and not _guarding(s)),
        key=lambda s: -s._seq,
    )
    for scoped in manual:
        scoped.stop()
    return len(manual)
