"""Where a training step's time goes, and how far FP8 is from ideal FP8 rounding, on a GPU.

Two diagnostics for the benchmark model of ``verify_and_bench.py`` (same shape options):

1. **Profile**: for each contender (original, fused, te BF16, te FP8 current), a few
   training steps under ``torch.profiler``: wall time per step, GPU kernel time per step
   (their difference is time the GPU waits for the host) and the kernels that take the
   most time.
2. **FP8 noise floor**: per decoder layer, the cosine similarity to the original's
   output of (a) the ``te`` layers under FP8 and (b) the original model with every
   decoder ``nn.Linear`` computing on operands rounded to FP8 E4M3 with per-tensor
   current scaling (ideal FP8 rounding, exact accumulation), on the same inputs. If (a)
   tracks (b), a divergence is FP8's precision, not a wrong layer.

Run from the repository root on the GPU machine::

    PYTHONUNBUFFERED=1 python3 scripts/gpu/profile_step.py --out "$OUT"
"""

from __future__ import annotations

import contextlib
import copy
import functools
import importlib.util
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))
_spec = importlib.util.spec_from_file_location("verify_and_bench", HERE / "verify_and_bench.py")
assert _spec is not None and _spec.loader is not None
vb = importlib.util.module_from_spec(_spec)
sys.modules["verify_and_bench"] = vb  # its dataclasses look their module up
_spec.loader.exec_module(vb)

from layerswap.backends import te  # noqa: E402
from layerswap.swap import swap  # noqa: E402

E4M3_MAX = 448.0


def fp8_round(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` rounded to E4M3 with one scale for the whole tensor, back in float32."""
    scale = E4M3_MAX / tensor.detach().abs().amax().float().clamp(min=1e-12)
    return (tensor.float() * scale).to(torch.float8_e4m3fn).float() / scale


def emulated_fp8_linear(module: nn.Linear, inputs: torch.Tensor) -> torch.Tensor:
    bias = None if module.bias is None else module.bias.float()
    out = nn.functional.linear(fp8_round(inputs), fp8_round(module.weight), bias)
    return out.to(inputs.dtype)


def layer_outputs(
    model: Any, ids: torch.Tensor, context: Any = contextlib.nullcontext
) -> list[torch.Tensor]:
    outputs: list[torch.Tensor] = []

    def keep(module: nn.Module, args: Any, output: Any) -> None:
        outputs.append((output[0] if isinstance(output, tuple) else output).float())

    hooks = [layer.register_forward_hook(keep) for layer in model.model.layers]
    try:
        with torch.no_grad(), context():
            model(input_ids=ids, use_cache=False)
    finally:
        for hook in hooks:
            hook.remove()
    return outputs


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0))


def fp8_noise_floor(original: Any, args: Any) -> None:
    ids = vb.unpadded(original.config.vocab_size, 2, 256)["input_ids"].to(vb.DEVICE)
    reference = layer_outputs(original, ids)
    emulated_model = copy.deepcopy(original)
    for module in emulated_model.model.layers.modules():
        if isinstance(module, nn.Linear):
            module.forward = functools.partial(emulated_fp8_linear, module)  # type: ignore[method-assign]
    emulated = layer_outputs(emulated_model, ids)
    del emulated_model
    columns = {"ideal fp8": emulated}
    if te.unmet_requirement() is None:
        te_model = copy.deepcopy(original)
        swap(te_model, "llama.decoder.te")
        columns["te bf16"] = layer_outputs(te_model, ids)
        from transformer_engine.common.recipe import MMParams

        recipes = {
            "te fp8 current": te.fp8_recipe("current"),
            "te fp8 delayed": te.fp8_recipe("delayed"),
            # TE's forward GEMMs accumulate FP8 products in the tensor cores' fast, reduced
            # precision mode by default; the split accumulator promotes them to FP32
            "current, split acc": te.fp8_recipe(
                "current", fp8_gemm_fprop=MMParams(use_split_accumulator=True)
            ),
        }
        for name, recipe in recipes.items():
            columns[name] = layer_outputs(te_model, ids, functools.partial(te.fp8_autocast, recipe))
        del te_model
    vb.log("\n== FP8 noise floor: cosine to the original's layer output (bf16), 2 x 256 tokens")
    vb.log("layer " + "".join(f"{name:>16}" for name in columns))
    for index, ref in enumerate(reference):
        vb.log(
            f"{index:>5} "
            + "".join(f"{cosine(out[index], ref):>16.4f}" for out in columns.values())
        )


def profile(original: Any, args: Any) -> None:
    contenders, notes = vb.make_contenders(original, args)
    for note in notes:
        vb.log(note)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), device=vb.DEVICE)
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    steps = 3
    for contender in contenders:
        for _ in range(3):
            vb.train_step(contender, ids)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=activities) as prof:
            started = time.perf_counter()
            for _ in range(steps):
                vb.train_step(contender, ids)
            torch.cuda.synchronize()
            wall = (time.perf_counter() - started) / steps * 1000
        averages = prof.key_averages()
        kernel_us = sum(
            event.self_device_time_total
            for event in averages
            if getattr(event, "device_type", None) == torch.autograd.DeviceType.CUDA
        )
        vb.log(
            f"\n== profile: {contender.name}: wall {wall:.2f} ms/step, GPU kernels "
            f"{kernel_us / steps / 1000:.2f} ms/step"
        )
        vb.log(
            averages.table(sort_by="self_device_time_total", row_limit=12, max_name_column_width=70)
        )
        contender.model.to("meta")  # free its memory before the next one
        del contender.optimizer
        torch.cuda.empty_cache()


def main() -> int:
    sys.argv += [] if "--skip-verify" in sys.argv else ["--skip-verify"]
    args = vb.parse_args()
    vb.DEVICE = torch.device(args.device)
    # import TransformerEngine before torch runs a cuDNN kernel: seen on the GPU machine, TE
    # imported later bound the system's libcudnn_cnn to torch's already loaded cuDNN graph
    # library and failed ("undefined symbol ... libcudnn_graph.so.9")
    vb.log("te:", te.unmet_requirement() or "usable")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    try:
        original = vb.build_on_gpu(vb.benchmark_config(args), args.seed)
        fp8_noise_floor(original, args)
        if not args.skip_bench:
            profile(original, args)
    finally:
        (out / "profile_step.txt").write_text("\n".join(vb.log.lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
