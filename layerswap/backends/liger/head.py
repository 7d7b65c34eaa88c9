"""The ``liger`` backend's head: Liger-Kernel's fused linear cross-entropy, GPU only.

In training (``labels`` given, training mode) the loss is Liger's
``liger_fused_linear_cross_entropy``: the logits of a chunk of tokens at a time, their
gradient taken in the same pass, so the full-vocabulary logits never exist; ``logits`` is
``None`` then (``skip_logits=False`` gives the original computation and the logits).
Inference (no labels, or eval mode) runs the original ``forward`` untouched. The head
contract (class swap, label shift, ``num_items_in_batch``, what is refused) is
:mod:`layerswap.backends.head`, shared with ``<family>.head.fused``.

The family's logit transforms are reproduced: a soft-cap (Gemma 2's
``final_logit_softcapping``) by Liger's own ``softcap``; a scaling (Granite's
``logits_scaling``, Cohere's ``logit_scale``) on the hidden states (and bias) before the
projection, which is the same product. A head that scales after soft-capping is refused
when it is swapped. The ``lm_head`` gradient is accumulated in float32 across chunks
(``accum_dtype``) and cast to the weight's dtype once.

Example::

    model = LlamaForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda()
    handle = layerswap.swap(model, "llama.head.liger")
    model.train()
    loss = model(input_ids, labels=input_ids).loss     # .logits is None
    loss.backward()
    handle.undo()
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from layerswap.backend import Implementation
from layerswap.backends.head import (
    CausalLMHead,
    check_head,
    head_class,
    head_class_named,
    head_contract,
)
from layerswap.backends.liger.declaration import BACKEND
from layerswap.backends.liger.runtime import kernels, require_cuda
from layerswap.errors import RequirementError
from layerswap.family import Family
from layerswap.ops.linear_cross_entropy import LogitTransform
from layerswap.substitution import Substitution

if TYPE_CHECKING:
    from transformers import PreTrainedConfig

__all__ = ["HEAD", "LigerHead", "check_liger_head", "liger_head_class", "unreproducible"]


def unreproducible(steps: Sequence[tuple[str, Any]]) -> str | None:
    """Why Liger's loss cannot reproduce a head's logit ``steps`` (kind first), or ``None``.

    Scalings fold into the hidden states before the projection and one soft-cap is
    Liger's own; a step after the soft-cap has no place.
    """
    capped = False
    for kind, *_ in steps:
        if capped:
            return (
                "Liger's fused linear cross-entropy soft-caps the logits last; this head "
                f"applies a {kind!r} step after its soft-cap"
            )
        capped = kind == "softcap"
    return None


class LigerHead(CausalLMHead):
    """Liger's fused linear + cross-entropy head (see the module docstring)."""

    backend: ClassVar[str] = "liger"
    summary: ClassVar[str] = "Liger's fused linear + cross-entropy when training with labels"

    def _summed_loss(
        self,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        targets: torch.Tensor,
        transforms: Sequence[LogitTransform],
        ignore_index: int,
    ) -> torch.Tensor:
        require_cuda(hidden, self)
        reason = unreproducible([(step.kind, step.value) for step in transforms])
        if reason is not None:
            raise RequirementError(reason)
        softcap = None
        for step in transforms:
            if step.kind == "softcap":
                softcap = step.value
            else:
                # (h W^T + b) / s == (h / s) W^T + b / s
                hidden = step.apply(hidden)
                bias = None if bias is None else step.apply(bias)
        loss: torch.Tensor = kernels().liger_fused_linear_cross_entropy(
            hidden,
            weight,
            targets,
            bias,
            ignore_index=ignore_index,
            reduction="sum",
            softcap=softcap,
            accum_dtype=torch.float32,
        )
        return loss


def liger_head_class(family: Family) -> type[torch.nn.Module]:
    """The Liger-head class of ``family`` (``LigerLlamaForCausalLM``), made once."""
    return head_class(LigerHead, family)


def check_liger_head(sub: Substitution, config: PreTrainedConfig) -> None:
    """The head still has the structure layerswap reads, in a form Liger's loss reproduces."""
    check_head(sub, config)
    reason = unreproducible(head_contract(sub.original_class()).steps)
    if reason is not None:
        raise RequirementError(f"{sub.name} cannot reproduce this head: {reason}")


#: the ``liger`` backend's ``head`` slot, as declared (:mod:`layerswap.backends.liger.declaration`)
HEAD: Implementation = BACKEND.slots["head"]


def __getattr__(name: str) -> Any:
    # a pickled model names its class; make it on demand in a fresh process
    return head_class_named(LigerHead, name)
