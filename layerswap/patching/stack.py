"""Layered stacks: every patched site has one stack of live layers.

``unittest.mock`` and most hand-written patching save "the old value" per patch and
put it back on exit. That is only right when patches exit in LIFO order: stop an
outer patch first and it writes back the original while the inner patch is still
live; stop the inner one next and it writes back the *outer* replacement, which
then leaks forever. Here each site keeps the value it had before the first patch
(``Original``) and a list of live layers. The visible value is always the top live
layer; removing any layer, in any order, re-exposes the new top, and removing the
last one restores the original exactly.

One re-entrant lock guards all stacks: starts and stops from many threads are
serialised, and a value is fully built before the single write that exposes it.
Nothing that can import runs under that lock: target resolution happens before it
is taken, and so does the first ``getattr`` of an attribute that is not in the
owner's own storage (a lazy module's ``__getattr__`` imports). An import holds the
interpreter's per-module import lock, and a post-import hook (``lazy=True``) takes
this lock while holding it; taking them in the other order would deadlock.
"""

from __future__ import annotations

import builtins
import threading
import types
import warnings
from collections.abc import Callable
from typing import Any

from layerswap.errors import (
    PatchConflictWarning,
    TargetAttributeError,
    TargetReadOnlyError,
    TargetTypeError,
)
from layerswap.patching.sites import NOTSET, DictSite, Original, Site, item_order, lay_over
from layerswap.patching.target import suggest

__all__ = [
    "LOCK",
    "Layer",
    "held_items",
    "live_stack",
    "push",
    "rebase_item",
    "rebuild",
    "remove",
    "reposition_items",
    "stack_depth",
]

LOCK = threading.RLock()


class Layer:
    """One live patch of one site: the value it shows while it is the top.

    A layer built by a ``factory`` (``wrap``) wraps the value below it; when a layer
    under it is removed, it is rebuilt around the new value below, so a stopped patch
    never lives on inside a wrapper that was layered over it.
    """

    __slots__ = ("factory", "owner", "site", "value")

    def __init__(
        self, site: Site, value: Any, owner: object, factory: Callable[[Site, Any], Any] | None
    ) -> None:
        self.site = site
        self.value = value
        self.owner = owner  # the Patch (or dict patch) that holds this layer
        self.factory = factory


class _Stack:
    __slots__ = ("conflict", "layers", "observed", "original", "site", "written")

    def __init__(self, site: Site, original: Original) -> None:
        self.site = site  # keeps the owner alive while patched
        self.original = original
        self.layers: list[Layer] = []
        self.written: Any = NOTSET
        # What reading the site gave right after the write: a property setter may
        # store a normalised value (2 -> 2.0, a copy of a list), which is no foreign write.
        self.observed: Any = NOTSET
        self.conflict: str | None = None  # a foreign write seen when a layer was pushed

    def value_below(self, index: int) -> Any:
        return self.layers[index - 1].value if index > 0 else self.original.value


_STACKS: dict[tuple[int, Any], _Stack] = {}
#: how many times a live stack's value before its layers was changed in place (a rebase):
#: what :func:`unpatched` returns then changes with no attribute changing
_REBASES = [0]


# A module attribute that shadows a builtin (``mod.open = ...``) does not exist until it
# is set, yet code in the module sees the builtin: patching it needs no create=True,
# and the shadow is removed on stop (as unittest.mock does).
_BUILTIN_NAMES = frozenset(name for name in dir(builtins) if not name.startswith("_"))


def push(
    site: Site,
    value: Any,
    factory: Callable[[Site, Any], Any] | None,
    owner: Any,
    create: bool,
) -> Layer:
    """Put a new top layer on ``site`` showing ``value`` (or ``factory(site, raw_below)``).

    ``owner`` is the patch object; its ``_label()`` names the target in errors.

    Raises (changing nothing) when the attribute is missing and ``create`` is
    false, or when the owner refuses the write.
    """
    key = site.key
    visible = None
    if key not in _STACKS and site.read() is NOTSET:
        # Not in the owner's own storage: getattr may run a lazy module's __getattr__,
        # which imports. Done before the lock is taken (see the module docstring).
        visible = site.visible()
    with LOCK:
        stack = _STACKS.get(key)
        if stack is not None:
            site = stack.site  # one Site object per place
            below = site.read()
            if stack.conflict is None and not site.same(below, stack.observed):
                # remembered, and reported when a layer is removed (see remove())
                stack.conflict = _conflict_message(site, stack.observed, below, 2)
        else:
            original = site.snapshot()
            shadows_builtin = (
                isinstance(site.owner, types.ModuleType) and site.name in _BUILTIN_NAMES
            )
            if (
                original.container is None
                and not create
                and visible is NOTSET
                and not shadows_builtin
            ):
                raise _missing(site, owner)
            stack = _Stack(site, original)
            below = original.value
        if factory is not None:
            value = factory(site, below)
        try:
            site.write(value, stack.original)
        except (AttributeError, TypeError) as exc:
            if not stack.layers:
                try:
                    site.restore(stack.original)
                except Exception:  # the write never happened; nothing to undo
                    pass
            kind = TargetReadOnlyError if isinstance(exc, AttributeError) else TargetTypeError
            raise kind(f"cannot patch {owner._label()}: {exc}") from exc
        layer = Layer(site, value, owner, factory)
        stack.layers.append(layer)
        stack.written = value
        stack.observed = value if site.raw_reads else site.read()
        _STACKS[key] = stack
        return layer


