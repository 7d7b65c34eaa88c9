from __future__ import annotations

import tinylm
import torch
from safetensors import safe_open


def test_training_steps_reduce_the_loss(model, input_ids):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = [tinylm.train_step(model, input_ids, optimizer) for _ in range(4)]
    assert losses[-1] < losses[0]


def test_every_parameter_gets_a_gradient(model, input_ids):
    model.train()
    model(input_ids=input_ids, labels=input_ids).loss.backward()
    missing = [name for name, p in model.named_parameters() if p.grad is None]
    assert missing == []


def test_checkpoint_round_trip_keeps_the_outputs(model, input_ids, tmp_path):
    model.save_pretrained(tmp_path)
    with safe_open(tmp_path / "model.safetensors", "pt") as saved:
        keys = set(saved.keys())
    # the standard transformers layout, whatever the layers are at run time
    assert "model.layers.0.self_attn.q_proj.weight" in keys
    assert "model.layers.0.mlp.gate_proj.weight" in keys
    reloaded = type(model).from_pretrained(tmp_path).eval()
    with torch.no_grad():
        before = model(input_ids=input_ids).logits
        after = reloaded(input_ids=input_ids).logits
    torch.testing.assert_close(after, before)
