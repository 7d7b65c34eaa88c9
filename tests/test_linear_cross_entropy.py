"""The chunked linear + cross-entropy equals ``F.cross_entropy(F.linear(h, W))``: loss and gradients."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from layerswap.ops import LogitTransform, linear_cross_entropy

TRANSFORMS: dict[str, tuple[LogitTransform, ...]] = {
    "plain": (),
    "softcap": (LogitTransform("softcap", 2.5),),
    "scaled": (LogitTransform("div", 4.0),),
    "multiplied-then-capped": (LogitTransform("mul", 1.5), LogitTransform("softcap", 3.0)),
}


def _inputs(
    rows: int, hidden: int, vocab: int, dtype: torch.dtype, *, bias: bool = False, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    h = torch.randn(rows, hidden, generator=generator, dtype=torch.float64).to(dtype)
    w = (torch.randn(vocab, hidden, generator=generator, dtype=torch.float64) / 2).to(dtype)
    b = torch.randn(vocab, generator=generator, dtype=torch.float64).to(dtype) if bias else None
    targets = torch.randint(0, vocab, (rows,), generator=generator)
    targets[::3] = -100
    for tensor in (h, w, b):
        if tensor is not None:
            tensor.requires_grad_(True)
    return h, w, b, targets


def _reference(
    h: torch.Tensor,
    w: torch.Tensor,
    b: torch.Tensor | None,
    targets: torch.Tensor,
    transforms: Sequence[LogitTransform],
    reduction: str = "mean",
) -> torch.Tensor:
    logits = F.linear(h, w, b)
    for transform in transforms:
        logits = transform.apply(logits)
    wide = torch.promote_types(logits.dtype, torch.float32)
    return F.cross_entropy(logits.to(wide), targets, ignore_index=-100, reduction=reduction)


def _grads(loss: torch.Tensor, *tensors: torch.Tensor | None) -> list[torch.Tensor]:
    present = [t for t in tensors if t is not None]
    return list(torch.autograd.grad(loss, present))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("transform", list(TRANSFORMS), ids=list(TRANSFORMS))
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_loss_and_gradients_equal_the_unfused_computation(
    dtype: torch.dtype, transform: str, bias: bool
) -> None:
    h, w, b, targets = _inputs(37, 16, 53, dtype, bias=bias)
    transforms = TRANSFORMS[transform]
    expected = _reference(h, w, b, targets, transforms)
    fused = linear_cross_entropy(h, w, targets, b, transforms=transforms, chunk_size=8)
    tight = 1e-12 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(fused, expected, rtol=tight, atol=tight)
    for got, want in zip(_grads(fused, h, w, b), _grads(expected, h, w, b), strict=True):
        torch.testing.assert_close(got, want, rtol=tight, atol=tight)


def test_sum_divided_by_num_items_in_batch_is_transformers_reduction() -> None:
    h, w, _, targets = _inputs(20, 8, 30, torch.float64)
    num_items = torch.tensor(7.0, dtype=torch.float64)
    expected = _reference(h, w, None, targets, (), reduction="sum") / num_items
    fused = linear_cross_entropy(h, w, targets, reduction="sum", chunk_size=3) / num_items
    torch.testing.assert_close(fused, expected, rtol=1e-12, atol=1e-12)
    for got, want in zip(_grads(fused, h, w), _grads(expected, h, w), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_leading_dimensions_are_flattened_like_the_targets() -> None:
    h, w, _, targets = _inputs(24, 8, 30, torch.float64)
    fused = linear_cross_entropy(h.view(2, 12, 8), w, targets.view(2, 12), chunk_size=5)
    torch.testing.assert_close(fused, _reference(h, w, None, targets, ()), rtol=1e-12, atol=0)


def test_a_frozen_weight_gets_no_gradient_and_hidden_still_does() -> None:
    h, w, _, targets = _inputs(10, 8, 30, torch.float32)
    w.requires_grad_(False)
    fused = linear_cross_entropy(h, w, targets, chunk_size=4)
    (grad_h,) = torch.autograd.grad(fused, h)
    (want,) = torch.autograd.grad(_reference(h, w, None, targets, ()), h)
    torch.testing.assert_close(grad_h, want)


def test_without_grad_mode_only_the_loss_is_computed() -> None:
    h, w, _, targets = _inputs(10, 8, 30, torch.float32)
    with torch.no_grad():
        fused = linear_cross_entropy(h, w, targets)
    assert not fused.requires_grad
    torch.testing.assert_close(fused, _reference(h, w, None, targets, ()).detach())


def test_all_targets_ignored_gives_nan_like_cross_entropy() -> None:
    h, w, _, targets = _inputs(6, 8, 30, torch.float32)
    targets[:] = -100
    assert torch.isnan(linear_cross_entropy(h, w, targets))
    assert torch.isnan(_reference(h, w, None, targets, ()))


def test_gradient_is_scaled_by_the_incoming_gradient() -> None:
    h, w, _, targets = _inputs(9, 8, 30, torch.float64)
    (scaled,) = torch.autograd.grad(3.0 * linear_cross_entropy(h, w, targets, chunk_size=2), w)
    (want,) = torch.autograd.grad(3.0 * _reference(h, w, None, targets, ()), w)
    torch.testing.assert_close(scaled, want, rtol=1e-12, atol=1e-12)


def test_bfloat16_stays_close_to_the_unfused_bfloat16_computation() -> None:
    h, w, _, targets = _inputs(64, 32, 100, torch.bfloat16)
    fused = linear_cross_entropy(h, w, targets, chunk_size=16)
    expected = _reference(h, w, None, targets, ())
    torch.testing.assert_close(fused, expected, rtol=1e-2, atol=1e-2)
    got, want = _grads(fused, h, w), _grads(expected, h, w)
    for a, b in zip(got, want, strict=True):
        assert a.dtype == torch.bfloat16
        torch.testing.assert_close(a.float(), b.float(), rtol=5e-2, atol=5e-3)


def test_a_target_outside_the_vocabulary_is_refused_by_value() -> None:
    h, w, _, targets = _inputs(6, 8, 30, torch.float32)
    targets[2] = 30
    with pytest.raises(ValueError, match="target 30 is outside the vocabulary"):
        linear_cross_entropy(h, w, targets)


def test_mismatched_targets_are_refused() -> None:
    h, w, _, targets = _inputs(6, 8, 30, torch.float32)
    with pytest.raises(ValueError, match="one target per row"):
        linear_cross_entropy(h, w, targets[:5])


@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(1, 40),
    hidden=st.integers(1, 12),
    vocab=st.integers(2, 60),
    chunk=st.integers(1, 50),
    transform=st.sampled_from(list(TRANSFORMS)),
    seed=st.integers(0, 2**16),
)
def test_any_shape_and_chunk_size_gives_the_unfused_result(
    rows: int, hidden: int, vocab: int, chunk: int, transform: str, seed: int
) -> None:
    h, w, _, targets = _inputs(rows, hidden, vocab, torch.float64, seed=seed)
    targets[0] = 0  # at least one counted target: the mean is defined
    transforms = TRANSFORMS[transform]
    expected = _reference(h, w, None, targets, transforms)
    fused = linear_cross_entropy(h, w, targets, transforms=transforms, chunk_size=chunk)
    torch.testing.assert_close(fused, expected, rtol=1e-10, atol=1e-12)
    for got, want in zip(_grads(fused, h, w), _grads(expected, h, w), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
