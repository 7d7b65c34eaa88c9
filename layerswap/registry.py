"""The registry: families, backends, and the substitutions derived from both.

Every ``<family>.<slot>.<backend>`` substitution is derived from a registered family and
a registered backend (:meth:`Backend.substitution`) when it is asked for, and kept until
either changes: nothing is derived ahead. A family registered later has every backend's
substitutions, a backend registered later covers every family its ``supports`` check
accepts. Substitutions can also be registered one by one (they take precedence over a
derived one of the same name). Builtin families and backends (their declarations: data,
read without importing torch, transformers or the layers) are registered on first use,
then the entry-point groups ``layerswap.backends`` and ``layerswap.substitutions``.

Example::

    layerswap.get("llama.decoder.fused")            # imports llama's modeling module only
    layerswap.substitutions(family="qwen3", backend="liger")
    layerswap.register_backend(MY_BACKEND)          # every family it supports
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib
import importlib.metadata
import re
import threading
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

from layerswap.backend import Backend
from layerswap.backends import builtin_modules, per_family
from layerswap.errors import SubstitutionError, UnknownBackendError, UnknownSubstitutionError
from layerswap.families import BUILTIN_FAMILIES
from layerswap.family import Family
from layerswap.substitution import Substitution
from layerswap.suggestions import did_you_mean

__all__ = [
    "BACKEND_ENTRY_POINT_GROUP",
    "ENTRY_POINT_GROUP",
    "Offer",
    "backend_of",
    "backends",
    "families",
    "get",
    "get_backend",
    "get_family",
    "load_entry_points",
    "offers",
    "register",
    "register_backend",
    "register_family",
    "substitutions",
    "unregister",
    "unregister_backend",
    "unregister_family",
    "visible",
]

ENTRY_POINT_GROUP = "layerswap.substitutions"
BACKEND_ENTRY_POINT_GROUP = "layerswap.backends"

_FAMILIES: dict[str, Family] = {}
_BACKENDS: dict[str, Backend] = {}
#: substitutions registered one by one (:func:`register`, the entry points)
_REGISTERED: dict[str, Substitution] = {}
#: derived names taken out by :func:`unregister`
_REMOVED: set[str] = set()
#: derived substitutions made so far, and the backends' answers: dropped on any change
_MADE: dict[str, tuple[Family, Backend, Substitution]] = {}
_ANSWERS: dict[tuple[str, str, str], tuple[Family, Backend, str | None]] = {}
_LOCK = threading.RLock()
_LOADED = False
#: families seen by this thread (and its tasks) only: :func:`visible`
_VISIBLE: contextvars.ContextVar[dict[str, Family] | None] = contextvars.ContextVar(
    "layerswap_visible_families", default=None
)

T = TypeVar("T")


def _suggest(name: str, known: Iterable[str]) -> str:
    known = sorted(known)
    hint = did_you_mean(name, known)
    return f"{'; ' + hint if hint else ''} Known: {', '.join(known) or '(none)'}."


def _ensure_loaded() -> None:
    global _LOADED
    if _LOADED:
        return
    with _LOCK:
        if _LOADED:
            return
        for family in BUILTIN_FAMILIES:
            _FAMILIES.setdefault(family.name, family)
        for backend in _builtin_backends():
            _BACKENDS.setdefault(backend.name, backend)
        # set before the entry points: they call register(), which calls back here
        _LOADED = True
        _load_entry_points()


def _builtin_backends() -> list[Backend]:
    """The builtin declarations, imported by name as a plugin's are. A module that fails
    to import is skipped with a warning, like a broken plugin."""
    found = []
    for module_name in builtin_modules():
        try:
            backend = vars(importlib.import_module(module_name)).get("BACKEND")
        except Exception as exc:
            warnings.warn(
                f"layerswap: backend {module_name} is unavailable: {exc}", RuntimeWarning, 3
            )
            continue
        if isinstance(backend, Backend):
            found.append(backend)
    return found


def _changed() -> None:
    """Forget what was derived (a family, backend or substitution came or went)."""
    _MADE.clear()
    _ANSWERS.clear()


# --- what is derived ------------------------------------------------------------------


@dataclass(frozen=True)
class Offer:
    """One substitution the registry offers, read without making it: its name, family,
    backend (a variant's name included), slot and description, and why it cannot run
    here (:meth:`unmet_requirement`). ``layerswap list`` shows these; making the
    :class:`Substitution` (:func:`get`) imports its layers.
    """

    name: str
    family: str
    backend: str
    slot: str
    description: str
    requirement: Callable[[], str | None]

    def unmet_requirement(self) -> str | None:
        """Why the substitution cannot run here, or ``None`` when it can."""
        return self.requirement()


def _refused(backend: Backend, family: Family, slot: str) -> str | None:
    """The backend's reason for not expressing ``family``'s ``slot`` (asked once)."""
    key = (backend.name, family.name, slot)
    known = _ANSWERS.get(key)
    if known is not None and known[0] is family and known[1] is backend:
        return known[2]
    answer = backend.unsupported(family, slot)
    _ANSWERS[key] = (family, backend, answer)
    return answer


def _derivable(name: str) -> tuple[Family, Backend, str, str | None] | None:
    """The family, backend, slot and variant ``name`` is derived from, when the registry
    has all of them (whether the backend supports the family is not asked here)."""
    family_name, _, rest = name.partition(".")
    slot, _, backend_name = rest.partition(".")
    family = _family(family_name)
    if family is None:
        return None
    for backend in _BACKENDS.values():
        if backend_name == backend.name:
            variant = None
        elif backend_name.startswith(backend.name + "_"):
            variant = backend_name[len(backend.name) + 1 :]
            if variant not in {v.name for v in backend.variants if slot in v.slots}:
                continue
        else:
            continue
        if slot in backend.slots:
            return family, backend, slot, variant
    return None


def _derived_offers(family: Family, backend: Backend, absence: str | None) -> list[Offer]:
    """``backend``'s offers for ``family``. A family the installed transformers lacks
    (``absence``, its reason) is not asked of the backend, which would read its missing
    source: each slot is offered, and cannot run here for that reason."""
    offers = []
    for slot, implementation in backend.slots.items():
        name = f"{family.name}.{slot}.{backend.name}"
        if absence is None and _refused(backend, family, slot) is not None:
            continue
        requirement = backend.requirement if absence is None else _always(absence)
        offers.append(
            Offer(name, family.name, backend.name, slot, implementation.description, requirement)
        )
        for variant in backend.variants:
            if slot not in variant.slots:
                continue
            offers.append(
                Offer(
                    f"{name}_{variant.name}",
                    family.name,
                    f"{backend.name}_{variant.name}",
                    slot,
                    variant.description or f"{implementation.description} ({variant.name})",
                    _both(requirement, variant.unmet_requirement),
                )
            )
    return offers


def _always(reason: str) -> Callable[[], str | None]:
    return lambda: reason


def _both(
    first: Callable[[], str | None], then: Callable[[], str | None]
) -> Callable[[], str | None]:
    def requirement() -> str | None:
        reason = first()
        return reason if reason is not None else then()

    return requirement


def _made(name: str) -> Substitution | None:
    """The derived substitution ``name`` (made once); ``None`` when none is offered, or
    its family is not in the installed transformers."""
    if name in _REMOVED:
        return None
    found = _derivable(name)
    if found is None:
        return None
    family, backend, slot, variant = found
    made = _MADE.get(name)
    if made is not None and made[0] is family and made[1] is backend:
        return made[2]
    # a family the installed transformers lacks is offered (listed as absent), never made
    if family.absence() is not None or _refused(backend, family, slot) is not None:
        return None
    sub = backend.substitution(family, slot, variant=variant)
    _MADE[name] = (family, backend, sub)
    return sub


def _all_offers(family: str | None = None) -> dict[str, Offer]:
    """Every substitution offered (of ``family`` alone, when named), by name: derived ones,
    then those registered. Only the families asked about are asked of the backends."""
    known = families()
    asked = known.values() if family is None else [known[family]] if family in known else []
    found = {
        offer.name: offer
        for spec in asked
        for absence in [spec.absence()]
        for backend in _BACKENDS.values()
        for offer in _derived_offers(spec, backend, absence)
        if offer.name not in _REMOVED
    }
    for sub in _REGISTERED.values():
        if family is None or sub.family == family:
            found[sub.name] = Offer(
                sub.name, sub.family, sub.backend, sub.slot, sub.description, sub.unmet_requirement
            )
    return found


def offers(
    family: str | None = None, backend: str | None = None, slot: str | None = None
) -> list[Offer]:
    """What :func:`substitutions` lists, without making any: no layer is imported.

    Example::

        [(o.name, o.unmet_requirement()) for o in layerswap.registry.offers(family="llama")]
    """
    _ensure_loaded()
    with _LOCK:
        found = _all_offers(family)
    return sorted(
        (
            offer
            for offer in found.values()
            if (family is None or offer.family == family)
            and (backend is None or offer.backend == backend)
            and (slot is None or offer.slot == slot)
        ),
        key=lambda offer: offer.name,
    )


def _existing(name: str) -> Substitution | None:
    """The substitution registered or derived under ``name``, if any."""
    registered = _REGISTERED.get(name)
    return registered if registered is not None else _made(name)


# --- families -----------------------------------------------------------------------


def _family(name: str) -> Family | None:
    visible = _VISIBLE.get() or {}
    return visible[name] if name in visible else _FAMILIES.get(name)


def families() -> dict[str, Family]:
    """All known families by name (builtin ones and those added by :func:`register_family`)."""
    _ensure_loaded()
    return {**_FAMILIES, **(_VISIBLE.get() or {})}


# the backends' per-family classes named by a substitution (the head slot's) are found
# among these families: given to them here, as they import nothing above them
per_family.find_families_with(families)


def get_family(name: str | Family) -> Family:
    """The family called ``name``; unknown names raise :class:`UnknownSubstitutionError`."""
    if isinstance(name, Family):
        return name
    _ensure_loaded()
    found = _family(name)
    if found is None:
        raise UnknownSubstitutionError(
            f"no model family named {name!r}{_suggest(name, families())}"
        )
    return found


@contextlib.contextmanager
def visible(family: Family) -> Iterator[Family]:
    """Inside the block, ``family`` is known to this thread (and the tasks it starts) as if
    registered; no other thread sees it, and nothing is left behind. Inference proves a
    family it infers this way before anyone may register it.

    Example::

        with layerswap.registry.visible(candidate):
            report = layerswap.verify(candidate.build(), backend.substitution(candidate))
    """
    _ensure_loaded()
    token = _VISIBLE.set({**(_VISIBLE.get() or {}), family.name: family})
    try:
        yield family
    finally:
        _VISIBLE.reset(token)


def register_family(family: Family, *, replace: bool = False) -> list[Substitution]:
    """Add a family; every registered backend's substitutions for it are derived from now.

    Returns the substitutions it gets. Example::

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
            _REGISTERED.pop(sub.name, None)
            _REMOVED.discard(sub.name)
        _changed()
        return derived


def unregister_family(name: str) -> Family:
    """Remove the family called ``name`` and every substitution registered for it.

    Example::

        unregister_family("ministral")
    """
    _ensure_loaded()
    with _LOCK:
        family = get_family(name)
        for sub_name in [key for key, sub in _REGISTERED.items() if sub.family == family.name]:
            del _REGISTERED[sub_name]
        _REMOVED.difference_update({n for n in _REMOVED if n.startswith(f"{family.name}.")})
        del _FAMILIES[family.name]
        _changed()
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


def register_backend(backend: Backend, *, replace: bool = False) -> list[Offer]:
    """Add a backend: it offers its substitutions for every registered family it supports
    (families registered later too), each derived when first asked for.

    Returns what it offers, read without making any (:func:`offers`): no family's classes
    are touched, so a family the installed transformers lacks fails only a substitution
    asked for by name. Example::

        layerswap.register_backend(MY_BACKEND)
        layerswap.get("llama.decoder.mine")
    """
    added = _add_backend_lazily(backend, replace=replace)
    if not added:
        return []
    with _LOCK:
        found = [
            offer
            for family in _FAMILIES.values()
            for offer in _derived_offers(family, backend, family.absence())
            if offer.name not in _REMOVED and offer.name not in _REGISTERED
        ]
    return sorted(found, key=lambda offer: offer.name)


def _add_backend_lazily(backend: Backend, *, replace: bool) -> bool:
    """Register ``backend`` without deriving anything; ``False`` when it already was."""
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
        stale = set(existing.names()) if existing is not None else set()
        # a registered substitution under a name the backend derives must be the same one
        derived = [
            sub for family in _FAMILIES.values() for sub in _registered_clashes(backend, family)
        ]
        _check_free([sub for sub in derived if sub.backend not in stale], replace)
        for name in [key for key, sub in _REGISTERED.items() if sub.backend in stale]:
            del _REGISTERED[name]
        for sub in derived:
            _REGISTERED.pop(sub.name, None)
        _REMOVED.difference_update({n for n in _REMOVED if n.rpartition(".")[2] in stale})
        _BACKENDS[backend.name] = backend
        _changed()
        return existing is None or existing != backend or replace


def _registered_clashes(backend: Backend, family: Family) -> list[Substitution]:
    """``backend``'s substitutions for ``family`` whose names are registered one by one
    (made only for those names)."""
    names = {f"{family.name}.{slot}.{name}" for slot in backend.slots for name in backend.names()}
    if not names & set(_REGISTERED):
        return []
    return [sub for sub in backend.substitutions(family) if sub.name in _REGISTERED]


def unregister_backend(name: str) -> Backend:
    """Remove the backend called ``name`` and every substitution derived from it.

    Example::

        layerswap.unregister_backend("mine")
    """
    _ensure_loaded()
    with _LOCK:
        backend = get_backend(name)
        names = set(backend.names())
        for sub_name in [key for key, sub in _REGISTERED.items() if sub.backend in names]:
            del _REGISTERED[sub_name]
        _REMOVED.difference_update({n for n in _REMOVED if n.rpartition(".")[2] in names})
        del _BACKENDS[backend.name]
        _changed()
        return backend


def _check_free(subs: list[Substitution], replace: bool) -> None:
    """Refuse (changing nothing) to overwrite a different substitution without ``replace``."""
    if replace:
        return
    for sub in subs:
        existing = _REGISTERED.get(sub.name)
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
        existing = _existing(sub.name)
        if existing is not None and existing != sub and not replace:
            raise SubstitutionError(
                f"a different substitution is already registered as {sub.name!r}; "
                "pass replace=True to replace it"
            )
        _REGISTERED[sub.name] = sub
        _REMOVED.discard(sub.name)
    return sub


def unregister(name: str) -> Substitution:
    """Remove a substitution from the registry and return it."""
    _ensure_loaded()
    with _LOCK:
        existing = _existing(name)
        if existing is None:
            raise UnknownSubstitutionError(
                f"no substitution named {name!r}{_suggest(name, _all_offers())}"
            )
        _REGISTERED.pop(name, None)
        if _derivable(name) is not None:
            _REMOVED.add(name)
        _MADE.pop(name, None)
        return existing


def get(name: str | Substitution) -> Substitution:
    """The registered substitution called ``name`` (a :class:`Substitution` is returned as is).

    Made when first asked for: only the family's own modeling module is imported. Unknown
    names raise :class:`UnknownSubstitutionError` listing the closest names. Example::

        sub = layerswap.get("llama.decoder.fused")
    """
    if isinstance(name, Substitution):
        return name
    if not isinstance(name, str):
        raise TypeError(f"get() takes a name or a Substitution, not {type(name).__name__}")
    _ensure_loaded()
    with _LOCK:
        found = _existing(name)
        if found is not None:
            return found
        refused = _refusal(name)
        if refused is not None:
            raise UnknownSubstitutionError(f"no substitution named {name!r}: {refused}")
        raise UnknownSubstitutionError(
            f"no substitution named {name!r}{_suggest(name, _all_offers())}"
        )


def _refusal(name: str) -> str | None:
    """Why ``<family>.<slot>.<backend>`` cannot be made when its family, slot and backend
    are registered: the installed transformers lacks the family, or the backend refuses
    that family's slot (its own reason)."""
    if name in _REMOVED:
        return None
    found = _derivable(name)
    if found is None:
        return None
    family, backend, slot, _ = found
    absence = family.absence()
    if absence is not None:
        return absence
    reason = _refused(backend, family, slot)
    if reason is None:
        return None
    return f"the {backend.name} backend does not express {family.name}'s {slot}: {reason}"


def substitutions(
    family: str | None = None, backend: str | None = None, slot: str | None = None
) -> list[Substitution]:
    """Registered substitutions, sorted by name, optionally filtered by family, backend, slot.

    Each is made when listed (its layers imported); :func:`offers` lists them without.
    Example::

        [s.name for s in layerswap.substitutions(backend="fused", slot="head")]
    """
    found = offers(family=family, backend=backend, slot=slot)
    with _LOCK:
        made = [_existing(offer.name) for offer in found]
    return [sub for sub in made if sub is not None]


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


def _add_backend(backend: Backend) -> list[Backend]:
    if _BACKENDS.get(backend.name) == backend:
        return []
    _add_backend_lazily(backend, replace=False)
    return [backend]


def _add_substitution(sub: Substitution) -> list[Substitution]:
    if _REGISTERED.get(sub.name) == sub:
        return []
    return [register(sub)]


def _load_entry_points() -> tuple[list[Backend], list[Substitution]]:
    added = _load_group(BACKEND_ENTRY_POINT_GROUP, Backend, _add_backend)
    return added, _load_group(ENTRY_POINT_GROUP, Substitution, _add_substitution)


def load_entry_points() -> list[Substitution]:
    """Register backends and substitutions from the ``layerswap.backends`` and
    ``layerswap.substitutions`` entry points.

    Called on first use of the registry; call it again after installing a plugin in
    a running process. A plugin that fails to load is skipped with a warning naming
    it, so one broken package does not take the registry down. Returns the
    substitutions registered (a backend's: each family it supports).

    A plugin declares, e.g. in ``pyproject.toml``::

        [project.entry-points."layerswap.backends"]
        mine = "my_pkg.backend:BACKEND"        # a Backend, an iterable, or a callable
        [project.entry-points."layerswap.substitutions"]
        mine = "my_pkg.layers:substitutions"   # a Substitution, an iterable, or a callable
    """
    _ensure_loaded()
    added_backends, added = _load_entry_points()
    return [
        *(
            sub
            for backend in added_backends
            for sub in substitutions(backend=None)
            if sub.backend in backend.names()
        ),
        *added,
    ]
