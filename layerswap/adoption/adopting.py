"""``layerswap.adopt``: another library's patch function, made scoped, reversible and proven.

Liger-Kernel's ``apply_liger_kernel_to_llama``, transformers' ``kernelize``, a training
repository's hand-written patch: each changes transformers in place and keeps no way back.
``adopt`` runs such a function recording every change it makes
(:mod:`layerswap.adoption.record`), proves that the patched code computes what the original
does on a tiny model of the family (:mod:`layerswap.adoption.proving`), and hands back an
:class:`Adoption`: a context manager whose exit, or ``undo()``, puts every module, class
and instance back as it was, object for object.

Example::

    with layerswap.adopt(apply_liger_kernel_to_llama, rope=True, swiglu=True):
        model = LlamaForCausalLM.from_pretrained(path)
    # modeling_llama is as before; the model keeps Liger's modules
"""

from __future__ import annotations

import copy
import itertools
import os
import warnings
from collections.abc import Callable
from contextlib import AbstractContextManager
from types import TracebackType
from typing import TYPE_CHECKING, Any

import torch

from layerswap.adoption.proving import check_patch, family_for, tiny_config
from layerswap.adoption.record import Recording, exclusive, record
from layerswap.adoption.verifying import verify_adopted
from layerswap.errors import AdoptionError, SwapWarning
from layerswap.hf_internals import torch_dtype_of
from layerswap.model import family_of, layer_config
from layerswap.patching.scoped import caller_outside
from layerswap.placement import Placement, autocast_dtype

if TYPE_CHECKING:
    from torch import nn
    from transformers import PreTrainedConfig

    from layerswap.adoption.changes import Change
    from layerswap.comparison.inputs import InputsLike
    from layerswap.comparison.report import VerificationReport
    from layerswap.comparison.tolerance import Tolerance
    from layerswap.family import Family

__all__ = ["Adoption", "adopt"]


class Adoption:
    """A patch function's changes, in effect until :meth:`undo` (or the ``with`` block's
    end).

    ``report()`` lists every change (where, and what happened there); ``proven`` names the
    family whose tiny model the patch was proven on (``None``: not proven); ``result`` is
    what the function returned.
    """

    def __init__(
        self, recording: Recording, result: Any, proven: str | None, checks: tuple[str, ...]
    ) -> None:
        self._recording = recording
        self.result = result
        self.proven = proven
        self.checks = checks
        self._active = True
        self._unproven_by_choice = False  # prove=False (set by adopt)
        #: ``file:line in function`` of the code that adopted it
        self.origin = _caller()
        self._sequence = next(_SEQUENCE)
        _LIVE[id(self)] = self

    @property
    def name(self) -> str:
        """The patch function's qualified name."""
        return self._recording.name

    @property
    def active(self) -> bool:
        """Whether the changes are still in effect."""
        return self._active

    @property
    def changes(self) -> list[str]:
        """One line per change the function made."""
        return self._recording.report()

    @property
    def records(self) -> tuple[Change, ...]:
        """The changes themselves (:mod:`layerswap.adoption.changes`), oldest first: where,
        what happened there, and the objects before and after."""
        return tuple(self._recording.changes)

    def suspended(self) -> AbstractContextManager[None]:
        """A context inside which the original code runs: the changes taken back on entry,
        made again on exit (the adoption stays in effect around it).

        Example::

            with adoption.suspended():
                reference = model(input_ids).logits     # the code before the patch
        """
        if not self._active:
            raise AdoptionError(f"{self.name} was undone: there is nothing to suspend")
        return self._recording.suspended()

    def verify(
        self,
        model: nn.Module,
        inputs: InputsLike = None,
        *,
        backward: bool = False,
        generate: int | None = None,
        tolerance: float | Tolerance | None = None,
    ) -> VerificationReport:
        """``model`` run with the original code and with the patched code, compared layer
        by layer as :func:`layerswap.verify` compares (:mod:`layerswap.adoption.verifying`).

        Example::

            report = adoption.verify(model, backward=True)
            assert report.passed, report.summary()
        """
        if not self._active:
            raise AdoptionError(f"{self.name} was undone: there is no patched code to verify")
        with exclusive():  # another thread's window would switch the patch off mid-pass
            return verify_adopted(
                self._recording,
                model,
                inputs,
                backward=backward,
                generate=generate,
                tolerance=tolerance,
            )

    def undo(self) -> None:
        """Put every module, class and instance the function changed back (a second call
        does nothing)."""
        if self._active:
            self._recording.undo()
            self._active = False
            _LIVE.pop(id(self), None)

    def patches(self) -> list[Any]:
        """The engine's patches behind its rebindings, while it is in effect (what
        :func:`layerswap.active_patches` lists of it)."""
        return self._recording.patches() if self._active else []

    def report(self) -> str:
        """What the function changed, and whether it was proven."""
        state = "in effect" if self._active else "undone"
        proof = (
            f"proven equal to the original on a tiny {self.proven} model ({', '.join(self.checks)})"
            if self.proven
            else "not proven (prove=False)"
            if self._unproven_by_choice
            else "not proven (no model, config or transformers family to prove it on)"
        )
        count = len(self.changes)
        lines = [f"{self.name}: {count} change{'' if count == 1 else 's'}, {state}; {proof}"]
        lines += [f"  {line}" for line in self.changes]
        return "\n".join(lines)

    def __enter__(self) -> Adoption:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.undo()

    def __repr__(self) -> str:
        state = "active" if self._active else "undone"
        return f"<Adoption {self.name} ({len(self.changes)} changes, {state})>"


