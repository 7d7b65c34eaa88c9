"""The registry: families, backends, and the substitutions derived from both.

Every ``<family>.<slot>.<backend>`` substitution is derived from a registered family and
a registered backend (:meth:`Backend.substitutions`), whichever was registered first: a
family registered later gets every backend's substitutions, a backend registered later
covers every family its ``supports`` check accepts. Substitutions can also be
registered one by one. Builtin families and backends are registered on first use,
then the entry-point groups ``layerswap.backends`` and ``layerswap.substitutions``.

Example::

    layerswap.get("llama.decoder.fused")
    layerswap.substitutions(family="qwen3", backend="liger")
    layerswap.register_backend(MY_BACKEND)          # every family it supports
"""

from __future__ import annotations

import importlib
import importlib.metadata
import re
import threading
import warnings
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from layerswap.backend import Backend
from layerswap.backends import builtin_modules
from layerswap.errors import SubstitutionError, UnknownBackendError, UnknownSubstitutionError
from layerswap.families import BUILTIN_FAMILIES
from layerswap.family import Family
from layerswap.substitution import Substitution
from layerswap.suggestions import close_names

__all__ = [
    "BACKEND_ENTRY_POINT_GROUP",
    "ENTRY_POINT_GROUP",
    "backend_of",
    "backends",
    "families",
    "get",
    "get_backend",
    "get_family",
    "load_entry_points",
    "register",
    "register_backend",
    "register_family",
    "substitutions",
    "unregister",
    "unregister_backend",
    "unregister_family",
]

ENTRY_POINT_GROUP = "layerswap.substitutions"
BACKEND_ENTRY_POINT_GROUP = "layerswap.backends"

_FAMILIES: dict[str, Family] = {}
_BACKENDS: dict[str, Backend] = {}
_REGISTRY: dict[str, Substitution] = {}
_LOCK = threading.RLock()
_LOADED = False

T = TypeVar("T")


def _suggest(name: str, known: Iterable[str]) -> str:
    known = sorted(known)
    close = close_names(name, known)
    hint = f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""
    return f"{hint} Known: {', '.join(known) or '(none)'}."


def _ensure_loaded() -> None:
    global _LOADED
    if _LOADED:
        return
    with _LOCK:
        if _LOADED:
            return
        builtin = _builtin_backends()
        for family in BUILTIN_FAMILIES:
            _FAMILIES.setdefault(family.name, family)
        for backend in builtin:
            _BACKENDS.setdefault(backend.name, backend)
        for backend in builtin:
            for family in BUILTIN_FAMILIES:
                for sub in backend.substitutions(family):
                    _REGISTRY.setdefault(sub.name, sub)
        # set before the entry points: they call register(), which calls back here
        _LOADED = True
        load_entry_points()


def _builtin_backends() -> list[Backend]:
    """The builtin declarations, imported by name as a plugin's are (a backend module may
    use the registry: a pickled model names a per-family class its module makes on demand).
    A module that fails to import is skipped with a warning, like a broken plugin."""
    found = []
    for module_name in builtin_modules():
        try:
            # vars(), not getattr(): a backend module's __getattr__ may ask the registry
            backend = vars(importlib.import_module(module_name)).get("BACKEND")
        except Exception as exc:
            warnings.warn(
                f"layerswap: backend {module_name} is unavailable: {exc}", RuntimeWarning, 3
            )
            continue
        if isinstance(backend, Backend):
            found.append(backend)
    return found


# --- families -----------------------------------------------------------------------


def families() -> dict[str, Family]:
    """All known families by name (builtin ones and those added by :func:`register_family`)."""
    _ensure_loaded()
    return dict(_FAMILIES)


def get_family(name: str | Family) -> Family:
    """The family called ``name``; unknown names raise :class:`UnknownSubstitutionError`."""
    if isinstance(name, Family):
        return name
    _ensure_loaded()
    try:
        return _FAMILIES[name]
    except KeyError:
        raise UnknownSubstitutionError(
            f"no model family named {name!r}{_suggest(name, _FAMILIES)}"
        ) from None


def register_family(family: Family, *, replace: bool = False) -> list[Substitution]:
    """Add a family and every registered backend's substitutions for it.

    Returns the substitutions registered. Example::

        register_family(Family(name="ministral", model_type="ministral", ...))
        layerswap.swap(model, backend="fused")
    """
    if not isinstance(family, Family):
        raise TypeError(f"register_family() takes a Family, not {type(family).__name__}")
    _ensure_loaded()
    with _LOCK:
        if family.name in _FAMILIES and not replace and _FAMILIES[family.name] != family:
            raise SubstitutionError(
                f"a family named {family.name!r} is already registered; pass replace=True"
            )
        derived = [sub for backend in _BACKENDS.values() for sub in backend.substitutions(family)]
        _check_free(derived, replace)
        _FAMILIES[family.name] = family
        for sub in derived:
            _REGISTRY[sub.name] = sub
        return derived


