"""The ``fused`` backend's rotary application: the rotate-half rotation of q and k written
into one output, in pure PyTorch, bit for bit the original's.

transformers' ``q * cos + rotate_half(q) * sin`` runs five kernels per tensor (a negation,
a concatenation, two products, a sum), each over the whole head, and makes four
temporaries of its size; its backward runs as many again. :class:`HalfRotation` writes
``x * cos`` into the output and adds each half's turned product into the other half in
place: one product over the head, two over half of it, two in-place sums over half of it,
one temporary of half its size, the same each way; it keeps only ``cos`` and ``sin`` for
the backward pass (the rotation is linear in ``x``). The products and sums are the
original's, each rounded as it rounds them (no fused multiply-add): the outputs and
gradients are bitwise equal in every dtype.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import torch
from torch import Tensor

from layerswap.backends.rotary import RotaryKernel, RotaryReplacement, transformed
from layerswap.rotaries import RotarySpec

__all__ = ["FusedRotary", "HalfRotation", "InterleavedRotation", "rotate", "rotate_interleaved"]


class HalfRotation(torch.autograd.Function):
    """The rotate-half rotation of ``x``'s leading ``cos.shape[-1]`` channels (the others
    passed), ``cos``/``sin`` broadcast against them; ``x``'s gradient only.

    Its backward rounds as autograd rounds the original's: where ``x``'s dtype is narrower
    than the output's (bfloat16 states with float32 cos/sin, under autocast), each term's
    gradient is cast to ``x``'s dtype before the terms are summed, as each product's
    backward casts it; under ``create_graph`` and a batched backward (``vmap`` over the
    gradients) it is built of differentiable, out-of-place operations."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        ctx.save_for_backward(cos, sin)
        ctx.dtype = x.dtype
        return _turn(x, cos, sin)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        cos, sin = ctx.saved_tensors
        # a second derivative taken through it, or a batched backward (vmap over the
        # gradients: jacobians, is_grads_batched): differentiable, out-of-place operations
        if torch.is_grad_enabled() or transformed(grad):
            return _turned_back(grad, cos, sin, ctx.dtype), None, None
        return _turn_back(grad, cos, sin, ctx.dtype), None, None


def _turn(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """``x * cos`` with each half's turned product subtracted from or added to the other
    half in place: the original's products and sums, each rounded as it rounds them (no
    fused multiply-add)."""
    width = cos.shape[-1]
    half = width // 2
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, cos.dtype), device=x.device)
    rotated = x[..., :width]
    torch.mul(rotated, cos, out=out[..., :width])
    turned = torch.mul(rotated[..., half:], sin[..., :half])
    out[..., :half].sub_(turned)
    torch.mul(rotated[..., :half], sin[..., half:], out=turned)
    out[..., half:width].add_(turned)
    if width < x.shape[-1]:
        out[..., width:] = x[..., width:]
    return out


def _turn_back(grad: Tensor, cos: Tensor, sin: Tensor, dtype: torch.dtype) -> Tensor:
    """The transposed rotation of ``grad``, in ``dtype``: each half takes the other's
    gradient turned back, each term cast to ``dtype`` before it is summed."""
    width = cos.shape[-1]
    half = width // 2
    out = torch.empty(grad.shape, dtype=dtype, device=grad.device)
    rotated = grad[..., :width]
    torch.mul(rotated, cos, out=out[..., :width])  # cast into ``dtype`` as it is written
    out[..., :half].add_(torch.mul(rotated[..., half:], sin[..., half:]).to(dtype))
    out[..., half:width].sub_(torch.mul(rotated[..., :half], sin[..., :half]).to(dtype))
    if width < grad.shape[-1]:
        out[..., width:] = grad[..., width:]
    return out


def _turned_back(grad: Tensor, cos: Tensor, sin: Tensor, dtype: torch.dtype) -> Tensor:
    """:func:`_turn_back` of differentiable, out-of-place operations, the same roundings
    (no view or cast that is a no-op: autograd's batched gradients have no rule for an
    alias)."""
    width = cos.shape[-1]
    half = width // 2
    rotated = grad if width == grad.shape[-1] else grad[..., :width]
    first = _cast(rotated[..., half:] * sin[..., half:], dtype)
    second = _cast(rotated[..., :half] * sin[..., :half], dtype)
    out = _cast(rotated * cos, dtype) + torch.cat((first, -second), dim=-1)
    if width < grad.shape[-1]:
        return torch.cat((out, _cast(grad[..., width:], dtype)), dim=-1)
    return out


def _cast(x: Tensor, dtype: torch.dtype) -> Tensor:
    return x if x.dtype == dtype else x.to(dtype)