def push_own_attribute(owner: Any, name: str, value: Any, patch: Any) -> Layer | None:
    """:func:`push` for the common case, in fewer steps; None where it does not apply.

    Applies to an attribute held in the own ``__dict__`` of a module or of a class
    whose metaclass is ``type``, with no live layer. The objects built are those
    :func:`push` builds, so every later operation treats the layer alike.
    """
    key = (id(owner), name)
    is_class = type(owner) is type
    LOCK.acquire()  # not ``with``: a third of the cost here, and nothing below can raise
    try:  # but the TypeError handled in place
        if key in _STACKS:
            return None
        raw = owner.__dict__.get(name, NOTSET)
        if raw is NOTSET:
            return None
        if is_class:
            try:
                type.__setattr__(owner, name, value)
            except TypeError:  # a builtin type: push() reports it
                return None
        else:
            owner.__dict__[name] = value
        site = DictSite.__new__(DictSite)
        site.owner, site.name, site.key, site._is_class = owner, name, key, is_class
        original = Original.__new__(Original)
        original.container, original.value, original.position = "__dict__", raw, -1
        stack = _Stack.__new__(_Stack)
        stack.site, stack.original, stack.conflict = site, original, None
        stack.written = stack.observed = value
        layer = Layer.__new__(Layer)
        layer.site, layer.value, layer.owner, layer.factory = site, value, patch, None
        stack.layers = [layer]
        _STACKS[key] = stack
        return layer
    finally:
        LOCK.release()


def _missing(site: Site, owner: Any) -> TargetAttributeError:
    names = [n for n in _names(site.owner) if n != site.name]
    if getattr(owner, "_factory", None) is not None:  # wrap(): nothing to create
        advice = "; there is nothing to wrap"
    else:
        advice = "; pass create=True to add it for the duration of the patch"
    return TargetAttributeError(
        f"cannot patch {owner._label()}: {_owner_text(site.owner)} has no attribute "
        f"{site.name!r}{suggest(str(site.name), names)}{advice}",
        name=str(site.name),
        obj=site.owner,
    )


def remove(layer: Layer) -> str | None:
    """Take ``layer`` off its stack. Returns a conflict message if a foreign write was seen.

    The caller warns (outside the lock, after every layer of the patch is removed),
    so that a ``warnings`` filter set to "error" cannot leave a patch half-undone.
    """
    site = layer.site
    LOCK.acquire()
    try:
        return _remove_locked(site, layer)
    finally:
        LOCK.release()


def _remove_locked(site: Site, layer: Layer) -> str | None:
    stack = _STACKS.get(site.key)
    if stack is None:
        return None
    layers = stack.layers
    index = len(layers) - 1
    if index == 0 and layers[0] is layer and type(site) is DictSite and stack.original.container:
        # The only layer of an own-__dict__ attribute: the common case, inlined.
        owner, name = site.owner, site.name
        current = owner.__dict__.get(name, NOTSET)
        conflict = stack.conflict
        if (
            current is not stack.observed
            and conflict is None
            and not site.same(current, stack.observed)
        ):
            conflict = _conflict_message(site, stack.observed, current, 1)
        del _STACKS[site.key]
        if site._is_class:
            type.__setattr__(owner, name, stack.original.value)
        else:
            owner.__dict__[name] = stack.original.value
        return conflict
    if layers[index] is not layer:  # not the top: non-LIFO stop
        for index, candidate in enumerate(layers):  # noqa: B007 - index used below
            if candidate is layer:
                break
        else:
            return None
    current = site.read()
    conflict, stack.conflict = stack.conflict, None
    observed = stack.observed
    foreign = current is not observed and not site.same(current, observed)
    if foreign and conflict is None:
        conflict = _conflict_message(site, observed, current, len(layers))
    was_top = index == len(layers) - 1
    del layers[index]
    if not layers:
        del _STACKS[site.key]
        site.restore(stack.original)
        return conflict
    # Wrappers above the removed layer were built around it: rebuild them.
    for position in range(index, len(layers)):
        above = layers[position]
        if above.factory is not None and getattr(above.factory, "rebuild", True):
            above.value = above.factory(site, stack.value_below(position))
            was_top = was_top or position == len(layers) - 1
    if was_top or foreign:
        top = layers[-1]
        site.write(top.value, stack.original)
        stack.written = top.value
        stack.observed = top.value if site.raw_reads else site.read()
    return conflict


