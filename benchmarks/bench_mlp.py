"""Training-step memory and time of a Llama-shaped model: the original MLPs vs the ``mlp``
slot (``llama.mlp.fused``: the activation recomputed in the backward pass); with
``--slot experts``, of a Qwen3-MoE-shaped model: the original experts vs the ``experts``
slot (``qwen3_moe.experts.fused``: each expert's gate recomputed in the backward pass).

A 4-layer Llama, hidden size 512, intermediate 1,536, a 2,048-token vocabulary, batch
4 x 512 tokens, float32, on the CPU (``--slot experts``: 8 experts of intermediate 384,
2 per token, the same other sizes). Each variant runs in its own subprocess, so one
cannot inherit the other's high-water mark: the model and the inputs are built (and for
the swapped variant the MLPs swapped, its first-use proof done), ``ru_maxrss`` is read,
one training step runs, ``ru_maxrss`` is read again; the rise is what the step needed
above what the process held. Then the bytes autograd keeps for the backward pass are
counted exactly (``saved_tensors_hooks``), and more steps give a median step time.

The parent prints both variants side by side, the ratios, and checks that the loss and
every gradient are the original's bit for bit.

Run: ``python benchmarks/bench_mlp.py [--slot mlp|experts] [--layers 4] [--hidden 512]
[--inner 1536] [--experts 8] [--per-token 2] [--batch 4] [--seq 512] [--steps 5]``
(``--inner`` is each expert's with ``--slot experts``, default 384 there).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import resource
import statistics
import subprocess
import sys
import time
from typing import Any

import torch


def _rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _step(model: Any, ids: torch.Tensor) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    loss = model(ids, labels=ids).loss
    loss.backward()
    return loss.detach()


def _model(args: argparse.Namespace) -> Any:
    if args.slot == "experts":
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

        moe = Qwen3MoeConfig(
            vocab_size=2048,
            hidden_size=args.hidden,
            moe_intermediate_size=args.inner or 384,
            num_experts=args.experts,
            num_experts_per_tok=args.per_token,
            num_hidden_layers=args.layers,
            num_attention_heads=8,
            num_key_value_heads=4,
            head_dim=args.hidden // 8,
            max_position_embeddings=args.seq,
        )
        return Qwen3MoeForCausalLM(moe).train()
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=2048,
        hidden_size=args.hidden,
        intermediate_size=args.inner or 1536,
        num_hidden_layers=args.layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=args.seq,
    )
    return LlamaForCausalLM(config).train()


def child(args: argparse.Namespace) -> dict[str, Any]:
    import layerswap

    torch.manual_seed(0)
    model = _model(args)
    ids = torch.randint(0, model.config.vocab_size, (args.batch, args.seq))
    if args.variant == "fused":
        name = "llama.mlp.fused" if args.slot == "mlp" else "qwen3_moe.experts.fused"
        layerswap.swap(model, name)
    before = _rss()
    loss = _step(model, ids)
    rise = _rss() - before
    saved = [0]

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved[0] += tensor.numel() * tensor.element_size()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        _step(model, ids)
    times = []
    for _ in range(args.steps):
        started = time.perf_counter()
        _step(model, ids)
        times.append(time.perf_counter() - started)
    grads = torch.cat([p.grad.flatten() for p in model.parameters()])
    return {
        "rise": rise,
        "saved": saved[0],
        "median": statistics.median(times),
        "loss": loss.item(),
        # every gradient's bits, hashed
        "digest": hashlib.sha256(grads.numpy().tobytes()).hexdigest(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--slot", choices=["mlp", "experts"], default="mlp")
    parser.add_argument("--inner", type=int, default=0)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--per-token", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--variant", choices=["original", "fused"])
    args = parser.parse_args()
    if args.variant:
        print(json.dumps(child(args)))
        return
    rows = {}
    for variant in ("original", "fused"):
        out = subprocess.run(
            [sys.executable, __file__, *sys.argv[1:], "--variant", variant],
            capture_output=True,
            text=True,
            check=True,
        )
        rows[variant] = json.loads(out.stdout.strip().splitlines()[-1])
    original, fused = rows["original"], rows["fused"]
    same = original["loss"] == fused["loss"] and original["digest"] == fused["digest"]
    mb = 1024 * 1024
    shape = (
        f"{args.layers}-layer Llama, hidden {args.hidden}, intermediate {args.inner or 1536}"
        if args.slot == "mlp"
        else f"{args.layers}-layer Qwen3-MoE, hidden {args.hidden}, {args.experts} experts of "
        f"intermediate {args.inner or 384}, {args.per_token} per token"
    )
    print(
        f"{shape}, batch {args.batch} x {args.seq}, float32, CPU "
        f"({torch.get_num_threads()} threads)"
    )
    print(f"{'':18}{'original':>12}{args.slot + '.fused':>14}{'ratio':>8}")
    for key, label, scale in (
        ("rise", "step RSS rise MB", mb),
        ("saved", "kept for bwd MB", mb),
        ("median", "step time s", 1),
    ):
        a, b = original[key] / scale, fused[key] / scale
        digits = 3 if scale == 1 else 1
        print(f"{label:18}{a:12.{digits}f}{b:14.{digits}f}{b / a:8.2f}")
    print(f"loss and gradients bit for bit the original's: {same}")


if __name__ == "__main__":
    main()
