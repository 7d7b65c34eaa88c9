"""Swapping a ~300M-parameter Llama on CPU: time, peak memory, forward latency.

Measured in one run, printed as ratios:

1. ``swap(model, backend="fused")`` time against cloning every decoder
   layer's weights once (the least a non-in-place conversion must do). Goal: at
   most 2x the clone.
2. Peak extra memory during the swap (and the undo), in units of one decoder
   layer: the rise of the process's resident set size above its level just before,
   sampled every millisecond with psutil, and the rise of ``ru_maxrss`` (the
   kernel's exact high-water mark; a lower bound, since the model build set it).
   Goal: at most 2 layers.
3. Forward latency, original vs fused, batch 4 x 256 tokens, ``torch.no_grad``,
   interleaved runs, medians.

The model is built on the meta device and materialised tensor by tensor (random
init of 300M parameters through ``nn.init`` would take minutes).

Run: ``python benchmarks/bench_swap.py [--layers 24] [--repeats 3]``.
"""

from __future__ import annotations

import argparse
import gc
import resource
import statistics
import threading
import time
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import psutil
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import layerswap
from layerswap.swap import build_replacement_layer, decoder_layers, swap


def build(layers: int) -> LlamaForCausalLM:
    config = LlamaConfig(
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=layers,
        num_attention_heads=16,
        num_key_value_heads=4,
        vocab_size=32000,
        max_position_embeddings=2048,
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
    # non-persistent buffers (rotary frequencies) are garbage after to_empty: rebuild
    model.model.rotary_emb = type(model.model.rotary_emb)(config)
    return model.eval()


class PeakRss:
    """Highest resident set size seen while the block runs, sampled every millisecond."""

    def __init__(self) -> None:
        self.process = psutil.Process()
        self.peak: int = 0
        self._stop = threading.Event()

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.process.memory_info().rss)
            time.sleep(0.001)

    def __enter__(self) -> PeakRss:
        gc.collect()
        self.before: int = self.process.memory_info().rss
        self.maxrss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        self.peak = self.before
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.process.memory_info().rss)
        self.maxrss_rise = (
            resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - self.maxrss_before
        )

    @property
    def rise(self) -> int:
        return self.peak - self.before


def timed(action: Callable[[], Any]) -> tuple[float, Any]:
    start = time.perf_counter()
    result = action()
    return time.perf_counter() - start, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    # warm up imports and the registry on a tiny model, so they are not timed
    warm = layerswap.families()["llama"].build(
        layerswap.families()["llama"].tiny_config(num_hidden_layers=1)
    )
    swap(warm, backend="fused").undo()

    model = build(args.layers)
    total = sum(p.numel() for p in model.parameters())
    layer_bytes = sum(p.numel() * p.element_size() for p in model.model.layers[0].parameters())
    print(
        f"model: Llama, {total / 1e6:.1f}M parameters, {args.layers} layers, one layer "
        f"{layer_bytes / 2**20:.1f} MiB (float32), {torch.get_num_threads()} CPU threads"
    )

    with PeakRss() as swap_memory:
        swap_seconds, handle = timed(lambda: swap(model, backend="fused"))
    with PeakRss() as undo_memory:
        undo_seconds, _ = timed(handle.undo)

    def clone_layers() -> None:
        clones = [
            [p.detach().clone() for p in layer.parameters()] for _, layer in decoder_layers(model)
        ]
        del clones

    clone_seconds, _ = timed(clone_layers)
    gc.collect()

    print(
        f"swap  {swap_seconds:6.3f} s | clone all layer weights once {clone_seconds:6.3f} s | "
        f"ratio {swap_seconds / clone_seconds:.2f}x (goal <= 2x)"
    )
    print(f"undo  {undo_seconds:6.3f} s | ratio to clone {undo_seconds / clone_seconds:.2f}x")
    for label, memory in (("swap", swap_memory), ("undo", undo_memory)):
        print(
            f"peak extra memory during {label}: {memory.rise / layer_bytes:.2f} layers "
            f"({memory.rise / 2**20:.0f} MiB, sampled RSS); ru_maxrss rise "
            f"{memory.maxrss_rise / layer_bytes:.2f} layers (goal <= 2)"
        )

    torch.manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (4, 256))
    timings: dict[str, list[float]] = {"original": [], "fused": []}
    with torch.no_grad():
        for kind in ("original", "fused"):  # one untimed warm-up each
            with swap(model, backend="fused") if kind == "fused" else nullcontext():
                model(ids)
        for _ in range(args.repeats):
            seconds, reference = timed(lambda: model(ids).logits)
            timings["original"].append(seconds)
            with swap(model, backend="fused"):
                seconds, fused_logits = timed(lambda: model(ids).logits)
            timings["fused"].append(seconds)
    original, fused = (statistics.median(timings[k]) for k in ("original", "fused"))
    difference = (fused_logits - reference).abs().max().item()
    print(
        f"forward batch 4 x 256 (median of {args.repeats}, interleaved): original "
        f"{original:.3f} s | fused {fused:.3f} s | fused/original {fused / original:.2f}x "
        f"(max |logit difference| {difference:.1e})"
    )

    # one decoder layer alone: cheap enough for many interleaved repeats
    layer = model.model.layers[0]
    fused_layer = build_replacement_layer("llama.decoder.fused", layer, config=model.config)
    hidden = torch.randn(4, 256, model.config.hidden_size)
    cos_sin = model.model.rotary_emb(hidden, torch.arange(256)[None])
    per_layer: dict[str, list[float]] = {"original": [], "fused": []}
    with torch.no_grad():
        for index in range(2 + 4 * args.repeats):
            for kind, module in (("original", layer), ("fused", fused_layer)):
                seconds, _ = timed(lambda m=module: m(hidden, position_embeddings=cos_sin))
                if index >= 2:  # two warm-up rounds
                    per_layer[kind].append(seconds)
    original, fused = (statistics.median(per_layer[k]) for k in ("original", "fused"))
    print(
        f"one decoder layer, batch 4 x 256 (median of {4 * args.repeats}, interleaved): "
        f"original {original * 1e3:.1f} ms | fused {fused * 1e3:.1f} ms | "
        f"fused/original {fused / original:.2f}x"
    )


if __name__ == "__main__":
    main()