#: the adoptions in effect, held until undone as their changes are (a leak guard asks
#: which a test left, and undoes one nobody holds any more)
_LIVE: dict[int, Adoption] = {}
_SEQUENCE = itertools.count()
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def live_adoptions() -> list[Adoption]:
    """The adoptions in effect, oldest first."""
    return sorted(_LIVE.values(), key=lambda adoption: adoption._sequence)


def _caller() -> str:
    """``file:line in function`` of the first frame outside layerswap."""
    file, line, function = caller_outside(_PACKAGE)
    return f"{file}:{line} in {function}"


def adopt(
    fn: Callable[..., Any],
    *args: Any,
    model: nn.Module | None = None,
    config: PreTrainedConfig | None = None,
    prove: bool | None = None,
    **kwargs: Any,
) -> Adoption:
    """Run the patch function ``fn(*args, **kwargs)`` recorded, proven and reversible.

    ``model``: passed on to ``fn`` as ``model=`` (Liger's convention), and its modules
    watched (a per-instance ``forward``, a class changed). The proof's tiny model is built
    from ``config``, else ``model.config``, else the family whose transformers modeling
    module ``fn`` changed. ``prove=None`` proves where a family is found; ``True``
    requires it (:class:`~layerswap.errors.AdoptionError` where none is); ``False`` skips it.

    Raises, with every change taken back: the function's own exception;
    :class:`~layerswap.errors.NoChangeError` (it changed nothing layerswap records);
    :class:`~layerswap.errors.UnrecordableChangeError`;
    :class:`~layerswap.errors.PatchDivergenceError` (naming the first divergent layer);
    :class:`~layerswap.errors.RequirementError` (its kernels need CUDA).

    Example::

        handle = layerswap.adopt(apply_liger_kernel_to_llama, model=model)
        print(handle.report())
        handle.undo()
    """
    __tracebackhide__ = True
    family = _family(model, config) if prove is not False else None
    if prove and family is None and (model is not None or config is not None):
        raise AdoptionError(_no_family(model, config))
    checks: tuple[str, ...] = ()
    if model is not None:
        kwargs["model"] = model
        proven: set[tuple[str, str]] = set()
        if family is not None:
            checks, proven = _prove_on_copy(
                fn, args, kwargs, family, config or model.config, Placement.of(model)
            )
        recording, result = record(fn, args, kwargs, model=model)
        if family is not None:
            try:
                _refuse_unproven_instances(recording, model, proven)
            except BaseException:
                recording.undo()
                raise
            _warn_unproven(recording, family)
        return _made(Adoption(recording, result, family.name if family else None, checks), prove)
    recording, result = record(fn, args, kwargs)
    if family is None and prove is not False:
        family = _changed_family(recording)
        if family is None and prove:
            recording.undo()
            raise AdoptionError(
                f"{recording.name} changed no transformers modeling module layerswap knows "
                "a family of: give config= to prove it"
            )
    if family is not None:
        try:
            _refuse_unreached(recording, family)
            dtype = None if config is None else torch_dtype_of(layer_config(config))
            placement = Placement(dtype, _device(), autocast_dtype(_device()))
            checks = _prove_in_place(recording, family, config, placement)
        except BaseException:
            recording.undo()
            raise
        _warn_unproven(recording, family)
    return _made(Adoption(recording, result, family.name if family else None, checks), prove)