def rebase_originals(replaced: dict[int, Any], restored: Any, keep: Callable[[Site], bool]) -> None:
    """Module globals still patched by newer patches whose value before them was one of
    ``replaced`` (a name bound to an older patch's replacement while it was live, then
    taken over by a newer patch): their value before becomes ``restored`` (``NOTSET``:
    absent), so the newer patch's stop does not bring the older replacement back.
    ``keep(site)``: a global bound to it before the older patch, left alone."""
    with LOCK:
        for stack in _STACKS.values():
            site, before = stack.site, stack.original.value
            if (
                not isinstance(site.owner, types.ModuleType)
                or replaced.get(id(before)) is not before
            ):
                continue
            if keep(site):
                continue
            if restored is NOTSET:
                stack.original.container, stack.original.value = None, NOTSET
            else:
                stack.original.value = restored
            _REBASES[0] += 1


def held_items(mapping: Any) -> set[Any]:
    """The keys of ``mapping`` that live item layers hold (an adoption's change of a
    registry entry): a :func:`~layerswap.patching.dicts.patch_dict` of the same mapping
    leaves them to their stacks. The caller holds :data:`LOCK`."""
    own = id(mapping)
    return {
        name[1]
        for (owner, name), stack in _STACKS.items()
        if owner == own
        and type(name) is tuple
        and name[0] == "item"
        and stack.site.owner is mapping
    }


def item_key(mapping: Any, key: Any) -> tuple[int, Any]:
    """The stack key of the item ``mapping[key]`` (:func:`live_stack` reads it)."""
    return (id(mapping), ("item", key))


def rebase_item(mapping: Any, key: Any, before: list[tuple[Any, Any]]) -> None:
    """The item ``mapping[key]``'s stack, started on a value a ``patch_dict`` that is
    ending had put there, takes what ``before`` (that patch's snapshot, in order) held
    for it as its value before every layer: absent, or that value at that place. The
    caller holds :data:`LOCK`."""
    stack = _STACKS.get(item_key(mapping, key))
    if stack is None:
        return
    _REBASES[0] += 1
    keys = [name for name, _ in before]
    if key not in keys:
        stack.original = Original(None, NOTSET)
    else:
        index = keys.index(key)
        stack.original = Original("item", before[index][1], tuple(keys[:index]))


def live_stack(key: tuple[int, Any]) -> _Stack | None:
    """The live stack of the site keyed ``key`` (its ``original`` readable), or None.
    The caller holds :data:`LOCK`."""
    return _STACKS.get(key)


def rebuild(key: tuple[int, Any], original: Any = NOTSET) -> None:
    """The live stack keyed ``key`` built again from its value before every layer
    (``original``: that value replaced first): each factory layer rebuilt around the
    value below it, and the top's value written. The caller holds :data:`LOCK`."""
    stack = _STACKS.get(key)
    if stack is None:
        return
    if original is not NOTSET:
        stack.original = Original(stack.original.container, original, stack.original.position)
        _REBASES[0] += 1
    site = stack.site
    for position, layer in enumerate(stack.layers):
        if layer.factory is not None and getattr(layer.factory, "rebuild", True):
            layer.value = layer.factory(site, stack.value_below(position))
    top = stack.layers[-1]
    site.write(top.value, stack.original)
    stack.written = top.value
    stack.observed = top.value if site.raw_reads else site.read()


def reposition_items(mapping: Any, order: tuple[Any, ...]) -> None:
    """The order ``mapping``'s keys had before every reordering layer, come back: its
    live item stacks take it as the order their keys were first seen in, and each puts
    its key back, when it ends, after the keys before it there. The caller holds
    :data:`LOCK`."""
    known = item_order(mapping)
    if known is None:
        return
    known[:] = lay_over(order, known, set(order))
    index = {key: number for number, key in enumerate(known)}
    own = id(mapping)
    for (owner, name), stack in _STACKS.items():
        if (
            owner == own
            and type(name) is tuple
            and name[0] == "item"
            and stack.site.owner is mapping
            and stack.original.container == "item"
            and name[1] in index
        ):
            stack.original.position = tuple(known[: index[name[1]]])


