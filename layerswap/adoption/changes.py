"""The changes a patch function made, found by comparing a :class:`Snapshot` with now.

Each change knows how to take itself back and how to make itself again (a proof runs the
original model with the changes taken back for the time of a call):

* :class:`Rebinding`: a name of a module, a class or an instance bound to another object,
  or added. It is handed to the patching engine as a :func:`layerswap.patch` layer, so an
  adopted patch nests with every other patch of the same attribute, stopped in any order
  (:mod:`layerswap.patching.stack`); restored raw (a ``staticmethod`` as the same object);
* :class:`Deletion`: a name removed: an engine layer showing it absent, on the stack a
  rebinding of the name uses;
* :class:`ItemChange`: a dict's items added, rebound, removed or reordered in place (a
  registry, a model's ``_modules``): one engine layer per key, and one of the dict's order
  where the function reordered its keys, the container object kept;
* :class:`ContentsChange`: a list or set changed in place: an engine layer of the
  container's contents holding the function's edit, the container object kept;
* :class:`ClassChange`: an instance given another class, and :class:`FunctionChange`: a
  function's ``__code__`` or defaults replaced in place: engine layers as a rebinding is;
* :class:`ModuleTableChange`: an entry of ``sys.modules`` replaced or removed, or added
  by the function itself (modules imported for the first time stay);
* :class:`SwitchChange`: one of torch's process-wide switches set (``allow_tf32``, the
  float32 matmul precision, deterministic algorithms ...), set back through torch's
  setters, and :class:`EnvironmentChange`: a variable of ``os.environ`` set or removed.

What cannot be taken back (a model's tensor changed in place, through ``.data`` too) is listed by
:func:`find_changes` as unrecordable, by name: the adoption is refused.

Example::

    changes, unrecordable = find_changes(snapshot)
    [str(change) for change in changes]   # ["transformers...modeling_llama.LlamaRMSNorm: rebound"]
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable
from typing import Any

from layerswap.adoption.process import Switches, set_environ
from layerswap.adoption.snapshot import (
    FUNCTION_PARTS,
    Contents,
    FunctionState,
    Owner,
    Snapshot,
    refill,
    same_contents,
)
from layerswap.patching import Patch
from layerswap.patching.contents import (
    ContentsSite,
    Edit,
    OrderSite,
    Reorder,
    reassert_order,
)
from layerswap.patching.sites import (
    DELETED,
    NOTSET,
    DictSite,
    ItemSite,
    Original,
    Site,
    make_site,
)
from layerswap.patching.stack import Layer, move_to, position_of, push, remove, warn_conflicts

__all__ = [
    "Change",
    "ClassChange",
    "ContentsChange",
    "Deletion",
    "EnvironmentChange",
    "FunctionChange",
    "ItemChange",
    "ModuleTableChange",
    "Rebinding",
    "SwitchChange",
    "find_changes",
]

#: names Python itself writes into a module's or class's ``__dict__`` (warning and pickling
#: caches, lazily created annotations): not the patch function's doing
_BOOKKEEPING = frozenset({"__warningregistry__", "__slotnames__", "__annotations__"})


class Change:
    """One change a patch function made: ``revert()`` takes it back, ``apply()`` makes it
    again; ``adopt()`` turns the raw change into its lasting form (a patch layer)."""

    where: str
    what: str

    def adopt(self) -> None:
        """Called once, after the function ran: the change is in place."""

    def patches(self) -> list[Patch]:
        """The engine's patches that hold the change (none for a change put back raw)."""
        return []

    def revert(self) -> None:
        raise NotImplementedError

    def apply(self) -> None:
        raise NotImplementedError

    def __str__(self) -> str:
        return f"{self.where}: {self.what}"

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self}>"


def _raw_site(owner: Any, name: str) -> DictSite:
    return DictSite(owner, name)


def _put(owner: Any, name: str, value: Any) -> None:
    """Write ``value`` raw into ``owner``'s own ``__dict__`` (``NOTSET``: remove the name)."""
    site = _raw_site(owner, name)
    site.restore(Original(None if value is NOTSET else "__dict__", value))