def _warn_unproven(recording: Recording, family: Family) -> None:
    """Say which of the changed modeling modules the proof on ``family`` did not run: a
    function patching two model types (a wrapper's and its language model's, or two
    unrelated ones) is proven on one model, the other model types' changes are not."""
    own = family.module.split(".")[2] if family.module.startswith("transformers.models.") else None
    others = sorted(_modeling_types(recording) - {own})
    if others:
        warnings.warn(
            f"{recording.name} was proven on a {family.name} model; its changes to "
            f"transformers' {', '.join(others)} modeling code were not run by that proof "
            f"(verify a model of that type: Adoption.verify)",
            SwapWarning,
            stacklevel=3,
        )


def _refuse_unreached(recording: Recording, family: Family) -> None:
    """Refuse a proof on a model that does not run what the patch changed: a patch of
    Llama's modeling module proven on a Qwen 3 model would pass, having changed nothing
    that model runs."""
    changed = _modeling_types(recording)
    own = family.module.split(".")[2] if family.module.startswith("transformers.models.") else None
    if changed and own not in changed:
        raise AdoptionError(
            f"{recording.name} changes transformers' {', '.join(sorted(changed))} modeling "
            f"code, which a {family.name} model does not run: a proof on it would prove "
            f"nothing; prove it on a model of that type (--model, or a config of model_type "
            f"{' or '.join(repr(t) for t in sorted(changed))})"
        )


def _made(adoption: Adoption, prove: bool | None) -> Adoption:
    adoption._unproven_by_choice = prove is False
    return adoption


def _device() -> torch.device:
    # a patch's kernels (Triton's) may run on a GPU only: the proof runs where they would
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _family(model: nn.Module | None, config: PreTrainedConfig | None) -> Family | None:
    if config is not None:
        return family_for(str(getattr(config, "model_type", "")))
    if model is not None:
        try:
            return family_of(model)
        except Exception:
            return None
    return None


def _no_family(model: nn.Module | None, config: PreTrainedConfig | None) -> str:
    source = config if config is not None else getattr(model, "config", None)
    kind = getattr(source, "model_type", None)
    return f"no layerswap family for model_type {kind!r}: the patch cannot be proven (prove=False adopts it unproven)"


def _modeling_types(recording: Recording) -> set[str]:
    """The model types whose transformers modeling or configuration module the recording
    changed (a config class's ``__post_init__`` changes every model built from it)."""
    found = set()
    for change in recording.changes:
        # transformers.models.<family>.modeling_<family>.<name> (or configuration_):
        # not the auto mappings' or a lazy package's caches
        parts = change.where.split(".")
        own = len(parts) > 4 and parts[3] in (f"modeling_{parts[2]}", f"configuration_{parts[2]}")
        if own and parts[:2] == ["transformers", "models"] and parts[2] != "auto":
            found.add(parts[2])
    return found


def _changed_family(recording: Recording) -> Family | None:
    """The family of the one transformers modeling module the recording changed."""
    found = _modeling_types(recording)
    if len(found) != 1:
        return None
    return family_for(found.pop())


def _prove_in_place(
    recording: Recording,
    family: Family,
    config: PreTrainedConfig | None,
    placement: Placement,
) -> tuple[str, ...]:
    """Prove the class-level changes of ``recording``: the tiny original (its config too)
    built with them taken back, the candidate built with them, holding the original's
    weights; in ``placement``'s dtype and under its autocast too."""
    with exclusive():
        # the configs too: a patch of the config class (its ``__post_init__``) changes
        # every model built from one, and the original's must be built without it
        with recording.suspended():
            reference = family.build(tiny_config(family, config), seed=0).to(_device())
        candidate = family.build(tiny_config(family, config), seed=0).to(_device())
        try:
            candidate.load_state_dict(reference.state_dict())
        except RuntimeError as exc:
            raise AdoptionError(
                f"{recording.name}: a model built with the patch does not hold the "
                f"original's weights ({exc}); it cannot be proven against the original"
            ) from exc
        return check_patch(recording, reference, candidate, placement.dtype, placement.autocast)


