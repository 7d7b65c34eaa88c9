"""What a patch function could change, copied before it runs: modules, classes, a model's modules.

A patch function (Liger-Kernel's ``apply_liger_kernel_to_llama``, a training repository's
hand-written patch) changes objects in place and keeps no record. To take its changes back,
:mod:`layerswap.adoption.record` copies, before it runs, every place it can write:

* every module of ``sys.modules``: its ``__dict__``, shallowly (a few milliseconds);
* in the *watched* packages (transformers, ``torch.nn``, the patch function's own
  package): the ``__dict__`` of each class a module defines, the contents of each dict,
  list or set held by a module or class attribute (a registry such as ``ACT2FN`` or
  ``ALL_ATTENTION_FUNCTIONS`` mutated in place), the code and defaults of each function
  held there (``forward.__code__`` replaced), and the ``__dict__`` of the plain objects
  held there (an interface instance with its own mapping);
* for a given model, every submodule: its ``__dict__`` (``forward`` bound per instance),
  its class, the contents of ``_parameters``, ``_buffers``, ``_modules`` and the hook
  dictionaries; each tensor's version counter and storage (an in-place change of a weight
  cannot be taken back, and is refused);
* a module imported for the first time while the function runs is copied once the
  outermost import under way finishes (:class:`SnapshotOnImport`), so the function's
  changes to a transformers modeling module it imports itself are seen and taken back too;
  the module stays imported. What that import did itself (a module it imported
  registering into another, a name it rebound in a module imported before) is the
  import's, not the function's: the copies take it as it stands then (:meth:`Snapshot.rebase`).

Comparing the copy with what is there afterwards (:mod:`layerswap.adoption.changes`) gives
each change the function made.

Example::

    snapshot = Snapshot(("transformers", "torch.nn", "my_patches"), model)
    with SnapshotOnImport(snapshot):
        apply_patch(model=model)
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import threading
import types
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

__all__ = [
    "Checkpoint",
    "Contents",
    "FunctionState",
    "Owner",
    "refill",
    "same_contents",
    "Snapshot",
    "SnapshotOnImport",
    "TensorState",
    "watched_packages",
]

#: how many functions deep a decorated function's ``__wrapped__`` chain is followed
_WRAPPED_DEPTH = 8

#: the containers whose contents are compared item by item, and restored in place
CONTAINERS = (dict, list, set)

#: packages watched whatever the patch function: the code patches change
ALWAYS_WATCHED = ("transformers", "torch.nn")


def watched_packages(fn: Any, extra: Sequence[str] = ()) -> tuple[str, ...]:
    """:data:`ALWAYS_WATCHED`, the top-level package of the module ``fn`` comes from (the
    module itself for ``__main__``), and ``extra``.

    Example::

        watched_packages(apply_liger_kernel_to_llama)   # ("transformers", "torch.nn", "liger_kernel")
    """
    target = getattr(fn, "func", fn)  # a functools.partial
    module = getattr(target, "__module__", None) or ""
    own = module if module == "__main__" else module.partition(".")[0]
    found = [*ALWAYS_WATCHED, *extra]
    if own and own not in found and own != "builtins":
        found.append(own)
    return tuple(found)


@dataclass
class Owner:
    """One object whose ``__dict__`` was copied: a module, a class or an instance."""

    obj: Any
    where: str
    entries: dict[str, Any]
    #: an instance's class then (``None`` for modules and classes: theirs cannot change)
    cls: type | None = None


@dataclass
class Contents:
    """A dict, list or set held by a watched attribute, and a copy of what it held."""

    obj: Any
    where: str
    before: Any

    @staticmethod
    def copy_of(obj: Any) -> Any:
        """What ``obj`` holds, read through the builtin type's own methods (a subclass's
        ``items()`` may compute, as transformers' lazy auto mappings import)."""
        return _base(obj).copy_items(obj)

    def unchanged(self) -> bool:
        """Whether the container holds the very same items, in the same order."""
        return same_contents(self.obj, self.before)