def _fits(x: Tensor, cos: Tensor, sin: Tensor, spec: RotarySpec) -> bool:
    """Whether :class:`HalfRotation` computes what the original does for this call: the
    shapes it was read on (cos/sin as wide as the rotated channels, even, broadcasting to
    them without widening ``x``), floating tensors on one device."""
    width = cos.shape[-1]
    if sin.shape != cos.shape or width % 2 or width > x.shape[-1] or width == 0:
        return False
    if width != x.shape[-1] and not spec.partial:
        return False
    if not (x.is_floating_point() and cos.is_floating_point() and sin.is_floating_point()):
        return False
    if not (x.device == cos.device == sin.device) or cos.dtype != sin.dtype:
        return False
    try:
        shape = torch.broadcast_shapes((*x.shape[:-1], width), cos.shape)  # type: ignore[no-untyped-call]
    except RuntimeError:
        return False
    return bool(shape == (*x.shape[:-1], width))


def _arguments(given: tuple[Any, ...], spec: RotarySpec) -> tuple[Any, ...] | None:
    """``(operands, cos, sin)`` unsqueezed as the call asks, from the arguments bound to
    the original's parameters; ``None`` where they are not what the kernel was read on (a
    ``position_ids`` given, an ``unsqueeze_dim`` that does not fit)."""
    named = dict(zip(spec.parameters, given, strict=True))
    dim = given[-1]
    if named.get("position_ids") is not None or not isinstance(dim, int):
        return None
    tensors = given[: spec.operands]
    cos, sin = given[spec.operands : spec.operands + 2]
    try:
        return tensors, cos.unsqueeze(dim), sin.unsqueeze(dim)
    except (IndexError, RuntimeError):
        return None


def rotate(given: tuple[Any, ...], spec: RotarySpec) -> tuple[Tensor, ...] | None:
    """Each operand of ``given`` (``q, k, cos, sin, unsqueeze_dim`` bound) rotated by
    :class:`HalfRotation` (in float32 and cast back where ``spec.upcast``), or ``None``
    where the call is not one it was read on."""
    found = _arguments(given, spec)
    if found is None:
        return None
    tensors, cos, sin = found
    if not all(_fits(x, cos, sin, spec) for x in tensors):
        return None
    if spec.upcast:
        # each term in float32 (the states cast for each, as the original casts them),
        # the result cast back
        cos, sin = cos.float(), sin.float()
        return tuple(_apply(x, cos, sin).to(x.dtype) for x in tensors)
    return tuple(_apply(x, cos, sin) for x in tensors)


def _apply(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    out: Tensor = HalfRotation.apply(x, cos, sin)  # type: ignore[no-untyped-call]
    return out


class InterleavedRotation(torch.autograd.Function):
    """DeepSeek's rotation of ``x``'s adjacent channel pairs by ``cos``/``sin`` of half its
    width (broadcast against the pairs), the pairs' first elements written first: the
    original's products and sums, rounded as it rounds them, its backward as autograd's."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        ctx.save_for_backward(cos, sin)
        ctx.dtype = x.dtype
        half = x.shape[-1] // 2
        out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, cos.dtype), device=x.device)
        first, second = x[..., 0::2], x[..., 1::2]
        torch.mul(first, cos, out=out[..., :half])
        turned = torch.mul(second, sin)
        out[..., :half].sub_(turned)
        torch.mul(second, cos, out=out[..., half:])
        torch.mul(first, sin, out=turned)
        out[..., half:].add_(turned)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        cos, sin = ctx.saved_tensors
        dtype = ctx.dtype
        half = grad.shape[-1] // 2
        top, bottom = grad[..., :half], grad[..., half:]
        if torch.is_grad_enabled() or transformed(grad):  # as HalfRotation's
            first = _cast(top * cos, dtype) + _cast(bottom * sin, dtype)
            second = _cast(bottom * cos, dtype) - _cast(top * sin, dtype)
            return torch.stack((first, second), dim=-1).reshape(grad.shape), None, None
        out = torch.empty(grad.shape, dtype=dtype, device=grad.device)
        evens, odds = out[..., 0::2], out[..., 1::2]
        torch.mul(top, cos, out=evens)
        evens.add_(torch.mul(bottom, sin).to(dtype))
        torch.mul(bottom, cos, out=odds)
        odds.sub_(torch.mul(top, sin).to(dtype))
        return out, None, None


def rotate_interleaved(given: tuple[Any, ...], spec: RotarySpec) -> tuple[Tensor, ...] | None:
    """Each operand of ``given`` (``q, k, cos, sin[, position_ids], unsqueeze_dim`` bound)
    rotated by :class:`InterleavedRotation`, or ``None`` where the call is not one it was
    read on (cos/sin as wide as the states, even, broadcasting to them)."""
    found = _arguments(given, spec)
    if found is None:
        return None
    tensors, cos, sin = found
    width = cos.shape[-1]
    if not all(_fits(x, cos, sin, spec) and x.shape[-1] == width for x in tensors):
        return None
    cos, sin = cos[..., : width // 2], sin[..., : width // 2]
    return tuple(
        InterleavedRotation.apply(x, cos, sin)  # type: ignore[no-untyped-call]
        for x in tensors
    )


class FusedRotary(RotaryReplacement):
    """A model's own attention whose rotary application is :class:`HalfRotation`."""

    backend = "fused"
    kernels: ClassVar[Mapping[str, RotaryKernel]] = {
        "half": rotate,
        "interleave": rotate_interleaved,
    }
