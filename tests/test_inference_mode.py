"""A swap (or undo) made inside torch.inference_mode() leaves a model that still trains.

Tensors created in inference mode can never join autograd; the converted weights must
not be such tensors, or training after the block fails (or the weights silently stop
learning).
"""

from __future__ import annotations

import copy

import pytest
import torch
from models import left_padded_batch, tiny_model

import layerswap
from layerswap.comparison.gradients import gradients_to_original


def _loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    loss: torch.Tensor = model(**batch, labels=labels, use_cache=False).loss
    return loss


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3"])
def test_swap_inside_inference_mode_gives_trainable_weights(name: str) -> None:
    original = tiny_model(name, num_hidden_layers=2)
    swapped = copy.deepcopy(original)
    batch = left_padded_batch(original.config.vocab_size)
    with torch.inference_mode():
        handle = layerswap.swap(swapped, backend="fused")
        expected = original(**batch).logits
        torch.testing.assert_close(swapped(**batch).logits, expected, atol=1e-5, rtol=0)
    assert not any(param.is_inference() for param in swapped.parameters())
    assert all(param.requires_grad for param in swapped.parameters())

    _loss(original, batch).backward()
    _loss(swapped, batch).backward()
    grads = {n: p.grad for n, p in swapped.named_parameters() if p.grad is not None}
    mapped = gradients_to_original(swapped, grads, handle.substitution)
    for key, param in original.named_parameters():
        torch.testing.assert_close(mapped[key], param.grad, atol=1e-5, rtol=1e-4, msg=key)


def test_undo_inside_inference_mode_gives_back_trainable_bitwise_weights() -> None:
    model = tiny_model("llama", num_hidden_layers=2)
    before = {key: value.clone() for key, value in model.state_dict().items()}
    handle = layerswap.swap(model, backend="fused")
    with torch.inference_mode():
        handle.undo()
    assert not any(param.is_inference() for param in model.parameters())
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key
    batch = left_padded_batch(model.config.vocab_size)
    _loss(model, batch).backward()
    assert all(param.grad is not None for param in model.parameters())
