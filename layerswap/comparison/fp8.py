"""FP8's noise floor: a reference pass whose decoder GEMMs round their operands to FP8.

A layer computing its matrix products in FP8 (TransformerEngine inside
``te.fp8_autocast``) moves every decoder layer's output by the rounding of its operands;
how far depends on the model's width and depth. A fixed FP8 tolerance is therefore too
tight for a deep model and too loose for a shallow one. Both were seen: on an H100, a
16-layer Llama (hidden 2048, random weights) under TE's current scaling ended at a
per-token cosine of 0.94 at its last layer, below the fixed 0.95 -- while the same
model with every decoder ``nn.Linear`` computing on E4M3-rounded operands (this module,
exact accumulation) matched TE's global cosine to four digits at each of the 16 layers:
FP8's precision, not a wrong layer. And on a 6-layer tiny Llama on the CPU, a
sign-flipped ``down_proj`` in one layer stayed above 0.95 (cosine 0.964, where FP8
rounding alone gives 0.996).

So :func:`layerswap.verify` runs the reference a second time under :func:`ideal_fp8`
and holds an FP8 candidate, layer by layer and at the logits, to :data:`FLOOR_FACTOR`
times the ideal-FP8 error measured at that point (cosine deficit and relative error,
with :data:`FLOOR_SLACK` on the cosine), instead of the fixed FP8 tolerance. Cached
decoding is held to what ideal FP8 decoding reaches: the token agreement the reference
keeps with its ideal-FP8 run (where that is below the fixed minimum), its logits at each
step to :data:`FLOOR_FACTOR` times ideal FP8's error, and a first differing token that
is a near-tie passes. A random-weight model's next tokens are often near-tied, so FP8
rounding alone can change the first one (seen on an H200: a 16-layer Llama under TE's
current scaling parted at token 0, each layer within the floor). Gradients keep the
fixed FP8 tolerance.

Example::

    with ideal_fp8(model.model.layers):
        logits = model(input_ids).logits      # as if every decoder GEMM ran in FP8
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

__all__ = ["E4M3_MAX", "FLOOR_FACTOR", "FLOOR_SLACK", "ideal_fp8", "round_e4m3"]

E4M3_MAX = 448.0
# How much noisier than ideal rounding an FP8 candidate may be. Measured on an H100 (TE
# 2.20, 16-layer Llama): current scaling 1.0x the ideal cosine deficit at every layer,
# delayed scaling 1.3x (its first step runs with scale 1, so small weights fall into
# E4M3's subnormal range). A wrong weight moves a layer by far more.
FLOOR_FACTOR = 2.0
# cosine deficit allowed on top: what BF16 attention and norms add when FP8 adds little
FLOOR_SLACK = 1e-4


def round_e4m3(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` rounded to FP8 E4M3 with one scale for the whole tensor (current scaling).

    The scale maps the tensor's largest magnitude to E4M3's largest value (448), as
    TransformerEngine's current-scaling recipe does; the result is in ``tensor``'s dtype.

    Example::

        round_e4m3(torch.tensor([1.0, 1.1, 448.0]))    # tensor([1.0, 1.125, 448.0])
    """
    amax = tensor.detach().abs().amax().float()
    if not torch.isfinite(amax) or amax == 0:
        return tensor
    scale = E4M3_MAX / amax
    rounded = (tensor.float() * scale).to(torch.float8_e4m3fn).float() / scale
    return rounded.to(tensor.dtype)


def _round_input(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
    return (round_e4m3(args[0]), *args[1:])


@contextlib.contextmanager
def ideal_fp8(layers: Iterable[nn.Module]) -> Iterator[None]:
    """Inside the block, every ``nn.Linear`` in ``layers`` computes on E4M3-rounded operands.

    Inputs are rounded by a forward pre-hook, weights in place; both are restored
    exactly on exit (the same ``Parameter`` objects, the same values), whatever happens
    inside. Biases, norms and attention stay as they are, as in TransformerEngine's FP8
    layers, whose attention runs in BF16.
    """
    linears = [m for layer in layers for m in layer.modules() if isinstance(m, nn.Linear)]
    saved: list[tuple[nn.Linear, torch.Tensor]] = []
    handles = []
    try:
        with torch.no_grad():
            for linear in linears:
                saved.append((linear, linear.weight.detach().clone()))
                linear.weight.copy_(round_e4m3(linear.weight))
        handles = [linear.register_forward_pre_hook(_round_input) for linear in linears]
        yield
    finally:
        for handle in handles:
            handle.remove()
        with torch.no_grad():
            for linear, weight in saved:
                linear.weight.copy_(weight)
