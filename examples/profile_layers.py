"""Time every decoder layer of a live model for one forward pass, then take the timers off.

Builds a tiny Llama with random weights, puts ``profiled`` around the ``forward``
of each decoder layer (this model's layers only, not the class), runs one forward
pass, prints the table, and checks the model is exactly as before.

Run: ``python examples/profile_layers.py``
"""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import layerswap
from layerswap.decorators import ProfileStats, profiled


def build_model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=256,
    )
    return LlamaForCausalLM(config).eval()


def main() -> ProfileStats:
    model = build_model()
    input_ids = torch.randint(0, model.config.vocab_size, (1, 16))
    layers = list(model.model.layers)
    with torch.no_grad():
        reference = model(input_ids).logits

    stats = ProfileStats()
    timers = [
        layerswap.wrap(layer, "forward", profiled(stats, name=f"model.layers.{i}"))
        for i, layer in enumerate(layers)
    ]
    with layerswap.patches(*timers), torch.no_grad():
        logits = model(input_ids).logits

    print(stats.table(sort_by=None))

    # One call per layer, and the timers changed nothing the model computes.
    assert [stats[f"model.layers.{i}"].count for i in range(len(layers))] == [1] * len(layers)
    assert torch.equal(logits, reference)
    # Off again: no per-instance forward left behind, the class's method shows through.
    for layer in layers:
        assert "forward" not in layer.__dict__, layer.__dict__["forward"]
        assert layer.forward.__func__ is type(layer).forward
    return stats


if __name__ == "__main__":
    main()