class _Layered(Change):
    """A change handed to the patching engine as one :class:`~layerswap.patching.Patch`
    layer per attribute it set (``owner.name = new``; before: ``old``), so that adoptions
    (and every other patch of the same attribute) stop in any order and each leaves the
    others' values in place."""

    _sets: list[tuple[Any, str, Any, Any]]  # (owner, name, old, new)

    def _raw(self, owner: Any, name: str, value: Any) -> None:
        setattr(owner, name, value)

    def adopt(self) -> None:
        # the engine's stack must see the value before the function as the one below
        self._patches = []
        for owner, name, old, new in self._sets:
            self._raw(owner, name, old)
            patch = Patch(owner, name, new, create=True)
            patch.start()
            self._patches.append(patch)
        # where each layer sat when taken back (suspended): made again there, under any
        # newer patch of the same attribute
        self._positions: list[int] | None = None

    def patches(self) -> list[Patch]:
        return list(getattr(self, "_patches", ()))

    def revert(self) -> None:
        patches = getattr(self, "_patches", None)
        if patches is None:  # the function failed half-way: nothing was adopted
            for owner, name, old, _ in self._sets:
                self._raw(owner, name, old)
            return
        self._positions = [patch.stack_position() for patch in patches]
        for patch in reversed(patches):
            patch.stop()

    def apply(self) -> None:
        patches = getattr(self, "_patches", None)
        if patches is None:
            for owner, name, _, new in self._sets:
                self._raw(owner, name, new)
            return
        for index, patch in enumerate(patches):
            patch.start()
            if self._positions is not None:
                patch.restack(self._positions[index])
        self._positions = None


class Rebinding(_Layered):
    """``owner.name`` bound to ``new`` (before: ``old``, ``NOTSET`` when absent)."""

    def __init__(self, owner: Any, name: str, old: Any, new: Any, where: str) -> None:
        self.owner, self.name, self.old, self.new = owner, name, old, new
        self.where = f"{where}.{name}"
        self.what = "added" if old is NOTSET else "rebound"
        self._sets = [(owner, name, old, new)]

    def _raw(self, owner: Any, name: str, value: Any) -> None:
        _put(owner, name, value)


class _Stacked(Change):
    """A change held as one layer per site of the engine's stacks
    (:mod:`layerswap.patching.stack`), pushed by the change itself (a name removed, a
    dict's item, a container's contents or order): adoptions, and every other patch of
    the same site, end in any order, each leaving the others' values in place."""

    _layers: list[Layer] | None = None
    #: where each layer sat when taken back (suspended): made again there, under any newer
    #: layer of the same site
    _positions: list[int | None] | None = None

    def _entries(self) -> list[tuple[Site, Any, Callable[[Site, Any], Any] | None]]:
        """Each site, with the value its layer shows (or the factory building it from the
        value below)."""
        raise NotImplementedError

    def _take_back_raw(self) -> None:
        """The function's change taken back, written raw (before it is adopted)."""
        raise NotImplementedError

    def _make_raw(self) -> None:
        """The function's change made again, written raw."""
        raise NotImplementedError

    def _label(self) -> str:
        return f"adoption of {self.where}"

    def adopt(self) -> None:
        # the stacks must see what was there before the function as the value below
        self._take_back_raw()
        self._sites = self._entries()
        layers: list[Layer] = []
        try:
            for site, value, factory in self._sites:
                layers.append(push(site, value, factory, self, create=True))
        except BaseException:
            for layer in reversed(layers):  # none left on the stacks: made again raw
                remove(layer)
            self._make_raw()
            raise
        self._layers = layers

    def revert(self) -> None:
        if self._layers is None:  # the function failed half-way: nothing was adopted
            self._take_back_raw()
            return
        self._positions = [position_of(layer) for layer in self._layers]
        conflicts = [remove(layer) for layer in reversed(self._layers)]
        warn_conflicts([c for c in conflicts if c is not None], stacklevel=3)

    def apply(self) -> None:
        if self._layers is None:
            self._make_raw()
            return
        positions = self._positions or [None] * len(self._sites)
        layers = []
        for (site, value, factory), position in zip(self._sites, positions, strict=True):
            layer = push(site, value, factory, self, create=True)
            if position is not None:
                move_to(layer, position)
            layers.append(layer)
        self._layers, self._positions = layers, None


