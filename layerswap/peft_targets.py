"""A new PEFT adapter on a swapped model: ``target_modules`` naming fused-away modules fail.

A swapped layer has ``qkv_proj`` where the original had ``q_proj``/``k_proj``/``v_proj``
(and ``gate_up_proj`` for ``gate_proj``/``up_proj``). PEFT matches ``target_modules``
against the modules it finds and adapts what matches: ``["q_proj", "o_proj"]`` on a
swapped model would adapt ``o_proj`` alone and say nothing, and ``["q_proj"]`` fails
with PEFT's own "not found". Here such a config fails before anything is injected,
with a :class:`~layerswap.errors.ConversionError` naming the fused-away modules, the
fused module to target instead and the corrected ``target_modules``.

Why a patch: PEFT resolves targets inside ``BaseTuner.inject_adapter`` (reached by
``get_peft_model``, ``PeftModel.from_pretrained``, ``add_adapter``,
``inject_adapter_in_model`` and transformers' ``model.add_adapter``), and none of the
model methods or attributes it consults there (``config``, ``named_modules``,
``get_input_embeddings``, the tied-weight keys) is given the adapter config, so a
model cannot answer for itself. The check is therefore around-advice on
``peft.tuners.tuners_utils:BaseTuner.inject_adapter`` (:func:`guard`), a
``layerswap.wrap`` patch:

- armed while a swapped model exists (:func:`hold`): a decoder swap
  (:func:`layerswap.swap`) holds it until its ``undo()``, a model built under
  :func:`layerswap.use` until it is collected; the last release takes it off.
  ``lazy=True``: it never imports PEFT, and applies when PEFT is imported;
- a pass-through for any model without swapped layers: PEFT gets the same call;
- listed by :func:`layerswap.active_patches`; ``guard().stop()`` takes it off, the next
  swap puts it back; :func:`layerswap.restore_all` leaves it on while a swapped model
  holds it (a safeguard: without it that model's saves would write its own layout);
- under layerswap's pytest plugin it is taken off at the teardown of the test (or the
  wider fixture) whose swap armed it, silently: it is layerswap's own, not a leak.

A config that names a fused-away module *and* its fused module
(``["q_proj", "k_proj", "v_proj", "qkv_proj"]``, one list for both layouts) passes:
the fused module is adapted, which covers its parts.

Example::

    layerswap.swap(model, backend="fused")
    get_peft_model(model, LoraConfig(target_modules=["q_proj", "o_proj"]))
    # ConversionError: ... q_proj ... fused into qkv_proj ...
    # target_modules=['o_proj', 'qkv_proj'] ...
"""

from __future__ import annotations

import copy
import inspect
import itertools
import re
import threading
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from torch import nn

from layerswap.errors import ConversionError
from layerswap.patching import Patch, Scoped, wrap
from layerswap.patching.scoped import safeguard
from layerswap.state import LAYER_COPIED, LayoutLoadHook, fused_modules

__all__ = ["check_targets", "fused_away", "guard", "hold", "hold_while_alive", "is_guard"]

INJECT = "peft.tuners.tuners_utils:BaseTuner.inject_adapter"

_LOCK = threading.Lock()
_GUARD: Patch | None = None
_LAYOUT: list[Patch] = []  # peft_io's and saving's advice, armed and taken off with _GUARD
#: one token per swapped model alive that holds the check armed (see :func:`hold`)
_HOLDS: set[int] = set()
_TOKENS = itertools.count()


def fused_away(model: nn.Module) -> dict[str, str]:
    """Module path of every original module ``model``'s swapped layers fused -> the fused one.

    Read from the load hook every replacement layer carries (see :mod:`layerswap.state`),
    so copies and unpickled models count too. Example::

        fused_away(model)["model.layers.0.self_attn.q_proj"]
        # 'model.layers.0.self_attn.qkv_proj'
    """
    found: dict[str, str] = {}
    for name, module in model.named_modules():
        for wrapped in module._load_state_dict_pre_hooks.values():
            hook = getattr(wrapped, "hook", wrapped)
            if not isinstance(hook, LayoutLoadHook):
                continue
            prefix = f"{name}." if name else ""
            for fused, parts in fused_modules(hook.substitution.converter).items():
                found.update((prefix + part, prefix + fused) for part in parts)
    return found


def _leaf(path: str) -> str:
    return path.rpartition(".")[2]


