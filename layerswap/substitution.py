"""A substitution: family x slot x backend, as data; the slot it fills, the handle its
swap returns, and the upstream checks.

A :class:`Substitution` names an original (a decoder layer, a norm, or a causal LM for the
``head`` slot), its replacement, the weight converter, a requirement check, an
upstream-structure check and the context its forward runs in. The registry derives them
from families x backends (:mod:`layerswap.backend`); other packages add theirs through the
entry-point group ``layerswap.substitutions``. The declarations that name each other live
here together (:class:`Slot`, :class:`SwapHandle`, :class:`Variant`); the slot registry
and the slots themselves are in :mod:`layerswap.slots`.

Example::

    sub = layerswap.get("llama.decoder.fused")
    mine = dataclasses.replace(sub, name="llama.decoder.mine", replacement=MyLayer)
    layerswap.register(mine)
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import importlib
import warnings
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, ExitStack
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeAlias

from layerswap.errors import (
    ConversionError,
    RequirementError,
    SubstitutionError,
    UpstreamDriftError,
)
from layerswap.family import Family, resolve
from layerswap.versions import transformers_version

if TYPE_CHECKING:
    from types import TracebackType

    import torch
    from torch import nn
    from transformers import PreTrainedConfig

    from layerswap.config_view import ModelConfig
    from layerswap.patching import Scoped
    from layerswap.placement import Placement
    from layerswap.weights import LayoutConverter

__all__ = [
    "UNPROVEN_TENSOR_PARALLEL",
    "ModelParts",
    "Parts",
    "Slot",
    "Substitution",
    "SwapHandle",
    "UpstreamCheck",
    "Variant",
    "check_call_contract",
    "check_signature",
    "check_structure",
    "runs_anywhere",
]

#: the reason a substitution nobody declared sharded is refused under tensor parallelism
UNPROVEN_TENSOR_PARALLEL = (
    "its layers are not proven under transformers' tensor parallelism (the backend does "
    "not declare them so)"
)

UpstreamCheck: TypeAlias = "Callable[[Substitution, PreTrainedConfig], None]"


def runs_anywhere(*args: Any, **options: Any) -> str | None:
    """The default requirement: none (runs anywhere)."""
    return None


def check_call_contract(sub: Substitution, config: PreTrainedConfig | None = None) -> None:
    """The original layer is called with nothing the replacement does not handle.

    Every parameter of the original layer's ``forward`` (with ``config``, its attention's
    where the replacement computes attention) must be one the replacement handles, and the
    original must take ``position_embeddings``: a new or renamed one (5.24's ``cache``)
    raises :class:`UpstreamDriftError` naming it, before any model is touched.

    Example::

        check_call_contract(layerswap.get("llama.decoder.fused"), config)
    """
    from layerswap import hf_internals

    version = transformers_version()
    supported, why = hf_internals.transformers_support(version)
    if not supported:
        raise UpstreamDriftError(f"{sub.name}: transformers {version} is {why}")
    sub.parts.slot.check_call(sub, config)


#: the earlier name of :func:`check_call_contract`
check_signature = check_call_contract


def check_structure(sub: Substitution, config: PreTrainedConfig) -> None:
    """The original layer's tensors are those the converter maps onto the replacement's.

    Builds both layers for ``config`` on the meta device (no memory, no init), runs
    the converter over the original's tensors, and compares names and shapes with
    the replacement's; then converts back. Raises :class:`UpstreamDriftError`
    naming the family, what differs and the transformers version.
    """
    import torch

    from layerswap.weights import layout_problems

    check_call_contract(sub, config)
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
    problems = layout_problems(converted, replacement.state_dict())
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
class Variant:
    """The same layers and weights, run another way: a forward context and its requirement.

    Its substitutions are named ``<family>.<slot>.<backend>_<name>``. ``context(**options)``
    is what the swapped model's forward passes run in (``te.fp8_autocast``),
    ``requirement(**options)`` why it cannot run here; ``options`` are the defaults a
    substitution can change with :meth:`Substitution.with_options`. ``precision`` names
    the default verification tolerance (``"fp8"``) when it is not the parameters' dtype.

    Example::

        sub = layerswap.get("llama.decoder.te_fp8").with_options(recipe="delayed")
    """

    name: str
    context: Callable[..., AbstractContextManager[Any]]
    requirement: Callable[..., str | None] = runs_anywhere
    options: Mapping[str, Any] = field(default_factory=dict)
    precision: str | None = None
    slots: tuple[str, ...] = ("decoder",)
    description: str = ""

    def forward_context(self) -> AbstractContextManager[Any]:
        """The context its forward passes run in, with its options."""
        return self.context(**self.options)

    def unmet_requirement(self) -> str | None:
        """Why it cannot run here with its options, or ``None``."""
        return self.requirement(**self.options)

    def with_options(self, **options: Any) -> Variant:
        """The variant with ``options`` changed; unknown option names raise."""
        unknown = sorted(set(options) - set(self.options))
        if unknown:
            raise SubstitutionError(
                f"variant {self.name!r} has no option {', '.join(map(repr, unknown))} "
                f"(its options: {', '.join(map(repr, self.options)) or 'none'})"
            )
        return dataclasses.replace(self, options={**self.options, **options})


@dataclass(frozen=True)
class ModelParts:
    """A model as coverage describes it: its decoder layers and the rest, as readable text."""

    model: Any  # the causal LM, built on the meta device
    family: Family
    layers: list[tuple[str, Any]]  # (qualified name, module) per decoder layer
    layers_text: str  # "model.layers.0-3 (LlamaDecoderLayer)"
    outside: tuple[str, ...]  # the modules outside the layers that hold tensors


class Slot:
    """One kind of model part a substitution replaces; subclasses say how.

    Every method takes the substitution it acts for; the slot holds no state of its own.
    """

    #: the slot's name, the middle part of ``<family>.<slot>.<backend>``
    name: str = ""
    #: what it replaces, in a few words (``layerswap list``)
    description: str = ""
    #: whether a substitution of this slot is compared with its original at first use on
    #: a transformers release (:func:`layerswap.proof.ensure_proven`; :meth:`proves`)
    proven_at_first_use: bool = False
    #: whether a substitution of this slot puts a layer of its own in each decoder layer's
    #: place (its weights converted layer by layer): its gradients are mapped back to the
    #: original layout, and :func:`layerswap.verify` can compare it layer by layer while
    #: streaming
    replaces_layers: bool = False
    #: whether its substitutions may name any causal-LM model type, not only a family
    takes_any_model_type: bool = False

    def original(self, family: Family) -> str:
        """``"module:Class"`` of what this slot replaces in ``family``."""
        raise NotImplementedError

    def swap(self, model: Any, sub: Substitution) -> SwapHandle:
        """Put ``sub`` into the built ``model`` (of ``sub``'s family), reversibly."""
        raise NotImplementedError

    def rebuild_originals(self, model: Any, sub: Substitution) -> int:
        """Put originals holding the converted weights where ``sub``'s parts are; how many."""
        raise NotImplementedError

    def construction(self, sub: Substitution) -> list[Scoped]:
        """The patches :func:`layerswap.use` starts so that models are built with ``sub``."""
        raise NotImplementedError

    def held(self, model: Any) -> list[tuple[str, str]]:
        """(qualified name, substitution name) of each module of ``model`` a live swap of
        this slot holds in an original's place, whose undo takes what another swap changed
        inside it along (default: none; the decoder slot's replacement layers)."""
        return []

    def swapped_by(self, model: Any) -> str | None:
        """The name of the substitution of this slot ``model`` runs, ``None`` for the original."""
        raise NotImplementedError

    def prepare(
        self,
        sub: Substitution,
        config: PreTrainedConfig | ModelConfig,
        placement: Placement | None = None,
    ) -> None:
        """Everything checked before ``sub`` changes a model of ``config``, in order: the
        call contract and structure (:meth:`Substitution.check_upstream`), then the slot's
        own (the decoder slot: the first-use proof, in the model's ``placement``). Raises;
        changes nothing."""
        sub.check_upstream(config)

    def proves(self, sub: Substitution) -> bool:
        """Whether ``sub`` is proven at first use (:attr:`proven_at_first_use`)."""
        return self.proven_at_first_use

    def proof_context(self, sub: Substitution) -> Callable[[], AbstractContextManager[Any]]:
        """What the proof's swapped copy computes its loss in (the head: its fused loss)."""
        return contextlib.nullcontext

    def proof_watch(self, sub: Substitution) -> Callable[[], str | None] | None:
        """Asked as a proof starts: a function the proof calls once its checks pass, saying
        why its swapped copy changed nothing (``None``: it did), or ``None`` where this
        slot's swaps cannot be idle (the ``rotary`` slot: a config that selects another
        rotary function leaves its kernel uncalled)."""
        return None

    def proof_reference(self, model: Any, sub: Substitution, config: PreTrainedConfig) -> None:
        """Originals in this slot's place in ``model``, the proof's causal LM of ``config``
        (built inside a :func:`layerswap.use`, it holds replacements; default:
        :meth:`rebuild_originals`; not asked where it :attr:`replaces_layers`)."""
        self.rebuild_originals(model, sub)

    def proof_candidate(self, reference: Any, sub: Substitution, config: PreTrainedConfig) -> Any:
        """A copy of the proof's ``reference`` (a causal LM of ``config``) with ``sub`` in
        place, holding the reference's weights (default: :meth:`swap` of a deep copy; not
        asked where it :attr:`replaces_layers`: the layers are converted)."""
        candidate = copy.deepcopy(reference)
        self.swap(candidate, sub)
        return candidate

    def check_call(self, sub: Substitution, config: PreTrainedConfig | None) -> None:
        """Raise :class:`~layerswap.errors.UpstreamDriftError` when transformers calls the
        original with something the replacement does not handle (default: nothing to check)."""

    def coverage(self, parts: ModelParts) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """(what a substitution of this slot replaces, what stays the original's)."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<Slot {self.name}>"


class SwapHandle:
    """A swap in effect: what was swapped, and the way back.

    ``undo()`` puts the originals back; a second ``undo()`` does nothing. As a context
    manager the swap is undone on exit, on any exception too.

    Example::

        with layerswap.swap(model, backend="fused") as handle:
            print(handle.report())
    """

    model: nn.Module
    substitution: Substitution
    _active: bool

    @property
    def active(self) -> bool:
        """Whether the swap is still in effect."""
        return self._active

    @property
    def swapped(self) -> list[tuple[str, type[nn.Module], type[nn.Module]]]:
        """(qualified module name, original class, replacement class) per swapped module."""
        raise NotImplementedError

    def undo(self) -> None:
        """Put the originals back (a no-op when already undone)."""
        raise NotImplementedError

    def report(self) -> str:
        """A readable summary: the substitution and what it swapped."""
        raise NotImplementedError

    def original_code(self) -> AbstractContextManager[Any]:
        """A context inside which the original code runs while the swap stays in effect.

        A swap of a model's own parts changes no code another model runs: nothing to do
        (the default). A swap that changes shared code (an adopted patch function,
        :mod:`layerswap.slots.patch`) takes it back inside, so that a reference model runs
        the original beside the swapped one.
        """
        return contextlib.nullcontext()

    def release(self) -> None:
        """The swapped model is let go without being needed again (the working copy a
        comparison swapped): take back what the swap changed beyond it. A swap of a
        model's own parts changed nothing beyond it (the default: nothing is done, the
        copy goes with its swap); a patch of shared code is undone."""

    def __iter__(self) -> Iterator[tuple[str, type[nn.Module], type[nn.Module]]]:
        return iter(self.swapped)

    def __len__(self) -> int:
        return len(self.swapped)

    def __enter__(self) -> SwapHandle:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.undo()


@dataclass(frozen=True)
class Parts:
    """What a substitution's names stand for: its family and its slot. The registry
    resolves them once (:meth:`Substitution.bound`); everything below takes them from
    here (what it needs of its backend, the substitution holds as data: its requirement,
    devices, variant, tensor-parallel reason)."""

    family: Family
    slot: Slot


#: how a substitution nobody resolved yet finds its parts: the registry's, given when it
#: loads (:func:`resolve_parts_with`), so that nothing here imports the registry
_RESOLVE_PARTS: Callable[[Substitution], Parts] | None = None


def resolve_parts_with(resolver: Callable[[Substitution], Parts]) -> None:
    """Where :attr:`Substitution.parts` resolves a substitution the registry has not seen
    (one made with ``dataclasses.replace`` and used at once): the registry's resolver."""
    global _RESOLVE_PARTS
    _RESOLVE_PARTS = resolver


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
    #: what it replaces: ``"decoder"`` (every decoder layer), ``"head"`` (the causal LM's
    #: head and loss, a class swap of the model: :mod:`layerswap.slots.head`) or
    #: ``"patch"`` (what an adopted patch function rebinds: :mod:`layerswap.slots.patch`)
    slot: str = "decoder"
    #: what the slot's forward runs in during verification (the head's fused loss in
    #: eval mode), ``None``: nothing
    context: Callable[[], AbstractContextManager[Any]] | None = None
    #: the backend's variant these layers run in (TransformerEngine's FP8), if any
    variant: Variant | None = None
    #: why transformers' tensor parallelism may not shard these layers (its plan,
    #: translated by :mod:`layerswap.parallel`), or ``None`` when it may: proven only
    #: for layers tested sharded, so refused unless the backend declares otherwise
    tensor_parallel: str | None = UNPROVEN_TENSOR_PARALLEL
    #: the device types its layers run on (its backend's ``devices``)
    devices: tuple[str, ...] = ("cpu", "cuda")
    #: what the names stand for, and the classes, resolved once (not compared, not copied
    #: by ``dataclasses.replace``: a changed substitution is resolved again)
    _parts: Parts | None = field(default=None, init=False, compare=False, repr=False)
    _classes: dict[str, type[torch.nn.Module]] = field(
        default_factory=dict, init=False, compare=False, repr=False
    )

    def bound(self, parts: Parts) -> Substitution:
        """This substitution, holding ``parts`` (the registry's resolution of its names)."""
        object.__setattr__(self, "_parts", parts)
        return self

    def resolution(self) -> Parts | None:
        """Its parts where they are resolved already, else ``None`` (nothing is looked up)."""
        return self._parts

    @property
    def parts(self) -> Parts:
        """Its family, slot and backend, as objects (resolved once, by the registry).

        Example::

            sub = layerswap.get("llama.decoder.fused")
            sub.parts.family.decoder, sub.parts.slot.name   # ("LlamaDecoderLayer", "decoder")
        """
        parts = self._parts
        if parts is None:
            if _RESOLVE_PARTS is None:
                raise SubstitutionError(
                    f"{self.name} is not resolved, and the registry has not loaded: pass it "
                    "through layerswap.get() first (swap, use and verify do)"
                )
            parts = _RESOLVE_PARTS(self)
            object.__setattr__(self, "_parts", parts)
        return parts

    def unmet_requirement(self) -> str | None:
        """Why this substitution cannot run here, or ``None`` when it can."""
        reason = self.requirement()
        if reason is None and self.variant is not None:
            reason = self.variant.unmet_requirement()
        return reason

    def forward_context(self) -> AbstractContextManager[Any]:
        """What the swapped model's forward passes run in: the slot's and the variant's
        contexts (``with layerswap.swap(model, sub), sub.forward_context(): model(ids)``)."""
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
        changed = dataclasses.replace(self, variant=self.variant.with_options(**options))
        return changed if self._parts is None else changed.bound(self._parts)

    def original_class(self) -> type[torch.nn.Module]:
        """The original layer class (found once); :class:`UpstreamDriftError` if
        transformers lost it."""
        return self._found("original")

    def replacement_class(self) -> type[torch.nn.Module]:
        """The replacement layer class; :class:`RequirementError` if it cannot run here."""
        return self.classes()[1]

    def classes(self) -> tuple[type[torch.nn.Module], type[torch.nn.Module]]:
        """``(original, replacement)``, each found once: :class:`RequirementError` if the
        replacement cannot run here, :class:`UpstreamDriftError` if transformers lost the
        original.

        Example::

            original, replacement = layerswap.get("llama.decoder.fused").classes()
        """
        reason = self.unmet_requirement()
        if reason is not None:
            raise RequirementError(f"{self.name} cannot run here: {reason}")
        replacement, original = (self._found(role) for role in ("replacement", "original"))
        return original, replacement

    def _found(self, role: str) -> type[torch.nn.Module]:
        spec = self.original if role == "original" else self.replacement
        if not isinstance(spec, str):
            return spec
        found = self._classes.get(role)
        if found is None:
            try:
                found = resolve(spec)
            except (ImportError, AttributeError) as exc:
                if role == "original":
                    raise UpstreamDriftError(
                        f"{self.family}: {spec} cannot be found in transformers "
                        f"{transformers_version()} ({exc}); {self.name} needs it"
                    ) from exc
                raise RequirementError(
                    f"{self.name} cannot run here: {spec} cannot be imported ({exc})"
                ) from exc
            self._classes[role] = found
        return found  # type: ignore[no-any-return]

    def check_upstream(self, config: PreTrainedConfig) -> None:
        """Raise :class:`UpstreamDriftError` if the original no longer fits the converter
        (``config``: the model's; a multimodal wrapper's layers read its text config)."""
        from layerswap import hf_internals, zero3

        config = hf_internals.text_config_of(config)
        # the probe layers are built whole, even inside deepspeed.zero.Init
        with zero3.outside_partitioning():
            if self.upstream is None:
                check_call_contract(self, config)
            else:
                self.upstream(self, config)

    def __str__(self) -> str:
        return self.name


#: names this module had before they moved: (module now, why)
_MOVED = {
    "original_of": "layerswap.backend",
    "check_layer_call": "layerswap.slots.layer_call",
    "call_parameters": "layerswap.slots.layer_call",
    "handled_parameters": "layerswap.slots.layer_call",
}


def __getattr__(name: str) -> Any:
    # a name that moved is still found here, with a warning naming where it lives now
    # (imported by name when asked: those modules sit above this one)
    moved = _MOVED.get(name)
    if moved is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn(
        f"layerswap.substitution.{name} moved to {moved}.{name}; import it from there",
        DeprecationWarning,
        stacklevel=2,
    )
    return getattr(importlib.import_module(moved), name)
