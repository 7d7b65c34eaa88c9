"""The registry object: the stores of families, backends and substitutions, and what is
derived from them, behind one lock.

:class:`Registry` holds every family and backend registered, the substitutions
registered one by one, and the substitutions derived so far (dropped on any change);
one context variable holds the families a thread sees alone. :data:`REGISTRY` is the
one the package uses; :mod:`layerswap.registry` documents its functions.

Example::

    from layerswap.catalog import REGISTRY

    REGISTRY.get("llama.decoder.fused")
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib
import re
import threading
import warnings
from collections.abc import Iterable, Iterator

from layerswap.backend import Backend
from layerswap.backends import builtin_modules
from layerswap.errors import (
    SubstitutionError,
    UnknownBackendError,
    UnknownSubstitutionError,
    UnsupportedFamilyError,
)
from layerswap.families import BUILTIN_FAMILIES
from layerswap.family import Family
from layerswap.offers import Offer, derived_offers
from layerswap.plugins import BACKEND_ENTRY_POINT_GROUP, ENTRY_POINT_GROUP, load_group
from layerswap.slots import get_slot, takes_any_model_type
from layerswap.substitution import Parts, Substitution, resolve_parts_with
from layerswap.suggestions import did_you_mean

__all__ = ["REGISTRY", "Offer", "Registry"]


#: the most names an error lists; beyond, it says how many and where to see them
_LISTED = 30


def _suggest(name: str, known: Iterable[str]) -> str:
    known = sorted(known)
    hint = did_you_mean(name, known)
    if len(known) > _LISTED:  # hundreds of substitution names bury the hint
        return (
            f"{'; ' + hint if hint else ''} ({len(known)} are known: `layerswap list` lists them)"
        )
    return f"{'; ' + hint if hint else ''} (known: {', '.join(known) or 'none'})"


def _builtin_backends() -> list[Backend]:
    """The builtin declarations, imported by name as a plugin's are. A module that fails
    to import is skipped with a warning, like a broken plugin."""
    found = []
    for module_name in builtin_modules():
        try:
            backend = vars(importlib.import_module(module_name)).get("BACKEND")
        except Exception as exc:
            warnings.warn(
                f"layerswap: backend {module_name} is unavailable: {exc}", RuntimeWarning, 4
            )
            continue
        if isinstance(backend, Backend):
            found.append(backend)
    return found


#: families seen by one thread (and its tasks) only: :meth:`Registry.visible`
_VISIBLE: contextvars.ContextVar[dict[str, Family] | None] = contextvars.ContextVar(
    "layerswap_visible_families", default=None
)


class Registry:
    """Every family, backend and substitution known, and what was derived from them.

    One lock guards the stores; one context variable holds the families a thread sees
    alone (:meth:`visible`). The module's functions (:func:`get`, :func:`register` ...)
    act on :data:`REGISTRY`; builtin families and backends, then the entry points, are
    loaded on first use.
    """

    def __init__(self) -> None:
        self._families: dict[str, Family] = {}
        self._backends: dict[str, Backend] = {}
        #: substitutions registered one by one (:meth:`register`, the entry points)
        self._registered: dict[str, Substitution] = {}
        #: derived names taken out by :meth:`unregister`
        self._removed: set[str] = set()
        #: derived substitutions made so far, and the backends' answers: dropped on any change
        self._made: dict[str, tuple[Family, Backend, Substitution]] = {}
        self._answers: dict[tuple[str, str, str], tuple[Family, Backend, str | None]] = {}
        #: families made for slots that take any model type, by model type (``None``:
        #: transformers has no causal LM of that type)
        self._bare: dict[str, Family | None] = {}
        self._lock = threading.RLock()
        self._loaded = False

    # --- loading ------------------------------------------------------------------------

    def ensure_loaded(self) -> None:
        if self._loaded:
            return
        with self._lock:
            if self._loaded:
                return
            for family in BUILTIN_FAMILIES:
                self._families.setdefault(family.name, family)
            for backend in _builtin_backends():
                self._backends.setdefault(backend.name, backend)
            # set before the entry points: they call register(), which calls back here
            self._loaded = True
            self._load_entry_points()

    def _load_entry_points(self) -> tuple[list[Backend], list[Substitution]]:
        added = load_group(BACKEND_ENTRY_POINT_GROUP, Backend, self._add_backend)
        return added, load_group(ENTRY_POINT_GROUP, Substitution, self._add_substitution)

    def _add_backend(self, backend: Backend) -> list[Backend]:
        if self._backends.get(backend.name) == backend:
            return []
        self._add_backend_lazily(backend, replace=False)
        return [backend]

    def _add_substitution(self, sub: Substitution) -> list[Substitution]:
        if self._registered.get(sub.name) == sub:
            return []
        return [self.register(sub)]

    def load_entry_points(self) -> list[Substitution]:
        self.ensure_loaded()
        added_backends, added = self._load_entry_points()
        return [
            *(
                sub
                for backend in added_backends
                for sub in self.substitutions()
                if sub.backend in backend.names()
            ),
            *added,
        ]

    def _changed(self) -> None:
        """Forget what was derived (a family, backend or substitution came or went)."""
        self._made.clear()
        self._answers.clear()

    # --- what is derived ----------------------------------------------------------------

    def _refused(self, backend: Backend, family: Family, slot: str) -> str | None:
        """The backend's reason for not expressing ``family``'s ``slot`` (asked once)."""
        key = (backend.name, family.name, slot)
        known = self._answers.get(key)
        if known is not None and known[0] is family and known[1] is backend:
            return known[2]
        answer = backend.unsupported(family, slot)
        self._answers[key] = (family, backend, answer)
        return answer

    def _offers_of(self, family: Family, backend: Backend) -> list[Offer]:
        return derived_offers(
            family,
            backend,
            family.absence(),
            lambda slot: self._refused(backend, family, slot),
        )

    def _derivable(self, name: str) -> tuple[Family, Backend, str, str | None] | None:
        """The family, backend, slot and variant ``name`` is derived from, when the
        registry has all of them (whether the backend supports the family is not asked)."""
        family_name, _, rest = name.partition(".")
        slot, _, backend_name = rest.partition(".")
        family = self._family_for(family_name, slot)
        if family is None:
            return None
        for backend in self._backends.values():
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

    def _made_one(self, name: str) -> Substitution | None:
        """The derived substitution ``name`` (made once); ``None`` when none is offered,
        or its family is not in the installed transformers."""
        if name in self._removed:
            return None
        found = self._derivable(name)
        if found is None:
            return None
        family, backend, slot, variant = found
        made = self._made.get(name)
        if made is not None and made[0] is family and made[1] is backend:
            return made[2]
        # a family the installed transformers lacks is offered (listed as absent), never made
        if family.absence() is not None or self._refused(backend, family, slot) is not None:
            return None
        sub = backend.substitution(family, slot, variant=variant)
        self._made[name] = (family, backend, sub)
        return sub

    def _all_offers(self, family: str | None = None) -> dict[str, Offer]:
        """Every substitution offered (of ``family`` alone, when named), by name: derived
        ones, then those registered. Only the families asked about are asked of the backends."""
        known = self.families()
        asked = known.values() if family is None else [known[family]] if family in known else []
        found = {
            offer.name: offer
            for spec in asked
            for backend in self._backends.values()
            for offer in self._offers_of(spec, backend)
            if offer.name not in self._removed
        }
        for sub in self._registered.values():
            if family is None or sub.family == family:
                found[sub.name] = Offer(
                    sub.name,
                    sub.family,
                    sub.backend,
                    sub.slot,
                    sub.description,
                    sub.unmet_requirement,
                )
        return found

    def offers(
        self, family: str | None = None, backend: str | None = None, slot: str | None = None
    ) -> list[Offer]:
        self.ensure_loaded()
        with self._lock:
            found = self._all_offers(family)
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

    def _existing(self, name: str) -> Substitution | None:
        """The substitution registered or derived under ``name``, if any."""
        registered = self._registered.get(name)
        return registered if registered is not None else self._made_one(name)

    # --- families -----------------------------------------------------------------------

    def family(self, name: str) -> Family | None:
        """The family called ``name`` as this thread sees it, or ``None``."""
        visible = _VISIBLE.get() or {}
        return visible[name] if name in visible else self._families.get(name)

    def families(self) -> dict[str, Family]:
        self.ensure_loaded()
        return {**self._families, **(_VISIBLE.get() or {})}

    def get_family(self, name: str | Family) -> Family:
        if isinstance(name, Family):
            return name
        self.ensure_loaded()
        found = self.family(name)
        if found is None:
            raise UnknownSubstitutionError(
                f"no model family named {name!r}{_suggest(name, self.families())}"
            )
        return found

    @contextlib.contextmanager
    def visible(self, family: Family) -> Iterator[Family]:
        self.ensure_loaded()
        token = _VISIBLE.set({**(_VISIBLE.get() or {}), family.name: family})
        try:
            yield family
        finally:
            _VISIBLE.reset(token)

    def register_family(self, family: Family, *, replace: bool = False) -> list[Substitution]:
        if not isinstance(family, Family):
            raise TypeError(f"register_family() takes a Family, not {type(family).__name__}")
        self.ensure_loaded()
        with self._lock:
            existing = self._families.get(family.name)
            if existing is not None and not replace and existing != family:
                raise SubstitutionError(
                    f"a family named {family.name!r} is already registered; pass replace=True"
                )
            derived = [
                sub for backend in self._backends.values() for sub in backend.substitutions(family)
            ]
            self._check_free(derived, replace)
            self._families[family.name] = family
            for sub in derived:
                self._registered.pop(sub.name, None)
                self._removed.discard(sub.name)
            self._changed()
            return derived

    def unregister_family(self, name: str) -> Family:
        self.ensure_loaded()
        with self._lock:
            family = self.get_family(name)
            for sub_name in [k for k, sub in self._registered.items() if sub.family == family.name]:
                del self._registered[sub_name]
            self._removed.difference_update(
                {n for n in self._removed if n.startswith(f"{family.name}.")}
            )
            del self._families[family.name]
            self._changed()
            return family

    # --- backends -----------------------------------------------------------------------

    def backends(self) -> dict[str, Backend]:
        self.ensure_loaded()
        return dict(self._backends)

    def get_backend(self, name: str | Backend) -> Backend:
        if isinstance(name, Backend):
            return name
        self.ensure_loaded()
        try:
            return self._backends[name]
        except KeyError:
            raise UnknownBackendError(
                f"no backend named {name!r}{_suggest(name, self._backends)}"
            ) from None

    def backend_of(self, sub: Substitution) -> Backend | None:
        self.ensure_loaded()
        with self._lock:
            return next((b for b in self._backends.values() if sub.backend in b.names()), None)

    def register_backend(self, backend: Backend, *, replace: bool = False) -> list[Offer]:
        if not self._add_backend_lazily(backend, replace=replace):
            return []
        with self._lock:
            found = [
                offer
                for family in self._families.values()
                for offer in self._offers_of(family, backend)
                if offer.name not in self._removed and offer.name not in self._registered
            ]
        return sorted(found, key=lambda offer: offer.name)

    def _add_backend_lazily(self, backend: Backend, *, replace: bool) -> bool:
        """Register ``backend`` without deriving anything; ``False`` when it already was."""
        if not isinstance(backend, Backend):
            raise TypeError(f"register_backend() takes a Backend, not {type(backend).__name__}")
        if not re.fullmatch(r"[\w\-]+", backend.name):
            raise SubstitutionError(
                f"backend name {backend.name!r} must be letters, digits, '_' and '-' (no '.')"
            )
        self.ensure_loaded()
        with self._lock:
            existing = self._backends.get(backend.name)
            if existing is not None and existing != backend and not replace:
                raise SubstitutionError(
                    f"a different backend is already registered as {backend.name!r}; "
                    "pass replace=True to replace it"
                )
            self._check_names(backend)
            stale = set(existing.names()) if existing is not None else set()
            # a registered substitution under a name the backend derives must be the same one
            derived = [
                sub
                for family in self._families.values()
                for sub in self._registered_clashes(backend, family)
            ]
            self._check_free([sub for sub in derived if sub.backend not in stale], replace)
            for name in [key for key, sub in self._registered.items() if sub.backend in stale]:
                del self._registered[name]
            for sub in derived:
                self._registered.pop(sub.name, None)
            self._removed.difference_update(
                {n for n in self._removed if n.rpartition(".")[2] in stale}
            )
            self._backends[backend.name] = backend
            self._changed()
            return existing is None or existing != backend or replace

    def _check_names(self, backend: Backend) -> None:
        """Refuse a backend naming substitutions another backend names already."""
        taken = {
            name: other.name
            for other in self._backends.values()
            if other.name != backend.name
            for name in other.names()
        }
        clash = sorted(set(backend.names()) & set(taken))
        if clash:
            raise SubstitutionError(
                f"backend {backend.name!r} would name substitutions {clash[0]!r}, which the "
                f"{taken[clash[0]]!r} backend names already"
            )

    def _registered_clashes(self, backend: Backend, family: Family) -> list[Substitution]:
        """``backend``'s substitutions for ``family`` whose names are registered one by one
        (made only for those names)."""
        names = {
            f"{family.name}.{slot}.{name}" for slot in backend.slots for name in backend.names()
        }
        if not names & set(self._registered):
            return []
        return [sub for sub in backend.substitutions(family) if sub.name in self._registered]

    def unregister_backend(self, name: str) -> Backend:
        self.ensure_loaded()
        with self._lock:
            backend = self.get_backend(name)
            names = set(backend.names())
            for sub_name in [k for k, sub in self._registered.items() if sub.backend in names]:
                del self._registered[sub_name]
            self._removed.difference_update(
                {n for n in self._removed if n.rpartition(".")[2] in names}
            )
            del self._backends[backend.name]
            self._changed()
            return backend

    def _check_free(self, subs: list[Substitution], replace: bool) -> None:
        """Refuse (changing nothing) to overwrite a different substitution without ``replace``."""
        if replace:
            return
        for sub in subs:
            existing = self._registered.get(sub.name)
            if existing is not None and existing != sub:
                raise SubstitutionError(
                    f"a different substitution is already registered as {sub.name!r}; "
                    "pass replace=True to replace it"
                )

    # --- substitutions ------------------------------------------------------------------

    def register(self, sub: Substitution, *, replace: bool = False) -> Substitution:
        if not isinstance(sub, Substitution):
            raise TypeError(f"register() takes a Substitution, not {type(sub).__name__}")
        if not re.fullmatch(r"[\w.\-]+", sub.name):
            raise SubstitutionError(
                f"substitution name {sub.name!r} must be letters, digits, '_', '-' and '.'"
            )
        self.ensure_loaded()
        with self._lock:
            existing = self._existing(sub.name)
            if existing is not None and existing != sub and not replace:
                raise SubstitutionError(
                    f"a different substitution is already registered as {sub.name!r}; "
                    "pass replace=True to replace it"
                )
            self._registered[sub.name] = sub
            self._removed.discard(sub.name)
        return self.resolved(sub)

    def unregister(self, name: str) -> Substitution:
        self.ensure_loaded()
        with self._lock:
            existing = self._existing(name)
            if existing is None:
                raise UnknownSubstitutionError(
                    f"no substitution named {name!r}{_suggest(name, self._all_offers())}"
                )
            self._registered.pop(name, None)
            if self._derivable(name) is not None:
                self._removed.add(name)
            self._made.pop(name, None)
            return existing

    def _family_for(self, name: str, slot: str) -> Family | None:
        """The family ``name`` as ``slot`` takes it: a registered one, or, for a slot that
        takes any model type (:func:`~layerswap.slots.takes_any_model_type`), the bare
        family of that model type (made once)."""
        found = self.family(name)
        if found is not None or not takes_any_model_type(slot):
            return found
        if name not in self._bare:
            from layerswap.model_types import bare_family

            try:
                self._bare[name] = bare_family(name)
            except UnsupportedFamilyError:
                self._bare[name] = None
        return self._bare[name]

    def bare_families_with(self, causal_lm_suffix: str) -> list[Family]:
        """The bare families (:meth:`_family_for`) of the model types no family is
        registered for whose causal-LM class name ends ``causal_lm_suffix``'s name: where
        a per-family class named for one of them is found (``FusedOPTForCausalLM``)."""
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        found = []
        with self._lock:
            for model_type, class_name in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items():
                if not causal_lm_suffix.endswith(str(class_name)) or self.family(model_type):
                    continue
                family = self._family_for(model_type, "head")
                if family is not None:
                    found.append(family)
        # where model types share a causal LM (GPT-SW3's is GPT-2's, Llama 4's its text
        # model's), the one its config class names first
        return sorted(found, key=lambda f: f.causal_lm_class().config_class.model_type != f.name)

    def parts_of(self, sub: Substitution) -> Parts:
        """What ``sub``'s names stand for: its family (one this thread sees) and slot;
        :class:`UnknownSubstitutionError` for a family nobody registered."""
        with self._lock:
            family = self._family_for(sub.family, sub.slot)
        if family is None:
            family = self.get_family(sub.family)  # raises, naming the families there are
        return Parts(family, get_slot(sub.slot))

    def resolved(self, sub: Substitution) -> Substitution:
        """``sub``, holding its parts (resolved now where it holds none, or other ones
        than its names say: the family or slot was changed, or registered anew)."""
        parts = sub.resolution()
        if (
            parts is None
            or parts.family is not self._family_for(sub.family, sub.slot)
            or parts.slot.name != sub.slot
        ):
            return sub.bound(self.parts_of(sub))
        return sub

    def get(self, name: str | Substitution) -> Substitution:
        if isinstance(name, Substitution):
            self.ensure_loaded()
            return self.resolved(name)
        if not isinstance(name, str):
            raise TypeError(f"get() takes a name or a Substitution, not {type(name).__name__}")
        self.ensure_loaded()
        with self._lock:
            found = self._existing(name)
            if found is not None:
                return found
            refused = self._refusal(name)
            if refused is not None:
                raise UnknownSubstitutionError(f"no substitution named {name!r}: {refused}")
            raise UnknownSubstitutionError(
                f"no substitution named {name!r}{_suggest(name, self._all_offers())}"
            )

    def _refusal(self, name: str) -> str | None:
        """Why ``<family>.<slot>.<backend>`` cannot be made when its family, slot and
        backend are registered: the installed transformers lacks the family, or the
        backend refuses that family's slot (its own reason)."""
        if name in self._removed:
            return None
        found = self._derivable(name)
        if found is None:
            return self._through_another(name)
        family, backend, slot, _ = found
        absence = family.absence()
        if absence is not None:
            return absence
        reason = self._refused(backend, family, slot)
        if reason is None:
            return None
        return f"the {backend.name} backend does not express {family.name}'s {slot}: {reason}"

    def _through_another(self, name: str) -> str | None:
        """Why ``<model type>.<slot>.<backend>`` names nothing where its model type has no
        causal LM, for a slot that takes any model type (``None``: not such a name)."""
        model_type, _, rest = name.partition(".")
        slot, _, backend = rest.partition(".")
        if self.family(model_type) is not None or not takes_any_model_type(slot):
            return None
        from layerswap.model_types import no_causal_lm

        return no_causal_lm(model_type, f"{slot}.{backend}", self._existing)

    def substitutions(
        self, family: str | None = None, backend: str | None = None, slot: str | None = None
    ) -> list[Substitution]:
        found = self.offers(family=family, backend=backend, slot=slot)
        with self._lock:
            made = [self._existing(offer.name) for offer in found]
        return [sub for sub in made if sub is not None]


#: the registry the module's functions act on
REGISTRY = Registry()
# a substitution made outside the registry finds its parts here when first asked
resolve_parts_with(REGISTRY.parts_of)
