"""``wrap``: around-advice on a function or method, with correct binding.

The advice follows wrapt's convention, ``advice(wrapped, instance, args, kwargs)``,
where ``instance`` is what the method is bound to:

========================  =====================  ==========================
what is wrapped           ``instance``           ``wrapped``
========================  =====================  ==========================
module-level function     ``None``               the function
instance method           the instance           the bound method
classmethod               the class              the bound classmethod
staticmethod              ``None``               the function
one instance's method     that instance          the bound method
========================  =====================  ==========================

How the wrapper is built (measured, see docs/benchmarks.md):

* a module-level function gets a plain Python closure made with
  :func:`safe_update_wrapper` — a call costs one extra frame, far less than a
  generic proxy object;
* a class attribute gets a ``wrapt.FunctionWrapper``: it is a descriptor, so it
  binds exactly like the function/classmethod/staticmethod it wraps;
* one instance gets the class's function bound through ``__get__`` and stored in the
  instance ``__dict__`` (removed on stop, so the class's method shows again).

Every wrapper keeps ``__name__``, ``__qualname__``, ``__doc__``, ``__module__``,
``__wrapped__`` and therefore ``inspect.signature`` of the original.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any, overload

from layerswap.errors import TargetAttributeError, TargetTypeError
from layerswap.patching.patch import Patch
from layerswap.patching.sites import NOTSET, Site
from layerswap.patching.target import ParsedTarget
from layerswap.patching.wraps import safe_update_wrapper

__all__ = ["Advice", "wrap"]

Advice = Callable[[Callable[..., Any], Any, tuple[Any, ...], dict[str, Any]], Any]


def _advice_of(wrapper: Any) -> Advice:
    advice = getattr(wrapper, "__layerswap_advice__", wrapper)
    if not callable(advice):
        raise TargetTypeError(
            "wrap() needs a wrapper callable(wrapped, instance, args, kwargs) or an object with "
            f"__layerswap_advice__, got {wrapper!r}"
        )
    return advice  # type: ignore[no-any-return]


def _closure(wrapped: Callable[..., Any], instance: Any, advice: Advice) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return advice(wrapped, instance, args, kwargs)

    return safe_update_wrapper(wrapper, wrapped)


def _class_raw(klass: type, name: str, skip_self: bool) -> Any:
    for base in klass.__mro__[1:] if skip_self else klass.__mro__:
        if name in base.__dict__:
            return base.__dict__[name]
    return NOTSET


def _make_wrapper(advice: Advice, label: Callable[[], str]) -> Callable[[Site, Any], Any]:
    import wrapt

    def build(site: Site, below: Any) -> Any:
        owner, name = site.owner, site.name
        if isinstance(owner, type):
            raw = below if below is not NOTSET else _class_raw(owner, name, skip_self=True)
            _require_callable(raw, label)
            return wrapt.FunctionWrapper(raw, advice)
        if isinstance(owner, types.ModuleType) or below is not NOTSET:
            raw = below if below is not NOTSET else getattr(owner, name)
            _require_callable(raw, label)
            instance = None if isinstance(owner, types.ModuleType) else owner
            if isinstance(raw, (staticmethod, classmethod)):
                return wrapt.FunctionWrapper(raw, advice)  # type: ignore[arg-type]
            return _closure(raw, instance, advice)
        # One instance, method from its class: bind the class's function to it.
        klass = type(owner)
        raw = _class_raw(klass, name, skip_self=False)
        if raw is NOTSET:
            raw = getattr(owner, name, NOTSET)
            _require_callable(raw, label)
            return _closure(raw, owner, advice)
        _require_callable(raw, label)
        if isinstance(raw, types.FunctionType):
            return _closure(raw.__get__(owner, klass), owner, advice)
        return wrapt.FunctionWrapper(raw, advice).__get__(owner, klass)

    return build


def _require_callable(raw: Any, label: Callable[[], str]) -> None:
    if raw is NOTSET:
        raise TargetAttributeError(f"cannot wrap {label()}: there is nothing to wrap")
    if not (callable(raw) or isinstance(raw, (staticmethod, classmethod))):
        raise TargetTypeError(f"cannot wrap {label()}: {raw!r} is not callable")


@overload
def wrap(target: str, wrapper: Any, /, *, lazy: bool = ..., aliases: bool = ...) -> Patch: ...


@overload
def wrap(
    target: object, attribute: str, wrapper: Any, /, *, lazy: bool = ..., aliases: bool = ...
) -> Patch: ...


def wrap(target: Any, *args: Any, lazy: bool = False, aliases: bool = False) -> Patch:
    """Wrap a function or method with around-advice; a patch like any other.

    ``wrapper(wrapped, instance, args, kwargs)`` is called instead of the original;
    it decides whether and how to call ``wrapped``. An object with a
    ``__layerswap_advice__`` attribute (every decorator in
    :mod:`layerswap.decorators`) is accepted too.

    Example::

        def timed(wrapped, instance, args, kwargs):
            start = time.perf_counter()
            try:
                return wrapped(*args, **kwargs)
            finally:
                print(type(instance).__name__, time.perf_counter() - start)

        with layerswap.wrap("transformers.models.llama.modeling_llama:LlamaMLP.forward", timed):
            model(input_ids)
        with layerswap.wrap(model.model.layers[0], "forward", timed):  # this layer only
            model(input_ids)
    """
    if isinstance(target, str):
        if len(args) != 1:
            raise TargetTypeError(
                f"wrap({target!r}, wrapper) takes the wrapper as its second argument"
            )
        parsed = ParsedTarget(target)
        patch = Patch(None, None, args[0], lazy=lazy, aliases=aliases, _parsed=parsed)
    else:
        if len(args) != 2 or not isinstance(args[0], str) or not args[0]:
            raise TargetTypeError(
                "wrap() takes 'pkg.mod:Name' and a wrapper, or an object, an attribute name "
                "and a wrapper: wrap(obj, 'method', wrapper)"
            )
        patch = Patch(target, args[0], args[1], lazy=lazy, aliases=aliases)
    patch._factory = _make_wrapper(_advice_of(args[-1]), patch._label)
    return patch
