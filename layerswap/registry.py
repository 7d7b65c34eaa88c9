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
from typing import TYPE_CHECKING

from layerswap.backends import per_family
from layerswap.catalog import REGISTRY, Offer, Registry
from layerswap.plugins import BACKEND_ENTRY_POINT_GROUP, ENTRY_POINT_GROUP

if TYPE_CHECKING:
    from layerswap.backend import Backend
    from layerswap.family import Family
    from layerswap.substitution import Substitution

__all__ = [
    "BACKEND_ENTRY_POINT_GROUP",
    "ENTRY_POINT_GROUP",
    "REGISTRY",
    "Offer",
    "Registry",
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


# --- the module's functions: the registry's, documented ------------------------------


def families() -> dict[str, Family]:
    """All known families by name (builtin ones and those added by :func:`register_family`)."""
    return REGISTRY.families()


def get_family(name: str | Family) -> Family:
    """The family called ``name``; unknown names raise :class:`UnknownSubstitutionError`."""
    return REGISTRY.get_family(name)


def visible(family: Family) -> contextlib.AbstractContextManager[Family]:
    """Inside the block, ``family`` is known to this thread (and the tasks it starts) as if
    registered; no other thread sees it, and nothing is left behind. Inference proves a
    family it infers this way before anyone may register it.

    Example::

        with layerswap.registry.visible(candidate):
            report = layerswap.verify(candidate.build(), backend.substitution(candidate))
    """
    return REGISTRY.visible(family)


def register_family(family: Family, *, replace: bool = False) -> list[Substitution]:
    """Add a family; every registered backend's substitutions for it are derived from now.

    Returns the substitutions it gets. Example::

        register_family(Family(name="ministral", model_type="ministral", ...))
        layerswap.swap(model, backend="fused")
    """
    return REGISTRY.register_family(family, replace=replace)


def unregister_family(name: str) -> Family:
    """Remove the family called ``name`` and every substitution registered for it.

    Example::

        unregister_family("ministral")
    """
    return REGISTRY.unregister_family(name)


def backends() -> dict[str, Backend]:
    """All registered backends by name (builtin, entry points, :func:`register_backend`).

    Example::

        sorted(layerswap.backends())     # ['fused', 'liger', 'te']
    """
    return REGISTRY.backends()


def get_backend(name: str | Backend) -> Backend:
    """The backend called ``name``; unknown names raise :class:`UnknownBackendError`
    (a :class:`LookupError`) naming the closest ones.

    Example::

        layerswap.get_backend("te").unsupported(layerswap.get_family("olmo2"))
    """
    return REGISTRY.get_backend(name)


def backend_of(sub: Substitution) -> Backend | None:
    """The registered backend ``sub`` comes from (its variants included), or ``None``.

    Example::

        backend_of(layerswap.get("llama.decoder.te_fp8")).name    # "te"
    """
    return REGISTRY.backend_of(sub)


def register_backend(backend: Backend, *, replace: bool = False) -> list[Offer]:
    """Add a backend: it offers its substitutions for every registered family it supports
    (families registered later too), each derived when first asked for.

    Returns what it offers, read without making any (:func:`offers`): no family's classes
    are touched, so a family the installed transformers lacks fails only a substitution
    asked for by name. Example::

        layerswap.register_backend(MY_BACKEND)
        layerswap.get("llama.decoder.mine")
    """
    return REGISTRY.register_backend(backend, replace=replace)


def unregister_backend(name: str) -> Backend:
    """Remove the backend called ``name`` and every substitution derived from it.

    Example::

        layerswap.unregister_backend("mine")
    """
    return REGISTRY.unregister_backend(name)


def register(sub: Substitution, *, replace: bool = False) -> Substitution:
    """Add ``sub`` to the registry under ``sub.name`` and return it.

    Registering a different substitution under a taken name raises
    :class:`SubstitutionError` unless ``replace=True``. Example::

        layerswap.register(dataclasses.replace(layerswap.get("llama.decoder.fused"),
                                               name="llama.decoder.mine", replacement=MyLayer))
    """
    return REGISTRY.register(sub, replace=replace)


def unregister(name: str) -> Substitution:
    """Remove a substitution from the registry and return it."""
    return REGISTRY.unregister(name)


def get(name: str | Substitution) -> Substitution:
    """The registered substitution called ``name`` (a :class:`Substitution` is returned as is).

    Made when first asked for: only the family's own modeling module is imported. Unknown
    names raise :class:`UnknownSubstitutionError` listing the closest names. Example::

        sub = layerswap.get("llama.decoder.fused")
    """
    return REGISTRY.get(name)


def substitutions(
    family: str | None = None, backend: str | None = None, slot: str | None = None
) -> list[Substitution]:
    """Registered substitutions, sorted by name, optionally filtered by family, backend, slot.

    Each is made when listed (its layers imported); :func:`offers` lists them without.
    Example::

        [s.name for s in layerswap.substitutions(backend="fused", slot="head")]
    """
    return REGISTRY.substitutions(family, backend, slot)


def offers(
    family: str | None = None, backend: str | None = None, slot: str | None = None
) -> list[Offer]:
    """What :func:`substitutions` lists, without making any: no layer is imported.

    Example::

        [(o.name, o.unmet_requirement()) for o in layerswap.registry.offers(family="llama")]
    """
    return REGISTRY.offers(family, backend, slot)


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
    return REGISTRY.load_entry_points()


# the backends' per-family classes named by a substitution (the head slot's) are found
# among these families: given to them here, as they import nothing above them
per_family.find_families_with(families, REGISTRY.bare_families_with)