def position_of(layer: Layer) -> int | None:
    """Where ``layer`` sits in its site's stack (0: the bottom), ``None`` when it is off."""
    with LOCK:
        stack = _STACKS.get(layer.site.key)
        if stack is None:
            return None
        for index, candidate in enumerate(stack.layers):
            if candidate is layer:
                return index
        return None


def move_to(layer: Layer, index: int) -> None:
    """Put ``layer`` back at ``index`` of its stack (a layer taken off and pushed again
    returns to the top; a newer patch above it must stay above): the wrappers from there
    up are rebuilt around what is below them, and the top's value is written."""
    with LOCK:
        stack = _STACKS.get(layer.site.key)
        if stack is None or layer not in stack.layers:
            return
        layers = stack.layers
        layers.remove(layer)
        index = max(0, min(index, len(layers)))
        layers.insert(index, layer)
        site = stack.site
        for position in range(index, len(layers)):
            above = layers[position]
            if above.factory is not None and getattr(above.factory, "rebuild", True):
                above.value = above.factory(site, stack.value_below(position))
        top = layers[-1]
        site.write(top.value, stack.original)
        stack.written = top.value
        stack.observed = top.value if site.raw_reads else site.read()


def _conflict_message(site: Site, expected: Any, found: Any, live: int) -> str:
    return (
        f"{site.describe()} was rebound outside layerswap while patched: expected "
        f"{_short(expected)}, found {_short(found)}; restoring the value it had "
        f"before {'the patches' if live > 1 else 'the patch'}"
    )


def rebases() -> int:
    """How many times a live patch's original was changed in place so far: a reader
    keeping what :func:`unpatched` returned reads again when it has grown."""
    return _REBASES[0]


def unpatched(owner: Any, name: str) -> Any:
    """``getattr(owner, name)`` as it was before every live patch of that attribute.

    Code that must see the real object while a patch shows another in its place (the
    original layer class while ``use()`` shows the replacement under its name) asks
    the engine, which holds each patched site's original, instead of keeping a copy.

    Example::

        with patch(module, "LlamaDecoderLayer", FusedLayer):
            unpatched(module, "LlamaDecoderLayer")   # the real LlamaDecoderLayer
    """
    with LOCK:
        stack = _STACKS.get((id(owner), name))
        if stack is not None and stack.site.owner is owner and stack.layers:
            original = stack.original
            if original.container is not None:
                return original.value
            return _past(owner, name)  # inherited: what getattr finds past the patch
    return getattr(owner, name)


def _past(owner: Any, name: str) -> Any:
    """``getattr(owner, name)`` as if ``owner`` held no ``name`` of its own: a class's
    bases, an instance's class, bound as attribute access binds them."""
    if isinstance(owner, type):
        for base in owner.__mro__[1:]:
            if name in base.__dict__:
                raw = base.__dict__[name]
                bind = getattr(type(raw), "__get__", None)
                return raw if bind is None else bind(raw, None, owner)
    elif not isinstance(owner, types.ModuleType):
        for klass in type(owner).__mro__:
            if name in klass.__dict__:
                raw = klass.__dict__[name]
                bind = getattr(type(raw), "__get__", None)
                return raw if bind is None else bind(raw, owner, type(owner))
    raise AttributeError(f"{owner!r} has no attribute {name!r} before its patches")


def stack_depth(site: Site) -> int:
    """How many live layers ``site`` has (0 when unpatched)."""
    with LOCK:
        stack = _STACKS.get(site.key)
        return 0 if stack is None else len(stack.layers)


def warn_conflicts(messages: list[str], stacklevel: int) -> None:
    for message in messages:
        warnings.warn(message, PatchConflictWarning, stacklevel=stacklevel + 1)


def _short(value: Any, limit: int = 80) -> str:
    try:
        text = repr(value)
    except Exception:
        text = f"<{type(value).__qualname__} object>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _owner_text(owner: Any) -> str:
    if isinstance(owner, type):
        return f"class {owner.__module__}.{owner.__qualname__}"
    name = getattr(owner, "__name__", None)
    if isinstance(name, str) and type(owner).__name__ == "module":
        return f"module {name!r}"
    return f"{type(owner).__qualname__} object"


def _names(owner: Any) -> list[str]:
    try:
        return [n for n in dir(owner) if isinstance(n, str)]
    except Exception:
        return []
