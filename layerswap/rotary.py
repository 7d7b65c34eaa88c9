"""Rotary position embeddings, in every layout a family may use: the one rotation.

The fused layer rotates queries and keys with :func:`rotate`; family inference reads a
family's layout (:attr:`layerswap.decoder_shape.Rope.layout`) by comparing its
``apply_rotary_pos_emb`` with :func:`rotate` in each of :data:`ROTARY_LAYOUTS`.

Example::

    query = rotate(query, cos, sin, family.rope.layout)   # bhsd states, (batch, seq, dim) cos/sin
"""

from __future__ import annotations

import torch

__all__ = ["ROTARY_LAYOUTS", "rotate", "rotate_half", "rotate_interleaved"]

#: the rotary layouts a family may have (:attr:`layerswap.decoder_shape.Rope.layout`); the last one
#: takes cos/sin for half a head
ROTARY_LAYOUTS = ("half", "half_reversed", "interleaved", "interleaved_from_half", "half_narrow")


def rotate_half(states: torch.Tensor) -> torch.Tensor:
    """``[-second half, first half]`` of the last axis: the rotate-half rotary convention.

    transformers' rotary embedding is ``x * cos + rotate_half(x) * sin``, with cos/sin
    repeated over both halves of the head. Each backend writes that product itself: the
    order its operations are recorded in fixes the order autograd sums gradients in, so
    it is part of a backend's bitwise behaviour.

    Example::

        rotate_half(torch.tensor([1.0, 2.0, 3.0, 4.0]))   # tensor([-3., -4., 1., 2.])
    """
    half = states.shape[-1] // 2
    return torch.cat((-states[..., half:], states[..., :half]), dim=-1)


def rotate_interleaved(states: torch.Tensor) -> torch.Tensor:
    """``[-x1, x0, -x3, x2, ...]``: each adjacent pair of the last axis turned, the
    interleaved rotary convention (Cohere, GLM), used as :func:`rotate_half` is.

    Example::

        rotate_interleaved(torch.tensor([1.0, 2.0, 3.0, 4.0]))   # tensor([-2., 1., -4., 3.])
    """
    return torch.stack((-states[..., 1::2], states[..., ::2]), dim=-1).flatten(-2)


def rotate(
    states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout: str = "half"
) -> torch.Tensor:
    """Rotary position embedding of bhsd ``states``; cos/sin are (batch, seq, rotary dim).

    Partial rotary (``partial_rotary_factor`` < 1, Phi-3, GLM): cos/sin are narrower than
    a head, and only its first dims rotate; the rest pass through, as in transformers.
    ``layout`` is the family's :attr:`~layerswap.decoder_shape.Rope.layout`: rotate halves (by the
    angle, or by its negative: nanochat), or
    interleaved pairs with cos/sin as given (Cohere) or from their first half (GLM), or
    halves with cos/sin given for one half (gpt-oss).
    Some families pass float32 cos/sin whatever the model's dtype (OLMo 2, ERNIE 4.5): the
    rotation is then computed in float32 and cast back to ``states``' dtype, as theirs is.
    """
    if layout == "half_narrow":  # cos/sin of one half: the rotate-half layout's, whole
        cos, sin, layout = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1), "half"
    width = cos.shape[-1]
    if width != states.shape[-1]:
        passed = states[..., width:]
        return torch.cat((rotate(states[..., :width], cos, sin, layout), passed), dim=-1)
    if layout == "half":
        rotated = rotate_half(states)
    elif layout == "half_reversed":  # nanochat: rotate_half is (x2, -x1), the angle negated
        rotated = -rotate_half(states)
    else:
        if layout == "interleaved_from_half":
            cos = cos[..., : width // 2].repeat_interleave(2, dim=-1)
            sin = sin[..., : width // 2].repeat_interleave(2, dim=-1)
        rotated = rotate_interleaved(states)
    return (states * cos.unsqueeze(1) + rotated * sin.unsqueeze(1)).to(states.dtype)