class Deletion(_Stacked):
    """``owner.name`` removed (it held ``old``): a layer showing the name absent on its
    stack, as a rebinding's is, so that adoptions removing or rebinding one name end in
    any order."""

    def __init__(self, owner: Any, name: str, old: Any, where: str) -> None:
        self.owner, self.name, self.old = owner, name, old
        self.where = f"{where}.{name}"
        self.what = "deleted"

    def _entries(self) -> list[tuple[Site, Any, Callable[[Site, Any], Any] | None]]:
        return [(make_site(self.owner, self.name), DELETED, None)]

    def _take_back_raw(self) -> None:
        _put(self.owner, self.name, self.old)

    def _make_raw(self) -> None:
        _put(self.owner, self.name, NOTSET)


class ItemChange(_Stacked):
    """A dict's items added, rebound, removed or reordered in place (a registry, a model's
    ``_modules``): one layer of the engine's per-site stacks per key
    (:class:`~layerswap.patching.sites.ItemSite`), and one of the dict's order
    (:class:`~layerswap.patching.contents.OrderSite`) where the function left its keys in
    another order than setting those items would (a key popped and set again goes to the
    end), so that adoptions changing one dict end in any order, each leaving the others'
    items and order, as rebindings do."""

    def __init__(self, contents: Contents) -> None:
        self.obj = contents.obj
        self.before = contents.before
        after = Contents.copy_of(contents.obj)
        self.where = contents.where
        old = dict(self.before)
        new = dict(after)
        self._sets = [(key, value) for key, value in after if old.get(key, NOTSET) is not value] + [
            (key, DELETED) for key, _ in self.before if key not in new
        ]
        self._after = after
        # the keys' order setting the items gives: the kept ones in place, the new ones
        # after them, in the function's order
        kept = [key for key, _ in self.before if key in new]
        self._order = tuple(new)
        self._reordered = self._order != (*kept, *(key for key in new if key not in old))
        what = _contents_delta(self.before, after, self.obj)
        self.what = f"{what}; reordered" if self._sets and self._reordered else what

    def _entries(self) -> list[tuple[Site, Any, Callable[[Site, Any], Any] | None]]:
        entries: list[tuple[Site, Any, Callable[[Site, Any], Any] | None]] = [
            (ItemSite(self.obj, key), value, None) for key, value in self._sets
        ]
        if self._reordered:
            before = tuple(key for key, _ in self.before)
            entries.append((OrderSite(self.obj), None, Reorder(before, self._order)))
        return entries

    def _take_back_raw(self) -> None:
        _refill(self.obj, self.before, self._after)

    def _make_raw(self) -> None:
        _refill(self.obj, self._after, self.before)

    def revert(self) -> None:
        super().revert()
        reassert_order(self.obj)  # a key put back goes where a live reordering has it

    def apply(self) -> None:
        super().apply()
        reassert_order(self.obj)


class ContentsChange(_Stacked):
    """A list or set changed in place: one layer of the container's stack
    (:class:`~layerswap.patching.contents.ContentsSite`) holding the function's edit, laid
    over whatever is below it, so that adoptions changing one list or set end in any
    order, each keeping the others' items. ``after`` is what it held after the function."""

    def __init__(self, contents: Contents) -> None:
        self.obj = contents.obj
        self.before = contents.before
        self.after = Contents.copy_of(contents.obj)
        self.where = contents.where
        self.what = _contents_delta(self.before, self.after, self.obj)

    def _entries(self) -> list[tuple[Site, Any, Callable[[Site, Any], Any] | None]]:
        edit = Edit(tuple(self.before), tuple(self.after))
        return [(ContentsSite(self.obj), None, edit)]

    def _take_back_raw(self) -> None:
        _refill(self.obj, self.before, self.after)

    def _make_raw(self) -> None:
        _refill(self.obj, self.after, self.before)


