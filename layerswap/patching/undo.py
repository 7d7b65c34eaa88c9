"""An undo log: changes made to live objects, put back newest first.

Patches (:mod:`layerswap.patching.patch`) change what a *name* resolves to, for a
scope, with stacks that let any number of them nest. Swapping a built model changes
*objects*: an instance attribute, an entry of a module's ``_modules``, an object's
class, or a step only its own code can take back (a layer whose weights are converted
back). Every such change of a swap is recorded here as it is made, and undone from
here, in reverse: after a failure half-way through, or on ``undo()``.

Example::

    log = UndoLog()
    log.set_attribute(model, "_checkpoint_conversion_mapping", mapping)
    log.set_class(model, FusedHeadLlamaForCausalLM)
    ...
    log.undo()          # the class, then the attribute, as they were
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, MutableMapping
from contextlib import contextmanager
from typing import Any

from layerswap.patching.sites import NOTSET

__all__ = ["UndoLog"]


class UndoLog:
    """Changes to live objects, each with the step that takes it back."""

    def __init__(self) -> None:
        self._steps: list[Callable[[], None]] = []
        self._lock = threading.Lock()

    def record(self, undo: Callable[[], None]) -> None:
        """Record a change already made: ``undo()`` takes it back."""
        with self._lock:
            self._steps.append(undo)

    def set_attribute(self, owner: Any, name: str, value: Any) -> None:
        """``setattr(owner, name, value)``; undone to the instance's own previous value,
        or to no instance attribute when it had none."""
        previous = owner.__dict__.get(name, NOTSET)
        setattr(owner, name, value)

        def put_back() -> None:
            if previous is NOTSET:
                owner.__dict__.pop(name, None)
            else:
                setattr(owner, name, previous)

        self.record(put_back)

    def set_item(self, mapping: MutableMapping[Any, Any], key: Any, value: Any) -> None:
        """``mapping[key] = value``; undone to the previous entry, or to none."""
        previous = mapping.get(key, NOTSET)
        mapping[key] = value

        def put_back() -> None:
            if previous is NOTSET:
                mapping.pop(key, None)
            else:
                mapping[key] = previous

        self.record(put_back)

    def set_class(self, obj: Any, cls: type) -> None:
        """``obj.__class__ = cls``; undone to its class before."""
        previous = type(obj)
        obj.__class__ = cls
        self.record(lambda: setattr(obj, "__class__", previous))

    def undo(self, on_error: Callable[[BaseException], None] | None = None) -> None:
        """Take every recorded change back, newest first, and forget them.

        A step that raises stops the undo (the steps before it stay recorded) unless
        ``on_error`` is given: then it is told, and the undo goes on (a rollback after
        a failure, where the first error is the one to raise).
        """
        while True:
            with self._lock:
                if not self._steps:
                    return
                step = self._steps[-1]
            try:
                step()
            except BaseException as error:
                if on_error is None:
                    raise
                on_error(error)
            with self._lock:
                self._steps.pop()

    @contextmanager
    def all_or_nothing(
        self, on_error: Callable[[BaseException], None] | None = None
    ) -> Iterator[UndoLog]:
        """Inside, changes are made and recorded; on any exception every change recorded is
        taken back (:meth:`undo`, going on past a step that fails, which ``on_error`` is
        told of) and the exception raised as it was: the objects as they were before.

        Example::

            with log.all_or_nothing(warn):
                log.set_attribute(model, "a", 1)
                log.set_class(model, Other)     # fails: ``a`` is taken back, then it raises
        """
        try:
            yield self
        except BaseException:
            self.undo(on_error=on_error or _ignore)
            raise

    def __len__(self) -> int:
        return len(self._steps)


def _ignore(error: BaseException) -> None:
    """A rollback step's failure, dropped: the failure being handled is the one raised."""
