"""Verify the ``te`` (BF16, FP8) and ``fused`` backends on a GPU, then benchmark them.

1. Verification, tiny models of every family on CUDA, with ``layerswap.verify``: logits and
   every layer's output on left-padded inputs, gradients (unpadded inputs), 8 greedily
   generated tokens with the KV cache -- ``fused`` in float32 and BF16, ``te`` in BF16;
   FP8 (te, "current" recipe) on unpadded inputs, held to twice the error of ideal FP8
   rounding at each layer (``layerswap.comparison.fp8``). Then the
   benchmark model in BF16.
2. Benchmark, a Llama-shaped model of about a billion parameters (hidden 2048, 16 layers,
   32 heads, 8 key/value heads, intermediate 5632, vocabulary 32000), batch 8 x 512 tokens:
   a forward pass and a full training step (forward, backward, AdamW step) for original,
   fused, te BF16 and te FP8 (one column per recipe). Runs are interleaved (the order
   rotates every round), timed with CUDA events, and medians are reported with their
   ratios to the original, plus the peak memory each step adds.

Everything printed is also written to ``<out>/verify_and_bench.txt``; the raw numbers
(every sample) to ``<out>/verify_and_bench.json``. Exit code 1 when a verification failed.

Run from the repository root on the GPU machine (TransformerEngine installed with
``scripts/gpu/stage_te.sh``)::

    PYTHONUNBUFFERED=1 python3 scripts/gpu/verify_and_bench.py --out "$OUT"
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import json
import os
import platform
import signal
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# the repository root, so `import layerswap` needs no installation on the GPU machine
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
import transformers

import layerswap
from layerswap.backends import te
from layerswap.comparison.inputs import inputs_for
from layerswap.errors import RequirementError
from layerswap.registry import families, get, get_backend
from layerswap.swap import swap
from layerswap.verify import default_inputs, verify

GIB = 1024**3
# --device cpu runs the whole flow on tiny shapes (a smoke test of this script); real runs
# use the default, cuda
DEVICE = torch.device("cuda")
StepContext = Callable[[], contextlib.AbstractContextManager[Any]]


class Log:
    """Print and keep every line, for the text file written at the end."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def __call__(self, *parts: Any) -> None:
        line = " ".join(str(part) for part in parts)
        print(line, flush=True)
        self.lines.append(line)


log = Log()


# --- environment ----------------------------------------------------------------------------


def environment() -> dict[str, Any]:
    info: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "layerswap": layerswap.__version__,
        "te_unmet_requirement": te.unmet_requirement(),
    }
    if DEVICE.type == "cuda":
        major, minor = torch.cuda.get_device_capability()
        info.update(
            gpu=torch.cuda.get_device_name(),
            compute_capability=f"{major}.{minor}",
            gpu_memory_gib=round(torch.cuda.get_device_properties(0).total_memory / GIB, 1),
        )
    if info["te_unmet_requirement"] is None:
        import transformer_engine

        info["transformer_engine"] = transformer_engine.__version__
        info["fp8_unmet_requirement"] = {
            recipe: te.fp8_unmet_requirement(recipe) for recipe in ("delayed", "current", "mxfp8")
        }
    return info


# --- verification ------------------------------------------------------------------------------


@dataclass
class Check:
    name: str
    passed: bool | None  # None: could not run here
    detail: str
    report: dict[str, Any] | None = None


def run_check(name: str, action: Callable[[], Any]) -> Check:
    """Run one verification; a crash or a missing requirement is a result, not an abort."""
    started = time.perf_counter()
    try:
        report = action()
    except RequirementError as exc:
        check = Check(name, None, f"skipped: {exc}")
    except Exception as exc:
        check = Check(name, False, f"crashed: {type(exc).__name__}: {exc}")
        traceback.print_exc()
    else:
        summary = report.summary().replace("\n", " | ")
        check = Check(name, bool(report.passed), summary, report.to_dict())
    status = {True: "PASS", False: "FAIL", None: "SKIP"}[check.passed]
    log(f"[{status}] {name} ({time.perf_counter() - started:.1f} s): {check.detail}")
    return check


def unpadded(vocab_size: int, batch: int, seq_len: int) -> dict[str, torch.Tensor]:
    return default_inputs(vocab_size, batch=batch, seq_len=seq_len, padding=0)