def _prove_on_copy(
    fn: Callable[..., Any],
    args: Any,
    kwargs: dict[str, Any],
    family: Family,
    config: PreTrainedConfig,
    placement: Placement,
) -> tuple[tuple[str, ...], set[tuple[str, str]]]:
    """Prove ``fn`` applied to a tiny model (in place of the user's, every layer of it
    kept): recorded, checked against an untouched copy, taken back; in ``placement``'s
    dtype and under its autocast too. Where it changes more than the copy's own objects
    (a class, a module's name, a registry), those changes are proven as without a model
    too: a model built with them against one built without (a class rebound runs only
    in a model built after it). The checks run, and the places of the copy it changed
    (:func:`_instance_changes`)."""
    reference = family.build(tiny_config(family, config), seed=0).to(_device())
    candidate = copy.deepcopy(reference)
    recording, _ = record(fn, args, {**kwargs, "model": candidate}, model=candidate, empty=True)
    try:
        with exclusive():
            checks = check_patch(
                recording, reference, candidate, placement.dtype, placement.autocast
            )
        own, shared = _instance_changes(recording, candidate)
        if shared:
            built = _prove_in_place(recording, family, config, placement)
            checks = (*checks, *(check for check in built if check not in checks))
        return checks, own
    finally:
        recording.undo()


def _instance_changes(
    recording: Recording, model: nn.Module
) -> tuple[set[tuple[str, str]], list[Change]]:
    """The places of ``model``'s own objects (its modules, the containers they hold, its
    configs) ``recording`` changed, as ``(path, what)`` (the path under the base model:
    a causal LM's ``model.layers.4.mlp`` and a base model's ``layers.4.mlp`` are one),
    and the changes to anything else (classes, modules, registries)."""
    places = _places(model)
    own: set[tuple[str, str]] = set()
    shared: list[Change] = []
    for change in recording.changes:
        target = getattr(change, "owner", getattr(change, "obj", None))
        path = places.get(id(target)) if target is not None else None
        if path is None:
            shared.append(change)
        else:
            own.add((path, f"{type(change).__name__} {change.where.rsplit('.', 1)[-1]}"))
    return own, shared


def _places(model: nn.Module) -> dict[int, str]:
    """``id`` of each of ``model``'s own objects -> its path (:func:`_instance_changes`)."""
    prefix = getattr(model, "base_model_prefix", "")
    nested = bool(prefix) and isinstance(getattr(model, prefix, None), torch.nn.Module)
    found: dict[int, str] = {}
    for qualname, module in model.named_modules():
        if nested and (qualname == prefix or qualname.startswith(f"{prefix}.")):
            path = qualname[len(prefix) + 1 :]
        else:
            path = f"^{qualname}" if nested else qualname
        found.setdefault(id(module), path)
        for value in vars(module).values():
            if isinstance(value, dict | list | set):
                found.setdefault(id(value), path)
    waiting = [("config", getattr(model, "config", None))]
    while waiting:
        path, config = waiting.pop()
        if config is None or id(config) in found:
            continue
        found[id(config)] = path
        for name, value in vars(config).items():
            if hasattr(value, "model_type") and callable(getattr(value, "to_dict", None)):
                waiting.append((f"{path}.{name}", value))
    return found


def _refuse_unproven_instances(
    recording: Recording, model: nn.Module, proven: set[tuple[str, str]]
) -> None:
    """Refuse the changes ``fn`` made to the user's model where it changed nothing on the
    proof's tiny copy (a module the copy does not have: a head of another task, a layer
    past the copy's): the proof did not run them."""
    own, _ = _instance_changes(recording, model)
    unproven = sorted(own - proven)
    if unproven:
        places = ", ".join(f"{path or type(model).__name__}: {what}" for path, what in unproven[:5])
        raise AdoptionError(
            f"{recording.name} changed {len(unproven)} place(s) of the "
            f"{type(model).__name__} given that it did not change on the proof's tiny copy "
            f"of it ({places}{' ...' if len(unproven) > 5 else ''}): those changes were not "
            "proven. Its changes were taken back; adopt it with prove=False and compare "
            "the model with Adoption.verify"
        )