def _contents_delta(before: Any, after: Any, obj: Any) -> str:
    if isinstance(obj, dict):
        old, new = dict(before), dict(after)
        added = [k for k in new if k not in old]
        removed = [k for k in old if k not in new]
        changed = [k for k in new if k in old and new[k] is not old[k]]
        parts = [
            f"{label} {', '.join(map(repr, keys[:5]))}{' ...' if len(keys) > 5 else ''}"
            for label, keys in (("added", added), ("changed", changed), ("removed", removed))
            if keys
        ]
        return "; ".join(parts) or "reordered"
    return "changed in place"


def _refill(obj: Any, target: Any, other: Any) -> None:
    """Make ``obj`` hold ``target`` again. A dict keeps the keys someone else added since
    (``other`` says which keys the function's side knew), after ``target``'s, in order."""
    if isinstance(obj, dict):
        known = {key for key, _ in target} | {key for key, _ in other}
        extra = [(key, value) for key, value in Contents.copy_of(obj) if key not in known]
        target = [*target, *extra]
    if not same_contents(obj, target):
        refill(obj, target)


class ClassChange(_Layered):
    """An instance given another class (``obj.__class__ = new``)."""

    def __init__(self, obj: Any, old: type, new: type, where: str) -> None:
        self.obj, self.old, self.new = obj, old, new
        self.where = where
        self.what = f"class {old.__qualname__} -> {new.__qualname__}"
        self._sets = [(obj, "__class__", old, new)]


class FunctionChange(_Layered):
    """A function's code or defaults replaced in place (``f.__code__ = other.__code__``)."""

    def __init__(self, state: FunctionState) -> None:
        self.function = state.function
        self.before = state.before
        self.after = FunctionState.parts_of(state.function)
        self.where = state.where
        changed = [
            (part, old, new)
            for part, old, new in zip(FUNCTION_PARTS, self.before, self.after, strict=True)
            if old is not new
        ]
        self.what = f"{', '.join(part for part, _, _ in changed)} replaced"
        self._sets = [(self.function, part, old, new) for part, old, new in changed]


class ModuleTableChange(Change):
    """``sys.modules[name]`` replaced, removed, or added (``old``: ``NOTSET``) by the
    function itself, not by an import."""

    def __init__(self, name: str, old: Any, new: Any) -> None:
        self.name, self.old, self.new = name, old, new
        self.where = f"sys.modules[{name!r}]"
        self.what = "removed" if new is NOTSET else "added" if old is NOTSET else "replaced"

    def revert(self) -> None:
        self._put(self.old)

    def apply(self) -> None:
        self._put(self.new)

    def _put(self, module: Any) -> None:
        if module is NOTSET:
            sys.modules.pop(self.name, None)
        else:
            sys.modules[self.name] = module


class SwitchChange(Change):
    """One reading of a group of torch's switches changed (``index``: which); the group
    is set back whole, through torch's setters (its switches are linked)."""

    def __init__(
        self, group: Switches, before: tuple[Any, ...], after: tuple[Any, ...], index: int
    ) -> None:
        self.group, self.before, self.after = group, before, after
        self.where = group.names[index]
        self.what = f"{before[index]!r} -> {after[index]!r}"

    def revert(self) -> None:
        self.group.write(self.before)

    def apply(self) -> None:
        self.group.write(self.after)


class EnvironmentChange(Change):
    """``os.environ[name]`` set, changed or removed (``None``: unset). The values are not
    shown: a variable may hold a secret."""

    def __init__(self, name: str, old: str | None, new: str | None) -> None:
        self.name, self.old, self.new = name, old, new
        self.where = f"os.environ[{name!r}]"
        self.what = "added" if old is None else "removed" if new is None else "changed"

    def revert(self) -> None:
        set_environ(self.name, self.old)

    def apply(self) -> None:
        set_environ(self.name, self.new)