def verify_fresh(
    family: Any,
    substitution: Any,
    dtype: torch.dtype = torch.bfloat16,
    unpadded_length: int | None = None,
    **options: Any,
) -> Any:
    """``verify`` on a freshly built tiny ``family`` model, in ``dtype`` on the device;
    ``unpadded_length``: on 2 unpadded rows of that many text tokens (a wrapper's media
    tokens left out) instead of verify's default inputs."""
    model = family.build(seed=0).to(DEVICE, dtype)
    if unpadded_length is not None:
        options["inputs"] = inputs_for(model, batch=2, seq_len=unpadded_length, padding=0)
    return verify(model, substitution, **options)


# the dtypes each backend is verified in: TransformerEngine's speed is in bf16 (and FP8)
VERIFY_DTYPES = {
    "fused": (torch.float32, torch.bfloat16),
    "liger": (torch.float32, torch.bfloat16),
    "te": (torch.bfloat16,),
}
DTYPE_LABEL = {torch.float32: "fp32", torch.bfloat16: "bf16"}


def verify_tiny(names: list[str], fp8_recipe: str, backends: list[str]) -> list[Check]:
    checks = []
    for name in names:
        family = families()[name]
        for backend in backends:
            sub = f"{name}.decoder.{backend}"
            refused = get_backend(backend).unsupported(family)
            if refused is not None:
                log(f"[SKIP] {sub}: refused by the backend: {refused}")
                continue
            for dtype in VERIFY_DTYPES[backend]:
                label = DTYPE_LABEL[dtype]
                for what, options in (
                    ("padded", {}),
                    ("backward", {"unpadded_length": 32, "backward": True}),
                    ("generate=8", {"generate": 8}),
                ):
                    action = functools.partial(verify_fresh, family, sub, dtype, **options)
                    checks.append(run_check(f"{sub} {label} {what}", action))
        if "te" in backends:
            # te's slots below the decoder layer, on the model's own norms and attentions
            for slot in ("norm", "qkv"):
                sub = f"{name}.{slot}.te"
                refused = te.BACKEND.unsupported(family, slot)
                if refused is not None:
                    log(f"[SKIP] {sub}: refused by the backend: {refused}")
                    continue
                for what, options in (
                    ("padded", {}),
                    ("backward", {"unpadded_length": 32, "backward": True}),
                ):
                    action = functools.partial(verify_fresh, family, sub, torch.bfloat16, **options)
                    checks.append(run_check(f"{sub} bf16 {what}", action))
        if "te" in backends and te.BACKEND.unsupported(family) is None:
            fp8 = te.BACKEND.substitution(family, variant="fp8").with_options(recipe=fp8_recipe)
            action = functools.partial(
                verify_fresh,
                family,
                fp8,
                unpadded_length=64,
            )
            checks.append(run_check(f"{fp8.name} ({fp8_recipe})", action))
    return checks


def verify_large(model: Any, fp8_recipe: str, backends: list[str]) -> list[Check]:
    inputs = unpadded(model.config.vocab_size, 2, 256)
    checks = [
        run_check(
            f"benchmark model: {sub} bf16", functools.partial(verify, model, sub, inputs=inputs)
        )
        for sub in (f"llama.decoder.{backend}" for backend in backends)
    ]
    if "te" not in backends:
        return checks
    fp8 = te.BACKEND.substitution(families()["llama"], variant="fp8").with_options(
        recipe=fp8_recipe
    )
    # the default tolerance: FP8 is held to twice ideal FP8 rounding's error per layer
    action = functools.partial(verify, model, fp8, inputs=inputs)
    checks.append(run_check(f"benchmark model: {fp8.name} ({fp8_recipe})", action))
    return checks


# --- benchmark ----------------------------------------------------------------------------------


def benchmark_config(args: argparse.Namespace) -> Any:
    return transformers.LlamaConfig(
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        vocab_size=args.vocab,
        max_position_embeddings=max(4096, args.seq),
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )


def build_on_gpu(config: Any, seed: int) -> Any:
    """The causal LM built directly on the GPU in bfloat16 (no CPU init of a billion weights)."""
    previous = torch.get_default_dtype()
    torch.manual_seed(seed)
    torch.set_default_dtype(torch.bfloat16)
    try:
        with DEVICE:
            model = transformers.LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    return model


