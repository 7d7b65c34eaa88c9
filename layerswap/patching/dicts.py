"""``patch_dict``: reversible changes to a mapping (``os.environ``, ``sys.modules``, registries).

Each dict patch takes a snapshot of the whole mapping when it starts — every key,
value and the insertion order — and puts exactly that back when it stops: keys the
block itself added, changed or deleted are restored too, as ``unittest.mock.patch.dict``
does. Values are written back only where they differ, so an unchanged
``sys.modules`` entry keeps its module object.

Dict patches of one mapping form a stack, like attribute patches, and may stop in
any order:

* stopping the newest live one restores its snapshot;
* stopping an older one (not LIFO) takes back its own values at once, where no
  newer live patch set the same key and the value is still the one it wrote; the
  other changes made while it was the newest stay until the patches above it stop,
  and the one just above it now restores the state from before the stopped one;
* so when the last one stops, the mapping is exactly as it was before the first.

Keys that the engine's item layers hold (an adoption's change of a registry entry,
:class:`~layerswap.patching.sites.ItemSite`) are theirs: a dict patch refuses to set
one, and leaves them to their stacks when it stops. A stack started on a key while a
dict patch was live takes that patch's snapshot as the key's value before it, so that
ending the two in either order leaves the mapping as it was. The order of the keys,
while an adoption's reordering of them is live
(:class:`~layerswap.patching.contents.OrderSite`), is that stack's alike.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from typing import Any

from layerswap.errors import PatchError, TargetTypeError
from layerswap.patching import stack as _stack
from layerswap.patching.contents import lay_over, order_key
from layerswap.patching.scoped import Scoped
from layerswap.patching.sites import DELETED, NOTSET, _raw_item, _same_value
from layerswap.patching.target import ParsedTarget

__all__ = ["DictPatch", "patch_dict"]

# id(mapping) -> (mapping, live dict patches of it, oldest first)
_STACKS: dict[int, tuple[Any, list[DictPatch]]] = {}


class DictPatch(Scoped):
    """Reversible update of a mapping; see :func:`patch_dict`."""

    def __init__(
        self,
        target: Any,
        values: Mapping[Any, Any] | None,
        clear: bool,
        parsed: ParsedTarget | None,
    ) -> None:
        self._target = target
        self._parsed = parsed
        self._values = dict(values or {})
        self._clear = clear
        self._mapping: Any = None
        self._before: list[tuple[Any, Any]] = []  # the snapshot, in insertion order
        self._written: dict[Any, Any] = {}  # what this patch set (DELETED: removed)
        #: the keys engine item layers held at start, each with its stack: held still
        #: while that very stack is live (one that ended, then began again, is another)
        self._held: dict[Any, Any] = {}
        self._order: Any = None  # the live stack of the mapping's order at start, if any

    def _label(self) -> str:
        if self._parsed is not None:
            return f"patch_dict({self._parsed.text})"
        return f"patch_dict(<{type(self._target).__qualname__} at {id(self._target):#x}>)"

    def _site_texts(self) -> tuple[str, ...]:
        mapping = self._mapping
        if mapping is None:
            return ()
        where = f"<{type(mapping).__qualname__} at {id(mapping):#x}>"
        return tuple(f"{where}[{key!r}]" for key in self._written)

    def _new_text(self) -> str:
        return _stack._short(self._values)

    def _copy(self) -> DictPatch:
        return DictPatch(self._target, self._values, self._clear, self._parsed)

    def _resolve(self) -> Any:
        mapping = self._target
        if self._parsed is not None:
            owner, name = self._parsed.resolve()
            try:
                mapping = getattr(owner, name)
            except AttributeError:
                from layerswap.patching.target import suggest

                raise _attribute_error(self._parsed.text, name, suggest(name, dir(owner))) from None
        if not isinstance(mapping, MutableMapping) and not _duck_mapping(mapping):
            raise TargetTypeError(
                f"{self._label()}: the target is a {type(mapping).__qualname__}, not a mutable "
                "mapping (needs __getitem__, __setitem__, __delitem__ and iteration over keys)"
            )
        return mapping

    def _apply(self) -> None:
        mapping = self._resolve()  # outside the lock: resolving may import
        with _stack.LOCK:
            before = _snapshot(mapping)
            written: dict[Any, Any] = {}
            if self._clear:
                written = dict.fromkeys((key for key, _ in before), DELETED)
            written.update(self._values)
            held = _stack.held_items(mapping)
            taken = [key for key in written if key in held]
            if taken:
                raise PatchError(
                    f"cannot start {self._label()}: {_stack._short(taken)} of this mapping "
                    "are held by live patches of single items (an adoption's registry "
                    "change); stop those first, or leave those keys out"
                )
            try:
                for key, value in written.items():
                    if value is DELETED:
                        del mapping[key]
                    else:
                        mapping[key] = value
            except BaseException:
                _restore(mapping, before)  # a failed start changes nothing
                raise
            entry = _STACKS.get(id(mapping))
            if entry is None:
                entry = _STACKS[id(mapping)] = (mapping, [])
            entry[1].append(self)
            stacks = {key: _stack.live_stack(_stack.item_key(mapping, key)) for key in held}
        self._mapping, self._before, self._written, self._held = mapping, before, written, stacks
        self._order = _stack.live_stack(order_key(mapping))

    def _revert(self) -> None:
        mapping = self._mapping
        with _stack.LOCK:
            entry = _STACKS.get(id(mapping))
            live = entry[1] if entry is not None else [self]
            index = live.index(self) if self in live else len(live) - 1
            above = live[index + 1 :]
            held = _stack.held_items(mapping)
            if not above:
                self._restore_as_newest(mapping, held)
            else:
                self._take_back_own_values(mapping, above, held)
                self._forget_in_snapshots_above(above)
                above[0]._before = self._ended_below(mapping, above)
                above[0]._held.update(self._still_held(mapping))
                above[0]._order = self._order
            if self in live:
                live.remove(self)
            if entry is not None and not live:
                del _STACKS[id(mapping)]
        self._mapping, self._before, self._written, self._held = None, [], {}, {}

    def _restore_as_newest(self, mapping: Any, held: set[Any]) -> None:
        """Put back the snapshot; the order of the keys is the live order layers' (an
        adoption's reordering), as they are now: a snapshot taken while some were live
        holds their order, which goes with the last of them; a stack of them started
        since takes the snapshot's order as the one before it."""
        before = self._before
        order = _stack.live_stack(order_key(mapping))
        seen = self._order
        if seen is not None and seen is not order:
            # every order layer live at the start has ended: the order from before them
            base = seen.original.value
            values = dict(before)
            before = [(key, values[key]) for key in lay_over(base, list(values), set(base))]
        for key in held - set(self._held):  # started on what this patch showed
            _stack.rebase_item(mapping, key, before)
        # a key item layers held at start shows what they left, or hold now
        _restore(mapping, before, set(self._held) | held)
        if order is not None:
            start = tuple(key for key, _ in before) if order is not seen else NOTSET
            _stack.rebuild(order_key(mapping), start)

    def _still_held(self, mapping: Any) -> dict[Any, Any]:
        """The keys held at start by item stacks that are live still (the very stacks)."""
        return {
            key: stack
            for key, stack in self._held.items()
            if _stack.live_stack(_stack.item_key(mapping, key)) is stack
        }

    def _ended_below(self, mapping: Any, above: list[DictPatch]) -> list[tuple[Any, Any]]:
        """This patch's snapshot, handed to the one above it as the state before both: a
        key item layers held at start, and that they have left since, at what they left
        (the snapshot caught their value): as the first patch above that set it found it,
        else as it is now."""
        ended = set(self._held) - set(self._still_held(mapping))
        if not ended:
            return self._before
        found: dict[Any, Any] = {}
        places: dict[Any, list[Any]] = {}  # the keys before an ended key where it was left
        for key in ended:
            setter = next((later for later in above if key in later._written), None)
            if setter is not None:
                found[key] = dict(setter._before).get(key, NOTSET)
                keys = [k for k, _ in setter._before]
            else:
                # a stack started on the key since holds, as its value before it, what
                # the ended one left; else the key shows that now
                live = _stack.live_stack(_stack.item_key(mapping, key))
                found[key] = live.original.value if live is not None else _get(mapping, key)
                keys = list(iter(mapping))
            places[key] = keys[: keys.index(key)] if key in keys else keys
        kept = [(k, found.get(k, v)) for k, v in self._before if found.get(k, v) is not NOTSET]
        for key, value in found.items():
            if value is NOTSET or any(k == key for k, _ in kept):
                continue
            # at its place: after the last key before it there that is kept here
            shown = [k for k, _ in kept]
            after = [shown.index(k) for k in places[key] if k in shown]
            kept.insert(max(after) + 1 if after else 0, (key, value))
        return kept

    def _take_back_own_values(self, mapping: Any, above: list[DictPatch], held: set[Any]) -> None:
        before = dict(self._before)
        for key, value in self._written.items():
            if any(key in later._written for later in above):
                continue  # a newer patch decides what this key shows
            if key in held:  # an item layer started on this patch's value: it shows
                _stack.rebase_item(mapping, key, self._before)
                continue
            current = _get(mapping, key)
            if value is DELETED:
                if current is not NOTSET:
                    continue  # set again meanwhile: not ours to undo
            elif not _same_value(current, value):
                continue
            old = before.get(key, NOTSET)
            if old is NOTSET:
                if current is not NOTSET:
                    del mapping[key]
            else:
                mapping[key] = old

    def _forget_in_snapshots_above(self, above: list[DictPatch]) -> None:
        # The snapshots of newer patches were taken with this one's values in them;
        # each key this one set shows, in them, what it held before this one instead
        # (unless a patch in between set that key too).
        before = dict(self._before)
        set_between: set[Any] = set()
        for later in above:
            snapshot = dict(later._before)
            for key in self._written:
                if key in set_between:
                    continue
                old = before.get(key, NOTSET)
                if old is NOTSET:
                    snapshot.pop(key, None)
                else:
                    snapshot[key] = old
            later._before = list(snapshot.items())
            set_between.update(later._written)


