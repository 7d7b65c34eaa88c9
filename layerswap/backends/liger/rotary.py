"""The ``liger`` backend's rotary application: Liger-Kernel's RoPE kernel on q and k, what
Liger's own patch binds as ``apply_rotary_pos_emb`` (and Llama 4's as ``apply_rotary_emb``;
GPU only).

Liger's ``LigerRopeFunction`` takes ``(batch, heads, seq, head_dim)`` q and k with
``(batch or 1, seq, rotary_dim)`` cos/sin, rotates the leading ``rotary_dim`` channels
and writes the result into the storage it is given, as Liger's patch does; the first-use
proof (on the GPU) compares the whole model with the original's. A call of another shape,
on the CPU, or rotating one tensor at a time (Gemma 3n, Gemma 4) runs the module's own
function, and a model whose rotary function rotates one tensor is kept with the reason.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import torch
from torch import Tensor

from layerswap.backends.rotary import RotaryKernel, RotaryReplacement
from layerswap.rotaries import RotarySpec

__all__ = ["LigerRotary"]


def _rope(given: tuple[Any, ...], spec: RotarySpec) -> tuple[Tensor, ...] | None:
    """Liger's RoPE on ``q, k, cos, sin, unsqueeze_dim`` (bound), where it takes them."""
    if len(given) != 5:  # a position_ids parameter: a function Liger's patch does not bind
        return None
    q, k, cos, sin, dim = given
    width = cos.shape[-1]
    if not (
        dim == 1
        and q.dim() == k.dim() == 4
        and cos.dim() == 3
        and sin.shape == cos.shape
        and q.is_cuda
        and q.device == k.device == cos.device == sin.device
        and q.dtype == k.dtype
        and cos.dtype == sin.dtype
        and width % 2 == 0
        and 0 < width <= q.shape[-1]
        and (width == q.shape[-1] or spec.partial)
        and q.shape[-1] == k.shape[-1]
    ):
        return None
    from layerswap.backends.liger.runtime import kernels

    rope = kernels().liger_rope
    if spec.upcast:
        q32, k32 = rope(q.float(), k.float(), cos.float(), sin.float())
        return q32.to(q.dtype), k32.to(k.dtype)
    if q.dtype != cos.dtype:
        # under autocast: bfloat16 states, float32 cos/sin; the original computes (and
        # returns) the promoted dtype, and so does Liger's kernel on promoted copies
        promoted = torch.promote_types(q.dtype, cos.dtype)
        q, k, cos, sin = (t.to(promoted) for t in (q, k, cos, sin))
    rotated: tuple[Tensor, Tensor] = rope(q, k, cos, sin)
    return rotated


def _llama4(given: tuple[Any, ...], spec: RotarySpec) -> tuple[Tensor, ...] | None:
    """Liger's Llama 4 RoPE (``LigerLlama4RopeFunction``, what Liger's patch binds as
    ``apply_rotary_emb``) on bshd ``xq, xk`` and complex ``freqs_cis``, where it takes
    them: one row of positions (Liger's kernel reads ``freqs_cis`` as (seq, pairs), so
    rows of a left-padded batch, which have positions of their own, run the original)."""
    q, k, freqs = given
    if not (
        q.dim() == k.dim() == 4
        and freqs.is_complex()
        and freqs.dim() == 3
        and freqs.shape[0] == 1
        and freqs.shape[1] == q.shape[1] == k.shape[1]
        and 2 * freqs.shape[-1] == q.shape[-1] == k.shape[-1]
        and q.is_cuda
        and q.device == k.device == freqs.device
    ):
        return None
    from layerswap.backends.liger.runtime import kernels

    kernels()  # the requirement, or RequirementError naming it
    from liger_kernel.ops import LigerLlama4RopeFunction

    rotated: tuple[Tensor, Tensor] = LigerLlama4RopeFunction.apply(q, k, freqs)
    return rotated


class LigerRotary(RotaryReplacement):
    """A model's own attention whose rotary application is Liger-Kernel's RoPE kernel."""

    backend = "liger"
    kernels: ClassVar[Mapping[str, RotaryKernel]] = {"half": _rope, "complex": _llama4}
    operands = frozenset({2})
