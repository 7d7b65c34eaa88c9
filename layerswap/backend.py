"""What a backend is: a declaration, like a family.

A :class:`Backend` names, per slot (``decoder``, ``head``), the implementation it puts
there for a family (an :class:`Implementation`: the replacement class, the weight
converter, the upstream check, which families it supports), the requirement it has on
this machine, what it needs installed, where it runs, and its :class:`Variant` s (the
same layers run another way, e.g. TransformerEngine's FP8: a forward context). The
registry (:mod:`layerswap.registry`) derives every ``<family>.<slot>.<backend>``
substitution from families x backends; nothing else names a backend.

Example: a backend of your own (one module, see ``docs/substitutions.md``)::

    from layerswap import Backend, Implementation, register_backend
    from layerswap.weights import Converter

    BACKEND = Backend(
        name="mine",
        description="my decoder layer",
        slots={"decoder": Implementation(replacement=lambda family: MyLayer,
                                         converter=lambda family: Converter())},
    )
    register_backend(BACKEND)     # or the entry point group "layerswap.backends"
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from layerswap.errors import SubstitutionError, UnsupportedFamilyError
from layerswap.family import Family
from layerswap.slots import get_slot, slot_names
from layerswap.substitution import (
    UNPROVEN_TENSOR_PARALLEL,
    Parts,
    Substitution,
    UpstreamCheck,
    Variant,
    check_structure,
    runs_anywhere,
)

if TYPE_CHECKING:
    import torch

    from layerswap.weights import LayoutConverter

__all__ = [
    "Backend",
    "Dependency",
    "Implementation",
    "Lazy",
    "Variant",
    "every_family",
    "original_of",
]


@dataclass(frozen=True)
class Lazy:
    """A function named ``"module:function"``, imported when first called.

    A declaration names its layers, converters and contexts this way, so that reading it
    (``layerswap list``, the registry) imports neither torch nor transformers nor the
    layers; two declarations naming the same function are equal.

    Example::

        Implementation(replacement=Lazy("my_pkg.layers:layer_class"),
                       converter=Lazy("my_pkg.layers:converter_for"))
    """

    target: str

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module, _, name = self.target.partition(":")
        return getattr(importlib.import_module(module), name)(*args, **kwargs)


def original_of(family: Family, slot: str) -> str:
    """``"module:Class"`` of what ``slot`` replaces in ``family``.

    Example::

        original_of(layerswap.get_family("llama"), "head")
        # "transformers.models.llama.modeling_llama:LlamaForCausalLM"
    """
    return get_slot(slot).original(family)


def every_family(family: Family) -> str | None:
    """The default ``supports`` check: every family (no reason to refuse one)."""
    return None


@dataclass(frozen=True)
class Implementation:
    """What a backend puts in one slot, as a function of the family.

    ``replacement(family)`` is the class (or a lazy ``"module:Class"``) and
    ``converter(family)`` the weight layout converter between the original's and the
    replacement's state dicts; ``supports(family)`` returns why the backend cannot
    express a family (``None`` when it can); ``upstream`` checks that the installed
    transformers still has the structure the converter assumes; ``context`` is what the
    slot's forward runs in during verification (``None``: nothing).
    """

    replacement: Callable[[Family], type[torch.nn.Module] | str]
    converter: Callable[[Family], LayoutConverter]
    description: str = ""
    supports: Callable[[Family], str | None] = every_family
    upstream: UpstreamCheck | None = check_structure
    context: Callable[[], AbstractContextManager[Any]] | None = None


@dataclass(frozen=True)
class Dependency:
    """A package a backend needs, as ``layerswap doctor`` reports it."""

    label: str
    module: str
    distribution: str
    install: str


@dataclass(frozen=True)
class Backend:
    """A backend, declared: its implementation per slot, requirement, dependencies, variants.

    ``requirement()`` says why none of its substitutions can run here (``None`` when
    they can); ``devices`` are the device types its layers run on; ``dependencies``
    what ``layerswap doctor`` looks for. Derive one with :func:`dataclasses.replace`.

    Example::

        te = layerswap.get_backend("te")
        te.unsupported(layerswap.get_family("olmo2"))   # "TransformerEngine ... across heads"
        [s.name for s in te.substitutions(layerswap.get_family("llama"))]
        # ['llama.decoder.te', 'llama.decoder.te_fp8']
    """

    name: str
    slots: Mapping[str, Implementation]
    description: str = ""
    requirement: Callable[[], str | None] = runs_anywhere
    devices: tuple[str, ...] = ("cpu", "cuda")
    dependencies: tuple[Dependency, ...] = ()
    variants: tuple[Variant, ...] = ()
    #: why transformers' tensor parallelism may not shard its layers, ``None`` when it
    #: may (declared by a backend whose layers are tested sharded)
    tensor_parallel: str | None = UNPROVEN_TENSOR_PARALLEL

    def __post_init__(self) -> None:
        known = slot_names()
        unknown = sorted(set(self.slots) - set(known))
        if unknown:
            raise SubstitutionError(
                f"backend {self.name!r} declares unknown slots {unknown}; slots are {known}"
            )
        for variant in self.variants:
            missing = sorted(set(variant.slots) - set(self.slots))
            if missing:
                raise SubstitutionError(
                    f"backend {self.name!r}: variant {variant.name!r} names slots {missing} "
                    "the backend does not implement"
                )

    def names(self) -> tuple[str, ...]:
        """The backend names its substitutions carry: its own and one per variant."""
        return (self.name, *(f"{self.name}_{variant.name}" for variant in self.variants))

    def unsupported(self, family: Family, slot: str = "decoder") -> str | None:
        """Why this backend has no ``slot`` implementation for ``family``, or ``None``."""
        implementation = self.slots.get(slot)
        if implementation is None:
            return f"the {self.name} backend has no {slot} implementation"
        return implementation.supports(family)

    def substitution(
        self, family: Family, slot: str = "decoder", *, variant: str | None = None
    ) -> Substitution:
        """The ``<family>.<slot>.<backend>[_<variant>]`` substitution.

        Raises :class:`~layerswap.errors.UnsupportedFamilyError` with the reason when the
        backend cannot express the family. Example::

            get_backend("te").substitution(family, variant="fp8")
        """
        reason = self.unsupported(family, slot)
        if reason is not None:
            raise UnsupportedFamilyError(f"{family.name}.{slot}.{self.name}: {reason}")
        implementation = self.slots[slot]
        sub = Substitution(
            name=f"{family.name}.{slot}.{self.name}",
            family=family.name,
            backend=self.name,
            original=original_of(family, slot),
            replacement=implementation.replacement(family),
            converter=implementation.converter(family),
            requirement=self.requirement,
            upstream=implementation.upstream,
            description=implementation.description,
            slot=slot,
            context=implementation.context,
            tensor_parallel=self.tensor_parallel,
            devices=self.devices,
        )
        parts = Parts(family, get_slot(slot))
        if variant is None:
            return sub.bound(parts)
        chosen = next((v for v in self.variants if v.name == variant), None)
        if chosen is None or slot not in chosen.slots:
            known = [v.name for v in self.variants if slot in v.slots]
            raise SubstitutionError(
                f"the {self.name} backend has no {slot} variant {variant!r} "
                f"(its variants: {', '.join(map(repr, known)) or 'none'})"
            )
        description = chosen.description or f"{sub.description} ({chosen.name})"
        return dataclasses.replace(
            sub,
            name=f"{sub.name}_{chosen.name}",
            backend=f"{self.name}_{chosen.name}",
            description=description,
            variant=chosen,
        ).bound(parts)

    def substitutions(self, family: Family) -> list[Substitution]:
        """Every substitution this backend offers for ``family``: each supported slot, each variant."""
        found: list[Substitution] = []
        for slot in self.slots:
            if self.unsupported(family, slot) is not None:
                continue
            found.append(self.substitution(family, slot))
            found.extend(
                self.substitution(family, slot, variant=variant.name)
                for variant in self.variants
                if slot in variant.slots
            )
        return found