def _get(mapping: Any, key: Any) -> Any:
    """``mapping[key]`` as stored (a dict's own lookup, past a subclass's ``__getitem__``,
    which may build an object: transformers' ``ACT2FN``), or NOTSET."""
    if isinstance(mapping, dict):
        return dict.get(mapping, key, NOTSET)
    try:
        return mapping[key]
    except KeyError:
        return NOTSET


def _snapshot(mapping: Any) -> list[tuple[Any, Any]]:
    items = getattr(mapping, "items", None)
    if items is not None:
        return list(items())
    return [(key, mapping[key]) for key in list(iter(mapping))]


def _restore(
    mapping: Any, before: list[tuple[Any, Any]], held: set[Any] | frozenset[Any] = frozenset()
) -> None:
    """Make ``mapping`` hold exactly ``before``: keys, values (by identity) and order;
    the ``held`` keys (live item layers') are left as and where they are."""
    wanted = dict(before)
    for key in [key for key in list(iter(mapping)) if key not in wanted and key not in held]:
        del mapping[key]
    for key, value in before:
        if key in held:
            continue
        current = _get(mapping, key)
        # the very object back; equal is enough only for strings, which a mapping such as
        # os.environ decodes afresh on every read
        if current is not value and not (
            isinstance(value, (str, bytes)) and _same_value(current, value)
        ):
            mapping[key] = value
    keys = list(iter(mapping))
    # the held keys stay at their places; the others fill the rest in the snapshot's order
    order = iter([key for key, _ in before if key not in held])
    target = [key if key in held else next(order) for key in keys]
    if keys == target:
        return
    # Re-insert only from the first key out of place, so that a long mapping
    # (sys.modules) is never emptied while other threads may read it.
    first = next(i for i, (a, b) in enumerate(zip(keys, target, strict=False)) if a != b)
    values = {key: _raw_item(mapping, key) if key in held else wanted[key] for key in keys[first:]}
    for key in keys[first:]:
        del mapping[key]
    for key in target[first:]:
        mapping[key] = values[key]


