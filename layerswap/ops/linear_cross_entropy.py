"""Cross-entropy of a linear projection without the full logits: ``F.cross_entropy(h @ W.T, y)``.

A causal LM's training step materialises ``tokens x vocabulary`` logits, then their
float32 copy, then a gradient of the same size: with a 128k vocabulary that is most of a
small model's training memory. :func:`linear_cross_entropy` computes the same loss chunk
by chunk over the tokens, and computes the gradients with respect to the hidden states,
the weight (and the bias) in the same pass -- the design of Liger-Kernel's fused linear
cross-entropy -- so at most one chunk of logits exists at a time. ``backward`` only scales
the stored gradients by the incoming one (a scalar), which is why the op is
differentiable once (no double backward).

The numerics follow transformers' ``ForCausalLMLoss``: the logits are computed in the
hidden states' dtype, transformed there (a family's scaling or soft-capping, in its order),
upcast to float32 (float64 stays float64), and then the loss is taken. The weight
gradient is accumulated in that precision across chunks and cast to the weight's dtype
once. On CUDA each chunk's weight-gradient product runs on the tensor cores in the hidden
states' dtype and adds into the float32 sum in the same matrix multiply (cuBLAS with a
float32 output); elsewhere the operands are upcast first.

A chunk holds at least :data:`DEFAULT_CHUNK_BYTES` of float32 logits, and, for long
inputs, as many rows as keep its logits no larger than the hidden states themselves
(Liger-Kernel's rule): small chunks starve a GPU of work, and the float32 sum of the
weight gradient is read and written once per chunk.

Example::

    loss = linear_cross_entropy(hidden, lm_head.weight, targets)            # mean
    loss = linear_cross_entropy(hidden, weight, targets, reduction="sum") / num_items
    loss = linear_cross_entropy(hidden, weight, targets,
                                transforms=(LogitTransform("softcap", 30.0),))
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch.autograd.function import FunctionCtx, once_differentiable

__all__ = ["DEFAULT_CHUNK_BYTES", "LogitTransform", "chunk_rows", "linear_cross_entropy"]

#: the float32 logits of one chunk take about this many bytes (a few copies live at once)
DEFAULT_CHUNK_BYTES = 32 * 2**20


@dataclass(frozen=True)
class LogitTransform:
    """One elementwise step between the projection and the loss, as a family's head does it.

    ``"div"``: ``z / value`` (granite's ``logits_scaling``); ``"mul"``: ``z * value``
    (cohere's ``logit_scale``); ``"softcap"``: ``tanh(z / value) * value`` (gemma2's
    ``final_logit_softcapping``).
    """

    kind: Literal["div", "mul", "softcap"]
    value: float

    def __post_init__(self) -> None:
        if self.kind not in ("div", "mul", "softcap"):
            raise ValueError(f"unknown logit transform {self.kind!r}; use div, mul or softcap")

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """The transformed logits, computed as transformers computes them."""
        if self.kind == "div":
            return logits / self.value
        if self.kind == "mul":
            return logits * self.value
        return torch.tanh(logits / self.value) * self.value


def chunk_rows(vocab_size: int, budget_bytes: int = DEFAULT_CHUNK_BYTES) -> int:
    """How many token rows one chunk holds so its float32 logits fit ``budget_bytes``."""
    return max(1, budget_bytes // (4 * max(vocab_size, 1)))


def _default_chunk(tokens: int, hidden_size: int, vocab_size: int) -> int:
    """:func:`chunk_rows`, or more rows where the logits of that many stay no larger than
    the hidden states of all ``tokens`` (``tokens / ceil(vocab / hidden)``)."""
    like_hidden = -(-tokens // max(1, -(-vocab_size // max(hidden_size, 1))))
    return max(chunk_rows(vocab_size), like_hidden)


_WIDE_ADDMM_PROVEN: dict[torch.device, bool] = {}


def _wide_addmm_works(device: torch.device) -> bool:
    """Whether ``torch.addmm(..., out_dtype=float32, out=acc)`` accumulates bfloat16
    products into ``acc`` on ``device``: checked once per device against the upcast
    product (older torch has no ``out_dtype``; CPU builds have no such kernel)."""
    if device.type != "cuda":
        return False
    known = _WIDE_ADDMM_PROVEN.get(device)
    if known is None:
        generator = torch.Generator(device=device).manual_seed(0)
        a = torch.randn(64, 32, device=device, generator=generator).to(torch.bfloat16)
        b = torch.randn(32, 48, device=device, generator=generator).to(torch.bfloat16)
        acc = torch.randn(64, 48, device=device, generator=generator)
        expected = acc + a.float() @ b.float()
        try:
            torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
            known = bool(torch.allclose(acc, expected, rtol=1e-5, atol=1e-4))
        except (RuntimeError, TypeError):
            known = False
        _WIDE_ADDMM_PROVEN[device] = known
    return known


def _accumulate_product(total: torch.Tensor, left: torch.Tensor, right: torch.Tensor) -> None:
    """``total += left @ right`` with ``total`` in a wider dtype than ``left``/``right``."""
    if left.dtype == total.dtype:
        total.addmm_(left, right)
    elif left.dtype in (torch.bfloat16, torch.float16) and _wide_addmm_works(total.device):
        torch.addmm(total, left, right, out_dtype=total.dtype, out=total)
    else:
        total.addmm_(left.to(total.dtype), right.to(total.dtype))


def _chunk_loss_and_grad(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    ignore_index: int,
    transforms: Sequence[LogitTransform],
    want_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Summed loss of one chunk and the gradient of that sum w.r.t. the chunk's logits."""
    logits = F.linear(hidden, weight, bias)
    steps = [logits]
    for transform in transforms:
        steps.append(transform.apply(steps[-1]))
    upcast = steps[-1].to(_accumulation_dtype(hidden.dtype))
    valid = targets != ignore_index
    safe_targets = torch.where(valid, targets, torch.zeros_like(targets))
    log_norm = torch.logsumexp(upcast, dim=-1)
    picked = upcast.gather(1, safe_targets.unsqueeze(1)).squeeze(1)
    loss = ((log_norm - picked) * valid).sum()
    if not want_grad:
        return loss, None
    # d(sum of losses)/d(upcast logits) = softmax - one_hot, zero on ignored rows
    grad = torch.exp(upcast.sub_(log_norm.unsqueeze(1)))
    grad.scatter_add_(1, safe_targets.unsqueeze(1), -torch.ones_like(picked).unsqueeze(1))
    grad.mul_(valid.unsqueeze(1))
    del upcast
    # back through the transforms, last first, in float32
    for transform, before in zip(reversed(transforms), reversed(steps[:-1]), strict=True):
        if transform.kind == "div":
            grad.div_(transform.value)
        elif transform.kind == "mul":
            grad.mul_(transform.value)
        else:
            squashed = torch.tanh(before.to(grad.dtype) / transform.value)
            grad.mul_(1.0 - squashed.square_())
    return loss, grad.to(hidden.dtype)


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


class _LinearCrossEntropy(torch.autograd.Function):
    """Summed cross-entropy of ``hidden @ weight.T + bias``; gradients made in forward."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: FunctionCtx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        targets: torch.Tensor,
        ignore_index: int,
        transforms: tuple[LogitTransform, ...],
        chunk: int,
        needs: tuple[bool, bool, bool],
    ) -> torch.Tensor:
        need_hidden, need_weight, need_bias = needs
        want_grad = any(needs)
        wide = _accumulation_dtype(hidden.dtype)
        total = torch.zeros((), dtype=wide, device=hidden.device)
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        grad_weight = torch.zeros(
            weight.shape if need_weight else (0,), dtype=wide, device=weight.device
        )
        grad_bias = (
            torch.zeros(bias.shape, dtype=wide, device=bias.device)
            if need_bias and bias is not None
            else None
        )
        for start in range(0, hidden.shape[0], chunk):
            rows = slice(start, start + chunk)
            loss, grad_logits = _chunk_loss_and_grad(
                hidden[rows], weight, bias, targets[rows], ignore_index, transforms, want_grad
            )
            total += loss
            if grad_logits is None:
                continue
            if grad_hidden is not None:
                torch.mm(grad_logits, weight, out=grad_hidden[rows])
            if need_weight:
                _accumulate_product(grad_weight, grad_logits.t(), hidden[rows])
            if grad_bias is not None:
                grad_bias += grad_logits.to(wide).sum(0)
        # new tensors, not inputs or outputs: kept on ctx without save_for_backward's checks
        ctx.gradients = (  # type: ignore[attr-defined]
            grad_hidden,
            grad_weight.to(weight.dtype) if need_weight else None,
            grad_bias.to(bias.dtype) if grad_bias is not None and bias is not None else None,
        )
        return total

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[Any, ...]:
        grad_hidden, grad_weight, grad_bias = ctx.gradients
        scale = grad_output

        def scaled(grad: torch.Tensor | None) -> torch.Tensor | None:
            return None if grad is None else grad * scale.to(grad.dtype)

        return (
            scaled(grad_hidden),
            scaled(grad_weight),
            scaled(grad_bias),
            None,
            None,
            None,
            None,
            None,
        )


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    ignore_index: int = -100,
    reduction: Literal["mean", "sum"] = "mean",
    transforms: Sequence[LogitTransform] = (),
    chunk_size: int | None = None,
) -> torch.Tensor:
    """``F.cross_entropy(t(F.linear(hidden, weight, bias)).float(), targets)``, chunk by chunk.

    ``hidden`` is ``(..., hidden_size)``, ``targets`` has ``hidden``'s leading shape;
    targets equal to ``ignore_index`` count neither in the loss nor in the mean's
    denominator (a mean over no valid target is ``nan``, as in ``F.cross_entropy``).
    ``transforms`` are applied to the logits in order (see :class:`LogitTransform`).
    ``chunk_size`` is the number of token rows per chunk (default: float32 logits of
    about :data:`DEFAULT_CHUNK_BYTES`, or more rows for long inputs: see above). Raises ``ValueError`` for a target outside
    ``[0, vocab)`` that is not ``ignore_index``, and for mismatched shapes.

    Example::

        loss = linear_cross_entropy(h, model.lm_head.weight, shifted_labels)
        loss.backward()          # h.grad and lm_head.weight.grad, never the full logits
    """
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', not {reduction!r}")
    if hidden.shape[:-1] != targets.shape:
        raise ValueError(
            f"hidden states {tuple(hidden.shape)} and targets {tuple(targets.shape)} do not "
            "have one target per row"
        )
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"weight {tuple(weight.shape)} does not project hidden size {hidden.shape[-1]}"
        )
    vocab = weight.shape[0]
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    flat_targets = targets.reshape(-1).to(device=hidden.device, dtype=torch.long)
    out_of_range = (flat_targets != ignore_index) & ((flat_targets < 0) | (flat_targets >= vocab))
    if bool(out_of_range.any()):
        bad = int(flat_targets[out_of_range][0])
        raise ValueError(
            f"target {bad} is outside the vocabulary [0, {vocab}) and is not ignore_index "
            f"({ignore_index})"
        )
    chunk = (
        chunk_size
        if chunk_size is not None
        else _default_chunk(flat_hidden.shape[0], flat_hidden.shape[1], vocab)
    )
    if chunk < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk}")
    grad_on = torch.is_grad_enabled()
    needs = (
        grad_on and hidden.requires_grad,
        grad_on and weight.requires_grad,
        grad_on and bias is not None and bias.requires_grad,
    )
    total: torch.Tensor = _LinearCrossEntropy.apply(  # type: ignore[no-untyped-call]
        flat_hidden, weight, bias, flat_targets, ignore_index, tuple(transforms), chunk, needs
    )
    if reduction == "sum":
        return total
    return total / (flat_targets != ignore_index).sum()
