"""Sites: one attribute of one object, read and written *raw*.

A site knows where a value really lives, so that restoring is exact:

* classes and modules: the owner's ``__dict__`` (so ``staticmethod``/``classmethod``/
  ``property`` objects are read and put back as they are, never via ``getattr``);
* ``nn.Module`` instances: ``_parameters`` / ``_buffers`` / ``_modules`` — values are
  written into the same dictionary under the same key, so identity *and order*
  survive; a value of another kind (a function replacing a child module) is kept in
  the instance ``__dict__`` meanwhile and the child is put back at its position;
* special attributes backed by a data descriptor of the type (``__defaults__``,
  ``__doc__`` of a function, ``__slots__`` members): read with ``getattr`` and set
  back with ``setattr`` — never deleted;
* one key of a mapping (:class:`ItemSite`: a registry's entry, a child in a model's
  ``_modules``): the mapping object kept, the key back where it sat in its order.

An attribute absent from the owner's own storage (inherited from a class, or
created by ``create=True``) is *deleted* on restore, not copied down.
"""

from __future__ import annotations

import sys
import types
import weakref
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence
from typing import Any, Final

__all__ = [
    "DELETED",
    "NOTSET",
    "ItemSite",
    "Original",
    "Site",
    "item_order",
    "lay_over",
    "make_site",
]


class _Sentinel:
    __slots__ = ("_name",)

    def __init__(self, name: str) -> None:
        self._name = name

    def __repr__(self) -> str:
        return self._name

    def __reduce__(self) -> str:
        return self._name


NOTSET: Final[Any] = _Sentinel("NOTSET")
"""No value: the attribute is absent from the owner's own storage."""

DELETED: Final[Any] = _Sentinel("DELETED")
"""A layer value meaning "the key is removed while this layer is on top"."""

_NN_CONTAINERS: Final = ("_parameters", "_buffers", "_modules")


class Original:
    """What a site held before the first patch: where, what, and at which position."""

    __slots__ = ("container", "position", "value")

    def __init__(
        self, container: str | None, value: Any, position: int | tuple[str, ...] = -1
    ) -> None:
        self.container = container  # None: absent (inherited, or missing)
        self.value = value
        # where it sat: an index, or (an nn.Module's child or tensor) the keys before it
        self.position = position


def _is_data_descriptor(obj: Any) -> bool:
    kind = type(obj)
    return hasattr(kind, "__set__") or hasattr(kind, "__delete__")


def _type_attribute(kind: type, name: str) -> Any:
    for klass in kind.__mro__:
        if name in klass.__dict__:
            return klass.__dict__[name]
    return NOTSET


class Site:
    """Base: a place that holds one value. Subclasses implement the raw access."""

    __slots__ = ("key", "name", "owner")

    kind = "attribute"
    raw_reads = False
    """True when ``read()`` hands back the stored object itself (identity is exact)."""

    def __init__(self, owner: Any, name: Any) -> None:
        self.owner = owner
        self.name = name
        self.key: tuple[int, Any] = (id(owner), name)

    # -- to implement ------------------------------------------------------------
    def read(self) -> Any:
        """The raw value now at the site, or NOTSET."""
        raise NotImplementedError

    def snapshot(self) -> Original:
        raise NotImplementedError

    def write(self, value: Any, original: Original) -> None:
        raise NotImplementedError

    def restore(self, original: Original) -> None:
        raise NotImplementedError

    # -- shared --------------------------------------------------------------
    def visible(self) -> Any:
        """The value a user sees (``getattr``), or NOTSET if there is none."""
        return getattr(self.owner, self.name, NOTSET)

    def same(self, current: Any, written: Any) -> bool:
        """Whether ``current`` is still what layerswap wrote (no foreign write); a name
        removed (``DELETED`` written) reads as absent."""
        return current is written or (written is DELETED and current is NOTSET)

    def describe(self) -> str:
        owner = self.owner
        if isinstance(owner, types.ModuleType):
            return f"{owner.__name__}.{self.name}"
        if isinstance(owner, type):
            return f"{owner.__module__}.{owner.__qualname__}.{self.name}"
        return f"<{type(owner).__qualname__} object at {id(owner):#x}>.{self.name}"


