"""``patch_dict``: reversible changes to a mapping (``os.environ``, registries, config dicts).

Each key is its own site with its own layered stack, so overlapping dict patches
may stop in any order. When the last dict patch of a mapping stops, the keys that
existed before are put back in their original insertion order.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from typing import Any

from layerswap.errors import TargetTypeError
from layerswap.patching import stack as _stack
from layerswap.patching.scoped import Scoped
from layerswap.patching.sites import DELETED, ItemSite
from layerswap.patching.target import ParsedTarget

__all__ = ["DictPatch", "patch_dict"]

# id(mapping) -> [mapping, original key order, number of live dict patches]
_ORDERS: dict[int, list[Any]] = {}


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
        self._layers: list[_stack.Layer] = []
        self._mapping: MutableMapping[Any, Any] | None = None

    def _label(self) -> str:
        if self._parsed is not None:
            return f"patch_dict({self._parsed.text})"
        return f"patch_dict(<{type(self._target).__qualname__} at {id(self._target):#x}>)"

    def _site_texts(self) -> tuple[str, ...]:
        return tuple(layer.site.describe() for layer in self._layers)

    def _new_text(self) -> str:
        return _stack._short(self._values)

    def _copy(self) -> DictPatch:
        return DictPatch(self._target, self._values, self._clear, self._parsed)

    def _resolve(self) -> MutableMapping[Any, Any]:
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
                f"{self._label()}: the target is a {type(mapping).__qualname__}, not a mutable mapping"
            )
        return mapping  # type: ignore[no-any-return]

    def _apply(self) -> None:
        mapping = self._resolve()  # outside the lock: resolving may import
        with _stack.LOCK:
            entry = _ORDERS.get(id(mapping))
            order_before = list(mapping.keys()) if entry is None else None
            changes: dict[Any, Any] = {}
            if self._clear:
                changes = dict.fromkeys(list(mapping.keys()), DELETED)
            changes.update(self._values)
            layers: list[_stack.Layer] = []
            try:
                for key, value in changes.items():
                    layers.append(_stack.push(ItemSite(mapping, key), value, None, self, True))
            except BaseException:
                for layer in reversed(layers):
                    _stack.remove(layer)
                if order_before is not None:
                    _reorder(mapping, order_before)
                raise
            if entry is None:
                entry = _ORDERS[id(mapping)] = [mapping, order_before, 0]
            entry[2] += 1
        self._layers = layers
        self._mapping = mapping

    def _revert(self) -> None:
        mapping = self._mapping
        conflicts: list[str] = []
        with _stack.LOCK:
            for layer in reversed(self._layers):
                message = _stack.remove(layer)
                if message is not None:
                    conflicts.append(message)
            self._layers = []
            if mapping is not None:
                entry = _ORDERS.get(id(mapping))
                if entry is not None:
                    entry[2] -= 1
                    if entry[2] == 0:
                        del _ORDERS[id(mapping)]
                        _reorder(mapping, entry[1])
        self._mapping = None
        _stack.warn_conflicts(conflicts, stacklevel=4)


def _reorder(mapping: MutableMapping[Any, Any], order: list[Any]) -> None:
    keys = list(mapping.keys())
    present = [k for k in order if k in mapping]
    known = set(order)
    extra = [k for k in keys if k not in known]
    if keys == present + extra:
        return
    items = [(k, mapping[k]) for k in present + extra]
    for k in keys:
        del mapping[k]
    for k, v in items:
        mapping[k] = v


def _duck_mapping(obj: Any) -> bool:
    return all(
        hasattr(obj, m) for m in ("__getitem__", "__setitem__", "__delitem__", "keys", "pop")
    )


def _attribute_error(target: str, name: str, hint: str) -> Exception:
    from layerswap.errors import TargetAttributeError

    return TargetAttributeError(f"cannot patch {target!r}: no attribute {name!r}{hint}", name=name)


def patch_dict(
    target: MutableMapping[Any, Any] | str,
    values: Mapping[Any, Any] | None = None,
    *,
    clear: bool = False,
) -> DictPatch:
    """Reversibly update a mapping: added keys removed, changed and deleted keys restored.

    ``target`` is the mapping itself or a target string naming it. With
    ``clear=True`` every existing key is removed first. Insertion order is kept.

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
    return DictPatch(target, values, clear, parsed)
