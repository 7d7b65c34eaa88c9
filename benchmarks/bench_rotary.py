"""Time and memory of the rotary application: transformers' ``apply_rotary_pos_emb`` vs the
``rotary`` slot's fused kernel (``llama.rotary.fused``), alone and inside a training step.

One process, rounds alternating between the two, medians compared:

- **op**: ``apply_rotary_pos_emb(q, k, cos, sin)`` forward and backward at one layer's
  shape (``--batch x --seq``, ``--hidden`` wide, 64-channel heads, 4 query heads per key
  head), and the bytes autograd keeps for its backward pass (a saved-tensors hook);
- **interleave**: DeepSeek's ``apply_rotary_pos_emb_interleave`` at the same shape with one
  key head (multi-head latent attention's shared rotary key);
- **train**: one training step (forward with labels, backward) of a Llama-shaped model with
  the same weights, one of them swapped.

The outputs are compared too: the fused kernel's are bit for bit the original's.

Run: ``python benchmarks/bench_rotary.py [--device cpu|cuda] [--dtype float32|bfloat16]
[--layers 4] [--hidden 1024] [--batch 4] [--seq 512] [--rounds 7]``
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
import warnings
from typing import Any

import torch


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _timed(fn: Any, device: str) -> float:
    _sync(device)
    started = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - started


def _kept_bytes(fn: Any) -> int:
    total = [0]

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        total[0] += tensor.numel() * tensor.element_size()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return total[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()

    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama import modeling_llama

    import layerswap

    warnings.filterwarnings("ignore")
    dtype = getattr(torch, args.dtype)
    heads = args.hidden // 64
    config = LlamaConfig(
        vocab_size=2048,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 8 // 3,
        num_hidden_layers=args.layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 4),
        max_position_embeddings=max(args.seq, 64),
    )
    torch.manual_seed(0)
    original = LlamaForCausalLM(config).to(args.device, dtype)
    swapped = copy.deepcopy(original)
    layerswap.swap(swapped, "llama.rotary.fused")
    fused = next(
        value
        for name, value in vars(modeling_llama).items()
        if name.startswith("_layerswap_FusedRotary_apply_rotary_pos_emb")
    )
    functions = {"original": modeling_llama.apply_rotary_pos_emb, "rotary.fused": fused}

    generator = torch.Generator().manual_seed(0)

    def draw(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(args.device, dtype)

    q = draw(args.batch, heads, args.seq, 64).requires_grad_()
    k = draw(args.batch, config.num_key_value_heads, args.seq, 64).requires_grad_()
    cos, sin = draw(args.batch, args.seq, 64), draw(args.batch, args.seq, 64)
    grads = (draw(*q.shape), draw(*k.shape))

    def op(function: Any) -> tuple[torch.Tensor, ...]:
        out = function(q, k, cos, sin)
        return torch.autograd.grad(out, (q, k), grads) + tuple(out)

    # DeepSeek's interleaved pairs (its rope head of 64 channels, one key head: MLA)
    from transformers.models.deepseek_v3 import modeling_deepseek_v3

    from layerswap.backends.fused.rotary import FusedRotary
    from layerswap.rotaries import RotarySpec

    spec = RotarySpec(
        "apply_rotary_pos_emb_interleave",
        2,
        False,
        False,
        ("q", "k", "cos", "sin", "position_ids", "unsqueeze_dim"),
        kind="interleave",
    )
    interleaved = {
        "original": modeling_deepseek_v3.apply_rotary_pos_emb_interleave,
        "rotary.fused": vars(modeling_deepseek_v3)[
            FusedRotary.bind(spec, vars(modeling_deepseek_v3))
        ],
    }
    latent_k = draw(args.batch, 1, args.seq, 64).requires_grad_()
    latent_grads = (grads[0], draw(*latent_k.shape))

    def latent_op(function: Any) -> tuple[torch.Tensor, ...]:
        out = function(q, latent_k, cos, sin)
        return torch.autograd.grad(out, (q, latent_k), latent_grads) + tuple(out)

    results = {name: op(fn) for name, fn in functions.items()}
    latent = {name: latent_op(fn) for name, fn in interleaved.items()}
    same = all(
        torch.equal(a, b)
        for found in (results, latent)
        for a, b in zip(found["original"], found["rotary.fused"], strict=True)
    )
    kept = {name: _kept_bytes(lambda f=fn: f(q, k, cos, sin)) for name, fn in functions.items()}
    batch = torch.randint(0, config.vocab_size, (args.batch, args.seq), device=args.device)
    models = {"original": original, "rotary.fused": swapped}

    def step(model: Any) -> None:
        model.zero_grad(set_to_none=True)
        model(batch, labels=batch).loss.backward()

    kinds = ("op", "interleave", "train")
    times: dict[str, dict[str, list[float]]] = {n: {k: [] for k in kinds} for n in models}
    for _ in range(args.rounds + 1):  # the first round warms up
        for name in models:
            times[name]["op"].append(_timed(lambda n=name: op(functions[n]), args.device))
            times[name]["interleave"].append(
                _timed(lambda n=name: latent_op(interleaved[n]), args.device)
            )
            times[name]["train"].append(_timed(lambda n=name: step(models[n]), args.device))

    threads = f", {torch.get_num_threads()} threads" if args.device == "cpu" else ""
    print(
        f"{args.layers}-layer Llama, hidden {args.hidden}, {heads} heads of 64, "
        f"{config.num_key_value_heads} key/value heads, {args.dtype}, {args.device}{threads}"
    )
    print(f"{'':34}{'original':>12}{'rotary.fused':>14}{'ratio':>8}")
    a, b = kept["original"], kept["rotary.fused"]
    print(f"{'op: bytes kept for backward':34}{a:12d}{b:14d}{b / a:7.2f}x")
    for kind, label in (
        ("op", f"op fwd+bwd {args.batch}x{args.seq}, s"),
        ("interleave", "DeepSeek interleave fwd+bwd, s"),
        ("train", f"train step {args.batch}x{args.seq}, s"),
    ):
        a = statistics.median(times["original"][kind][1:])
        b = statistics.median(times["rotary.fused"][kind][1:])
        print(f"{label:34}{a:12.4f}{b:14.4f}{a / b:7.2f}x faster")
    print(f"outputs and gradients bit for bit the original's: {same}")


if __name__ == "__main__":
    main()