class DictSite(Site):
    """An attribute stored in the owner's ``__dict__`` (classes, modules, instances)."""

    __slots__ = ("_is_class",)
    raw_reads = True

    def __init__(self, owner: Any, name: str) -> None:
        self.owner = owner
        self.name = name
        self.key = (id(owner), name)
        self._is_class = isinstance(owner, type)

    def read(self) -> Any:
        return self.owner.__dict__.get(self.name, NOTSET)

    def snapshot(self) -> Original:
        raw = self.owner.__dict__.get(self.name, NOTSET)
        return Original(None if raw is NOTSET else "__dict__", raw)

    def write(self, value: Any, original: Original) -> None:
        if value is DELETED:
            self._delete()
        elif self._is_class:
            # type.__setattr__ stores the raw object: a staticmethod stays a staticmethod.
            type.__setattr__(self.owner, self.name, value)
        else:
            self.owner.__dict__[self.name] = value

    def _delete(self) -> None:
        if self.name not in self.owner.__dict__:
            return
        if self._is_class:
            type.__delattr__(self.owner, self.name)
        else:
            del self.owner.__dict__[self.name]

    def restore(self, original: Original) -> None:
        if original.container is None:
            self._delete()
        elif self._is_class:
            type.__setattr__(self.owner, self.name, original.value)
        else:
            self.owner.__dict__[self.name] = original.value


class DescriptorSite(Site):
    """A special attribute backed by a data descriptor on the type (``__defaults__``...)."""

    __slots__ = ()

    def read(self) -> Any:
        return getattr(self.owner, self.name, NOTSET)

    def snapshot(self) -> Original:
        value = getattr(self.owner, self.name, NOTSET)  # an unset __slots__ member: NOTSET
        return Original(None if value is NOTSET else "descriptor", value)

    def same(self, current: Any, written: Any) -> bool:
        return _same_value(current, written)

    def write(self, value: Any, original: Original) -> None:
        if value is DELETED:
            delattr(self.owner, self.name)
        else:
            setattr(self.owner, self.name, value)

    def restore(self, original: Original) -> None:
        if original.container is None:
            if getattr(self.owner, self.name, NOTSET) is not NOTSET:
                delattr(self.owner, self.name)
        else:
            setattr(self.owner, self.name, original.value)


class AttributeSite(Site):
    """An attribute of an object with its own ``__setattr__``/``__getattribute__``.

    Such objects (transformers configs with an ``attribute_map``, torch's backend
    flag modules, proxies) decide where a value lives; writing their ``__dict__``
    directly would do nothing. Values go through ``setattr``/``getattr``; an
    attribute the class provides (not the instance) is deleted on restore.
    """

    __slots__ = ()

    def read(self) -> Any:
        return getattr(self.owner, self.name, NOTSET)

    def same(self, current: Any, written: Any) -> bool:
        return _same_value(current, written)

    def snapshot(self) -> Original:
        own = getattr(self.owner, "__dict__", None)
        in_own_dict = isinstance(own, dict) and self.name in own
        if not in_own_dict and _type_attribute(type(self.owner), self.name) is not NOTSET:
            return Original(None, NOTSET)  # inherited from the class
        value = getattr(self.owner, self.name, NOTSET)
        return Original(None if value is NOTSET else "attribute", value)

    def write(self, value: Any, original: Original) -> None:
        if value is DELETED:
            delattr(self.owner, self.name)
        else:
            setattr(self.owner, self.name, value)

    def restore(self, original: Original) -> None:
        if original.container is not None:
            setattr(self.owner, self.name, original.value)
            return
        own = getattr(self.owner, "__dict__", None)
        if (isinstance(own, dict) and self.name in own) or (
            _type_attribute(type(self.owner), self.name) is NOTSET
            and getattr(self.owner, self.name, NOTSET) is not NOTSET
        ):
            delattr(self.owner, self.name)


