"""Imports while a patch function runs: each module copied when the outermost import ends.

A patch function may import what it patches (Liger's ``apply_*`` import the modeling
module). :class:`SnapshotOnImport` copies each module imported for the first time into
the :class:`~layerswap.adoption.snapshot.Snapshot` once the outermost import under way
finishes, and takes what that import changed in the places copied before as the state
before the function (:meth:`~layerswap.adoption.snapshot.Snapshot.rebase`).

Example::

    snapshot = Snapshot(("transformers", "torch.nn", "my_patches"), model).take()
    with SnapshotOnImport(snapshot):
        apply_patch(model=model)
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import threading
import types
from collections.abc import Sequence
from types import TracebackType
from typing import Any

from layerswap.adoption.snapshot import Checkpoint, Snapshot

__all__ = ["SnapshotOnImport"]


class SnapshotOnImport(importlib.abc.MetaPathFinder):
    """While active, each module imported for the first time is copied into ``snapshot``
    once the outermost import under way finishes: its code has run, and so has the code of
    the modules it imported, which may register into it; nothing has patched it yet.
    Whatever that import changed in modules copied before is taken as it stands then
    (:meth:`Snapshot.rebase`): an import's own doing is not the function's.

    A finder in front of ``sys.meta_path`` that finds nothing itself: it asks the finders
    behind it and wraps the loader of the spec found, so that ``exec_module`` runs inside
    the import's window. The module's ``__loader__`` is the real loader again after.
    """

    def __init__(self, snapshot: Snapshot) -> None:
        self._snapshot = snapshot
        self._lock = threading.RLock()
        self._depth = 0
        self._then: Checkpoint | None = None
        self._executed: list[tuple[str, Any]] = []

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        for finder in list(sys.meta_path):
            if finder is self:
                continue
            find = getattr(finder, "find_spec", None)
            if find is None:
                continue
            spec: importlib.machinery.ModuleSpec | None = find(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        self._snapshot.imported.add(spec.name)
        loader = spec.loader
        if loader is not None and hasattr(loader, "exec_module"):
            spec.loader = _CopyingLoader(loader, self)
        return spec

    def opening(self, name: str, module: types.ModuleType) -> None:
        """A module's code is about to run: the outermost import's window opens."""
        with self._lock:
            if self._depth == 0:
                then = self._snapshot.checkpoint()
                # the import system put the module in sys.modules just before: the import's
                if name not in self._snapshot.modules and then.modules.get(name) is module:
                    del then.modules[name]
                self._then = then
            self._depth += 1

    def closing(self, name: str, module: types.ModuleType) -> None:
        """A module's code has run; the outermost one's end takes its changes as they are."""
        with self._lock:
            self._depth -= 1
            self._executed.append((name, module))
            if self._depth or self._then is None:
                return
            then, self._then = self._then, None
            executed, self._executed = self._executed, []
            self._snapshot.rebase(then)
            self._snapshot.add_imported(executed)

    def __enter__(self) -> SnapshotOnImport:
        sys.meta_path.insert(0, self)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        try:
            sys.meta_path.remove(self)
        except ValueError:
            pass


class _CopyingLoader(importlib.abc.Loader):
    """A loader that runs the real one inside its finder's window (:class:`SnapshotOnImport`)."""

    def __init__(self, loader: Any, watch: SnapshotOnImport) -> None:
        self._self_loader = loader
        self._self_watch = watch

    def __getattr__(self, name: str) -> Any:
        return getattr(self._self_loader, name)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        module: types.ModuleType | None = self._self_loader.create_module(spec)
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        loader = self._self_loader
        spec = module.__spec__
        # the spec's name: a module's own __name__ may be another (``_decimal``'s is "decimal")
        name = spec.name if spec is not None else module.__name__
        self._self_watch.opening(name, module)
        try:
            loader.exec_module(module)
        finally:
            if spec is not None:
                spec.loader = loader
            try:
                module.__loader__ = loader
            except Exception:
                pass
            self._self_watch.closing(name, module)
