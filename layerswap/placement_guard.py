"""A swapped model cast or moved after its swap is proven where it now computes, before its
next forward pass.

The first-use proof runs in the model's :class:`~layerswap.placement.Placement` when it is
swapped, or when :func:`layerswap.use` builds it (on the meta device, inside
``from_pretrained``). A model swapped in float32 and then cast
(``model.to(torch.bfloat16)``), or loaded and then moved to a GPU, computes where that
proof never ran. :func:`guard` watches the model two ways:

* its cast or move (``model.to``, ``.half()``, ``.cuda()``: the model's ``_apply``,
  wrapped on the instance): once the model is cast, each substitution is prepared where
  it now computes, and the call raises the proof's error where one fails (the model
  stays cast);
* one forward pre-hook, on its base model where it has one (the decoder stack, which
  runs inside any ``torch.autocast`` the model's own ``forward`` enters, as accelerate's
  mixed precision and Trainer's ``bf16=True`` wrap it, and runs when it is called
  alone), else on the model: while the dtype and device of its first floating-point weight,
  the ``torch.autocast`` dtype in effect there, and the attention implementation its
  config selects are ones each substitution in effect was proven in, the hook only
  compares them (a few microseconds); when they change (a model loaded, dispatched or
  cast part by part, run under Trainer's ``bf16=True`` autocast, or switched by
  ``model.set_attn_implementation("eager")``), the same preparation runs before the
  pass, refusing it where one fails. (A switch of the experts implementation is the
  experts slot's own: it warns, and the original's eager loop runs.)

Preparing is ``slot.prepare`` (contract, structure, proof) in
:meth:`Placement.of <layerswap.placement.Placement.of>`, once per placement. The hook does
nothing while ``torch.compile`` traces: a model cast after its swap was proven at the
cast, but one whose first weight alone says nothing of a change (only some of its layers
cast) and then compiled is proven where it was swapped. A deep copy of the model
(``copy.deepcopy``: TRL's reference model, an EMA copy), or of its base model alone, is
guarded as a model of its own, with what the original was proven at; an unpickled copy
(``pickle``, ``torch.save`` of the whole model) is not.

Example::

    handle = layerswap.swap(model, "llama.decoder.fused")    # proven in float32
    model.to(torch.bfloat16)
    model(**batch)                   # proven in bfloat16 first, or refused saying so
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from layerswap.config_view import ModelConfig
from layerswap.errors import LayerswapError
from layerswap.hf_internals import (
    attention_function,
    attention_implementation,
    text_config_object,
)
from layerswap.placement import COMPUTE_DTYPES, Placement, autocast_dtype

if TYPE_CHECKING:
    from layerswap.substitution import Substitution

__all__ = ["guard", "unguard"]

#: (dtype, device) of a model's first floating-point weight, the dtype torch.autocast
#: runs it in there (``None``: off), the attention implementation its text config
#: selects (:func:`~layerswap.hf_internals.attention_implementation`), and the function
#: transformers dispatches that name to (:func:`~layerswap.hf_internals.attention_function`:
#: another registered under it since is other code)
Probe = tuple[torch.dtype, torch.device, "torch.dtype | None", Any, Any]

_LOCK = threading.RLock()


class _Guard:
    """The substitutions in effect on one model, each with the probes it was proven at."""

    __slots__ = ("check", "config", "entries", "text", "watched")

    def __init__(self, watched: nn.Module, check: _Check) -> None:
        #: the module the forward pre-hook ``check`` is on (the model's base model, or the
        #: model), weakly: a copy of it carries a copy of the hook
        self.watched = weakref.ref(watched)
        self.check = check
        #: the model's config object, and its text config (never a copy: they are
        #: watched), read again where the model holds another config
        self.config: Any = None
        self.text: Any = None
        # substitution name -> (substitution, config it was prepared with, probes proven)
        self.entries: dict[str, tuple[Substitution, Any, set[Probe | None]]] = {}

    def remove(self) -> None:
        """Take the guard's hook off the module it is on."""
        watched = self.watched()
        hooks = {} if watched is None else watched._forward_pre_hooks
        for key, hook in list(hooks.items()):
            if hook is self.check:
                del hooks[key]


