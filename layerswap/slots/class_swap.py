"""Slots that swap the class of some of a model's own modules, keeping their parameters.

The ``norm`` and ``mlp`` slots work alike: each module of the model whose class is one of
the slot's candidates in the model's modeling module is asked what it computes, by running
a copy of it (the slot's ``classify``); where the backend's replacement computes that, the
module gets a subclass of its class whose ``forward`` is the backend's kernel
(:class:`~layerswap.backends.class_swap.ClassReplacement`). Nothing else changes:
parameters, names, ``state_dict``, ``save_pretrained``, PEFT targets and optimizers see the
same objects; undo sets the classes back. Modules it does not express stay the original's,
and the handle's report says which and why; a model with none it expresses is refused.

A concrete slot (:class:`ClassSwapSlot`) names its candidates, its classifier and its
replacement base; everything else is here, once, but for the plan of one swap and its
handle (:mod:`layerswap.slots.class_plan`).
"""

from __future__ import annotations

import importlib
import inspect
import threading
import warnings
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from layerswap import hf_internals
from layerswap.backends.class_swap import ClassReplacement
from layerswap.config_view import ModelConfig
from layerswap.errors import SubstitutionError, SwapWarning, UpstreamDriftError
from layerswap.patching.undo import UndoLog
from layerswap.placement import Placement
from layerswap.placement_guard import guard
from layerswap.proof import ensure_proven
from layerswap.slots import ModelParts, Slot, get_slot, rolling_back, slot_names, undo_first
from layerswap.slots.class_plan import SWAP_LOCK, ClassPlan, ClassSwapHandle, kept_text
from layerswap.trials import not_built
from layerswap.versions import transformers_version

if TYPE_CHECKING:
    from transformers import PreTrainedConfig

    from layerswap.family import Family
    from layerswap.patching import Scoped
    from layerswap.substitution import Substitution

__all__ = [
    "ClassPlan",
    "ClassSwapHandle",
    "ClassSwapSlot",
    "check_class_structure",
    "instance_forward",
    "settings",
    "tiny_on_meta",
]

#: what each module computes, asked once per classifier, class and settings
_SPECS: dict[tuple[Any, ...], Any] = {}
_SPECS_LOCK = threading.Lock()
#: the most parameters a tiny model may have for its first-use proof to run
_TINY_LIMIT = 300_000_000
#: tiny models built on the meta device, the most recent first asked of again
_TINY_MODELS: OrderedDict[tuple[str, ...], Any] = OrderedDict()
_TINY_KEPT = 2