def _same_value(current: Any, observed: Any) -> bool:
    # getattr through a property or a C setter may hand out a new, equal object on
    # each read (a copy of a list, a decoded string): equal and of the same type is
    # "unchanged". A comparison that is not a plain True (arrays) counts as a change.
    if current is observed:
        return True
    if type(current) is not type(observed):
        return False
    try:
        return (current == observed) is True
    except Exception:
        return False


class ModuleSite(Site):
    """An attribute of a ``torch.nn.Module`` instance: parameters, buffers, children."""

    __slots__ = ()
    raw_reads = True

    def _containers(self) -> list[dict[str, Any]]:
        d = self.owner.__dict__
        return [d[c] for c in _NN_CONTAINERS if c in d]

    def read(self) -> Any:
        d = self.owner.__dict__
        name = self.name
        for container in _NN_CONTAINERS:
            store = d.get(container)
            if store is not None and name in store:
                return store[name]
        return d.get(name, NOTSET)

    def snapshot(self) -> Original:
        d = self.owner.__dict__
        for container in _NN_CONTAINERS:
            store = d.get(container)
            if store is not None and self.name in store:
                # the keys before it in the order first seen, not an index: other patches
                # may have taken keys out already, and may put them back in any order
                keys = _order_of(self.owner, container, store)
                return Original(container, store[self.name], tuple(keys[: keys.index(self.name)]))
        raw = d.get(self.name, NOTSET)
        return Original(None if raw is NOTSET else "__dict__", raw)

    @staticmethod
    def _fits(container: str, value: Any) -> bool:
        torch = sys.modules["torch"]  # loaded: the owner is an nn.Module

        if value is None:
            return True
        if container == "_modules":
            return isinstance(value, torch.nn.Module)
        if container == "_parameters":
            return isinstance(value, torch.nn.Parameter)
        return isinstance(value, torch.Tensor)  # _buffers

    def _discard(self) -> None:
        d = self.owner.__dict__
        for container in _NN_CONTAINERS:
            store = d.get(container)
            if store is not None:
                store.pop(self.name, None)
        d.pop(self.name, None)

    def write(self, value: Any, original: Original, *, placed: bool = False) -> None:
        d = self.owner.__dict__
        container = original.container
        if value is not DELETED and container in _NN_CONTAINERS and self._fits(container, value):
            d.pop(self.name, None)
            store = d[container]
            if self.name in store and not placed:
                store[self.name] = value  # same key: position kept
            else:  # back where it sat (a foreign write may have moved it to the end)
                _insert_at(d, container, self.name, value, original.position)
            return
        self._discard()
        if value is DELETED:
            return
        if container is None:  # a new attribute: register it as nn.Module.__setattr__ would
            torch = sys.modules["torch"]

            if isinstance(value, torch.nn.Parameter):
                d["_parameters"][self.name] = value
                return
            if isinstance(value, torch.nn.Module):
                d["_modules"][self.name] = value
                return
        d[self.name] = value

    def restore(self, original: Original) -> None:
        if original.container is None:
            self._discard()
        elif original.container == "__dict__":
            self._discard()
            self.owner.__dict__[self.name] = original.value
        else:
            self.write(original.value, original, placed=True)


