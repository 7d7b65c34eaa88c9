"""Sites for what a container holds, whole, or its order, whose layers are built from the
value below.

An adopted patch function that changed a list or a set in place (appended a hook, added
a name to a registry set) is held as one layer of the container's stack
(:mod:`layerswap.patching.stack`): :class:`ContentsSite` reads and writes the container's
items raw, the container object kept, and the layer's value is built by the change's
:class:`Edit` from the value below it. Two adoptions changing one list end in any order:
ended out of order, the layers above are rebuilt around what is below them (the engine's
``factory`` layers), so each keeps its own items and none brings back the other's; once
every layer has ended the container holds exactly what it held before the first, by
identity and in order (the stack's original).

A dict's items are one stack per key (:class:`~layerswap.patching.sites.ItemSite`); the
order of its keys, where a change reordered them (a key popped and set again goes to the
end), is one more stack (:class:`OrderSite`), whose layers each hold one change's order
(:class:`Reorder`) laid over the order below: ended out of order, the keys that are there
then take the order of the changes still in effect, and once the last has ended, the
order from before them, whatever keys other layers added or removed meanwhile.

Example::

    hooks = [a, b]
    first = push(ContentsSite(hooks), None, Edit((a, b), (b, c)), owner, create=True)
    second = push(ContentsSite(hooks), None, Edit((b, c), (b, c, d)), owner, create=True)
    remove(first)     # hooks == [a, b, d]: first's edit taken out, second's kept
    remove(second)    # hooks == [a, b]
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from layerswap.patching import stack as _stack
from layerswap.patching.sites import Original, Site, _mapping_base, _raw_item, lay_over

__all__ = [
    "ContentsSite",
    "Edit",
    "OrderSite",
    "Reorder",
    "lay_over",
    "order_key",
    "reassert_order",
    "reorder",
]


def _tokens(items: Iterable[Any]) -> list[tuple[int, int]]:
    """Each item as ``(id, how many times it came before)``: a list may hold one object
    twice, each occurrence an item of its own."""
    seen: dict[int, int] = {}
    found = []
    for item in items:
        count = seen.get(id(item), 0)
        seen[id(item)] = count + 1
        found.append((id(item), count))
    return found


class Edit:
    """A list's or set's change from ``before`` to ``after`` (tuples of its items), made
    again over any value below (:func:`lay_over`, items by identity): what it took out
    stays out, what it put in comes in, in its order, and another layer's items stay
    where they were."""

    rebuild = True  # rebuilt around a new value below when a layer under it ends

    def __init__(self, before: tuple[Any, ...], after: tuple[Any, ...]) -> None:
        self.before, self.after = before, after  # held: the ids stay theirs
        self._known = set(_tokens(before))
        self._target = _tokens(after)

    def __call__(self, site: Site, below: tuple[Any, ...]) -> tuple[Any, ...]:
        objects = {id(item): item for item in (*below, *self.after)}
        return tuple(objects[key] for key, _ in lay_over(self._target, _tokens(below), self._known))


class ContentsSite(Site):
    """What a list or set holds, whole (one stack per container, apart from its items'
    and attributes'): read as a tuple of its items, written in place through the builtin
    type's own methods, the container object kept."""

    __slots__ = ()
    kind = "contents"

    def __init__(self, owner: Any) -> None:
        if not isinstance(owner, (list, set)):
            raise TypeError(f"a list or set, not {type(owner).__qualname__}")
        self.owner = owner
        self.name = "<contents>"
        self.key = (id(owner), ("contents",))

    def read(self) -> tuple[Any, ...]:
        if isinstance(self.owner, list):
            return tuple(list.copy(self.owner))
        return tuple(set.copy(self.owner))

    def visible(self) -> tuple[Any, ...]:
        return self.read()

    def same(self, current: Any, written: Any) -> bool:
        if isinstance(self.owner, set):
            return {id(item) for item in current} == {id(item) for item in written}
        return len(current) == len(written) and all(
            a is b for a, b in zip(current, written, strict=True)
        )

    def snapshot(self) -> Original:
        return Original("contents", self.read())

    def write(self, value: Any, original: Original) -> None:
        if self.same(self.read(), value):
            return
        if isinstance(self.owner, list):
            list.__setitem__(self.owner, slice(None), value)
        else:
            set.clear(self.owner)
            set.update(self.owner, value)

    def restore(self, original: Original) -> None:
        self.write(original.value, original)

    def describe(self) -> str:
        return f"<{type(self.owner).__qualname__} at {id(self.owner):#x}> (its items)"


def order_key(mapping: Any) -> tuple[int, Any]:
    """The engine's key of ``mapping``'s :class:`OrderSite` (apart from its items')."""
    return (id(mapping), ("order",))


def reorder(mapping: Any, order: Sequence[Any]) -> None:
    """Put the keys of the dict ``mapping`` in ``order`` (:func:`lay_over`): those it
    names in its order, any other after the key before it now; the values and the
    mapping object kept, only the keys from the first one out of place taken out and
    put back."""
    keys = list(_mapping_base(mapping).__iter__(mapping))
    target = lay_over(order, keys, set(order))
    if target == keys:
        return
    first = next(i for i, (a, b) in enumerate(zip(keys, target, strict=True)) if a != b)
    base = _mapping_base(mapping)
    values = {key: _raw_item(mapping, key) for key in keys[first:]}
    for key in keys[first:]:
        base.pop(mapping, key)
    for key in target[first:]:
        base.__setitem__(mapping, key, values[key])


class Reorder:
    """A dict's keys reordered by one change (from ``before`` to ``after``, its keys in
    order), made again over any order below (:func:`lay_over`)."""

    rebuild = True

    def __init__(self, before: tuple[Any, ...], after: tuple[Any, ...]) -> None:
        self.after = after
        self._known = set(before)

    def __call__(self, site: Site, below: tuple[Any, ...]) -> tuple[Any, ...]:
        return tuple(lay_over(self.after, below, self._known))


class OrderSite(Site):
    """The order of a dict's keys (which keys it holds, and their values, are their item
    stacks' and dict patches'): read as a tuple of its keys, written by :func:`reorder`;
    another order of the same keys read back is a foreign write, a key added or removed
    is not. Restored (its last layer ended), the live item stacks of the dict put a key
    back after the keys before it in the order restored."""

    __slots__ = ()
    kind = "order"

    def __init__(self, owner: Any) -> None:
        if not isinstance(owner, dict):
            raise TypeError(f"a dict, not {type(owner).__qualname__}")
        self.owner = owner
        self.name = "<order>"
        self.key = order_key(owner)

    def read(self) -> tuple[Any, ...]:
        return tuple(_mapping_base(self.owner).__iter__(self.owner))

    def visible(self) -> tuple[Any, ...]:
        return self.read()

    def same(self, current: Any, written: Any) -> bool:
        if current is written:
            return True
        common = set(current) & set(written)
        return [k for k in current if k in common] == [k for k in written if k in common]

    def snapshot(self) -> Original:
        return Original("order", self.read())

    def write(self, value: Any, original: Original) -> None:
        reorder(self.owner, value)

    def restore(self, original: Original) -> None:
        reorder(self.owner, original.value)
        _stack.reposition_items(self.owner, original.value)

    def describe(self) -> str:
        return f"<{type(self.owner).__qualname__} at {id(self.owner):#x}> (the order of its keys)"


def reassert_order(mapping: Any) -> None:
    """The live order layers of ``mapping``, if any, written again over the keys there now
    (an item taken back or made again goes where its stack puts it: the order is theirs)."""
    with _stack.LOCK:
        if _stack.live_stack(order_key(mapping)) is not None:
            _stack.rebuild(order_key(mapping))