def _saved_match(saved: str, key: str) -> bool:
    # PEFT's own test for modules_to_save (tuners_utils.check_target_module_exists)
    return re.match(rf"(^|.*\.){saved}($|\..*)", key) is not None


@dataclass(frozen=True)
class _Named:
    """Fused-away modules an adapter names: where it names them, and that setting's value."""

    stranded: dict[str, str]
    """Fused-away module path -> fused module path."""
    what: str
    """What names them, for the message (``target_modules ['o_proj', 'q_proj']``)."""
    setting: str | None = None
    """``target_modules`` or ``modules_to_save``: the config field to correct."""
    names: Any = None
    """That field's value (PEFT's default targets when the config gave none)."""


def _named(
    model: nn.Module,
    config: Any,
    matches: Callable[[Any, str], object],
    default_targets: Mapping[str, Any],
    state_dict: Mapping[str, Any] | None,
) -> _Named | None:
    """The fused-away modules ``config`` (or ``state_dict``) names, or None."""
    fused = fused_away(model)
    if not fused:
        return None
    if state_dict is not None:
        keys = [key.removeprefix("_orig_mod.") for key in state_dict]
        stranded = {
            part: into
            for part, into in fused.items()
            if any(key.startswith(part + ".") for key in keys)
        }
        return _Named(stranded, "the adapter state") if stranded else None
    saved = list(getattr(config, "modules_to_save", None) or ())
    stranded = {
        part: into for part, into in fused.items() if any(_saved_match(m, part) for m in saved)
    }
    if stranded:
        return _Named(stranded, f"modules_to_save {sorted(saved)}", "modules_to_save", saved)
    targets = getattr(config, "target_modules", None)
    what = "target_modules"
    if targets is None:
        model_type = getattr(getattr(model, "config", None), "model_type", "")
        targets = default_targets.get(model_type)
        if not targets:
            return None  # PEFT refuses a config without targets itself
        config = copy.copy(config)
        config.target_modules = targets if isinstance(targets, str) else set(targets)
        what = f"PEFT's default target_modules for {model_type}"
    shown = repr(targets) if isinstance(targets, str) else str(sorted(targets))
    stranded = {
        part: into
        for part, into in fused.items()
        if matches(config, part) and not matches(config, into)
    }
    return _Named(stranded, f"{what} {shown}", "target_modules", targets) if stranded else None


def _suggestion(named: _Named) -> str:
    """The setting with every fused-away name replaced by its fused module's name."""
    if named.setting is None or isinstance(named.names, str):
        return ""
    renames = {_leaf(part): _leaf(into) for part, into in named.stranded.items()}
    fixed: list[str] = []
    for name in named.names:
        head, dot, leaf = name.rpartition(".")
        new = f"{head}{dot}{renames[leaf]}" if leaf in renames else name
        if new not in fixed:
            fixed.append(new)
    return f" ({named.setting}={sorted(fixed)!r})"


def check_targets(
    model: nn.Module,
    config: Any,
    *,
    state_dict: Mapping[str, Any] | None = None,
    tuner: Any = None,
) -> None:
    """Raise :class:`ConversionError` if ``config`` targets modules ``model``'s swap fused away.

    ``tuner`` is PEFT's tuner (its own matching and default targets are used); with
    ``state_dict`` (PEFT's injection from adapter weights) its keys are what names the
    modules. Nothing to check on a model without swapped layers. Example::

        check_targets(model, LoraConfig(target_modules=["q_proj", "o_proj"]))
    """
    if tuner is not None:
        matches: Callable[[Any, str], object] = tuner._check_target_module_exists
        default_targets = getattr(tuner, "target_module_mapping", None) or {}
    else:
        from peft.tuners.tuners_utils import check_target_module_exists

        matches, default_targets = check_target_module_exists, {}
    named = _named(model, config, matches, default_targets, state_dict)
    if named is None:
        return
    by_leaf: dict[str, str] = {}
    for part, into in named.stranded.items():
        by_leaf.setdefault(_leaf(part), _leaf(into))
    listed = ", ".join(f"{leaf} (fused into {into})" for leaf, into in sorted(by_leaf.items()))
    fused = sorted(set(by_leaf.values()))
    raise ConversionError(
        f"{named.what} names modules that the swapped layers of this model fused away: "
        f"{listed}, e.g. {min(named.stranded)!r}. PEFT would adapt only the modules it "
        "finds, and the adapter would silently miss these. Name the fused "
        f"module{'s' if len(fused) > 1 else ''} {', '.join(fused)} instead"
        f"{_suggestion(named)}; to move an adapter between the original and the swapped "
        "layout, use layerswap.adapters.load_adapter / layerswap.adapters.save_adapter "
        "(see docs/integrations.md, PEFT)"
    )


