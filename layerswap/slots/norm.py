"""The ``norm`` slot: every norm of a model that its own classes compute, swapped for one kernel.

A ``<model type>.norm.<backend>`` substitution takes the norms below the decoder layer:
each module of the model whose class is a norm of the model's modeling module
(:func:`~layerswap.norms.candidate_norm_classes`) and computes a kind the backend has a
kernel for (:func:`~layerswap.norms.classify`, by running a copy of it) gets a subclass of
its class whose ``forward`` is that kernel (:mod:`layerswap.backends.norm`). Nothing else
changes: parameters, names, ``state_dict``, ``save_pretrained``, PEFT targets and
optimizers see the same objects; undo sets the classes back. Norms it does not express
(a gated norm taking a second tensor, grouped norms, L2 norms) stay the original's, and
the handle's report says which and why; a model with none it expresses is refused.

It needs no decoder layer it can replace: hybrids (linear attention, Mamba, convolution
mixers), multi-head latent attention and per-layer inputs keep every module but their norms.
Any causal-LM model type of the installed transformers may be named, with or without a
registered family (``qwen3_next.norm.fused``).

Example::

    handle = layerswap.swap(model, "qwen3_next.norm.fused")
    print(handle.report())       # 11 norms swapped (Qwen3NextRMSNorm: rms_offset), 3 kept
    handle.undo()
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch import nn

from layerswap import hf_internals
from layerswap.backends.norm import NormReplacement
from layerswap.errors import SubstitutionError, SwapWarning, UpstreamDriftError
from layerswap.handle import SwapHandle
from layerswap.norms import NormSpec, candidate_norm_classes, classify
from layerswap.patching.undo import UndoLog
from layerswap.proof import ensure_proven
from layerswap.slots import ModelParts, Slot
from layerswap.versions import transformers_version

if TYPE_CHECKING:
    from transformers import PreTrainedConfig

    from layerswap.family import Family
    from layerswap.patching import Scoped
    from layerswap.substitution import Substitution

__all__ = [
    "SLOT",
    "NormPlan",
    "NormSlot",
    "NormSwapHandle",
    "check_norm_structure",
    "norm_plan",
    "read_norm_refusal",
    "spec_of",
]

_SPECS: dict[tuple[Any, ...], NormSpec | str] = {}
#: the most parameters a tiny model may have for its first-use proof to run
_TINY_LIMIT = 300_000_000
_SPECS_LOCK = threading.Lock()


def _settings(module: nn.Module) -> tuple[Any, ...]:
    """What, besides its class, decides what a norm computes: its plain attributes and
    which parameters it has (a config's ``group_size``, ``elementwise_affine``...)."""
    plain = tuple(
        sorted(
            (key, value)
            for key, value in vars(module).items()
            if not key.startswith("_")
            and key != "training"
            and isinstance(value, (int, float, str, bool, tuple, type(None)))
        )
    )
    params = tuple((name, tuple(p.shape)) for name, p in module.named_parameters())
    return (type(module), plain, params)


def spec_of(module: nn.Module) -> NormSpec | str:
    """:func:`~layerswap.norms.classify` of ``module``, asked once per class and settings."""
    key = _settings(module)
    with _SPECS_LOCK:
        known = _SPECS.get(key)
    if known is None:
        known = classify(module)
        with _SPECS_LOCK:
            _SPECS[key] = known
    return known


@dataclass
class NormPlan:
    """What a swap of ``sub`` does to one model: the modules it swaps, and those it keeps."""

    #: (qualified name, module, the class it gets)
    swapped: list[tuple[str, nn.Module, type[NormReplacement]]]
    #: original class name -> (how many, why it stays)
    kept: dict[str, tuple[int, str]]
    #: (qualified name, the substitution that swapped it): norms another swap holds
    taken: list[tuple[str, str]]


def norm_plan(model: nn.Module, sub: Substitution) -> NormPlan:
    """Which of ``model``'s norms ``sub`` swaps (and into which class), and which stay."""
    replacement: Any = sub.replacement_class()
    plan = NormPlan([], {}, [])
    for cls, names in candidate_norm_classes(model, sub.parts.family.module).items():
        for name in names:
            module = model.get_submodule(name)
            if isinstance(module, NormReplacement):
                plan.taken.append((name, module._layerswap_norm_of))
                continue
            spec = spec_of(module)
            if isinstance(spec, str):
                reason = spec
            elif spec.kind not in replacement.kernels:
                reason = f"it computes {spec.kind}, which the {replacement.backend} backend lacks"
            else:
                made = replacement.subclass_for(cls, spec, sub.name)
                plan.swapped.append((name, module, made))
                continue
            count, _ = plan.kept.get(cls.__name__, (0, reason))
            plan.kept[cls.__name__] = (count + 1, reason)
    return plan


def check_norm_structure(sub: Substitution, config: PreTrainedConfig) -> None:
    """The norm class ``sub`` names is still in its modeling module (what each norm
    computes is asked of the norm itself, by running it, when it is swapped)."""
    try:
        sub.original_class()
    except (ImportError, AttributeError) as exc:
        raise UpstreamDriftError(
            f"{sub.name}: transformers {transformers_version()} has no {sub.original} ({exc})"
        ) from exc


def read_norm_refusal(family: Family, replacement: str) -> str | None:
    """Why ``replacement`` (``"module:Class"``, a :class:`NormReplacement`) computes none of
    the norms of ``family``'s tiny model, built on the meta device (``None``: it computes
    at least one). The declaration asks it once per transformers release."""
    import torch

    from layerswap.family import resolve

    kernels = resolve(replacement).kernels
    try:
        with torch.device("meta"):
            model = family.causal_lm_class()(family.tiny_config())
    except Exception as exc:
        return f"its tiny model does not build here ({type(exc).__name__}: {exc})"
    size = sum(param.numel() for param in model.parameters())
    if size > _TINY_LIMIT:
        return (
            f"its tiny config builds {size / 1e6:.0f}M parameters (parts it builds at their "
            "full size): too large to prove here"
        )
    classes = candidate_norm_classes(model, family.module)
    if not classes:
        return f"its model has no norm class of {family.module} (torch's own norms are one kernel already)"
    reasons: dict[str, None] = {}
    for cls, names in classes.items():
        # one instance per setting: a class may compute another kind under other settings
        # (Qwen4-Exp's RMSNorm is grouped in its hyper-connections, plain in attention)
        for module in {_settings(m): m for m in map(model.get_submodule, names)}.values():
            spec = spec_of(module)
            if not isinstance(spec, str) and spec.kind in kernels:
                return None
            reasons[f"{cls.__name__}: " + (spec if isinstance(spec, str) else spec.kind)] = None
    return "no norm of its model is one this backend computes (" + "; ".join(reasons) + ")"


def _kept_text(plan: NormPlan) -> str:
    return "; ".join(
        f"{name} x{count} ({reason})" if count > 1 else f"{name} ({reason})"
        for name, (count, reason) in plan.kept.items()
    )


def _checked_plan(model: nn.Module, sub: Substitution) -> NormPlan:
    plan = norm_plan(model, sub)
    if plan.taken:
        name, owner = plan.taken[0]
        raise SubstitutionError(
            f"{len(plan.taken)} norms of this model are already swapped by {owner} "
            f"({name}...); undo that swap first"
        )
    if not plan.swapped:
        module = sub.parts.family.module
        raise SubstitutionError(
            f"{sub.name}: no norm of this {type(model).__name__} is one the "
            f"{sub.backend} backend computes"
            + (f": {_kept_text(plan)}" if plan.kept else f" (no norm class of {module} in it)")
        )
    return plan


class NormSwapHandle(SwapHandle):
    """A norm swap in effect; ``undo()`` sets every swapped norm's class back."""

    def __init__(
        self, model: nn.Module, substitution: Substitution, plan: NormPlan, changes: UndoLog
    ) -> None:
        self.model = model
        self.substitution = substitution
        self._rows = [(name, type(module), made) for name, module, made in plan.swapped]
        self._plan = plan
        self._changes = changes
        self._active = True

    @property
    def swapped(self) -> list[tuple[str, type[nn.Module], type[nn.Module]]]:
        """(qualified name, original class, replacement class) per swapped norm."""
        return [(name, made._layerswap_original, made) for name, _, made in self._rows]

    @property
    def kept(self) -> dict[str, tuple[int, str]]:
        """The norm classes left the original's: name -> (how many, why)."""
        return dict(self._plan.kept)

    def undo(self) -> None:
        """Put every original class back (a no-op when already undone)."""
        if not self._active:
            return
        for name, module, made in self._plan.swapped:
            if type(module) is not made:
                raise SubstitutionError(
                    f"cannot undo {self.substitution.name}: {name} is now a "
                    f"{type(module).__qualname__}, not {made.__qualname__} (changed since)"
                )
        self._changes.undo()
        self._active = False

    def report(self) -> str:
        """A readable summary: the norms swapped (per class and kind) and those kept."""
        state = "active" if self._active else "undone"
        per_class: dict[str, list[str]] = {}
        for _, _, made in self._plan.swapped:
            kinds = per_class.setdefault(made._layerswap_original.__name__, [])
            if made._layerswap_spec.kind not in kinds:
                kinds.append(made._layerswap_spec.kind)
        lines = [f"{self.substitution.name}: {len(self)} norms swapped ({state})"]
        lines += [f"  {name} -> {', '.join(kinds)}" for name, kinds in per_class.items()]
        if self._plan.kept:
            lines.append(f"  kept: {_kept_text(self._plan)}")
        return "\n".join(lines)

    def __len__(self) -> int:
        return len(self._plan.swapped)

    def __repr__(self) -> str:
        state = "active" if self._active else "undone"
        return f"<NormSwapHandle {self.substitution.name}: {len(self)} norms, {state}>"


def _apply(plan: NormPlan, changes: UndoLog) -> None:
    for _, module, made in plan.swapped:
        changes.set_class(module, made)


class NormSlot(Slot):
    """The norms a model's own classes compute: each swapped for one kernel of a backend."""

    name = "norm"
    description = "every norm of the model's own classes (RMSNorm, (1 + w) RMSNorm, LayerNorm)"
    proven_at_first_use = True
    #: a ``<model type>.norm.*`` name needs no registered family
    takes_any_model_type = True

    def original(self, family: Family) -> str:
        """The first norm class the family's modeling module names; its causal LM where it
        names none (its parts are another model's, built through an ``Auto`` class)."""
        from layerswap.errors import UnsupportedFamilyError
        from layerswap.model_types import norm_class_name

        try:
            return f"{family.module}:{norm_class_name(family.module)}"
        except UnsupportedFamilyError:
            return f"{family.module}:{family.causal_lm}"

    def swap(self, model: nn.Module, sub: Substitution) -> NormSwapHandle:
        """Swap every norm of ``model`` that ``sub``'s backend computes; refuse when none."""
        config = getattr(model, "config", None)
        if config is None:
            raise SubstitutionError(f"{type(model).__name__} has no config; swap() needs one")
        plan = _checked_plan(model, sub)
        self.prepare(sub, config)
        changes = UndoLog()
        try:
            _apply(plan, changes)
        except BaseException:
            changes.undo()
            raise
        return NormSwapHandle(model, sub, plan, changes)

    def rebuild_originals(self, model: nn.Module, sub: Substitution) -> int:
        """Give every norm ``sub`` swapped its original class back; how many."""
        rebuilt = 0
        for name, module in model.named_modules():
            if not isinstance(module, NormReplacement):
                continue
            if module._layerswap_norm_of != sub.name:
                raise SubstitutionError(
                    f"{name!r} was swapped by {module._layerswap_norm_of}, not by {sub.name}"
                )
            restored: Any = module
            restored.__class__ = module._layerswap_original
            rebuilt += 1
        return rebuilt

    def construction(self, sub: Substitution) -> list[Scoped]:
        """Every model of the family built inside the block has its norms swapped when its
        ``__init__`` finishes (``post_init``), before any weight is loaded."""
        from layerswap.patching import wrap

        module_name = sub.parts.family.module
        prepared: list[bool] = []

        def adopt(wrapped: Callable[..., Any], instance: Any, args: Any, kwargs: Any) -> Any:
            result = wrapped(*args, **kwargs)
            if type(instance).__module__ == module_name:
                plan = norm_plan(instance, sub)
                if plan.swapped:
                    if not prepared:
                        self.prepare(sub, instance.config)
                        prepared.append(True)
                    _apply(plan, UndoLog())  # kept: a built model has no handle
                elif plan.kept and not plan.taken:  # built, and nothing of it swapped
                    warnings.warn(
                        f"{sub.name}: this {type(instance).__name__} was built inside use() "
                        f"with its original norms, none of which the {sub.backend} backend "
                        f"computes: {_kept_text(plan)}",
                        SwapWarning,
                        stacklevel=2,
                    )
            return result

        return [wrap(hf_internals.POST_INIT_TARGET, adopt)]

    def swapped_by(self, model: nn.Module) -> str | None:
        for module in model.modules():
            if isinstance(module, NormReplacement):
                return module._layerswap_norm_of
        return None

    def prepare(self, sub: Substitution, config: PreTrainedConfig) -> None:
        """The structure check, then the first-use proof for ``config``."""
        super().prepare(sub, config)
        ensure_proven(sub, config)

    def coverage(self, parts: ModelParts) -> tuple[tuple[str, ...], tuple[str, ...]]:
        classes = candidate_norm_classes(parts.model, parts.family.module)
        named = ", ".join(f"{cls.__name__} x{len(names)}" for cls, names in classes.items())
        return (f"the norms ({named or 'none'})",), (parts.layers_text, *parts.outside)


SLOT = NormSlot()