@dataclass
class Contender:
    name: str
    model: Any
    optimizer: torch.optim.Optimizer
    context: StepContext = contextlib.nullcontext
    forward_ms: list[float] = field(default_factory=list)
    train_ms: list[float] = field(default_factory=list)
    losses: list[torch.Tensor] = field(default_factory=list)  # read after timing: no sync
    forward_peak_bytes: int = 0
    train_peak_bytes: int = 0


def forward_step(contender: Contender, ids: torch.Tensor) -> None:
    contender.model.eval()
    with torch.no_grad(), contender.context():
        contender.model(input_ids=ids, use_cache=False)


def train_step(contender: Contender, ids: torch.Tensor) -> None:
    contender.model.train()
    with contender.context():
        loss = contender.model(input_ids=ids, labels=ids, use_cache=False).loss
    # TransformerEngine runs the backward pass after its autocast region has closed
    loss.backward()
    contender.optimizer.step()
    contender.optimizer.zero_grad(set_to_none=True)
    contender.losses.append(loss.detach())


def step_ms(step: Callable[[], None]) -> float:
    if DEVICE.type != "cuda":
        started = time.perf_counter()
        step()
        return (time.perf_counter() - started) * 1000
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    step()
    end.record()
    end.synchronize()
    return float(start.elapsed_time(end))


def peak_bytes(step: Callable[[], None]) -> int:
    """Memory the step allocates above what was allocated before it (activations, grads...)."""
    if DEVICE.type != "cuda":
        step()
        return 0
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    return int(torch.cuda.max_memory_allocated() - before)


def rotations(items: list[Contender]) -> Iterator[list[Contender]]:
    """Each round starts with the next contender, so none always runs first (or after another)."""
    index = 0
    while True:
        yield items[index % len(items) :] + items[: index % len(items)]
        index += 1


#: the contenders that swap slots of the original, and which slots (``*-slots``: the
#: slots below the decoder layer and the head, the original's decoder layers kept, which is
#: what Liger-Kernel's own patch replaces, rotary aside)
_SWAPPED = {
    "fused": ("decoder",),
    "liger": ("decoder",),
    "fused+head": ("decoder", "head"),
    "liger+head": ("decoder", "head"),
    "fused-slots": ("norm", "mlp", "head"),
    "liger-slots": ("norm", "mlp", "head"),
}