def same_contents(obj: Any, copy: Any) -> bool:
    """Whether ``obj`` holds what ``copy`` (:meth:`Contents.copy_of`) recorded, by identity."""
    now = Contents.copy_of(obj)
    if isinstance(obj, set):
        return bool(now == copy)
    if len(now) != len(copy):
        return False
    if isinstance(obj, dict):
        return all(
            (k is key or k == key) and v is value
            for (k, v), (key, value) in zip(now, copy, strict=True)
        )
    return all(a is b for a, b in zip(now, copy, strict=True))


class _Raw:
    """Reading and refilling a container through its builtin base type's methods."""

    def __init__(self, base: type) -> None:
        self.base = base

    def copy_items(self, obj: Any) -> Any:
        base: Any = self.base
        if issubclass(base, dict):
            return list(base.items(obj))
        if base is list:
            return list.copy(obj)
        return set.copy(obj)

    def refill(self, obj: Any, items: Any) -> None:
        base: Any = self.base
        if issubclass(base, dict):
            base.clear(obj)
            for key, value in items:
                base.__setitem__(obj, key, value)
        elif base is list:
            list.__setitem__(obj, slice(None), items)
        else:
            set.clear(obj)
            set.update(obj, items)


def _base(obj: Any) -> _Raw:
    for base in (OrderedDict, dict, list, set):
        if isinstance(obj, base):
            return _Raw(base)
    raise TypeError(f"not a container: {type(obj).__name__}")


def refill(obj: Any, items: Any) -> None:
    """Make the container ``obj`` hold ``items`` (a :meth:`Contents.copy_of`), in place."""
    _base(obj).refill(obj, items)


#: what a function's own slots hold that a patch may replace in place
FUNCTION_PARTS = ("__code__", "__defaults__", "__kwdefaults__")


@dataclass
class FunctionState:
    """A function of a watched module or class: its code and defaults."""

    function: Any
    where: str
    before: tuple[Any, ...]

    @staticmethod
    def parts_of(function: Any) -> tuple[Any, ...]:
        return tuple(getattr(function, part) for part in FUNCTION_PARTS)

    def changed(self) -> bool:
        now = self.parts_of(self.function)
        return any(a is not b for a, b in zip(now, self.before, strict=True))


@dataclass
class TensorState:
    """A parameter or buffer of the model: its version counter and storage."""

    where: str
    tensor: Any
    version: int
    pointer: int

    def changed(self) -> bool:
        tensor = self.tensor
        return bool(tensor._version != self.version or tensor.data_ptr() != self.pointer)


