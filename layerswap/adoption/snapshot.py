"""What a patch function could change, copied before it runs: modules, classes, a model's modules.

A patch function (Liger-Kernel's ``apply_liger_kernel_to_llama``, a training repository's
hand-written patch) changes objects in place and keeps no record. To take its changes back,
:mod:`layerswap.adoption.record` copies, before it runs, every place it can write:

* every module of ``sys.modules``: its ``__dict__``, shallowly (a few milliseconds), and
  the table itself;
* torch's process-wide switches and ``os.environ`` (:mod:`layerswap.adoption.process`);
* in the *watched* packages (transformers, ``torch.nn``, the patch function's own
  package): the ``__dict__`` of each class a module defines, the contents of each dict,
  list or set held by a module or class attribute (a registry such as ``ACT2FN`` or
  ``ALL_ATTENTION_FUNCTIONS`` mutated in place), the code and defaults of each function
  held there (``forward.__code__`` replaced), and the ``__dict__`` of the plain objects
  held there (an interface instance with its own mapping);
* for a given model, every submodule: its ``__dict__`` (``forward`` bound per instance),
  its class, the contents of ``_parameters``, ``_buffers``, ``_modules`` and the hook
  dictionaries; each tensor's version counter, storage and a fingerprint of its bytes (an
  in-place change of a weight, through ``.data`` too, cannot be taken back, and is refused);
* a module imported for the first time while the function runs is copied once the
  outermost import under way finishes
  (:class:`~layerswap.adoption.importing.SnapshotOnImport`), so the function's
  changes to a transformers modeling module it imports itself are seen and taken back too;
  the module stays imported. What that import did itself (a module it imported
  registering into another, a name it rebound in a module imported before) is the
  import's, not the function's: the copies take it as it stands then (:meth:`Snapshot.rebase`).

Comparing the copy with what is there afterwards (:mod:`layerswap.adoption.changes`) gives
each change the function made.

Example::

    snapshot = Snapshot(("transformers", "torch.nn", "my_patches"), model).take()
    with SnapshotOnImport(snapshot):          # layerswap.adoption.importing
        apply_patch(model=model)
"""

from __future__ import annotations

import sys
import types
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from layerswap.adoption.process import ProcessState

__all__ = [
    "Checkpoint",
    "Contents",
    "FunctionState",
    "Owner",
    "refill",
    "same_contents",
    "Snapshot",
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
    """A parameter or buffer of the model: its version counter, storage and contents."""

    where: str
    tensor: Any
    version: int
    pointer: int
    #: what :func:`fingerprint` read then (``None``: unreadable, a meta tensor)
    contents: Any = None

    @classmethod
    def of(cls, where: str, tensor: Any) -> TensorState:
        return cls(where, tensor, tensor._version, tensor.data_ptr(), fingerprint(tensor))

    def moved(self) -> bool:
        """Changed in place through the tensor itself (its version counter or storage)."""
        tensor = self.tensor
        return bool(tensor._version != self.version or tensor.data_ptr() != self.pointer)

    def changed(self) -> bool:
        """:meth:`moved`, or its contents changed through another view (``.data``, whose
        version counter is its own)."""
        if self.moved():
            return True
        if self.contents is None:
            return False
        import torch

        now = fingerprint(self.tensor)
        return now is None or not torch.equal(now, self.contents)


#: how many sums of consecutive stretches a tensor's fingerprint holds
_STRETCHES = 1024


def fingerprint(tensor: Any) -> Any:
    """The tensor's bytes read as 64-bit integers, summed per stretch (about
    :data:`_STRETCHES` of them, and the bytes left over): a small tensor on the tensor's
    device. A value changed, or moved to another stretch, changes it. One read of the
    bytes, without a copy where the tensor is contiguous and 8-byte aligned (sums wrap
    around, in any order the same); ``None`` where it cannot be read (a meta tensor, a
    tensor subclass without a storage of its own)."""
    try:
        import torch

        data = tensor.detach()
        if data.device.type == "meta":
            return None
        raw = data.contiguous().reshape(-1).view(torch.uint8)
        whole = raw.numel() // 8 * 8
        if (raw.storage_offset() % 8) != 0:
            raw = raw.clone()
        words = raw[:whole].view(torch.int64)
        size = max(words.numel() // _STRETCHES, 1)  # a small tensor: each word its own
        count = words.numel() // size * size
        parts = [
            words[:count].view(-1, size).sum(1),
            words[count:].sum().reshape(1),
            raw[whole:].to(torch.int64).sum().reshape(1),
        ]
        return torch.cat(parts)
    except Exception:
        return None


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
    #: torch's process-wide switches and the environment
    process: ProcessState = field(default_factory=ProcessState)

    def take(self) -> Snapshot:
        self.process = ProcessState.take()
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
            process=ProcessState.take(),
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
        self.process.rebase(then.process)

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
                        named = f"{where}.{name}" if qualname else name
                        self.tensors.append(TensorState.of(named, tensor))

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
    process: ProcessState


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
