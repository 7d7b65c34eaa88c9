"""The ``fused`` backend's head: linear + cross-entropy chunk by chunk, never the full logits.

In training (``labels`` given, training mode) the loss is
:func:`layerswap.ops.linear_cross_entropy`: the logits of a chunk of tokens at a time,
their gradient taken in the same pass, so peak memory holds one chunk of logits instead of
all of them, their float32 copy and their gradient. ``logits`` is ``None`` then (as with
Liger-Kernel's fused linear cross-entropy); ``skip_logits=False`` gives the original
computation and the logits. Inference (no labels, or eval mode) runs the original
``forward`` untouched. The head contract (class swap, what is reproduced, what is
refused) is :mod:`layerswap.backends.head`.

Example::

    handle = layerswap.swap(model, "llama.head.fused")
    model.train()
    loss = model(input_ids, labels=input_ids).loss     # .logits is None
    loss.backward()
    handle.undo()
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import torch

from layerswap.backend import Implementation
from layerswap.backends.fused.declaration import BACKEND
from layerswap.backends.head import CausalLMHead, head_class, head_class_named
from layerswap.family import Family
from layerswap.ops.linear_cross_entropy import LogitTransform, linear_cross_entropy

__all__ = ["HEAD", "FusedHead", "fused_head_class"]


class FusedHead(CausalLMHead):
    """The fused linear + cross-entropy head (see the module docstring)."""

    backend: ClassVar[str] = "fused"
    summary: ClassVar[str] = "linear + cross-entropy in chunks when training with labels"

    def _summed_loss(
        self,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        targets: torch.Tensor,
        transforms: Sequence[LogitTransform],
        ignore_index: int,
    ) -> torch.Tensor:
        return linear_cross_entropy(
            hidden,
            weight,
            targets,
            bias,
            ignore_index=ignore_index,
            reduction="sum",
            transforms=transforms,
        )


def fused_head_class(family: Family) -> type[torch.nn.Module]:
    """The fused-head class of ``family`` (``FusedLlamaForCausalLM``), made once."""
    return head_class(FusedHead, family)


#: the ``fused`` backend's ``head`` slot, as declared (:mod:`layerswap.backends.fused.declaration`)
HEAD: Implementation = BACKEND.slots["head"]


def __getattr__(name: str) -> Any:
    # a pickled model names its class; make it on demand in a fresh process
    return head_class_named(FusedHead, name)