_GUARDS: weakref.WeakKeyDictionary[nn.Module, _Guard] = weakref.WeakKeyDictionary()


def _probe(model: nn.Module, state: _Guard) -> Probe | None:
    config = model.__dict__.get("config")
    if config is not state.config:
        state.config, state.text = config, text_config_object(config)
    for param in model.parameters():
        if param.dtype in COMPUTE_DTYPES:
            device = param.device
            chosen = None if state.text is None else attention_implementation(state.text)
            return param.dtype, device, autocast_dtype(device), chosen, attention_function(chosen)
    return None


def guard(model: nn.Module, sub: Substitution, config: Any, *, proven: bool) -> Callable[[], None]:
    """Prove ``sub`` again before a forward pass of ``model`` wherever ``model`` has moved
    to since; the function that stops it (a swap's undo calls it). ``config``: the
    model's, or its :class:`~layerswap.config_view.ModelConfig` (unwrapped already).

    ``proven``: ``sub`` was just prepared in ``model``'s placement as it is (a swap);
    ``False`` where it was prepared for another (a model ``use()`` builds on the meta
    device), so the first forward pass prepares it where the model is then.
    """
    with _LOCK:
        state = _GUARDS.get(model)
        if state is None:
            # on the base model where there is one: it runs inside whatever the model's
            # own forward enters (accelerate's autocast), and runs when called alone
            inner = getattr(model, "base_model", None)
            watched = inner if isinstance(inner, nn.Module) and inner is not model else model
            check = _Check(model)
            watched.register_forward_pre_hook(check)
            state = _Guard(watched, check)
            _GUARDS[model] = state
            # the instance's own: a cast of a model holding it (PEFT's wrapper) calls it too
            model.__dict__["_apply"] = _GuardedApply(model)
        if isinstance(config, ModelConfig):
            if model.__dict__.get("config") is config.config:
                state.config, state.text = config.config, config.text_object  # unwrapped
            config = config.config
        state.entries[sub.name] = (sub, config, {_probe(model, state)} if proven else set())

    def stop() -> None:
        with _LOCK:
            current = _GUARDS.get(model)
            if current is None or current.entries.pop(sub.name, None) is None:
                return
            if not current.entries:
                current.remove()
                del _GUARDS[model]
                model.__dict__.pop("_apply", None)

    return stop


def unguard(model: nn.Module) -> None:
    """Stop guarding ``model`` and every module in it (a scratch copy that
    :func:`layerswap.verify` or the benchmark compares with the original itself: its cast
    must not prove it first; a model built inside ``use()`` guards its base model too)."""
    with _LOCK:
        for module in model.modules():
            state = _GUARDS.pop(module, None)
            if state is not None:
                state.remove()
                module.__dict__.pop("_apply", None)


class _Check:
    """The guard's forward pre-hook, on the guarded model's base model (its
    ``base_model``, the decoder stack) where it has one: so it runs inside the
    ``torch.autocast`` the model's own ``forward`` enters (accelerate's mixed precision
    wraps it so, and with it Trainer's ``bf16=True``), and where the base model runs, or
    was cast, alone. It holds the model weakly, as :class:`_GuardedApply` does."""

    __slots__ = ("_model",)

    def __init__(self, model: nn.Module | None = None) -> None:
        self._model: Callable[[], nn.Module | None] = _gone if model is None else weakref.ref(model)

    def __call__(self, module: nn.Module, args: Any) -> None:
        if torch.compiler.is_compiling():
            return
        model = self._model()
        state = None if model is None else _GUARDS.get(model)
        if model is not None and state is not None:
            _prepare_where_moved(model, state)

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        model = self._model()
        state = None if model is None else _GUARDS.get(model)
        watched = None if state is None else state.watched()
        copied_watched = None if watched is None else memo.get(id(watched))
        if state is None or copied_watched is None:
            # a guard stopped since, or a hook table copied alone: a hook checking nothing
            return _Check()
        # the whole model copied (the copy's own base model holds this hook), or its base
        # model alone (guarded as a model of its own: it is what is cast and run)
        copied = memo.get(id(model), copied_watched)
        return _guard_copy(state, copied, copied_watched)

    def __reduce__(self) -> tuple[Any, ...]:
        # not the model: a base model pickled alone would carry the whole model (its
        # head too), or nothing to load once the model is gone; unpickled, it checks nothing
        return (_Check, ())