def make_contenders(original: Any, args: argparse.Namespace) -> tuple[list[Contender], list[str]]:
    """The contenders ``args.contenders`` names, each on its own copy of the same weights.

    ``original``; ``compiled`` (the original under ``torch.compile``); ``liger-patch``
    (Liger-Kernel's own ``apply_liger_kernel_to_llama``, adopted: every other contender
    steps with it suspended); ``fused`` / ``liger`` (decoder layers swapped); ``fused+head`` /
    ``liger+head`` (the decoder layers and the head's loss); ``fused-slots`` /
    ``liger-slots`` (the norms, the MLPs and the head, the decoder layers the original's);
    ``te`` (bf16, then one FP8
    contender per recipe in ``args.fp8_recipes``). A contender that cannot run here is
    left out with a note saying why.
    """

    def optimizer(model: Any) -> torch.optim.Optimizer:
        fused_step = DEVICE.type == "cuda"
        return torch.optim.AdamW(model.parameters(), lr=args.lr, fused=fused_step)

    def swapped(*names: str) -> Any:
        model = copy.deepcopy(original)
        for name in names:
            swap(model, name)
        return model

    notes = []
    contenders = []
    adopted: list[Any] = []  # Liger's own patch, in effect for its contender's steps only
    for wanted in args.contenders:
        if wanted == "original":
            contenders.append(Contender("original", original, optimizer(original)))
        elif wanted == "compiled":
            # what a user may pick instead of a swap: the original under torch.compile
            model = torch.compile(copy.deepcopy(original))
            contenders.append(Contender("original compiled", model, optimizer(model)))
        elif wanted == "liger-patch":
            # the peer: Liger-Kernel's own apply_liger_kernel_to_llama, adopted so that it
            # can be suspended while every other contender steps (it rebinds modeling_llama)
            adoption, why_not = liger_patched(original)
            if adoption is None:
                notes.append(f"liger-patch skipped: {why_not}")
                continue
            adopted.append(adoption)
            contenders.append(Contender("liger patch", why_not, optimizer(why_not)))
        elif wanted.removesuffix("-compiled") in _SWAPPED:
            base = wanted.removesuffix("-compiled")
            backend = base.split("+")[0].split("-")[0]
            names = [f"llama.{slot}.{backend}" for slot in _SWAPPED[base]]
            reason = next(filter(None, (get(name).unmet_requirement() for name in names)), None)
            if reason is not None:
                notes.append(f"{wanted} skipped: {reason}")
                continue
            model = swapped(*names)
            if wanted.endswith("-compiled"):
                # regional compilation: each swapped decoder layer under torch.compile (one
                # graph reused by every layer), the rest of the model eager
                for layer in model.model.layers:
                    layer.compile()
            contenders.append(Contender(wanted, model, optimizer(model)))
        elif wanted in ("te-graphed", "fused-graphed"):
            # the decoder layers captured as CUDA graphs (forward and backward), one per
            # layer: what removes the host's launch overhead where the GPU waits for it
            backend = wanted.split("-")[0]
            recipes = [None] + (["current"] if backend == "te" else [])
            for recipe in recipes:
                name = f"{backend} {'fp8 ' + recipe + ' ' if recipe else ''}graphed"
                try:
                    model = graphed_layers(original, backend, recipe, args)
                except Exception as exc:  # a contender that cannot run is a note
                    notes.append(f"{name} skipped: {type(exc).__name__}: {exc}")
                    continue
                context = (
                    functools.partial(te.fp8_autocast, recipe) if recipe else contextlib.nullcontext
                )
                contenders.append(Contender(name, model, optimizer(model), context=context))
        elif wanted in ("te", "te-bf16", "te-fp8"):
            # "te": bf16 and one FP8 contender per recipe; "te-bf16" / "te-fp8" one kind only
            # (two 7B contenders with AdamW are what one H200 holds)
            reason = te.unmet_requirement()
            if reason is not None:
                notes.append(f"{wanted} skipped: {reason}")
                continue
            # every contender trains its own copy from the same weights, so the losses they
            # print after the same number of steps are comparable (the swap trains the same)
            if wanted != "te-fp8":
                te_model = swapped("llama.decoder.te")
                contenders.append(Contender("te bf16", te_model, optimizer(te_model)))
            if wanted == "te-bf16":
                continue
            for recipe in args.fp8_recipes:
                why_not = te.fp8_unmet_requirement(recipe)
                if why_not is not None:
                    notes.append(f"te fp8 {recipe} skipped: {why_not}")
                    continue
                fp8_model = swapped("llama.decoder.te")
                contenders.append(
                    Contender(
                        f"te fp8 {recipe}",
                        fp8_model,
                        optimizer(fp8_model),
                        context=functools.partial(te.fp8_autocast, recipe),
                    )
                )
    for adoption in adopted:
        for contender in contenders:
            if contender.name != "liger patch":
                contender.context = _suspending(contender.context, adoption)
    return contenders, notes


def liger_patched(original: Any) -> tuple[Any, Any]:
    """(the adoption, a copy of ``original`` patched by Liger's apply_liger_kernel_to_llama),
    or ``(None, why not)``."""
    if DEVICE.type != "cuda":
        return None, "Liger-Kernel's Triton kernels need CUDA"
    try:
        from liger_kernel.transformers import apply_liger_kernel_to_llama
    except Exception as exc:
        return None, f"liger_kernel does not import here ({type(exc).__name__}: {exc})"
    model = copy.deepcopy(original)
    adoption = layerswap.adopt(apply_liger_kernel_to_llama, model=model, prove=False)
    return adoption, model


def _suspending(context: StepContext, adoption: Any) -> StepContext:
    """``context``, run with ``adoption``'s changes taken back (the original code)."""

    @contextlib.contextmanager
    def suspended() -> Iterator[None]:
        with adoption.suspended(), context():
            yield

    return suspended


