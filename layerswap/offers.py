"""What the registry offers, read without making a substitution: one :class:`Offer` per
``<family>.<slot>.<backend>[_<variant>]`` a backend declares for a family, and why it
cannot run here (``layerswap list`` reads these; no backend's layers are imported)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from layerswap.backend import Backend
from layerswap.family import Family

__all__ = ["Offer", "derived_offers"]


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


def _always(reason: str) -> Callable[[], str | None]:
    return lambda: reason


def _both(
    first: Callable[[], str | None], then: Callable[[], str | None]
) -> Callable[[], str | None]:
    def requirement() -> str | None:
        reason = first()
        return reason if reason is not None else then()

    return requirement


def derived_offers(
    family: Family, backend: Backend, absence: str | None, refused: Callable[[str], str | None]
) -> list[Offer]:
    """``backend``'s offers for ``family``. A family the installed transformers lacks
    (``absence``, its reason) is not asked of the backend, which would read its missing
    source: each slot is offered, and cannot run here for that reason."""
    offers = []
    for slot, implementation in backend.slots.items():
        name = f"{family.name}.{slot}.{backend.name}"
        if absence is None and refused(slot) is not None:
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
