"""Streaming mode: the swapped model's activations with one replacement layer at a time.

A reference pass records every layer's output; a second pass replaces each decoder
layer's output, through a forward hook, by the output of a replacement layer built from
that layer's weights on the fly and dropped right after. Memory: one model plus one
layer.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from layerswap.comparison.compare import Comparison
from layerswap.comparison.forward import (
    ContextFactory,
    evaluation,
    forward,
    layer_hooks,
    layer_output,
)
from layerswap.comparison.gradients import layer_gradients_to_original
from layerswap.comparison.inputs import text_config
from layerswap.comparison.placement import model_placement, working_copy
from layerswap.comparison.report import VerificationReport
from layerswap.layers import convert_layer, layer_index
from layerswap.model import decoder_layers
from layerswap.verify.candidate import candidate_context

if TYPE_CHECKING:
    from layerswap.substitution import Substitution

__all__ = ["verify_streaming"]

# what a decoder layer was called with: positional and keyword arguments
_LayerInput = tuple[tuple[Any, ...], dict[str, Any]]


def _replacement_layer(
    sub: Substitution, layer: nn.Module, position: int, config: Any
) -> nn.Module:
    """The replacement for one original ``layer``, converted the way :func:`swap` converts.

    The original is only read: renamed tensors are shared with it (detached and frozen),
    computed ones are new, so the replacement costs at most one layer of memory.
    """
    replacement = convert_layer(
        layer,
        sub,
        config,
        layer_idx=layer_index(layer, position),
        where=f"layer {position}",
        grad=False,
        detach=True,
    )
    return replacement.eval()


def verify_streaming(
    model: nn.Module, sub: Substitution, comparison: Comparison, *, backward: bool
) -> VerificationReport:
    """:func:`~layerswap.verify` with ``streaming=True`` (see the module docstring)."""
    device, dtype = comparison.device, comparison.dtype
    in_place = model_placement(model) == (device, dtype)
    host = model if in_place else working_copy(model, device, dtype, trainable=False)
    layers = decoder_layers(host)
    config = text_config(host)
    context = candidate_context(sub)
    batch = comparison.batch

    # pass 1: the reference, with every layer's input kept for the local backward check
    layer_inputs: list[_LayerInput] = []

    def keep_input(position: int, layer: nn.Module) -> RemovableHandle:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            kept = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)
            layer_inputs.append((kept, dict(kwargs)))

        return layer.register_forward_pre_hook(hook, with_kwargs=True)

    with layer_hooks(layers, keep_input) if backward else contextlib.nullcontext():
        # no routing recorded: in pass 2 the original layers' blocks run on the swapped
        # model's inputs, not the replacements', so their routing would prove nothing
        reference = forward(host, batch, loss=backward, routing=False)

    # pass 2: each decoder layer's output replaced by its replacement's, built on the fly;
    # registered before forward() captures the outputs, so the replacement's is captured
    def substitute(position: int, layer: nn.Module) -> RemovableHandle:
        def hook(
            module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
        ) -> Any:
            replacement = _replacement_layer(sub, module, position, config)
            with context():
                return replacement(*args, **kwargs)

        return layer.register_forward_hook(hook, with_kwargs=True)

    with layer_hooks(layers, substitute):
        candidate = forward(host, batch, loss=backward, routing=False)

    if backward:
        valid = batch["attention_mask"].bool()
        reference.gradients, candidate.gradients = _local_gradients(
            layers, layer_inputs, sub, config, valid, context
        )
    return comparison.report(reference, candidate, mode="streaming", local_gradients=True)


def _local_gradients(
    layers: Sequence[tuple[str, nn.Module]],
    layer_inputs: Sequence[_LayerInput],
    sub: Substitution,
    config: Any,
    valid: torch.Tensor,
    context: ContextFactory,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Per-layer gradients on the reference's inputs, one replacement layer at a time.

    Each layer and its replacement get the reference's input for that layer and the same
    random upstream gradient, so a difference points at that layer alone. Returns the
    reference's and the candidate's gradients (the candidate's in the original layout).
    """
    ref_grads: dict[str, torch.Tensor] = {}
    cand_grads: dict[str, torch.Tensor] = {}
    for position, ((qualname, layer), (args, kwargs)) in enumerate(
        zip(layers, layer_inputs, strict=True)
    ):
        hidden = args[0] if args else kwargs.pop("hidden_states")
        rest = args[1:]
        generator = torch.Generator().manual_seed(position)
        upstream = torch.randn(hidden.shape, generator=generator).to(hidden)
        upstream = upstream * valid.unsqueeze(-1).to(upstream)
        replacement = _replacement_layer(sub, layer, position, config)
        for grads, module, ctx in (
            (ref_grads, layer, contextlib.nullcontext),
            (cand_grads, replacement, context),
        ):
            input_grad, local = _layer_gradients(module, hidden, rest, kwargs, upstream, ctx)
            if module is replacement:
                local = layer_gradients_to_original(replacement, local, sub, config)
            grads[f"{qualname}.<input>"] = input_grad[valid]
            grads.update({f"{qualname}.{name}": value for name, value in local.items()})
        del replacement
    return ref_grads, cand_grads


def _layer_gradients(
    module: nn.Module,
    hidden: torch.Tensor,
    rest: tuple[Any, ...],
    kwargs: dict[str, Any],
    upstream: torch.Tensor,
    context: ContextFactory,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The gradients of one layer's input and floating-point parameters for ``upstream``.

    Every parameter takes part, whatever its ``requires_grad``, which is restored after.
    """
    params = [(n, p) for n, p in module.named_parameters() if p.is_floating_point()]
    flags = [p.requires_grad for _, p in params]
    x = hidden.detach().clone().requires_grad_(True)
    try:
        for _, p in params:
            p.requires_grad_(True)
        with torch.enable_grad(), context(), evaluation(module):
            out = layer_output(module(x, *rest, **kwargs))
            grads = torch.autograd.grad(
                out, [x, *(p for _, p in params)], upstream, allow_unused=True
            )
    finally:
        for (_, p), flag in zip(params, flags, strict=True):
            p.requires_grad_(flag)
    local = {
        name: (g if g is not None else torch.zeros_like(p)).detach()
        for (name, p), g in zip(params, grads[1:], strict=True)
    }
    return grads[0].detach(), local