class GraphableLayer(torch.nn.Module):
    """One swapped decoder layer called with tensors only, as CUDA graph capture wants."""

    def __init__(self, layer: torch.nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return self.layer(hidden, attention_mask=None, position_embeddings=(cos, sin))


class GraphedSlot(torch.nn.Module):
    """Stands in the model's layer list for a graphed layer: causal, unpadded, no cache."""

    def __init__(self, graphed: torch.nn.Module, attention_type: str) -> None:
        super().__init__()
        self.graphed = graphed
        self.attention_type = attention_type

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        if attention_mask is not None or position_embeddings is None:
            raise RuntimeError("a graphed layer runs causal attention on unpadded input only")
        out: torch.Tensor = self.graphed(hidden_states, *position_embeddings)
        return out


def graphed_layers(original: Any, backend: str, recipe: str | None, args: Any) -> Any:
    """A copy of ``original`` with ``backend``'s layers, each captured as CUDA graphs.

    TE's ``make_graphed_callables`` for te (FP8 when ``recipe`` is given), torch's for
    fused: forward and backward of every layer replayed from graphs at the benchmark's
    shape (``args.batch`` x ``args.seq``). Raises when the model passes a mask (the graphs
    hold plain causal attention) or capture fails; one training step runs before it is
    returned, so a graph that cannot replay fails here, not in the timed rounds.
    """
    if DEVICE.type != "cuda":
        raise RuntimeError("CUDA graphs need a CUDA device")
    model = copy.deepcopy(original)
    swap(model, f"llama.decoder.{backend}")
    layers = model.model.layers
    seen: dict[str, Any] = {}

    def record(module: Any, positional: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        seen["mask"] = kwargs.get("attention_mask")
        seen["cos_sin"] = kwargs["position_embeddings"]

    ids = torch.randint(0, args.vocab, (args.batch, args.seq), device=DEVICE)
    handle = layers[0].register_forward_pre_hook(record, with_kwargs=True)
    with torch.no_grad():
        model(input_ids=ids, use_cache=False)
    handle.remove()
    if seen["mask"] is not None:
        raise RuntimeError(f"the model passes its layers a mask ({type(seen['mask']).__name__})")
    cos, sin = (tensor.detach().clone() for tensor in seen["cos_sin"])
    graphables = tuple(GraphableLayer(layer) for layer in layers)
    shape = (args.batch, args.seq, original.config.hidden_size)
    sample_args = tuple(
        (torch.randn(shape, device=DEVICE, dtype=torch.bfloat16, requires_grad=True), cos, sin)
        for _ in graphables
    )
    model.train()
    if backend == "te":
        options: dict[str, Any] = {}
        if recipe is not None:
            options = {"enabled": True, "recipe": te.fp8_recipe(recipe)}
        graphed = te._te().make_graphed_callables(graphables, sample_args, **options)
    else:
        graphed = torch.cuda.make_graphed_callables(graphables, sample_args)
    for index, module in enumerate(graphed):
        layers[index] = GraphedSlot(module, getattr(layers[index], "attention_type", "full"))
    with te.fp8_autocast(recipe) if recipe else contextlib.nullcontext():
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    model.zero_grad(set_to_none=True)
    return model


# dense (no sparsity) tensor-core peaks from the vendor's datasheets, TFLOP/s: the
# denominator of model FLOPs utilisation (MFU); the H200's arithmetic is the H100's
DATASHEET_TFLOPS = {
    "H100": {"bf16": 989.4, "fp8": 1978.9},
    "H200": {"bf16": 989.4, "fp8": 1978.9},
}


def datasheet_peak(precision: str) -> float | None:
    if DEVICE.type != "cuda":
        return None
    name = torch.cuda.get_device_name()
    for key, peaks in DATASHEET_TFLOPS.items():
        if key in name:
            return peaks[precision] * 1e12
    return None


def measured_matmul_peak() -> float | None:
    """bf16 8192^3 matrix products through torch on random data, FLOP/s (median of 10)."""
    if DEVICE.type != "cuda":
        return None
    size = 8192
    a = torch.randn(size, size, device=DEVICE, dtype=torch.bfloat16)
    b = torch.randn(size, size, device=DEVICE, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    times = [step_ms(lambda: a @ b) for _ in range(10)]
    return 2 * size**3 / (statistics.median(times) / 1000)


def model_flops_per_token(config: Any, seq: int, training: bool) -> float:
    """PaLM's count (appendix B): 6N + 12·L·d·S per trained token, 2N + 4·L·d·S forward.

    N is every weight a token's matrix products use (the decoder layers and ``lm_head``;
    not the embedding lookup); attention's two products are counted whole (no causal
    halving), as PaLM and Megatron count them.
    """
    d, layers = config.hidden_size, config.num_hidden_layers
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head = d // heads
    attention = d * heads * head + 2 * d * kv_heads * head + heads * head * d
    mlp = 3 * d * config.intermediate_size
    n = layers * (attention + mlp) + d * config.vocab_size
    if training:
        return 6 * n + 12 * layers * d * seq
    return 2 * n + 4 * layers * d * seq


def benchmark(args: argparse.Namespace, original: Any) -> dict[str, Any]:
    contenders, notes = make_contenders(original, args)
    for note in notes:
        log(note)
    generator = torch.Generator(device=DEVICE).manual_seed(args.seed)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), device=DEVICE, generator=generator)
    order = rotations(contenders)
    total = args.warmup + args.rounds
    for round_index in range(total):
        measured = round_index >= args.warmup
        for contender in next(order):
            forward = step_ms(functools.partial(forward_step, contender, ids))
            train = step_ms(functools.partial(train_step, contender, ids))
            if measured:
                contender.forward_ms.append(forward)
                contender.train_ms.append(train)
        log(f"round {round_index + 1}/{total}{'' if measured else ' (warm-up)'} done")
    for contender in contenders:
        contender.forward_peak_bytes = peak_bytes(functools.partial(forward_step, contender, ids))
        contender.train_peak_bytes = peak_bytes(functools.partial(train_step, contender, ids))
    tokens = args.batch * args.seq
    config = original.config
    train_flops = model_flops_per_token(config, args.seq, training=True) * tokens
    forward_flops = model_flops_per_token(config, args.seq, training=False) * tokens
    matmul_peak = measured_matmul_peak()

    def mfu(contender: Contender, flops: float, ms: float) -> float | None:
        peak = datasheet_peak("fp8" if "fp8" in contender.name else "bf16")
        return None if peak is None else flops / (ms / 1000) / peak

    base = contenders[0]
    base_forward = statistics.median(base.forward_ms)
    base_train = statistics.median(base.train_ms)
    rows = []
    for contender in contenders:
        forward = statistics.median(contender.forward_ms)
        train = statistics.median(contender.train_ms)
        rows.append(
            {
                "contender": contender.name,
                "forward_ms": forward,
                "forward_tokens_per_s": tokens / (forward / 1000),
                "forward_speedup": base_forward / forward,
                "train_step_ms": train,
                "train_tokens_per_s": tokens / (train / 1000),
                "train_speedup": base_train / train,
                "forward_peak_gib": contender.forward_peak_bytes / GIB,
                "train_peak_gib": contender.train_peak_bytes / GIB,
                "train_peak_ratio": contender.train_peak_bytes / max(base.train_peak_bytes, 1),
                "forward_mfu": mfu(contender, forward_flops, forward),
                "train_mfu": mfu(contender, train_flops, train),
                "train_tflops": train_flops / (train / 1000) / 1e12,
                "forward_samples_ms": contender.forward_ms,
                "train_samples_ms": contender.train_ms,
                "losses": [float(loss) for loss in contender.losses],
            }
        )
    log()
    log(
        f"benchmark: {sum(p.numel() for p in original.parameters()) / 1e9:.2f}B parameters, "
        f"batch {args.batch} x {args.seq} tokens, bf16 weights, AdamW (fused); "
        f"medians of {args.rounds} interleaved rounds after {args.warmup} warm-up rounds, "
        f"timed with {'CUDA events' if DEVICE.type == 'cuda' else 'perf_counter'}"
    )
    header = (
        f"{'contender':<22}{'fwd ms':>9}{'fwd tok/s':>12}{'x orig':>8}"
        f"{'train ms':>10}{'train tok/s':>13}{'x orig':>8}{'fwd peak':>10}{'train peak':>12}"
        f"{'x orig':>8}{'fwd MFU':>9}{'train MFU':>10}"
    )
    log(header)
    log("-" * len(header))
    for row in rows:
        log(
            f"{row['contender']:<22}{row['forward_ms']:>9.2f}{row['forward_tokens_per_s']:>12,.0f}"
            f"{row['forward_speedup']:>8.2f}{row['train_step_ms']:>10.2f}"
            f"{row['train_tokens_per_s']:>13,.0f}{row['train_speedup']:>8.2f}"
            f"{row['forward_peak_gib']:>9.2f}G{row['train_peak_gib']:>11.2f}G"
            f"{row['train_peak_ratio']:>8.2f}"
            f"{percent(row['forward_mfu']):>9}{percent(row['train_mfu']):>10}"
        )
    log(
        f"MFU: model FLOPs ({train_flops / tokens / 1e9:.2f} GFLOP per trained token, "
        f"{forward_flops / tokens / 1e9:.2f} forward; PaLM's count) over the datasheet's dense "
        f"peak (bf16, or fp8 for FP8 contenders); this GPU's bf16 matrix product measured "
        f"{'n/a' if matmul_peak is None else f'{matmul_peak / 1e12:.0f} TFLOP/s'}"
    )
    log("x orig: original's time / contender's time (above 1 is faster); peak: memory a step")
    log("allocates above the resident weights and optimizer state; losses of the last steps:")
    for row in rows:
        log(f"  {row['contender']:<22}" + " ".join(f"{loss:.4f}" for loss in row["losses"][-3:]))
    return {
        "notes": notes,
        "tokens_per_step": tokens,
        "train_flops_per_step": train_flops,
        "measured_bf16_matmul_flops": matmul_peak,
        "rows": rows,
    }


def percent(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.1f}%"


# --- main -----------------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "gpu_results"))
    parser.add_argument("--families", default=",".join(sorted(families())))
    parser.add_argument("--backends", default="fused,liger,te", help="verified backends")
    parser.add_argument("--fp8-recipes", default="delayed,current", help="benchmark columns")
    parser.add_argument(
        "--contenders",
        default="original,fused,fused+head,liger,liger+head,te",
        help="benchmarked: original, compiled (the original under torch.compile), "
        "liger-patch (Liger-Kernel's own apply_liger_kernel_to_llama, adopted), fused, liger, "
        "fused+head, liger+head, fused-slots, liger-slots (the norms, MLPs and head swapped, "
        "the decoder layers the original's), te (bf16 and FP8), "
        "te-bf16, te-fp8 (one FP8 contender per --fp8-recipes), te-graphed (bf16 and FP8 "
        "current, each layer a CUDA graph), fused-graphed; a swapped contender with "
        "'-compiled' (fused-compiled, fused+head-compiled, ...) has each decoder layer under "
        "torch.compile",
    )
    parser.add_argument("--verify-fp8-recipe", default="current")
    parser.add_argument("--skip-verify", action="store_true")
    parser.add_argument("--skip-bench", action="store_true")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=5632)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda", help="cpu: a smoke test of this script")
    args = parser.parse_args()
    args.fp8_recipes = [name for name in args.fp8_recipes.split(",") if name]
    args.families = [name for name in args.families.split(",") if name]
    args.backends = [name for name in args.backends.split(",") if name]
    args.contenders = [name for name in args.contenders.split(",") if name]
    unknown = sorted(set(args.backends) - set(VERIFY_DTYPES))
    if unknown:
        parser.error(f"unknown backend(s) {unknown}; known: {sorted(VERIFY_DTYPES)}")
    return args