def _check_then_inject(
    wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """Around-advice of ``BaseTuner.inject_adapter``: check, then PEFT's own injection."""
    try:
        bound = inspect.signature(wrapped).bind(*args, **kwargs)
    except TypeError:
        return wrapped(*args, **kwargs)  # a call PEFT itself refuses: its error, not ours
    model = bound.arguments.get("model")
    adapter_name = bound.arguments.get("adapter_name")
    configs = getattr(instance, "peft_config", None)
    if isinstance(model, nn.Module) and isinstance(configs, Mapping) and adapter_name in configs:
        check_targets(
            model,
            configs[adapter_name],
            state_dict=bound.arguments.get("state_dict"),
            tuner=instance,
        )
    return wrapped(*args, **kwargs)


def guard() -> Patch:
    """The check on PEFT's injection, armed (started) if it was not. Idempotent, thread-safe.

    Arms with it the advice of :mod:`layerswap.peft_io` (PEFT's save and load in the
    original layout), of :mod:`layerswap.saving` (``save_pretrained`` checked), of
    :mod:`layerswap.placed_loads` (torch's and accelerate's loads by name converted) and of
    :mod:`layerswap.dcp_loads` (``torch.distributed.checkpoint`` reading an original
    layout into the joined tensors). Held by every swap (:func:`hold`); see the module
    docstring. Example::

        layerswap.peft_targets.guard().stop()   # PEFT's injection as it was
    """
    with _LOCK:
        return _arm()


def _arm() -> Patch:
    global _GUARD
    from layerswap.dcp_loads import ADVICE as DCP_ADVICE
    from layerswap.peft_io import ADVICE
    from layerswap.placed_loads import ADVICE as LOAD_ADVICE
    from layerswap.saving import ADVICE as SAVE_ADVICE

    if _GUARD is None:
        # safeguards: restore_all() leaves them on while a swapped model holds them
        _GUARD = safeguard(wrap(INJECT, _check_then_inject, lazy=True), _held)
        _LAYOUT.extend(
            safeguard(wrap(target, advice, lazy=True), _held)
            for target, advice in (*ADVICE, *SAVE_ADVICE, *LOAD_ADVICE, *DCP_ADVICE)
        )
    for patch in (_GUARD, *_LAYOUT):
        if not patch.is_active:
            patch.start()
    return _GUARD


def _held() -> bool:
    """Whether a swapped model holds the check (one collected since no longer does)."""
    return bool(_HOLDS)


def hold(model: nn.Module) -> Callable[[], None]:
    """Arm the check for as long as ``model`` is swapped; returns the release.

    The check comes off at the release that leaves no hold: every swap holding it undone,
    every model built under :func:`layerswap.use` collected. A collected model drops its
    hold at once, and the check comes off at the next release (a finalizer stops no
    patch: it may run anywhere, inside the engine too). Releasing twice is harmless.

    Example::

        release = hold(model)      # what layerswap.swap does
        ...
        release()                  # what its undo() does
    """
    token = next(_TOKENS)
    with _LOCK:
        _HOLDS.add(token)
        _arm()
    weakref.finalize(model, _HOLDS.discard, token)
    released: list[bool] = []

    def release() -> None:
        with _LOCK:
            if released:
                return
            released.append(True)
            _HOLDS.discard(token)
            if _HOLDS:
                return
            for patch in (_GUARD, *_LAYOUT):
                if patch is not None and patch.is_active:
                    patch.stop()

    return release


def hold_while_alive(module: nn.Module) -> None:
    """Arm the check for as long as ``module`` lives: a swapped layer made by copying or
    unpickling one (``copy.deepcopy`` of a swapped model: TRL's reference model, an EMA
    copy) is still swapped after the swap it was copied from is undone."""
    token = next(_TOKENS)
    with _LOCK:
        _HOLDS.add(token)
        _arm()
    weakref.finalize(module, _HOLDS.discard, token)


LAYER_COPIED.append(hold_while_alive)


def is_guard(scoped: Scoped) -> bool:
    """Whether ``scoped`` is a patch :func:`guard` arms (layerswap's own, not a leak)."""
    return scoped is _GUARD or any(scoped is patch for patch in _LAYOUT)
