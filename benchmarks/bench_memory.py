"""Training-step memory of a large-vocabulary causal LM: original head vs ``llama.head.fused``.

One training step (forward with labels, backward) of a 2-layer Llama with a 128,256-token
vocabulary, hidden size 256, batch 2 x 1024 tokens, float32, on the CPU. Each variant
runs in its own subprocess, so one cannot inherit the other's high-water mark:

1. the model (built on the meta device, then materialised tensor by tensor: no
   full-model initialisation peak) and the inputs are built, and for the fused variant
   the head is swapped;
2. ``ru_maxrss`` is read (the kernel's exact high-water mark of the process);
3. one training step runs (the first: no warm-up, which would set the mark);
4. ``ru_maxrss`` is read again. The rise is what the step needed above what the process
   already held.

The parent prints both rises, their ratio, the step times and their ratio, and checks
that the fused loss equals the original's (relative 1e-5) and the ``lm_head`` gradient
too (max abs difference over max abs value, 1e-4). Goal: the fused rise at most 0.25x.
Then a few more steps per variant give a median step time (after the measured one).

Run: ``python benchmarks/bench_memory.py [--vocab 128256] [--hidden 256] [--layers 2]
[--batch 2] [--seq 1024] [--steps 3]``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

LOSS_RTOL = 1e-5
GRAD_RTOL = 1e-4
GOAL = 0.25


def _rss_bytes() -> int:
    # ru_maxrss is in kilobytes on Linux, bytes on macOS
    scale = 1 if sys.platform == "darwin" else 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


def _build(args: argparse.Namespace) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=args.seq,
        tie_word_embeddings=False,
    )
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model.to_empty(device="cpu")
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.8, 1.2, generator=generator)
            else:
                param.normal_(0.0, 0.02, generator=generator)
    for name, buffer in model.named_buffers():
        if "inv_freq" in name:
            inv_freq, _ = model.model.rotary_emb.compute_default_rope_parameters(
                config, device=torch.device("cpu")
            )
            buffer.copy_(inv_freq)
    return model.train()


def child(args: argparse.Namespace) -> None:
    """One variant, one process: build, read, step, read; a JSON line on stdout."""
    torch.set_num_threads(args.threads)
    model = _build(args)
    if args.variant == "fused":
        import layerswap

        layerswap.swap(model, "llama.head.fused")
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=generator)
    labels = input_ids.clone()
    labels[:, : args.seq // 8] = -100  # some ignored positions, as with a prompt
    gc.collect()
    before = _rss_bytes()
    start = time.perf_counter()
    output = model(input_ids=input_ids, labels=labels, use_cache=False)
    output.loss.backward()
    first_ms = (time.perf_counter() - start) * 1e3
    after = _rss_bytes()
    loss = float(output.loss)
    logits_none = output.logits is None
    torch.save(model.lm_head.weight.grad, args.grad_file)
    del output
    times = []
    for _ in range(args.steps):
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        model(input_ids=input_ids, labels=labels, use_cache=False).loss.backward()
        times.append((time.perf_counter() - start) * 1e3)
    print(
        json.dumps(
            {
                "variant": args.variant,
                "before": before,
                "rise": after - before,
                "first_ms": first_ms,
                "median_ms": statistics.median(times) if times else first_ms,
                "loss": loss,
                "logits_none": logits_none,
            }
        )
    )


def _run(variant: str, args: argparse.Namespace, grad_file: Path) -> dict[str, Any]:
    command = [sys.executable, __file__, "--variant", variant, "--grad-file", str(grad_file)]
    for option in ("vocab", "hidden", "layers", "batch", "seq", "steps", "threads"):
        command += [f"--{option}", str(getattr(args, option))]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{variant} failed:\n{done.stderr}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=3, help="timed steps after the measured one")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--variant", choices=("original", "fused"), help=argparse.SUPPRESS)
    parser.add_argument("--grad-file", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.variant is not None:
        child(args)
        return
    with tempfile.TemporaryDirectory() as folder:
        files = {name: Path(folder) / f"{name}.pt" for name in ("original", "fused")}
        results = {name: _run(name, args, path) for name, path in files.items()}
        grads = {name: torch.load(path) for name, path in files.items()}
    original, fused = results["original"], results["fused"]
    mib = 2**20
    memory_ratio = fused["rise"] / original["rise"]
    loss_rel = abs(fused["loss"] - original["loss"]) / abs(original["loss"])
    grad_rel = float(
        (grads["fused"] - grads["original"]).abs().max() / grads["original"].abs().max()
    )
    print(
        f"one training step: Llama, vocab {args.vocab}, hidden {args.hidden}, "
        f"{args.layers} layers, batch {args.batch} x {args.seq}, float32, CPU, "
        f"{args.threads} threads, torch {torch.__version__}"
    )
    print(f"{'':24}{'original':>12}{'head.fused':>12}{'ratio':>9}")
    print(
        f"{'peak RSS rise (MiB)':24}{original['rise'] / mib:>12.0f}"
        f"{fused['rise'] / mib:>12.0f}{memory_ratio:>8.3f}x"
    )
    print(
        f"{'RSS before step (MiB)':24}{original['before'] / mib:>12.0f}"
        f"{fused['before'] / mib:>12.0f}"
    )
    print(
        f"{'first step (ms)':24}{original['first_ms']:>12.0f}{fused['first_ms']:>12.0f}"
        f"{fused['first_ms'] / original['first_ms']:>8.2f}x"
    )
    print(
        f"{'median step (ms)':24}{original['median_ms']:>12.0f}{fused['median_ms']:>12.0f}"
        f"{fused['median_ms'] / original['median_ms']:>8.2f}x"
    )
    print(f"loss: {original['loss']:.7f} vs {fused['loss']:.7f} (relative {loss_rel:.1e})")
    print(f"lm_head gradient: max abs difference / max abs value {grad_rel:.1e}")
    print(f"fused logits in training: {'None' if fused['logits_none'] else 'materialised'}")
    checks = {
        f"memory ratio <= {GOAL}": memory_ratio <= GOAL,
        f"loss relative <= {LOSS_RTOL}": loss_rel <= LOSS_RTOL,
        f"lm_head gradient relative <= {GRAD_RTOL}": grad_rel <= GRAD_RTOL,
    }
    for name, passed in checks.items():
        print(f"{'PASS' if passed else 'FAIL'}: {name}")
    if not all(checks.values()):
        raise SystemExit(1)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