def unregister_family(name: str) -> Family:
    """Remove the family called ``name`` and every substitution registered for it.

    Example::

        unregister_family("ministral")
    """
    _ensure_loaded()
    with _LOCK:
        family = get_family(name)
        for sub_name in [key for key, sub in _REGISTRY.items() if sub.family == family.name]:
            del _REGISTRY[sub_name]
        del _FAMILIES[family.name]
        return family


# --- backends -----------------------------------------------------------------------


def backends() -> dict[str, Backend]:
    """All registered backends by name (builtin, entry points, :func:`register_backend`).

    Example::

        sorted(layerswap.backends())     # ['fused', 'liger', 'te']
    """
    _ensure_loaded()
    return dict(_BACKENDS)


def get_backend(name: str | Backend) -> Backend:
    """The backend called ``name``; unknown names raise :class:`UnknownBackendError`
    (a :class:`LookupError`) naming the closest ones.

    Example::

        layerswap.get_backend("te").unsupported(layerswap.get_family("olmo2"))
    """
    if isinstance(name, Backend):
        return name
    _ensure_loaded()
    try:
        return _BACKENDS[name]
    except KeyError:
        raise UnknownBackendError(f"no backend named {name!r}{_suggest(name, _BACKENDS)}") from None


def backend_of(sub: Substitution) -> Backend | None:
    """The registered backend ``sub`` comes from (its variants included), or ``None``.

    Example::

        backend_of(layerswap.get("llama.decoder.te_fp8")).name    # "te"
    """
    _ensure_loaded()
    with _LOCK:
        return next((b for b in _BACKENDS.values() if sub.backend in b.names()), None)


def register_backend(backend: Backend, *, replace: bool = False) -> list[Substitution]:
    """Add a backend and its substitutions for every registered family it supports.

    Families registered later get this backend's substitutions too. Returns the
    substitutions registered. Example::

        layerswap.register_backend(MY_BACKEND)
        layerswap.get("llama.decoder.mine")
    """
    if not isinstance(backend, Backend):
        raise TypeError(f"register_backend() takes a Backend, not {type(backend).__name__}")
    if not re.fullmatch(r"[\w\-]+", backend.name):
        raise SubstitutionError(
            f"backend name {backend.name!r} must be letters, digits, '_' and '-' (no '.')"
        )
    _ensure_loaded()
    with _LOCK:
        existing = _BACKENDS.get(backend.name)
        if existing is not None and existing != backend and not replace:
            raise SubstitutionError(
                f"a different backend is already registered as {backend.name!r}; "
                "pass replace=True to replace it"
            )
        taken = {
            name: other.name
            for other in _BACKENDS.values()
            if other.name != backend.name
            for name in other.names()
        }
        clash = sorted(set(backend.names()) & set(taken))
        if clash:
            raise SubstitutionError(
                f"backend {backend.name!r} would name substitutions {clash[0]!r}, which the "
                f"{taken[clash[0]]!r} backend names already"
            )
        derived = [sub for family in _FAMILIES.values() for sub in backend.substitutions(family)]
        stale = [] if existing is None else _of_backend(existing)
        _check_free([sub for sub in derived if sub.name not in stale], replace)
        for name in stale:
            del _REGISTRY[name]
        _BACKENDS[backend.name] = backend
        for sub in derived:
            _REGISTRY[sub.name] = sub
        return derived


def unregister_backend(name: str) -> Backend:
    """Remove the backend called ``name`` and every substitution derived from it.

    Example::

        layerswap.unregister_backend("mine")
    """
    _ensure_loaded()
    with _LOCK:
        backend = get_backend(name)
        for sub_name in _of_backend(backend):
            del _REGISTRY[sub_name]
        del _BACKENDS[backend.name]
        return backend


def _of_backend(backend: Backend) -> list[str]:
    return [key for key, sub in _REGISTRY.items() if sub.backend in backend.names()]


def _check_free(subs: list[Substitution], replace: bool) -> None:
    """Refuse (changing nothing) to overwrite a different substitution without ``replace``."""
    if replace:
        return
    for sub in subs:
        existing = _REGISTRY.get(sub.name)
        if existing is not None and existing != sub:
            raise SubstitutionError(
                f"a different substitution is already registered as {sub.name!r}; "
                "pass replace=True to replace it"
            )


# --- substitutions ------------------------------------------------------------------


def register(sub: Substitution, *, replace: bool = False) -> Substitution:
    """Add ``sub`` to the registry under ``sub.name`` and return it.

    Registering a different substitution under a taken name raises
    :class:`SubstitutionError` unless ``replace=True``. Example::

        layerswap.register(dataclasses.replace(layerswap.get("llama.decoder.fused"),
                                               name="llama.decoder.mine", replacement=MyLayer))
    """
    if not isinstance(sub, Substitution):
        raise TypeError(f"register() takes a Substitution, not {type(sub).__name__}")
    if not re.fullmatch(r"[\w.\-]+", sub.name):
        raise SubstitutionError(
            f"substitution name {sub.name!r} must be letters, digits, '_', '-' and '.'"
        )
    _ensure_loaded()
    with _LOCK:
        _check_free([sub], replace)
        _REGISTRY[sub.name] = sub
    return sub


