"""A miniature model repository: a tiny Llama, one training step, and text generation.

Nothing here knows about layerswap. Its test suite runs unchanged against swapped
decoder layers with ``pytest --layerswap=llama.decoder.fused``.
"""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def tiny_config() -> LlamaConfig:
    """Two layers, grouped-query attention, a small vocabulary: built in milliseconds."""
    return LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )


def build(config: LlamaConfig | None = None, *, seed: int = 0) -> LlamaForCausalLM:
    """The model with random weights from ``seed``; the global RNG is left as it was."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config if config is not None else tiny_config())
    return model


def train_step(
    model: LlamaForCausalLM, input_ids: torch.Tensor, optimizer: torch.optim.Optimizer
) -> float:
    """One next-token-prediction step; returns the loss before the update."""
    model.train()
    optimizer.zero_grad()
    loss = model(input_ids=input_ids, labels=input_ids).loss
    loss.backward()
    optimizer.step()
    return float(loss.detach())
