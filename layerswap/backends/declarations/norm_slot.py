"""The ``norm`` slot as a declaration names it: the backend's norm replacement, by name.

The replacement (:class:`~layerswap.backends.norm.NormReplacement`) says which kinds of
norm it computes; the slot asks each of a model's norms what it computes by running it
(:mod:`layerswap.norms`). A family is refused when no norm of its tiny model is one the
backend computes (asked once per transformers release, as the head's refusal is); a
user's model with none is refused when swapped, with each norm's reason.
"""

from __future__ import annotations

from layerswap import verdicts
from layerswap.backend import Implementation, Lazy
from layerswap.family import Family

__all__ = ["norm_slot"]


def norm_slot(replacement: str, *, description: str) -> Implementation:
    """The ``norm`` slot whose replacement is ``replacement`` (``"module:Class"``)."""

    def named(family: Family) -> str:
        return replacement

    def refusal(family: Family) -> str | None:
        compute = Lazy("layerswap.slots.norm:read_norm_refusal")
        return verdicts.remembered(
            "norm",
            f"{replacement}|{family.module}:{family.causal_lm}",
            lambda: compute(family, replacement),
            module=family.module,
        )

    return Implementation(
        replacement=named,
        converter=Lazy("layerswap.backends.head:no_conversion"),
        description=description,
        supports=refusal,
        upstream=Lazy("layerswap.slots.norm:check_norm_structure"),
    )
