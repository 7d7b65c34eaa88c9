"""The ``fused`` backend's MLP: the activation and its product recomputed in the backward
pass, so a gated MLP keeps three of its four intermediate tensors for it.

In training, PyTorch's autograd keeps, per gated MLP, the gate's output (for the
activation's gradient), the activation's output and the up projection's output (for the
product's), and the product (for the down projection's weight gradient): four tensors of
``tokens x intermediate``. ``torch.utils.checkpoint`` around ``act(gate) * up`` keeps the
gate and up outputs it needs and recomputes the activation when the gradient comes, one
elementwise pass; the values and gradients are the original's, bit for bit. Outside
autograd (inference, ``no_grad``) it is the original's computation.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import ClassVar

import torch
import torch.nn.modules.module as module_hooks
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from layerswap.backends.mlp import MLPKernel, MLPReplacement
from layerswap.mlps import ACTIVATIONS

__all__ = ["FusedMLP", "recomputed_product"]


def _product(gate: Tensor, up: Tensor, act: Callable[[Tensor], Tensor]) -> Tensor:
    return act(gate) * up


def _hooked(act: Callable[[Tensor], Tensor]) -> bool:
    """Whether calling ``act`` (an activation module) runs hooks: a recomputation would run
    them a second time (a random one, a dropout on the activation, drawing anew)."""
    if not isinstance(act, nn.Module):
        return False
    tables = (act._forward_hooks, act._forward_pre_hooks)
    everywhere = (module_hooks._global_forward_hooks, module_hooks._global_forward_pre_hooks)
    return any(tables) or any(everywhere)


def recomputed_product(gate: Tensor, up: Tensor, act: Callable[[Tensor], Tensor]) -> Tensor:
    """``act(gate) * up``; where a gradient will flow, the activation's output is not kept
    but recomputed from ``gate`` in the backward pass (not where the activation module
    has hooks: they run once, as in the original)."""
    grads = torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad)
    if grads and not _hooked(act):
        out: Tensor = checkpoint(
            _product, gate, up, act, use_reentrant=False, preserve_rng_state=False
        )
        return out
    return act(gate) * up


class FusedMLP(MLPReplacement):
    """A model's own gated MLP whose activation is recomputed in the backward pass."""

    backend = "fused"
    kernels: ClassVar[Mapping[str, MLPKernel]] = {
        kind: recomputed_product for kind in (*ACTIVATIONS, "other")
    }