@dataclass
class Snapshot:
    """The copies: see the module docstring. ``take()`` copies; ``add_module`` copies a
    module imported later."""

    packages: tuple[str, ...]
    model: Any = None
    owners: dict[int, Owner] = field(default_factory=dict)
    contents: dict[int, Contents] = field(default_factory=dict)
    functions: dict[int, FunctionState] = field(default_factory=dict)
    modules: dict[str, Any] = field(default_factory=dict)
    tensors: list[TensorState] = field(default_factory=list)
    #: the names the import system looked up while the function ran (found by a finder)
    imported: set[str] = field(default_factory=set)

    def take(self) -> Snapshot:
        self.modules = dict(sys.modules)
        for name, module in list(self.modules.items()):
            self.add_module(name, module)
        torch = self.modules.get("torch")
        if torch is not None:  # a tensor method rebound is the model's code changed too
            self.add_class(torch.Tensor)
        if self.model is not None:
            self._add_model(self.model)
        return self

    def checkpoint(self) -> Checkpoint:
        """What the copied places hold now (an import is about to run): :meth:`rebase`
        takes what changed since as the state before the function."""
        return Checkpoint(
            entries={
                key: entries
                for key, owner in self.owners.items()
                if (entries := _entries_now(owner.obj)) is not None
            },
            classes={key: type(owner.obj) for key, owner in self.owners.items() if owner.cls},
            contents={key: Contents.copy_of(c.obj) for key, c in self.contents.items()},
            functions={
                key: FunctionState.parts_of(state.function) for key, state in self.functions.items()
            },
            modules=dict(sys.modules),
        )

    def rebase(self, then: Checkpoint) -> None:
        """Take every change made since ``then`` (by an import and what it imported) as
        the state before the function: an import's own doing is not the function's
        change, and undoing it would break what the import set up (a pytree node
        registered, a module's names filled in)."""
        for key, owner in self.owners.items():
            entries = then.entries.get(key)
            if entries is not None:
                _rebase_entries(owner.entries, entries, _entries_now(owner.obj) or {})
            if key in then.classes and then.classes[key] is not type(owner.obj):
                owner.cls = type(owner.obj)
        for key, contents in self.contents.items():
            if key in then.contents and not same_contents(contents.obj, then.contents[key]):
                contents.before = _rebase_items(
                    contents.obj,
                    contents.before,
                    then.contents[key],
                    Contents.copy_of(contents.obj),
                )
        for key, state in self.functions.items():
            parts = then.functions.get(key)
            if parts is not None:
                now = FunctionState.parts_of(state.function)
                state.before = tuple(
                    new if new is not old else before
                    for before, old, new in zip(state.before, parts, now, strict=True)
                )
        _rebase_entries(self.modules, then.modules, dict(sys.modules))

    def add_imported(self, executed: Sequence[tuple[str, Any]]) -> None:
        """Copy the modules an import brought (``executed``: each module it ran, by its
        spec's name; and whatever else is new in ``sys.modules``), as they stand now."""
        for name, module in executed:
            self.add_module(name, sys.modules.get(name, module))
            self.add_module(name, module)  # a package may put another object in its place
        for name, module in list(sys.modules.items()):
            self.add_module(name, module)

    def watches(self, module_name: str) -> bool:
        return module_name in self.packages or module_name.startswith(self._prefixes)

    @property
    def _prefixes(self) -> tuple[str, ...]:
        return tuple(f"{package}." for package in self.packages)

    def add_module(self, name: str, module: Any) -> None:
        entries = _own_dict(module)
        if entries is None or id(module) in self.owners:
            return
        self.owners[id(module)] = Owner(module, name, dict(entries))
        if not self.watches(name):
            return
        self._add_contents(name, entries)
        for key, value in list(entries.items()):
            if isinstance(value, type):
                if getattr(value, "__module__", None) == name:
                    self.add_class(value)
            elif _plain_object(value, self):
                self._add_object(value, f"{name}.{key}")

    def add_class(self, cls: type) -> None:
        if id(cls) in self.owners or cls is object:
            return
        entries = dict(cls.__dict__)
        where = f"{cls.__module__}.{cls.__qualname__}"
        self.owners[id(cls)] = Owner(cls, where, entries)
        self._add_contents(where, entries)

    def _add_object(self, obj: Any, where: str) -> None:
        entries = obj.__dict__
        self.owners[id(obj)] = Owner(obj, where, dict(entries), type(obj))
        self._add_contents(where, entries)

    def _add_contents(self, where: str, entries: Any) -> None:
        for key, value in list(entries.items()):
            if isinstance(value, CONTAINERS) and id(value) not in self.contents:
                self.contents[id(value)] = Contents(
                    value, f"{where}.{key}", Contents.copy_of(value)
                )
            elif isinstance(value, (staticmethod, classmethod)):
                value = value.__func__
            named = f"{where}.{key}"
            # the functions a decorator wraps too (``inspect.unwrap``): a patch may change
            # the code of the one inside
            for _ in range(_WRAPPED_DEPTH):
                if not isinstance(value, types.FunctionType) or id(value) in self.functions:
                    break
                self.functions[id(value)] = FunctionState(
                    value, named, FunctionState.parts_of(value)
                )
                value, named = getattr(value, "__wrapped__", None), f"{named}.__wrapped__"

    def _add_model(self, model: Any) -> None:
        self._add_configs(model)
        for qualname, module in model.named_modules():
            where = qualname or type(model).__name__
            self._add_object(module, where)
            for cls in type(module).__mro__:
                self.add_class(cls)
            for kind in ("_parameters", "_buffers"):
                for name, tensor in module.__dict__.get(kind, {}).items():
                    if tensor is not None:
                        self.tensors.append(
                            TensorState(
                                f"{where}.{name}" if qualname else name,
                                tensor,
                                tensor._version,
                                tensor.data_ptr(),
                            )
                        )

    def _add_configs(self, model: Any) -> None:
        """The model's config and the configs it holds (a wrapper's text config): a patch
        may set ``model.config._attn_implementation`` to the attention it registers."""
        waiting = [(getattr(model, "config", None), "config")]
        while waiting:
            config, where = waiting.pop()
            entries = _own_dict(config)
            if entries is None or id(config) in self.owners or not _is_config(config):
                continue
            self._add_object(config, where)
            waiting.extend(
                (value, f"{where}.{key}") for key, value in entries.items() if _is_config(value)
            )