def unregister(name: str) -> Substitution:
    """Remove a substitution from the registry and return it."""
    _ensure_loaded()
    with _LOCK:
        if name not in _REGISTRY:
            raise UnknownSubstitutionError(
                f"no substitution named {name!r}{_suggest(name, _REGISTRY)}"
            )
        return _REGISTRY.pop(name)


def get(name: str | Substitution) -> Substitution:
    """The registered substitution called ``name`` (a :class:`Substitution` is returned as is).

    Unknown names raise :class:`UnknownSubstitutionError` listing the closest names.
    Example::

        sub = layerswap.get("llama.decoder.fused")
    """
    if isinstance(name, Substitution):
        return name
    if not isinstance(name, str):
        raise TypeError(f"get() takes a name or a Substitution, not {type(name).__name__}")
    _ensure_loaded()
    try:
        return _REGISTRY[name]
    except KeyError:
        refused = _refusal(name)
        if refused is not None:
            raise UnknownSubstitutionError(f"no substitution named {name!r}: {refused}") from None
        raise UnknownSubstitutionError(
            f"no substitution named {name!r}{_suggest(name, _REGISTRY)}"
        ) from None


def _refusal(name: str) -> str | None:
    """Why ``<family>.<slot>.<backend>`` is not registered when its family, slot and backend
    all are: the backend's own reason for refusing that family's slot."""
    family_name, _, rest = name.partition(".")
    slot, _, backend_name = rest.partition(".")
    with _LOCK:
        family = _FAMILIES.get(family_name)
        backend = next((b for b in _BACKENDS.values() if backend_name in b.names()), None)
    if family is None or backend is None or slot not in backend.slots:
        return None
    reason = backend.unsupported(family, slot)
    if reason is None:
        return None
    return f"the {backend.name} backend does not express {family_name}'s {slot}: {reason}"


def substitutions(
    family: str | None = None, backend: str | None = None, slot: str | None = None
) -> list[Substitution]:
    """Registered substitutions, sorted by name, optionally filtered by family, backend, slot.

    Example::

        [s.name for s in layerswap.substitutions(backend="fused", slot="head")]
    """
    _ensure_loaded()
    with _LOCK:
        found = list(_REGISTRY.values())
    return sorted(
        (
            sub
            for sub in found
            if (family is None or sub.family == family)
            and (backend is None or sub.backend == backend)
            and (slot is None or sub.slot == slot)
        ),
        key=lambda sub: sub.name,
    )


# --- entry points -------------------------------------------------------------------


def _as_items(obj: Any, kind: type[T], origin: str, group: str) -> list[T]:
    """An entry point's object as a list of ``kind``: one, an iterable, or a callable giving either."""
    if isinstance(obj, kind):
        return [obj]
    if callable(obj) and not isinstance(obj, (Iterable, type)):
        return _as_items(obj(), kind, origin, group)
    if isinstance(obj, Iterable) and not isinstance(obj, (str, bytes)):
        items = list(obj)
        if all(isinstance(item, kind) for item in items):
            return items
    raise SubstitutionError(
        f"entry point {origin} of {group!r} must give a {kind.__name__}, an iterable of "
        f"them, or a zero-argument callable returning either; it gave {type(obj).__name__}"
    )


def _load_group(group: str, kind: type[T], add: Callable[[T], list[Any]]) -> list[Any]:
    added: list[Any] = []
    for entry_point in importlib.metadata.entry_points(group=group):
        origin = f"{entry_point.name!r} ({entry_point.value})"
        try:
            for item in _as_items(entry_point.load(), kind, origin, group):
                added.extend(add(item))
        except Exception as exc:
            warnings.warn(
                f"layerswap: skipping the {group} plugin {origin}: {exc}",
                RuntimeWarning,
                stacklevel=3,
            )
    return added


def _add_backend(backend: Backend) -> list[Substitution]:
    if _BACKENDS.get(backend.name) == backend:
        return []
    return [*register_backend(backend)]


def _add_substitution(sub: Substitution) -> list[Substitution]:
    if _REGISTRY.get(sub.name) == sub:
        return []
    return [register(sub)]


def load_entry_points() -> list[Substitution]:
    """Register backends and substitutions from the ``layerswap.backends`` and
    ``layerswap.substitutions`` entry points.

    Called on first use of the registry; call it again after installing a plugin in
    a running process. A plugin that fails to load is skipped with a warning naming
    it, so one broken package does not take the registry down. Returns the
    substitutions registered.

    A plugin declares, e.g. in ``pyproject.toml``::

        [project.entry-points."layerswap.backends"]
        mine = "my_pkg.backend:BACKEND"        # a Backend, an iterable, or a callable
        [project.entry-points."layerswap.substitutions"]
        mine = "my_pkg.layers:substitutions"   # a Substitution, an iterable, or a callable
    """
    added = _load_group(BACKEND_ENTRY_POINT_GROUP, Backend, _add_backend)
    added += _load_group(ENTRY_POINT_GROUP, Substitution, _add_substitution)
    return added