def settings(module: nn.Module) -> tuple[Any, ...]:
    """What, besides its class, decides what a module computes: its plain attributes and
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
    children = tuple((name, type(child)) for name, child in module.named_children())
    return (type(module), plain, params, children)


def tiny_on_meta(family: Family) -> Any:
    """``family``'s tiny model built on the meta device, or what building it raised; the
    last few are kept, since every class-swapping slot and backend asks of the same one."""
    key = (family.module, family.causal_lm, family.config_class, repr(family.tiny))
    with _SPECS_LOCK:
        if key in _TINY_MODELS:
            _TINY_MODELS.move_to_end(key)
            return _TINY_MODELS[key]
    built: Any
    try:
        with torch.device("meta"):
            built = family.causal_lm_class()(family.tiny_config())
    except Exception as exc:
        built = exc
    with _SPECS_LOCK:
        _TINY_MODELS[key] = built
        while len(_TINY_MODELS) > _TINY_KEPT:
            _TINY_MODELS.popitem(last=False)
    return built


def _proof_roots(model: nn.Module, family: Family) -> list[str]:
    """The names of ``model``'s transformers models of ``family``'s modeling module (``""``
    for ``model`` itself): what the first-use proof builds, from the same config, and runs.
    A module below none of them (a wrapper's vision tower or projector) it never runs."""
    from transformers import PreTrainedModel

    return [
        name
        for name, module in model.named_modules()
        if isinstance(module, PreTrainedModel)
        and getattr(type(module), "_layerswap_original", type(module)).__module__ == family.module
    ]


def _outside(name: str, roots: list[str]) -> bool:
    return not any(root == "" or name == root or name.startswith(root + ".") for root in roots)


def check_class_structure(sub: Substitution, config: PreTrainedConfig) -> None:
    """The class ``sub`` names is still in its modeling module (what each module computes
    is asked of the module itself, by running it, when it is swapped)."""
    try:
        sub.original_class()
    except (ImportError, AttributeError) as exc:
        raise UpstreamDriftError(
            f"{sub.name}: transformers {transformers_version()} has no {sub.original} ({exc})"
        ) from exc


def _keep_parametrized(
    model: nn.Module, candidates: dict[type, list[str]], plan: ClassPlan
) -> None:
    """Count among the kept modules those of a candidate class that
    ``torch.nn.utils.parametrize`` gave a class of its own (they are no candidates: their
    class is parametrize's, and they hold its modules): the report says they stay."""
    from torch.nn.utils import parametrize

    for _, module in model.named_modules():
        if not parametrize.is_parametrized(module):
            continue
        base = type(module).__bases__[0]
        if base in candidates:
            count, _ = plan.kept.get(base.__name__, (0, ""))
            plan.kept[base.__name__] = (
                count + 1,
                "parametrized (torch.nn.utils.parametrize): remove its parametrizations to swap it",
            )


def instance_forward(module: nn.Module) -> str | None:
    """Why a class swap would not reach ``module``'s computation: a ``forward`` set on the
    instance (accelerate's hooks: ``dispatch_model``, a ``device_map`` that offloads; a
    library's expert parallelism) runs whatever class the module has. ``None``: none is."""
    if "forward" not in vars(module):
        return None
    hooked = " (an accelerate hook)" if hasattr(module, "_hf_hook") else ""
    return (
        f"its forward is set on the instance{hooked}, so a new class would not run; swap "
        "before dispatching or offloading the model"
    )


def _other_class_swap(module: nn.Module, slot: ClassSwapSlot) -> str | None:
    """Why ``module`` stays: another slot's class swap holds it (the ``qkv`` and ``rotary``
    slots both give an attention a class of their own; one class cannot be both)."""
    if not isinstance(module, ClassReplacement):
        return None
    return (
        f"{module._layerswap_swapped_by} gave it a class of its own, and the {slot.name} slot "
        f"would give it another: undo {module._layerswap_swapped_by} to take {slot.name}"
    )


def _apply(plan: ClassPlan, changes: UndoLog) -> None:
    for _, module, made in plan.swapped:
        changes.set_class(module, made)
        swapped: Any = module
        swapped._layerswap_attach(changes)


def _lost_on_undo(model: nn.Module, slot: ClassSwapSlot, plan: ClassPlan) -> str | None:
    """Why ``plan`` would swap a module inside one that another slot's live swap holds
    (a decoder swap's replacement layer, whose mixture-of-experts block it built anew from
    the original's classes), else ``None``: that swap's undo would take the module out of
    the model, leaving this swap's handle active over nothing."""
    held = [
        place for name in slot_names() if name != slot.name for place in get_slot(name).held(model)
    ]
    for name, _, _ in plan.swapped:
        for place, owner in held:
            if name.startswith(f"{place}."):
                return (
                    f"{name} is inside {place}, which {owner} swapped: its undo gives the "
                    f"original layers back, taking this swap's {slot.plural} with them; undo "
                    f"{owner} first and swap the {slot.plural} alone, or build the model "
                    "inside use() of both"
                )
    return None


def _decoder_overlap(model: nn.Module, slot: ClassSwapSlot, plan: ClassPlan) -> str | None:
    """Why ``slot`` finds nothing of the model's own to swap where its decoder layers are a
    decoder substitution's (which computes its own norms and MLPs), else ``None``."""
    if plan.kept or plan.taken:
        return None
    decoder = get_slot("decoder").swapped_by(model)
    if decoder is None:
        return None
    return (
        f"this model's decoder layers are {decoder}'s, which compute their own "
        f"{slot.plural}: no {slot.noun} of the model's own classes is left in them to swap "
        f"(undo {decoder} first, or take the {slot.name} slot alone)"
    )


class ClassSwapSlot(Slot):
    """A slot that swaps the class of the model's own modules of one kind (its norms, its
    MLPs), each for a backend's kernel; subclasses name the kind."""

    proven_at_first_use = True
    #: a ``<model type>.<slot>.<backend>`` name needs no registered family
    takes_any_model_type = True
    #: what one swapped module is called, and many (``"norm"``, ``"norms"``)
    noun: ClassVar[str] = ""
    plural: ClassVar[str] = ""
    #: the base of every backend's replacement of this slot
    replacement_base: ClassVar[type[ClassReplacement]] = ClassReplacement
    #: the handle a swap returns
    handle_class: ClassVar[type[ClassSwapHandle]] = ClassSwapHandle

    # --- what a subclass says -------------------------------------------------------------

    def candidates(self, model: nn.Module, module_name: str) -> dict[type, list[str]]:
        """The candidate classes of ``model`` (of the modeling module ``module_name``), with
        the names of their instances, in the order they first appear."""
        raise NotImplementedError

    def classify(self, module: nn.Module) -> Any:
        """What ``module`` computes (a spec with a ``kind``), or why none is expressed."""
        raise NotImplementedError

    def spec_label(self, spec: Any) -> str:
        """How a report names what a module computes."""
        return str(spec.kind)

    # --- shared ---------------------------------------------------------------------------

    def spec_of(self, module: nn.Module) -> Any:
        """:meth:`classify` of ``module``, asked once per class and settings."""
        return self._memo((type(self), *settings(module)), module)

    def _memo(self, key: tuple[Any, ...], module: nn.Module) -> Any:
        """:meth:`classify` of ``module``, kept under ``key``."""
        with _SPECS_LOCK:
            known = _SPECS.get(key)
        if known is None:
            known = self.classify(module)
            with _SPECS_LOCK:
                _SPECS[key] = known
        return known

    def plan(self, model: nn.Module, sub: Substitution) -> ClassPlan:
        """Which of ``model``'s modules ``sub`` swaps (and into which class), and which stay."""
        replacement: Any = sub.replacement_class()
        family = sub.parts.family
        plan = ClassPlan([], {}, [])
        roots: list[str] | None = None
        candidates = self.candidates(model, family.module)
        for cls, names in candidates.items():
            for name in names:
                module = model.get_submodule(name)
                if isinstance(module, self.replacement_base):
                    plan.taken.append((name, module._layerswap_swapped_by))
                    continue
                clash = _other_class_swap(module, self)
                if clash is not None:
                    plan.clashing.append((name, clash))
                reason = instance_forward(module) or clash
                if cls.__module__ != family.module:
                    # another model's class: swapped only where the proof's model holds it
                    roots = _proof_roots(model, family) if roots is None else roots
                    if _outside(name, roots):
                        reason = (
                            f"not in the {family.causal_lm} the first-use proof builds and "
                            "runs, so not proven here"
                        )
                if reason is None:
                    spec = self.spec_of(module)
                    reason = spec if isinstance(spec, str) else replacement.refusal(spec)
                if reason is None:
                    made = replacement.subclass_for(cls, spec, sub.name)
                    plan.swapped.append((name, module, made))
                    continue
                count, _ = plan.kept.get(cls.__name__, (0, reason))
                plan.kept[cls.__name__] = (count + 1, reason)
        _keep_parametrized(model, candidates, plan)
        return plan

    def read_refusal(self, family: Family, replacement: str) -> str | None:
        """Why ``replacement`` (``"module:Class"``) computes none of the candidates of
        ``family``'s tiny model, built on the meta device (``None``: it computes at least
        one). A declaration asks it once per transformers release."""
        from layerswap.family import resolve

        made: Any = resolve(replacement)
        model = tiny_on_meta(family)
        if isinstance(model, Exception):
            return not_built(model)
        size = sum(param.numel() for param in model.parameters())
        if size > _TINY_LIMIT:
            return (
                f"its tiny config builds {size / 1e6:.0f}M parameters (parts it builds at "
                "their full size): too large to prove here"
            )
        classes = self.candidates(model, family.module)
        if not classes:
            return self.none_found(family)
        reasons: dict[str, None] = {}
        for cls, names in classes.items():
            # one instance per setting: a class may compute another kind under other
            # settings (Qwen4-Exp's RMSNorm is grouped in its hyper-connections only)
            for module in {settings(m): m for m in map(model.get_submodule, names)}.values():
                spec = self.spec_of(module)
                reason = spec if isinstance(spec, str) else made.refusal(spec)
                if reason is None:
                    return None
                reasons[f"{cls.__name__}: {reason}"] = None
        return (
            f"no {self.noun} of its model is one this backend computes (" + "; ".join(reasons) + ")"
        )

    def none_found(self, family: Family) -> str:
        """Why a model with no candidate class is refused."""
        return f"its model has no {self.noun} class of {family.module}"

    def _checked_plan(self, model: nn.Module, sub: Substitution) -> ClassPlan:
        plan = self.plan(model, sub)
        if plan.taken:
            name, owner = plan.taken[0]
            raise SubstitutionError(
                f"{len(plan.taken)} {self.plural} of this model are already swapped by "
                f"{owner} ({name}...); {undo_first(owner)}"
            )
        lost = _lost_on_undo(model, self, plan)
        if lost is not None:
            raise SubstitutionError(f"{sub.name}: {lost}")
        if not plan.swapped:
            module = sub.parts.family.module
            overlap = _decoder_overlap(model, self, plan)
            if overlap is not None:
                raise SubstitutionError(f"{sub.name}: {overlap}")
            raise SubstitutionError(
                f"{sub.name}: no {self.noun} of this {type(model).__name__} is one the "
                f"{sub.backend} backend computes"
                + (
                    f": {kept_text(plan)}"
                    if plan.kept
                    else f" (no {self.noun} class of {module} in it)"
                )
            )
        return plan

    def swap(self, model: nn.Module, sub: Substitution) -> ClassSwapHandle:
        """Swap every module of ``model`` that ``sub``'s backend computes; refuse when none."""
        config = getattr(model, "config", None)
        if config is None:
            raise SubstitutionError(f"{type(model).__name__} has no config; swap() needs one")
        view = ModelConfig.of(config)  # unwrapped here, once: every step below is handed it
        with SWAP_LOCK:  # refused before the proof runs; never seeing a swap half-applied
            self._checked_plan(model, sub)
        with view.current():  # prepare is handed the config itself, unwrapped already
            self.prepare(sub, config, Placement.of(model))
        # planned again and applied as one step: two threads swapping one model cannot
        # both find it unswapped
        with SWAP_LOCK:
            plan = self._checked_plan(model, sub)
            with rolling_back(sub.name) as changes:
                changes.record(guard(model, sub, view, proven=True))
                _apply(plan, changes)
        return self.handle_class(model, sub, plan, changes, self)

    def rebuild_originals(self, model: nn.Module, sub: Substitution) -> int:
        """Give every module ``sub`` swapped its original class back; how many."""
        rebuilt = 0
        for name, module in model.named_modules():
            if not isinstance(module, self.replacement_base):
                continue
            if module._layerswap_swapped_by != sub.name:
                raise SubstitutionError(
                    f"{name!r} was swapped by {module._layerswap_swapped_by}, not by {sub.name}"
                )
            module._layerswap_detach()
            restored: Any = module
            restored.__class__ = module._layerswap_original
            rebuilt += 1
        return rebuilt

    def construction(self, sub: Substitution) -> list[Scoped]:
        """Every model of the family built inside the block has its modules swapped when
        its ``__init__`` finishes (``post_init``), before any weight is loaded."""
        from layerswap.patching import wrap

        module_name = sub.parts.family.module
        prepared: list[bool] = []

        def adopt(wrapped: Callable[..., Any], instance: Any, args: Any, kwargs: Any) -> Any:
            result = wrapped(*args, **kwargs)
            if type(instance).__module__ == module_name:
                plan = self.plan(instance, sub)
                if plan.clashing:  # the two requests overlap: refused
                    name, why = plan.clashing[0]
                    raise SubstitutionError(f"{sub.name} inside use(): {name}: {why}")
                if plan.swapped:
                    if not prepared:
                        self.prepare(sub, instance.config, Placement.of(instance))
                        prepared.append(True)
                    _apply(plan, UndoLog())  # kept: a built model has no handle
                    guard(instance, sub, instance.config, proven=False)
                elif not plan.taken:  # built, and nothing of it swapped
                    overlap = _decoder_overlap(instance, self, plan)
                    if overlap is not None:  # the two requests overlap: refused
                        raise SubstitutionError(f"{sub.name} inside use(): {overlap}")
                    # said of the outermost model (a base model built inside its causal
                    # LM, a tower inside its wrapper, is answered for by the whole)
                    if not hf_internals.built_inside_another(instance):
                        why = (
                            f"its original {self.plural}, none of which the {sub.backend} "
                            f"backend computes: {kept_text(plan)}"
                            if plan.kept
                            else f"no {self.noun} of {module_name} in it: use() changed nothing"
                        )
                        warnings.warn(
                            f"{sub.name}: this {type(instance).__name__} was built inside "
                            f"use() with {why}",
                            SwapWarning,
                            stacklevel=2,
                        )
            return result

        return [wrap(hf_internals.POST_INIT_TARGET, adopt)]

    def first_class(self, family: Family, matches: Callable[[str, type], bool]) -> str:
        """``"module:Class"`` of the first ``nn.Module`` class the family's modeling module
        holds for which ``matches(name, cls)``; its causal LM where none does."""
        module = importlib.import_module(family.module)
        for name, value in vars(module).items():
            if inspect.isclass(value) and issubclass(value, nn.Module) and matches(name, value):
                return f"{family.module}:{name}"
        return f"{family.module}:{family.causal_lm}"

    def first_attention_class(self, family: Family) -> str:
        """``"module:Class"`` of the first attention class the family's modeling module
        defines (the ``qkv`` and ``rotary`` slots' original); its causal LM where none."""
        from layerswap.projections import is_attention_class

        return self.first_class(
            family,
            lambda _, cls: (
                cls.__module__ == family.module and is_attention_class(cls, family.module)
            ),
        )

    def swapped_by(self, model: nn.Module) -> str | None:
        for module in model.modules():
            if isinstance(module, self.replacement_base):
                return module._layerswap_swapped_by
        return None

    def prepare(
        self,
        sub: Substitution,
        config: PreTrainedConfig,
        placement: Placement | None = None,
    ) -> None:
        """The structure check, then the first-use proof for ``config`` (in the model's
        ``placement``: its dtype too where it is bfloat16 or float16)."""
        view = ModelConfig.of(config)  # a swap's, unwrapped already
        super().prepare(sub, view)
        ensure_proven(sub, view, placement)

    def coverage(self, parts: ModelParts) -> tuple[tuple[str, ...], tuple[str, ...]]:
        classes = self.candidates(parts.model, parts.family.module)
        named = ", ".join(f"{cls.__name__} x{len(names)}" for cls, names in classes.items())
        return (f"the {self.plural} ({named or 'none'})",), (parts.layers_text, *parts.outside)