@dataclass
class Checkpoint:
    """What the copied places held when an import began (:meth:`Snapshot.checkpoint`)."""

    entries: dict[int, dict[str, Any]]
    classes: dict[int, type]
    contents: dict[int, Any]
    functions: dict[int, tuple[Any, ...]]
    modules: dict[str, Any]


_ABSENT = object()


def _rebase_entries(before: dict[str, Any], then: dict[str, Any], now: dict[str, Any]) -> None:
    """Each name bound, rebound or removed between ``then`` and ``now``, so in ``before``."""
    for name in [*then, *(key for key in now if key not in then)]:
        old, new = then.get(name, _ABSENT), now.get(name, _ABSENT)
        if old is new:
            continue
        if new is _ABSENT:
            before.pop(name, None)
        else:
            before[name] = new


def _rebase_items(obj: Any, before: Any, then: Any, now: Any) -> Any:
    """A container's copy ``before`` with the changes made between ``then`` and ``now``:
    a dict's items added, rebound and removed, in place and order; a set's items added
    and removed; a list as it is now."""
    if isinstance(obj, dict):
        old, new = dict(then), dict(now)
        changed = {key: value for key, value in now if old.get(key, _ABSENT) is not value}
        gone = {key for key in old if key not in new}
        kept = [(key, changed.pop(key, value)) for key, value in before if key not in gone]
        return [*kept, *((key, value) for key, value in now if key in changed)]
    if isinstance(obj, set):
        return (before - (then - now)) | (now - then)
    return now


def _is_config(value: Any) -> bool:
    """A transformers config (read by what it has: this module imports no transformers)."""
    return hasattr(value, "model_type") and callable(getattr(value, "to_dict", None))


def _own_dict(obj: Any) -> dict[str, Any] | None:
    try:
        entries = object.__getattribute__(obj, "__dict__")
    except Exception:
        return None
    return entries if isinstance(entries, dict) else None


def _entries_now(obj: Any) -> dict[str, Any] | None:
    """A copy of what a module's, class's or instance's own ``__dict__`` holds now."""
    try:
        return dict(object.__getattribute__(obj, "__dict__"))
    except Exception:
        return None


def _plain_object(value: Any, snapshot: Snapshot) -> bool:
    """An instance of a class of a watched package, holding its state in a ``__dict__``
    (an attention interface, a registry object): not a module, class or function."""
    if isinstance(value, (types.ModuleType, types.FunctionType, types.MethodType, type)):
        return False
    if id(value) in snapshot.owners:
        return False
    module = getattr(type(value), "__module__", "") or ""
    return snapshot.watches(module) and _own_dict(value) is not None


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
