"""The class-swapping slots (``norm``, ``mlp``, ``experts``, ``qkv``, ``rotary``) as a declaration names them: the backend's
replacement, by name.

The replacement (a :class:`~layerswap.backends.class_swap.ClassReplacement`) says what it
computes; the slot asks each of a model's candidate modules what it computes by running it
(:mod:`layerswap.norms`, :mod:`layerswap.mlps`, :mod:`layerswap.experts`). A family is refused when no candidate of
its tiny model is one the backend computes (asked once per transformers release, as the
head's refusal is, and not while a ``use()`` of the family's module is live: a tiny model
built then would be that use()'s); a user's model with none is refused when swapped, with
each module's reason.
"""

from __future__ import annotations

from layerswap import verdicts
from layerswap.backend import Implementation, Lazy
from layerswap.family import Family
from layerswap.patching import active_patches

__all__ = ["class_slot", "experts_slot", "mlp_slot", "norm_slot", "qkv_slot", "rotary_slot"]


def class_slot(slot: str, replacement: str, *, description: str) -> Implementation:
    """The class-swapping slot ``slot`` whose replacement is ``replacement``
    (``"module:Class"``)."""

    def named(family: Family) -> str:
        return replacement

    def refusal(family: Family) -> str | None:
        if _built_in_use(family.module):
            # a tiny model built now would hold what that use() builds, not the family's own
            # modules: the swap or the build reads the model itself (its plan refuses a
            # model with nothing to swap, naming each module's reason)
            return None
        compute = Lazy(f"layerswap.slots.{slot}:read_refusal")
        return verdicts.remembered(
            slot,
            f"{replacement}|{family.module}:{family.causal_lm}",
            lambda: compute(family, replacement),
            module=family.module,
        )

    return Implementation(
        replacement=named,
        converter=Lazy("layerswap.backends.head:no_conversion"),
        description=description,
        supports=refusal,
        upstream=Lazy("layerswap.slots.class_swap:check_class_structure"),
    )


def _built_in_use(module: str) -> bool:
    """Whether a ``use()`` of a substitution whose original lives in the modeling module
    ``module`` is live (in any thread: it patches that module's classes)."""
    for info in active_patches():
        original = getattr(getattr(info.patch, "substitution", None), "original", None)
        if isinstance(original, str) and original.partition(":")[0] == module:
            return True
    return False


def norm_slot(replacement: str, *, description: str) -> Implementation:
    """The ``norm`` slot whose replacement is ``replacement`` (``"module:Class"``)."""
    return class_slot("norm", replacement, description=description)


def mlp_slot(replacement: str, *, description: str) -> Implementation:
    """The ``mlp`` slot whose replacement is ``replacement`` (``"module:Class"``)."""
    return class_slot("mlp", replacement, description=description)


def experts_slot(replacement: str, *, description: str) -> Implementation:
    """The ``experts`` slot whose replacement is ``replacement`` (``"module:Class"``)."""
    return class_slot("experts", replacement, description=description)


def qkv_slot(replacement: str, *, description: str) -> Implementation:
    """The ``qkv`` slot whose replacement is ``replacement`` (``"module:Class"``)."""
    return class_slot("qkv", replacement, description=description)


def rotary_slot(replacement: str, *, description: str) -> Implementation:
    """The ``rotary`` slot whose replacement is ``replacement`` (``"module:Class"``)."""
    return class_slot("rotary", replacement, description=description)