class ItemSite(Site):
    """One key of a mutable mapping (a registry's entry, a child in a model's
    ``_modules``). Read raw where the mapping is a dict (a registry whose lookup builds
    an object, as transformers' ``ACT2FN`` does, holds the object itself); written
    through the mapping; a key put back goes where it sat, after the keys that were
    before it, the mapping object kept (its order rebuilt in place only then)."""

    __slots__ = ()
    raw_reads = True
    kind = "item"

    def __init__(self, owner: Any, name: Any) -> None:
        self.owner = owner
        self.name = name
        self.key = (id(owner), ("item", name))  # apart from an attribute of that name

    def read(self) -> Any:
        return _raw_item(self.owner, self.name)

    def visible(self) -> Any:
        return self.read()

    def same(self, current: Any, written: Any) -> bool:
        return current is written or (written is DELETED and current is NOTSET)

    def snapshot(self) -> Original:
        # the keys before it in the order first seen, not only those there now: a key an
        # older stack removed comes back before it, whichever stack ends first
        entry = _item_order(self.owner)
        entry[2] += 1
        if self.name not in self.owner:
            return Original(None, NOTSET)
        known = entry[1]
        return Original("item", self.read(), tuple(known[: known.index(self.name)]))

    def write(self, value: Any, original: Original) -> None:
        owner, name = self.owner, self.name
        base = _mapping_base(owner)
        if value is DELETED:
            base.pop(owner, name, None)
        elif name in owner or original.container is None:
            base.__setitem__(owner, name, value)  # same key: position kept; new: at the end
        else:
            _put_back(owner, name, value, original.position)

    def restore(self, original: Original) -> None:
        if original.container is None:
            _mapping_base(self.owner).pop(self.owner, self.name, None)
        else:
            self.write(original.value, original)
        entry = _ITEM_ORDERS.get(id(self.owner))
        if entry is not None and entry[0] is self.owner:
            entry[2] -= 1
            if entry[2] <= 0:  # its last item stack ended
                del _ITEM_ORDERS[id(self.owner)]

    def describe(self) -> str:
        return f"<{type(self.owner).__qualname__} at {id(self.owner):#x}>[{self.name!r}]"


#: per mapping with live item stacks (by id): [the mapping, its keys in the order first
#: seen, how many stacks]; the keys come in as each stack starts, a new one after the key
#: before it now
_ITEM_ORDERS: dict[int, list[Any]] = {}


def _item_order(mapping: Any) -> list[Any]:
    current = list(mapping)
    entry = _ITEM_ORDERS.get(id(mapping))
    if entry is None or entry[0] is not mapping:
        entry = _ITEM_ORDERS[id(mapping)] = [mapping, current, 0]
        return entry
    known: list[Any] = entry[1]
    seen = set(known)
    for index, name in enumerate(current):
        if name not in seen:
            before = current[index - 1] if index else None
            known.insert(known.index(before) + 1 if before in seen else 0, name)
            seen.add(name)
    return entry


def item_order(mapping: Any) -> list[Any] | None:
    """The keys of ``mapping`` in the order its live item stacks first saw them (a key
    some of them removed included), or None where none is live."""
    entry = _ITEM_ORDERS.get(id(mapping))
    return entry[1] if entry is not None and entry[0] is mapping else None


_START = object()  # lay_over: before the first key


def lay_over(target: Sequence[Hashable], below: Iterable[Hashable], known: set[Any]) -> list[Any]:
    """``target`` (the keys a change left, in its order; it found ``known``) laid over
    ``below`` (what is there now in its place, another change's taken out or put in):
    the keys of ``target`` that the change put in, or that are still ``below``, in the
    change's order; the keys below that the change did not know (another change's,
    come in since), each after the key before it below. A key the change knew and left
    out stays out.

    Example::

        lay_over(["b", "c"], ["a", "b", "x"], {"a", "b"})   # ["b", "x", "c"]
    """
    present = set(below)
    ordered = [key for key in target if key not in known or key in present]
    placed, targeted = set(ordered), set(target)
    after: dict[Any, list[Any]] = {}
    anchor: Any = _START
    for key in below:
        if key in placed:
            anchor = key
        elif key not in known and key not in targeted:
            after.setdefault(anchor, []).append(key)
    result = list(after.get(_START, ()))
    for key in ordered:
        result.append(key)
        result.extend(after.get(key, ()))
    return result


def _mapping_base(mapping: Any) -> Any:
    """Whose methods write ``mapping`` raw: its builtin base type's (a subclass's own
    ``__setitem__`` may compute or import), else its own type's (a duck mapping)."""
    for base in (OrderedDict, dict):
        if isinstance(mapping, base):
            return base
    return type(mapping)


def _raw_item(mapping: Any, key: Any) -> Any:
    """``mapping[key]`` as stored (a dict's own lookup, past an overridden
    ``__getitem__``), or NOTSET."""
    if isinstance(mapping, dict):
        return dict.get(mapping, key, NOTSET)
    return mapping.get(key, NOTSET)


