"""layerswap in one page: swap at construction, swap a built model, verify, undo.

Run: ``python examples/quickstart.py`` (CPU, a few seconds, nothing downloaded).
"""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama import modeling_llama

import layerswap


def tiny_config() -> LlamaConfig:
    return LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
    )


def main() -> None:
    torch.manual_seed(0)
    input_ids = torch.randint(0, 256, (1, 12))

    # 1. The seed API: every decoder layer is built as the replacement class.
    fused_layer = layerswap.get("llama.decoder.fused").replacement_class()
    with layerswap.replace_decoder(fused_layer):
        built_swapped = LlamaForCausalLM(tiny_config())
    assert modeling_llama.LlamaDecoderLayer is not fused_layer  # restored on exit
    print("built with:", type(built_swapped.model.layers[0]).__name__)

    # 2. Swap the decoder layers of a model that already exists, weights carried over.
    model = LlamaForCausalLM(tiny_config()).eval()
    with torch.no_grad():
        before = model(input_ids).logits
    handle = layerswap.swap(model, "llama.decoder.fused")
    print(handle.report())
    with torch.no_grad():
        after = model(input_ids).logits
    print(f"max |logits difference| after swap: {(after - before).abs().max().item():.2e}")
    handle.undo()  # the original layer objects and weights are back, bitwise
    assert type(model.model.layers[0]) is modeling_llama.LlamaDecoderLayer

    # 3. Verify: the swapped model against the original, layer by layer.
    report = layerswap.verify(model, "llama.decoder.fused")
    print(report.summary())
    assert report.passed, report.failure_message()


if __name__ == "__main__":
    main()
