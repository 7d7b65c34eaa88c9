"""A substitution: family x slot x backend, as data, and the upstream checks.

A :class:`Substitution` names an original (a decoder layer, or a causal LM for the
``head`` slot), its replacement, the weight layout converter between them, a
requirement check, an upstream-structure check, and the context its forward runs in.
The registry derives them from families x backends (:mod:`layerswap.backend`); other
packages add theirs through the entry-point group ``layerswap.substitutions``.

Example::

    sub = layerswap.get("llama.decoder.fused")
    mine = dataclasses.replace(sub, name="llama.decoder.mine", replacement=MyLayer)
    layerswap.register(mine)
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from contextlib import AbstractContextManager, ExitStack
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeAlias

import torch

from layerswap.errors import (
    ConversionError,
    RequirementError,
    SubstitutionError,
    UpstreamDriftError,
)
from layerswap.family import Family, resolve, transformers_version
from layerswap.weights import LayoutConverter, is_extra_state

if TYPE_CHECKING:
    from transformers import PreTrainedConfig

    from layerswap.backend import Variant

__all__ = [
    "SLOTS",
    "Substitution",
    "UpstreamCheck",
    "check_signature",
    "check_structure",
    "original_of",
    "runs_anywhere",
]

#: what a substitution can replace: every decoder layer, or the causal LM's head and loss
SLOTS = ("decoder", "head")

UpstreamCheck: TypeAlias = "Callable[[Substitution, PreTrainedConfig], None]"


def original_of(family: Family, slot: str) -> str:
    """``"module:Class"`` of what ``slot`` replaces in ``family``.

    Example::

        original_of(layerswap.get_family("llama"), "head")
        # "transformers.models.llama.modeling_llama:LlamaForCausalLM"
    """
    if slot == "decoder":
        return f"{family.module}:{family.decoder}"
    if slot == "head":
        return f"{family.module}:{family.causal_lm}"
    raise SubstitutionError(f"unknown slot {slot!r}; slots are {', '.join(SLOTS)}")


def runs_anywhere(*args: Any, **options: Any) -> str | None:
    """The default requirement: none (runs anywhere)."""
    return None


def check_signature(sub: Substitution, config: PreTrainedConfig) -> None:
    """The original layer still takes ``position_embeddings`` (the transformers 5 contract)."""
    original = sub.original_class()
    parameters = inspect.signature(original.forward).parameters
    if "position_embeddings" not in parameters:
        raise UpstreamDriftError(
            f"{sub.family}: {original.__name__}.forward in transformers "
            f"{transformers_version()} no longer takes position_embeddings "
            f"(it takes {list(parameters)}); {sub.name} follows the older contract"
        )


def check_structure(sub: Substitution, config: PreTrainedConfig) -> None:
    """The original layer's tensors are those the converter maps onto the replacement's.

    Builds both layers for ``config`` on the meta device (no memory, no init), runs
    the converter over the original's tensors, and compares names and shapes with
    the replacement's; then converts back. Raises :class:`UpstreamDriftError`
    naming the family, what differs and the transformers version.
    """
    check_signature(sub, config)
    version = transformers_version()
    original_cls = sub.original_class()
    where = f"{sub.family}: {original_cls.__name__} in transformers {version}"
    with torch.device("meta"):
        original = original_cls(config, 0)
    original_state = original.state_dict()
    try:
        converted = sub.converter.to_replacement(original_state, config)
    except ConversionError as exc:
        raise UpstreamDriftError(
            f"{where} does not have the structure {sub.name} assumes: {exc}"
        ) from exc
    try:
        with torch.device("meta"):
            replacement = sub.replacement_class()(config, 0)
    except RequirementError:
        raise
    except Exception:
        # some replacements cannot be built on the meta device; the converter check stands
        return
    expected = {
        key: tuple(value.shape)
        for key, value in replacement.state_dict().items()
        if not is_extra_state(key)
    }
    produced = {key: tuple(value.shape) for key, value in converted.items()}
    problems = []
    for key in sorted(set(produced) - set(expected)):
        problems.append(f"{key!r} {produced[key]} has no place in the replacement")
    for key in sorted(set(expected) - set(produced)):
        problems.append(f"the replacement's {key!r} {expected[key]} gets no tensor")
    for key in sorted(set(expected) & set(produced)):
        if expected[key] != produced[key]:
            problems.append(f"{key!r} converts to {produced[key]}, replacement has {expected[key]}")
    if problems:
        raise UpstreamDriftError(
            f"{where} does not have the structure {sub.name} assumes: " + "; ".join(problems)
        )
    try:
        back = sub.converter.to_original(converted, config)
    except ConversionError as exc:
        raise UpstreamDriftError(f"{where}: {sub.name} cannot convert back: {exc}") from exc
    if {k: tuple(v.shape) for k, v in back.items()} != {
        k: tuple(v.shape) for k, v in original_state.items()
    }:
        raise UpstreamDriftError(
            f"{where}: {sub.name} does not convert back to the original layout"
        )


@dataclass(frozen=True)
class Substitution:
    """One reversible layer substitution, as data. Derive variants with ``dataclasses.replace``.

    ``converter`` maps one decoder layer's state dict (layer-relative keys) between
    the original and the replacement layout, both ways. ``requirement()`` returns a
    human reason when the replacement cannot run here, else ``None``. ``upstream``
    checks that the installed transformers still has the structure the converter
    assumes (:func:`check_structure` by default).

    Example::

        sub = layerswap.get("llama.decoder.fused")
        mine = dataclasses.replace(sub, name="llama.decoder.mine", replacement=MyLayer)
        layerswap.register(mine)
    """

    name: str
    family: str
    backend: str
    original: str
    replacement: type[torch.nn.Module] | str
    converter: LayoutConverter
    requirement: Callable[[], str | None] = runs_anywhere
    upstream: UpstreamCheck | None = check_structure
    description: str = ""
    #: what it replaces: ``"decoder"`` (every decoder layer) or ``"head"`` (the causal LM's
    #: head and loss, a class swap of the model: :mod:`layerswap.heads`)
    slot: str = "decoder"
    #: what the slot's forward runs in during verification (the head's fused loss in
    #: eval mode), ``None``: nothing
    context: Callable[[], AbstractContextManager[Any]] | None = None
    #: the backend's variant these layers run in (TransformerEngine's FP8), if any
    variant: Variant | None = None

    def unmet_requirement(self) -> str | None:
        """Why this substitution cannot run here, or ``None`` when it can."""
        reason = self.requirement()
        if reason is None and self.variant is not None:
            reason = self.variant.unmet_requirement()
        return reason

    def forward_context(self) -> AbstractContextManager[Any]:
        """What the swapped model's forward passes run in: the slot's and the variant's contexts.

        Example::

            sub = layerswap.get("llama.decoder.te_fp8")
            with layerswap.swap(model, sub), sub.forward_context():
                logits = model(input_ids).logits
        """
        stack = ExitStack()
        if self.context is not None:
            stack.enter_context(self.context())
        if self.variant is not None:
            stack.enter_context(self.variant.forward_context())
        return stack

    @property
    def precision(self) -> str | None:
        """What the layers compute in when it is not the parameters' dtype, else ``None``:
        the variant's declared precision (``"fp8"`` for ``te_fp8``), or ``"fp8"`` for a
        substitution without one whose backend or name says FP8 (``"mine_fp8"``)."""
        if self.variant is not None and self.variant.precision is not None:
            return self.variant.precision
        if any("fp8" in label.lower() for label in (self.backend, self.name)):
            return "fp8"
        return None

    def with_options(self, **options: Any) -> Substitution:
        """This substitution with its variant's options changed (``recipe="delayed"``).

        Example::

            sub = layerswap.get("llama.decoder.te_fp8").with_options(recipe="current")
        """
        if self.variant is None:
            raise SubstitutionError(f"{self.name} has no variant, so no options to set")
        return dataclasses.replace(self, variant=self.variant.with_options(**options))

    def original_class(self) -> type[torch.nn.Module]:
        """The original layer class; :class:`UpstreamDriftError` if transformers lost it."""
        try:
            return resolve(self.original)  # type: ignore[no-any-return]
        except (ImportError, AttributeError) as exc:
            raise UpstreamDriftError(
                f"{self.family}: {self.original} cannot be found in transformers "
                f"{transformers_version()} ({exc}); {self.name} needs it"
            ) from exc

    def replacement_class(self) -> type[torch.nn.Module]:
        """The replacement layer class; :class:`RequirementError` if it cannot run here."""
        reason = self.unmet_requirement()
        if reason is not None:
            raise RequirementError(f"{self.name} cannot run here: {reason}")
        if not isinstance(self.replacement, str):
            return self.replacement
        try:
            return resolve(self.replacement)  # type: ignore[no-any-return]
        except (ImportError, AttributeError) as exc:
            raise RequirementError(
                f"{self.name} cannot run here: {self.replacement} cannot be imported ({exc})"
            ) from exc

    def check_upstream(self, config: PreTrainedConfig) -> None:
        """Raise :class:`UpstreamDriftError` if the original no longer fits the converter."""
        if self.upstream is None:
            check_signature(self, config)
        else:
            self.upstream(self, config)

    def __str__(self) -> str:
        return self.name