def _put_back(mapping: Any, key: Any, value: Any, position: int | tuple[Any, ...]) -> None:
    """``mapping[key] = value`` after the last of the keys that preceded it (``position``)
    that is there now; the mapping object is kept."""
    keys = list(mapping)
    before = position if isinstance(position, tuple) else ()
    present = set(keys)
    anchor = next((name for name in reversed(before) if name in present), None)
    index = 0 if anchor is None else keys.index(anchor) + 1
    base = _mapping_base(mapping)
    if index == len(keys):
        base.__setitem__(mapping, key, value)
        return
    items = [(name, _raw_item(mapping, name)) for name in keys]
    items.insert(index, (key, value))
    base.clear(mapping)
    for name, item in items:
        base.__setitem__(mapping, name, item)


#: per nn.Module and container, its keys in the order first seen by a patch (kept while
#: the module lives): where a displaced key goes back, whichever were displaced before it
_ORDERS: weakref.WeakKeyDictionary[Any, dict[str, list[str]]] = weakref.WeakKeyDictionary()


def _order_of(owner: Any, container: str, store: dict[str, Any]) -> list[str]:
    orders = _ORDERS.get(owner)
    if orders is None:
        orders = _ORDERS[owner] = {}
    current = list(store)
    known = orders.get(container)
    if known is None:
        orders[container] = current
        return current
    for index, name in enumerate(current):
        if name not in known:  # come in since: after the key before it now
            before = current[index - 1] if index else None
            known.insert(known.index(before) + 1 if before in known else 0, name)
    return known


def _insert_at(
    owner: dict[str, Any], container: str, key: str, value: Any, position: int | tuple[str, ...]
) -> None:
    """``owner[container][key] = value`` at ``position`` (an index, or after the last of
    the keys that preceded it that is there now). The container is replaced by its new
    form in one step: a reader in another thread sees the old one or the new one, never
    one emptied to be rebuilt."""
    store = owner[container]
    keys = [name for name in store if name != key]
    if isinstance(position, tuple):
        present = set(keys)
        anchor = next((name for name in reversed(position) if name in present), None)
        index = 0 if anchor is None else keys.index(anchor) + 1
    else:
        index = len(keys) if position < 0 else min(position, len(keys))
    order = [*keys[:index], key, *keys[index:]]
    if list(store) == order:
        store[key] = value
        return
    owner[container] = {name: value if name == key else store[name] for name in order}


def _is_nn_module(owner: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(owner, torch.nn.Module)


def _has_custom_access(kind: Any) -> bool:
    base: Any = object
    return bool(
        kind.__setattr__ is not base.__setattr__
        or kind.__getattribute__ is not base.__getattribute__
    )


def make_site(owner: Any, name: str) -> Site:
    """Pick the site kind for ``owner.name`` (see the module docstring)."""
    if isinstance(owner, (type, types.ModuleType)):
        if name in owner.__dict__:
            return DictSite(owner, name)
        if _is_data_descriptor(_type_attribute(type(owner), name)):
            return DescriptorSite(owner, name)
        return DictSite(owner, name)
    on_type = _type_attribute(type(owner), name)
    if on_type is not NOTSET and _is_data_descriptor(on_type):
        # A property/slot on the type wins over the instance dict: set through it.
        return DescriptorSite(owner, name)
    if _is_nn_module(owner):
        return ModuleSite(owner, name)
    kind: Any = type(owner)
    if _has_custom_access(kind):
        return AttributeSite(owner, name)
    if not isinstance(getattr(owner, "__dict__", None), dict):
        from layerswap.errors import TargetReadOnlyError

        # An AttributeError, as Python's own ``obj.name = value`` raises here.
        raise TargetReadOnlyError(
            f"cannot patch attribute {name!r} of {type(owner).__qualname__} object: it has no "
            "__dict__ and no settable descriptor for that name",
            name=name,
            obj=owner,
        )
    return DictSite(owner, name)