def _gone() -> None:
    return None


def _guard_copy(state: _Guard, model: nn.Module, watched: nn.Module) -> _Check:
    """The hook of ``model``, a deep copy of a guarded model (or of its base model alone,
    then ``watched`` too), guarded with the substitutions in effect on the original and
    the places each was proven at: the copy computes as the original did until it is cast,
    moved or run otherwise, and is then proven where it computes, as the original is."""
    check = _Check(model)
    with _LOCK:
        copied = _Guard(watched, check)
        copied.entries = {
            name: (sub, config, set(probes))
            for name, (sub, config, probes) in state.entries.items()
        }
        _GUARDS[model] = copied
        if model is watched:
            # the whole model's copy gets its _apply from the model's own __dict__
            model.__dict__["_apply"] = _GuardedApply(model)
    return check


class _GuardedApply:
    """A guarded model's ``_apply``: the class's, then each substitution prepared where the
    model moved. It holds the model weakly (a strong reference from the model's own
    ``__dict__`` would keep a deleted model, its weights with it, until a garbage
    collection), and a deep copy or a pickle of the model gets one of its own."""

    __slots__ = ("_model",)

    def __init__(self, model: nn.Module) -> None:
        self._model = weakref.ref(model)

    def __call__(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        model = self._model()
        assert model is not None  # called through the model, which is alive
        apply: Any = type(model)._apply
        result = apply(model, fn, *args, **kwargs)
        state = _GUARDS.get(model)
        if state is not None:
            _prepare_where_moved(model, state)
        return result

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        copied = memo.get(id(self._model()))
        return _GuardedApply(copied) if copied is not None else self

    def __reduce__(self) -> tuple[Any, ...]:
        return (_GuardedApply, (self._model(),))


def _prepare_where_moved(model: nn.Module, state: _Guard) -> None:
    now = _probe(model, state)
    for _, _, probes in list(state.entries.values()):
        if now not in probes:
            _prepare_again(model, state, now)
            return


def _prepare_again(model: nn.Module, state: _Guard, now: Probe | None) -> None:
    """Each substitution not yet prepared at ``now`` prepared in ``model``'s placement."""
    with _LOCK:
        placement = Placement.of(model)
        for sub, given, probes in list(state.entries.values()):
            if now in probes:
                continue
            # the model's config as it is now (another object where it was replaced)
            config = given if state.config is None else state.config
            try:
                sub.parts.slot.prepare(sub, config, placement)
            except LayerswapError as error:
                where = ", ".join(
                    str(part) for part in (placement.dtype, placement.device) if part is not None
                )
                if placement.autocast is not None:
                    where += f" under autocast to {placement.autocast}"
                attention = now[3] if now is not None else None
                if isinstance(attention, str):
                    where += f" with attn_implementation {attention!r}"
                said = (
                    f"{error}\n(this {type(model).__name__} computes in {where} since "
                    f"{sub.name} was swapped, where it is not proven: cast it back, or "
                    "undo the swap)"
                )
                try:
                    refusal = type(error)(said)
                except TypeError:  # an error type taking more than its message
                    raise error from None
                raise refusal from error
            probes.add(now)