def find_changes(snapshot: Snapshot) -> tuple[list[Change], list[str]]:
    """Every change since ``snapshot`` was taken, and what changed that cannot be taken
    back (by name)."""
    changes: list[Change] = []
    for owner in list(snapshot.owners.values()):
        changes.extend(_owner_changes(owner, snapshot))
    for contents in list(snapshot.contents.values()):
        if not contents.unchanged():
            changes.append(_contents_change(contents))
    changes.extend(
        FunctionChange(state) for state in snapshot.functions.values() if state.changed()
    )
    for name, module in snapshot.modules.items():
        now = sys.modules.get(name, NOTSET)
        if now is not module:
            changes.append(ModuleTableChange(name, module, now))
    changes.extend(
        ModuleTableChange(name, NOTSET, module)
        for name, module in list(sys.modules.items())
        if name not in snapshot.modules and name not in snapshot.imported
    )
    switched = snapshot.process.changed()
    # a name torch rebinds with a switch (torch.Storage) is set back with the switch
    rebound = {name for group, _, _ in switched for name in group.rebinds}
    changes = [c for c in changes if not (isinstance(c, Rebinding) and c.where in rebound)]
    changes.extend(_process_changes(snapshot, switched))
    unrecordable = [
        f"{state.where} (a tensor of the model, changed in place"
        + ("" if state.moved() else " through .data or another tensor sharing its storage")
        + ")"
        for state in snapshot.tensors
        if state.changed()
    ]
    return changes, unrecordable


def _contents_change(contents: Contents) -> Change:
    return ItemChange(contents) if isinstance(contents.obj, dict) else ContentsChange(contents)


def _process_changes(
    snapshot: Snapshot, switched: list[tuple[Switches, tuple[Any, ...], tuple[Any, ...]]]
) -> list[Change]:
    """torch's switches set (``switched``) and ``os.environ``'s variables set or removed."""
    found: list[Change] = [
        SwitchChange(group, before, after, index)
        for group, before, after in switched
        for index in range(len(before))
        if before[index] != after[index]
    ]
    found += [
        EnvironmentChange(name, old, new) for name, old, new in snapshot.process.environ_changed()
    ]
    return found


def _owner_changes(owner: Owner, snapshot: Snapshot) -> list[Change]:
    obj = owner.obj
    try:
        now = dict(object.__getattribute__(obj, "__dict__"))
    except Exception:
        return []
    found: list[Change] = []
    before = owner.entries
    for name in [*before, *(key for key in now if key not in before)]:
        old, new = before.get(name, NOTSET), now.get(name, NOTSET)
        if old is new or name in _BOOKKEEPING or _import_binding(owner, name, new, snapshot):
            continue
        if new is NOTSET:
            found.append(Deletion(obj, name, old, owner.where))
        else:
            found.append(Rebinding(obj, name, old, new, owner.where))
    if owner.cls is not None and type(obj) is not owner.cls:
        found.append(ClassChange(obj, owner.cls, type(obj), owner.where))
    return found


def _import_binding(owner: Owner, name: str, value: Any, snapshot: Snapshot) -> bool:
    """Whether ``owner.name = value`` is the import system's: a package given its
    submodule on import (taken back, ``owner.name`` would fail while the module is in
    ``sys.modules``). Not where the function put that module in ``sys.modules`` itself,
    in place of another or as a new entry: the package's name for it is then the
    function's change too, taken back with the table's."""
    if not isinstance(owner.obj, types.ModuleType) or not isinstance(value, types.ModuleType):
        return False
    full = f"{owner.where}.{name}"
    if sys.modules.get(full) is not value:
        return False
    # the table before the function, with what each import added
    before = snapshot.modules.get(full, NOTSET)
    return before is value or (before is NOTSET and full in snapshot.imported)
