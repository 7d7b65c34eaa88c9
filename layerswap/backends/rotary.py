"""What every backend's ``rotary`` replacement shares: an attention of the model's own class
whose forward calls a backend's rotary kernel where it called its module's
``apply_rotary_pos_emb``.

The ``rotary`` slot (:mod:`layerswap.slots.rotary`) gives each attention it swaps a class
made by :meth:`~layerswap.backends.class_swap.ClassReplacement.subclass_for` whose
``forward`` is the original's code with that one global name changed
(:func:`~layerswap.rotaries.rebuilt_forward`): the projections, q/k norms, cache, mask and
attention function are the original's, run as they are. The name it calls instead,
``_layerswap_<replacement class>_apply_rotary_pos_emb_<kind>``, is bound in the attention's modeling
module the first time a class is made for it, and stays there (it is inert: only the made
classes call it; :mod:`layerswap.sources` leaves such names out of the code it vouches
for). Nothing of the module changes: its parameters and buffers are untouched, undo sets
the class back.

A backend's kernel takes a call it has preconditions for (shapes, dtypes, devices, cos/sin
that need no gradient); any other call runs the module's own function, as it is bound at
that call: so do ``torch.func`` transforms and forward-mode AD (the kernel's autograd
function has no rule for them) and ``torch.compile`` (which fuses the original's
elementwise expression into one kernel itself).

Example::

    class FusedRotary(RotaryReplacement):
        backend = "fused"
        kernels = {"half": rotate}
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import torch
from torch import Tensor, nn
from torch.autograd import forward_ad

from layerswap.backends.class_swap import ClassReplacement
from layerswap.rotaries import RotaryCalls, RotarySpec, rebuilt_forward

__all__ = ["RotaryKernel", "RotaryReplacement", "calls", "is_replaced_rotary", "transformed"]

#: ``(arguments, spec) -> rotated operands``, the arguments bound to the original's
#: parameters in order (``q, k, cos, sin, unsqueeze_dim``; ``xq, xk, freqs_cis``), or
#: ``None`` where the call is not one the kernel takes (the module's own function then runs)
RotaryKernel = Callable[[tuple[Any, ...], RotarySpec], "tuple[Tensor, ...] | None"]

_LOCK = threading.Lock()
#: per thread: how many calls reached a made class's rotary function, and how many of them
#: its kernel computed (:func:`calls`)
_COUNTS = threading.local()


def calls() -> tuple[int, int]:
    """``(entered, computed)``: the calls of this thread so far that reached a swapped
    attention's rotary function, and those its backend's kernel computed (the others ran
    the module's own function). The slot compares them before and after a run."""
    return getattr(_COUNTS, "entered", 0), getattr(_COUNTS, "computed", 0)


_WRAPPED = getattr(torch._C._functorch, "is_functorch_wrapped_tensor", None)


_LEGACY_BATCHED = getattr(torch._C._functorch, "is_legacy_batchedtensor", None)


def transformed(*tensors: Tensor) -> bool:
    """Whether a ``torch.func`` transform (``vmap``, ``grad``), autograd's batched
    gradients (``is_grads_batched``, a vectorized jacobian) or forward-mode AD runs over
    ``tensors``: the kernels' in-place operations have no batching rule and their autograd
    functions no forward-mode one."""
    if forward_ad._current_level >= 0:
        return True
    for x in tensors:
        if _WRAPPED is not None and _WRAPPED(x):
            return True
        if _LEGACY_BATCHED is not None and _LEGACY_BATCHED(x):
            return True
    return False


_MISSING = object()


def _dispatcher(
    kernel: RotaryKernel, spec: RotarySpec, namespace: dict[str, Any]
) -> Callable[..., Any]:
    """The function a swapped forward calls: ``kernel`` where it takes the call, else
    ``namespace[spec.function]`` (the module's own, as bound when called)."""
    import inspect

    found = inspect.signature(namespace[spec.function]).parameters
    defaults = tuple(
        _MISSING if found[name].default is inspect.Parameter.empty else found[name].default
        for name in spec.parameters
    )
    tensors = spec.operands + spec.tables

    def bound(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...] | None:
        """``args`` and ``kwargs`` in the original's parameter order, or ``None`` where
        they do not bind (the original then raises its own error)."""
        if len(args) > len(spec.parameters):
            return None
        named = dict(kwargs)
        values = list(args)
        for name, default in zip(spec.parameters[len(args) :], defaults[len(args) :], strict=True):
            value = named.pop(name, default)
            if value is _MISSING:
                return None
            values.append(value)
        return None if named else tuple(values)

    def rotary(*args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():  # the compiler fuses the original's itself
            return namespace[spec.function](*args, **kwargs)
        _COUNTS.entered = getattr(_COUNTS, "entered", 0) + 1
        given = bound(args, kwargs)
        if (
            given is not None
            # plain tensors: a subclass (a tensor-parallel DTensor) is the original's to run
            and all(type(t) is Tensor for t in given[:tensors])
            and not any(t.requires_grad for t in given[spec.operands : tensors])
            and not transformed(*given[:tensors])
        ):
            out = kernel(given, spec)
            if out is not None:
                _COUNTS.computed = getattr(_COUNTS, "computed", 0) + 1
                return out if spec.operands == 2 else out[0]
        return namespace[spec.function](*args, **kwargs)

    return rotary


class RotaryReplacement(ClassReplacement):
    """The base of a backend's rotary replacement: the attention's own forward, calling the
    backend's kernel for its rotary function."""

    #: the rotary kinds this backend computes, and its kernel for each
    kernels: ClassVar[Mapping[str, RotaryKernel]] = {}
    #: the operand counts it takes (2: q and k; 1: one tensor)
    operands: ClassVar[frozenset[int]] = frozenset({1, 2})
    _layerswap_spec: ClassVar[RotaryCalls]

    @classmethod
    def call_refusal(cls, spec: RotarySpec) -> str | None:
        """Why this backend has no kernel for the rotary function ``spec`` reads."""
        if spec.kind not in cls.kernels:
            return (
                f"its {spec.function} computes {spec.label}, which the {cls.backend} backend "
                "has no kernel for"
                + (" (one complex product already)" if spec.kind == "complex" else "")
            )
        if spec.operands not in cls.operands:
            return (
                f"its {spec.function} rotates one tensor at a time; the {cls.backend} "
                "backend's kernel rotates q and k together"
            )
        return None

    @classmethod
    def refusal(cls, spec: RotaryCalls) -> str | None:
        """Why no rotary function an attention calls is one this backend computes
        (``None``: at least one is; the others stay the module's own)."""
        reasons = [cls.call_refusal(call) for call in spec.calls]
        if any(reason is None for reason in reasons):
            return None
        return "; ".join(str(reason) for reason in reasons)

    @classmethod
    def made_namespace(cls, original: type, spec: RotaryCalls) -> dict[str, Any]:
        forward = original.forward  # type: ignore[attr-defined]
        inner = forward
        while getattr(inner, "__wrapped__", None) is not None:
            inner = inner.__wrapped__
        namespace: dict[str, Any] = inner.__globals__
        renamed = {
            call.function: cls.bind(call, namespace)
            for call in spec.calls
            if cls.call_refusal(call) is None
        }
        return {"forward": rebuilt_forward(forward, renamed)}

    @classmethod
    def bind(cls, spec: RotarySpec, namespace: dict[str, Any]) -> str:
        """The name under which this backend's function for ``spec`` is bound in
        ``namespace`` (bound there the first time)."""
        base = f"_layerswap_{cls.__name__}_{spec.function}_{spec.slug}"
        with _LOCK:
            name, count = base, 1
            # a name another class of the same name bound (a subclass in a test) is not ours
            while (
                name in namespace and getattr(namespace[name], "_layerswap_owner", None) is not cls
            ):
                count += 1
                name = f"{base}_{count}"
            if name not in namespace:
                bound: Any = _dispatcher(cls.kernels[spec.kind], spec, namespace)
                bound.__qualname__ = bound.__name__ = name
                bound._layerswap_owner = cls
                namespace[name] = bound
        return name

    def extra_repr(self) -> str:
        return f"{self._layerswap_spec.label} ({self.backend})"


def is_replaced_rotary(module: nn.Module) -> bool:
    """Whether ``module`` is an attention the ``rotary`` slot swapped."""
    return isinstance(module, RotaryReplacement)
