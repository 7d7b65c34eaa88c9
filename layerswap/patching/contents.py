"""Sites for what a container holds, whole, whose layers are built from the value below.

An adopted patch function that changed a list or a set in place (appended a hook, added
a name to a registry set) is held as one layer of the container's stack
(:mod:`layerswap.patching.stack`): :class:`ContentsSite` reads and writes the container's
items raw, the container object kept, and the layer's value is built by the change's
:class:`Edit` from the value below it. Two adoptions changing one list end in any order:
ended out of order, the layers above are rebuilt around what is below them (the engine's
``factory`` layers), so each keeps its own items and none brings back the other's; once
every layer has ended the container holds exactly what it held before the first, by
identity and in order (the stack's original).

Example::

    hooks = [a, b]
    first = push(ContentsSite(hooks), None, Edit((a, b), (b, c)), owner, create=True)
    second = push(ContentsSite(hooks), None, Edit((b, c), (b, c, d)), owner, create=True)
    remove(first)     # hooks == [a, b, d]: first's edit taken out, second's kept
    remove(second)    # hooks == [a, b]
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from typing import Any

from layerswap.patching.sites import Original, Site

__all__ = ["ContentsSite", "Edit", "lay_over"]

_START = object()


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