def _duck_mapping(obj: Any) -> bool:
    kind = type(obj)
    return all(hasattr(kind, m) for m in ("__getitem__", "__setitem__", "__delitem__", "__iter__"))


def _attribute_error(target: str, name: str, hint: str) -> Exception:
    from layerswap.errors import TargetAttributeError

    return TargetAttributeError(f"cannot patch {target!r}: no attribute {name!r}{hint}", name=name)


def patch_dict(
    target: MutableMapping[Any, Any] | str,
    values: Mapping[Any, Any] | None = None,
    *,
    clear: bool = False,
    **items: Any,
) -> DictPatch:
    """Reversibly update a mapping; on stop it is exactly as it was before.

    ``target`` is the mapping itself, any object with ``__getitem__``,
    ``__setitem__``, ``__delitem__`` and iteration over its keys, or a target
    string naming one (resolved at start). ``values`` (a mapping or key/value
    pairs) and keyword ``items`` are set; with ``clear=True`` every existing key is
    removed first. On stop the whole mapping goes back to its state at start —
    keys the block added, changed or deleted included, insertion order kept.

    Example::

        with layerswap.patch_dict(os.environ, {"CUDA_VISIBLE_DEVICES": ""}):
            ...
        with layerswap.patch_dict("transformers.activations:ACT2CLS", {"silu": MySiLU}):
            ...
    """
    parsed = ParsedTarget(target) if isinstance(target, str) else None
    if parsed is None and not isinstance(target, MutableMapping) and not _duck_mapping(target):
        raise TargetTypeError(
            f"patch_dict() needs a mutable mapping or a target string naming one, got "
            f"{type(target).__qualname__}"
        )
    if values is not None and not isinstance(values, Mapping):
        try:
            values = dict(values)
        except (TypeError, ValueError):
            raise TargetTypeError(
                f"patch_dict() values must be a mapping, got {type(values).__qualname__}"
            ) from None
    if items:
        values = {**(values or {}), **items}
    return DictPatch(target, values, clear, parsed)
