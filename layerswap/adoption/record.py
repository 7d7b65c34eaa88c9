"""Running a patch function so that every change it makes is recorded, and can be undone.

:func:`record` copies what the function can change (:mod:`layerswap.adoption.snapshot`),
runs it, finds what it changed (:mod:`layerswap.adoption.changes`) and keeps each change on
an :class:`~layerswap.patching.undo.UndoLog`: :meth:`Recording.undo` takes them back, newest
first. The function raising half-way takes back what it had done so far and re-raises;
a change that cannot be taken back (a model's tensor changed in place) takes back the rest
and raises :class:`~layerswap.errors.UnrecordableChangeError` naming it; a function that
changed nothing recorded raises :class:`~layerswap.errors.NoChangeError`.

Example::

    recording, _ = record(apply_liger_kernel_to_llama, (), {"rope": True})
    recording.undo()              # modeling_llama as it was, object for object
"""

from __future__ import annotations

import gc
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import Any

from layerswap.adoption.changes import Change, find_changes
from layerswap.adoption.importing import SnapshotOnImport
from layerswap.adoption.snapshot import Snapshot, watched_packages
from layerswap.errors import NoChangeError, PatchConflictWarning, UnrecordableChangeError
from layerswap.patching.undo import UndoLog

__all__ = ["Recording", "exclusive", "record"]

# one recording, one suspended window or one undo at a time: two functions running at
# once would be credited each other's changes, and a window's re-application or another
# adoption's undo would land in the recording under way
_RECORDING = threading.RLock()


def exclusive() -> AbstractContextManager[Any]:
    """Held for a comparison that suspends an adoption (a proof, ``Adoption.verify``): its
    passes with and without the patch are not interleaved with another thread's
    suspended windows, nor with a recording."""
    return _RECORDING


class Recording:
    """The changes one run of a patch function made, in effect until :meth:`undo`."""

    def __init__(self, name: str, changes: list[Change]) -> None:
        self.name = name
        self.changes = changes
        self._log = UndoLog()
        for position, change in enumerate(changes):
            try:
                change.adopt()
            except Exception as error:
                raise self._abandoned(changes[position:], change, error) from error
            self._log.record(change.revert)

    def _abandoned(
        self, rest: list[Change], failing: Change, error: Exception
    ) -> UnrecordableChangeError:
        """Everything taken back (the adopted changes through the log, ``rest`` raw) after
        ``failing`` could not be taken over: the error to raise."""
        failed: list[str] = []
        self._log.undo(on_error=lambda e: failed.append(f"{type(e).__name__}: {e}"))
        failed += _take_back(rest)
        return UnrecordableChangeError(
            f"{self.name} changed {failing.where}, which layerswap cannot take over "
            f"({type(error).__name__}: {error}); its changes were taken back" + _not_back(failed)
        )

    def undo(self) -> None:
        """Take every change back, newest first (a second call does nothing). Waits for a
        recording under way in another thread, which would take this undo for its own."""
        with _RECORDING:
            self._log.undo()

    @contextmanager
    def suspended(self) -> Iterator[None]:
        """The changes taken back inside, made again on exit: the original code runs.

        One window at a time in the process, and none while a patch function is being
        recorded (the recording would credit this one's changes to it): another thread
        waits. A window opened inside one of the same recording changes nothing more."""
        with _RECORDING:
            self._depth = getattr(self, "_depth", 0) + 1
            try:
                if self._depth == 1:
                    self._log.undo()
                try:
                    yield
                finally:
                    if self._depth == 1:
                        for change in self.changes:
                            change.apply()
                            self._log.record(change.revert)
            finally:
                self._depth -= 1

    def patches(self) -> list[Any]:
        """The engine's patches behind the changes (a leak guard tells them apart)."""
        return [patch for change in self.changes for patch in change.patches()]

    def report(self) -> list[str]:
        """One line per change: where, and what happened there."""
        return [str(change) for change in self.changes]


def record(
    fn: Callable[..., Any],
    args: Sequence[Any],
    kwargs: dict[str, Any],
    *,
    model: Any = None,
    packages: Sequence[str] = (),
    empty: bool = False,
) -> tuple[Recording, Any]:
    """Run ``fn(*args, **kwargs)`` recording its changes; (the recording, what it returned).

    ``model``'s modules are watched too; ``packages`` adds packages whose classes and
    registries are watched (:func:`~layerswap.adoption.snapshot.watched_packages`).
    ``empty``: a recording of no change is returned, not refused (the proof's run on a
    copy, which the function may leave as it was where it changed the user's model).
    """
    __tracebackhide__ = True
    name = getattr(fn, "__qualname__", None) or repr(fn)
    # no garbage collection, whose callbacks (a profiler's, a test runner's) rebind module
    # globals of their own. Not the engine's lock: a function may start a patch in a
    # worker thread and wait for it (another thread's engine patch started meanwhile is
    # seen as the function's change; its stop then warns of the rebinding)
    with _RECORDING, _no_garbage_collection():
        snapshot = Snapshot(watched_packages(fn, packages), model).take()
        try:
            with SnapshotOnImport(snapshot):
                result = fn(*args, **kwargs)
        except BaseException:
            changes, _ = find_changes(snapshot)
            failed = _take_back(changes)
            if failed:  # the function's exception is the one to raise; this is said beside it
                warnings.warn(
                    f"{name} raised; its changes were taken back" + _not_back(failed),
                    PatchConflictWarning,
                    stacklevel=2,
                )
            raise
        changes, unrecordable = find_changes(snapshot)
        if unrecordable:
            failed = _take_back(changes)
            raise UnrecordableChangeError(
                f"{name} changed what layerswap cannot record and take back: "
                f"{', '.join(unrecordable)}; its other changes were taken back"
                + _not_back(failed)
                + ". A patch function may rebind names, classes and instances' attributes, "
                "not change a model's weights in place"
            )
        if not changes and not empty:
            raise NoChangeError(
                f"{name} changed nothing layerswap records: no module, class or instance "
                "attribute, registry item, sys.modules entry, torch switch or environment "
                "variable. A patch that did nothing is not adopted: check what it was "
                "called with, and that it still finds what it patches"
            )
        return Recording(name, changes), result


@contextmanager
def _no_garbage_collection() -> Iterator[None]:
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _take_back(changes: list[Change]) -> list[str]:
    """Revert raw changes newest first; a failing step does not stop the others, and is
    listed (``"where: error"``)."""
    failed: list[str] = []
    for change in reversed(changes):
        try:
            change.revert()
        except Exception as error:
            failed.append(f"{change.where}: {type(error).__name__}: {error}")
    return failed


def _not_back(failed: list[str]) -> str:
    return f", except: {'; '.join(failed)}" if failed else ""
