"""Decoding and training time of a Llama-shaped model: the original attentions vs the
``qkv`` slot (``llama.qkv.fused``: q/k/v as one product).

Two models with the same weights in one process, one swapped; rounds alternate between
them and the medians are compared:

- **decode**: greedy generation of ``--new`` tokens after an 8-token prompt, batch 1, with
  the cache (where one product instead of three matters most: one kernel launch and one
  read of the input per attention);
- **train**: one training step (forward with labels, backward) on ``--batch x --seq``.

Before timing, the matrix products one decoding step runs are counted (a dispatch mode):
that figure depends on shapes alone. The logits of both models are compared.

Run: ``python benchmarks/bench_qkv.py [--device cpu|cuda] [--dtype float32|bfloat16]
[--layers 4] [--hidden 1024] [--new 32] [--batch 4] [--seq 256] [--rounds 5]``
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class _Products(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm):
            self.count += 1
        return func(*args, **(kwargs or {}))


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _decode(model: Any, ids: torch.Tensor, new: int) -> None:
    model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False)


def _train(model: Any, ids: torch.Tensor) -> None:
    model.zero_grad(set_to_none=True)
    model(ids, labels=ids).loss.backward()


def _timed(fn: Any, device: str) -> float:
    _sync(device)
    started = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()

    import warnings

    from transformers import LlamaConfig, LlamaForCausalLM

    import layerswap

    warnings.filterwarnings("ignore")
    dtype = getattr(torch, args.dtype)
    config = LlamaConfig(
        vocab_size=2048,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 8 // 3,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64,
        num_key_value_heads=args.hidden // 256,
        max_position_embeddings=max(args.seq, 64),
    )
    torch.manual_seed(0)
    original = LlamaForCausalLM(config).to(args.device, dtype).eval()
    packed = copy.deepcopy(original)
    layerswap.swap(packed, "llama.qkv.fused")
    prompt = torch.randint(0, config.vocab_size, (1, 8), device=args.device)
    batch = torch.randint(0, config.vocab_size, (args.batch, args.seq), device=args.device)
    models = {"original": original, "qkv.fused": packed}

    products = {}
    for name, model in models.items():
        with torch.no_grad():
            out = model(prompt, use_cache=True)
            step = prompt[:, -1:]
            with _Products() as counted:
                model(step, cache=out.cache, use_cache=True)
        products[name] = counted.count
    with torch.no_grad():
        difference = (original(batch).logits - packed(batch).logits).abs().max().item()

    times: dict[str, dict[str, list[float]]] = {n: {"decode": [], "train": []} for n in models}
    for _ in range(args.rounds + 1):  # the first round warms up
        for name, model in models.items():
            model.eval()
            with torch.no_grad():
                times[name]["decode"].append(
                    _timed(lambda m=model: _decode(m, prompt, args.new), args.device)
                )
            model.train()
            times[name]["train"].append(_timed(lambda m=model: _train(m, batch), args.device))

    threads = f", {torch.get_num_threads()} threads" if args.device == "cpu" else ""
    print(
        f"{args.layers}-layer Llama, hidden {args.hidden}, {config.num_attention_heads} heads, "
        f"{config.num_key_value_heads} key/value heads, {args.dtype}, {args.device}{threads}"
    )
    print(f"{'':30}{'original':>12}{'qkv.fused':>12}{'speedup':>9}")
    print(f"{'matrix products per token':30}{products['original']:12d}{products['qkv.fused']:12d}")
    for kind, label in (
        ("decode", f"decode {args.new} tokens, s"),
        ("train", f"train step {args.batch}x{args.seq}, s"),
    ):
        a = statistics.median(times["original"][kind][1:])
        b = statistics.median(times["qkv.fused"][kind][1:])
        print(f"{label:30}{a:12.4f}{b:12.4f}{a / b:8.2f}x")
    print(f"largest logit difference: {difference:.2e}")


if __name__ == "__main__":
    main()