def _interrupted(signum: int, frame: Any) -> None:
    # `timeout` sends SIGTERM: unwind, so what was measured is still written
    raise KeyboardInterrupt(f"signal {signum}")


def main() -> int:
    global DEVICE
    signal.signal(signal.SIGTERM, _interrupted)
    args = parse_args()
    DEVICE = torch.device(args.device)
    if DEVICE.type == "cuda" and not torch.cuda.is_available():
        print("verify_and_bench.py needs a CUDA device (--device cpu: smoke test)", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"environment": environment(), "arguments": vars(args)}
    log("environment:", json.dumps(results["environment"]))
    checks: list[Check] = []
    try:
        if not args.skip_verify:
            log("\n== verification: tiny models, every family")
            checks += verify_tiny(args.families, args.verify_fp8_recipe, args.backends)
        original = build_on_gpu(benchmark_config(args), args.seed)
        if not args.skip_verify:
            log("\n== verification: the benchmark model")
            checks += verify_large(original, args.verify_fp8_recipe, args.backends)
        if not args.skip_bench:
            log("\n== benchmark")
            results["benchmark"] = benchmark(args, original)
    finally:
        results["checks"] = [check.__dict__ for check in checks]
        failed = [check.name for check in checks if check.passed is False]
        results["failed"] = failed
        log(
            f"\nverification: {sum(c.passed is True for c in checks)} passed, {len(failed)} failed, "
            f"{sum(c.passed is None for c in checks)} skipped"
        )
        for name in failed:
            log(f"  FAILED: {name}")
        (out / "verify_and_bench.json").write_text(json.dumps(results, indent=2, default=str))
        (out / "verify_and_bench.txt").write_text("\n".join(log.lines) + "\n")
    return 1 if results["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
