"""Latency, throughput and memory of a model before and after a substitution.

:func:`bench` builds two working copies of the model (the caller's model is only read):
the original and the swapped one, on the same device, in the same dtype, fed the same
batch. Runs are interleaved, original and swapped alternating and the order flipping
every step, so that clock boosts, thermal drift and allocator warm-up hit both alike.
Warm-up steps are not recorded; figures are medians, with the min and max beside them,
and :meth:`BenchReport.noise` says when the spread makes a ratio meaningless.

Peak memory is what a step needs above what was in use before it (activations,
gradients, workspaces): on CUDA from the allocator's peak statistics, on CPU from the
process's resident set size sampled in a background thread during one extra step. RSS
sampling is coarse (the allocator reuses freed pages), so small CPU figures are noise.

Example::

    report = layerswap.bench(model, "llama.decoder.fused", batch=4, seq=128, steps=10)
    print(report.table())
    report.forward_speedup       # > 1: the swapped model is faster
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import statistics
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import nn

from layerswap.comparison.forward import ContextFactory
from layerswap.comparison.inputs import inputs_for, text_config
from layerswap.comparison.model_classes import ModelTask, task_of
from layerswap.comparison.placement import (
    DeviceLike,
    DTypeLike,
    dtype_name,
    target_placement,
    working_copy,
)
from layerswap.verify.candidate import SubstitutionLike, candidate_context, resolve_substitution

if TYPE_CHECKING:
    from layerswap.substitution import Substitution

__all__ = ["NOISY_SPREAD", "BenchReport", "BenchResult", "bench"]

_MIB = 1024 * 1024
#: per-step time ratios whose largest exceeds this times their smallest are noise
NOISY_SPREAD = 1.5
_RSS_NOISE_FLOOR = 4 * _MIB


@dataclass(frozen=True)
class BenchResult:
    """Figures of one model: median latencies, throughput, and memory.

    ``peak_memory_bytes`` is the largest rise above the memory in use before a step
    (forward+backward when measured, else forward); ``parameter_bytes`` the weights.
    """

    forward_ms: float
    forward_tokens_per_s: float
    forward_backward_ms: float | None
    forward_backward_tokens_per_s: float | None
    peak_memory_bytes: int
    parameter_bytes: int
    forward_samples_ms: tuple[float, ...]
    forward_backward_samples_ms: tuple[float, ...]


@dataclass(frozen=True)
class BenchReport:
    """Original against swapped; ratios are original / swapped for time (> 1: faster)
    and swapped / original for memory (< 1: smaller)."""

    substitution: str
    device: str
    dtype: str
    batch: int
    seq_len: int
    steps: int
    warmup: int
    memory_method: Literal["cuda", "rss"]
    original: BenchResult
    swapped: BenchResult
    forward_speedup: float
    forward_backward_speedup: float | None
    peak_memory_ratio: float | None

    def step_ratios(self, metric: Literal["forward", "forward_backward"]) -> tuple[float, ...]:
        """original / swapped for each measured step: the two ran in the same step."""
        if metric == "forward":
            original, swapped = self.original.forward_samples_ms, self.swapped.forward_samples_ms
        else:
            original = self.original.forward_backward_samples_ms
            swapped = self.swapped.forward_backward_samples_ms
        pairs = zip(original, swapped, strict=True)
        return tuple(o / s for o, s in pairs if s > 0)

    def noise(self) -> list[str]:
        """Why a time ratio cannot be trusted, one sentence per metric that is too noisy.

        Each step times both models back to back, so the ratio of one step's pair is a
        sample of the speedup. A ratio is judged meaningless when those per-step ratios
        fall on both sides of 1 (the swapped model was faster in some steps and slower in
        others), and uncertain when the largest is more than :data:`NOISY_SPREAD` times
        the smallest.
        """
        found = []
        for metric, label in (("forward", "forward"), ("forward_backward", "forward+backward")):
            ratios = self.step_ratios(metric)  # type: ignore[arg-type]
            if len(ratios) < 2:
                continue
            low, high = min(ratios), max(ratios)
            span = f"per-step ratios range from {low:.2f}x to {high:.2f}x"
            if low < 1.0 < high:
                found.append(
                    f"{label}: the ratio is not meaningful: {span}, on both sides of 1 "
                    "(more --steps, a larger --batch/--seq, or a quieter machine)"
                )
            elif high > NOISY_SPREAD * low:
                found.append(f"{label}: the ratio is uncertain: {span}")
        return found

    def to_dict(self) -> dict[str, Any]:
        """A plain dict (nested results become dicts, tuples become lists)."""
        return dataclasses.asdict(self)

    def to_json(self, **kwargs: Any) -> str:
        """The report as JSON; kwargs go to ``json.dumps``."""
        return json.dumps(self.to_dict(), **kwargs)

    def rows(self) -> list[tuple[str, str, str, str]]:
        """(metric, original, swapped, ratio) rows, formatted, as :meth:`table` shows them."""

        def ms(value: float | None, samples: tuple[float, ...] = ()) -> str:
            if value is None:
                return "-"
            spread = f" ({min(samples):.2f}-{max(samples):.2f})" if len(samples) > 1 else ""
            return f"{value:.2f}{spread}"

        def rate(value: float | None) -> str:
            return "-" if value is None else f"{value:,.0f}"

        def ratio(value: float | None) -> str:
            return "-" if value is None else f"{value:.2f}x"

        orig, swapped = self.original, self.swapped
        rows = [
            ("forward (ms)", ms(orig.forward_ms, orig.forward_samples_ms),
             ms(swapped.forward_ms, swapped.forward_samples_ms), ratio(self.forward_speedup)),
            ("forward tokens/s", rate(orig.forward_tokens_per_s),
             rate(swapped.forward_tokens_per_s), ratio(self.forward_speedup)),
        ]  # fmt: skip
        if orig.forward_backward_ms is not None:
            rows += [
                ("forward+backward (ms)",
                 ms(orig.forward_backward_ms, orig.forward_backward_samples_ms),
                 ms(swapped.forward_backward_ms, swapped.forward_backward_samples_ms),
                 ratio(self.forward_backward_speedup)),
                ("forward+backward tokens/s", rate(orig.forward_backward_tokens_per_s),
                 rate(swapped.forward_backward_tokens_per_s),
                 ratio(self.forward_backward_speedup)),
            ]  # fmt: skip
        rows += [
            (f"peak step memory (MiB, {self.memory_method})",
             f"{orig.peak_memory_bytes / _MIB:.1f}", f"{swapped.peak_memory_bytes / _MIB:.1f}",
             ratio(self.peak_memory_ratio)),
            ("parameters (MiB)", f"{orig.parameter_bytes / _MIB:.1f}",
             f"{swapped.parameter_bytes / _MIB:.1f}", "-"),
        ]  # fmt: skip
        return rows

    def table(self) -> str:
        """A plain-text table: one row per metric, original, swapped, ratio."""
        header = ("metric", "original", "swapped", "ratio")
        rows = [header, *self.rows()]
        widths = [max(len(row[i]) for row in rows) for i in range(4)]
        lines = [
            f"{self.substitution} on {self.device} ({self.dtype}), batch {self.batch} x "
            f"seq {self.seq_len}, median (min-max) of {self.steps} interleaved steps "
            f"after {self.warmup} warm-up"
        ]
        for row in rows:
            lines.append(
                "  ".join(
                    cell.ljust(widths[i]) if i == 0 else cell.rjust(widths[i])
                    for i, cell in enumerate(row)
                )
            )
        lines += [f"warning: {sentence}" for sentence in self.noise()]
        return "\n".join(lines)


class _MemoryProbe:
    """Peak memory rise during a block: CUDA allocator statistics, else sampled RSS."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.method: Literal["cuda", "rss"] = "cuda" if device.type == "cuda" else "rss"
        self.peak = 0

    def measure(self, step: Callable[[], None]) -> int:
        if self.method == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            before = torch.cuda.memory_allocated(self.device)
            step()
            torch.cuda.synchronize(self.device)
            return max(0, int(torch.cuda.max_memory_allocated(self.device)) - int(before))
        return self._measure_rss(step)

    @staticmethod
    def _measure_rss(step: Callable[[], None]) -> int:
        import psutil

        process = psutil.Process()
        before = process.memory_info().rss
        peak = before
        done = threading.Event()

        def sample() -> None:
            nonlocal peak
            while not done.is_set():
                peak = max(peak, process.memory_info().rss)
                done.wait(0.0005)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        try:
            step()
        finally:
            done.set()
            sampler.join()
        peak = max(peak, process.memory_info().rss)
        return max(0, int(peak) - int(before))


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _parameter_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


@dataclass
class _Contestants:
    """The original and the swapped working copies, what they are fed and what they run in.

    The swapped layers may need a context to run in (an FP8 autocast, say); the loss is
    the model's own head's: a classifier learns from class labels, a base model (no head)
    from a fixed projection of its output.
    """

    models: dict[str, nn.Module]
    contexts: Mapping[str, ContextFactory]
    inputs: dict[str, torch.Tensor]
    labels: dict[str, torch.Tensor]
    task: ModelTask
    device: torch.device

    def forward_step(self, name: str) -> Callable[[], None]:
        def run() -> None:
            module = self.models[name]
            module.eval()
            with torch.no_grad(), self.contexts[name]():
                module(**self.inputs, use_cache=False)

        return run

    def train_step(self, name: str) -> Callable[[], None]:
        def run() -> None:
            module = self.models[name]
            module.train()
            with self.contexts[name]():
                loss = self.task.loss(
                    module(**self.inputs, **self.labels, use_cache=False), self.inputs
                )
            loss.backward()  # type: ignore[no-untyped-call]
            module.zero_grad(set_to_none=True)

        return run

    def timed(self, step: Callable[[], None]) -> float:
        """Milliseconds ``step`` takes, the device synchronised on both sides."""
        _synchronize(self.device)
        start = time.perf_counter()
        step()
        _synchronize(self.device)
        return (time.perf_counter() - start) * 1000.0


def _contestants(
    model: nn.Module,
    sub: Substitution,
    *,
    batch: int,
    seq: int,
    backward: bool,
    device: torch.device,
    dtype: torch.dtype,
    seed: int,
) -> _Contestants:
    """Two working copies of ``model``, one swapped by ``sub``, and one batch for both."""
    from layerswap.swap import swap

    original = working_copy(model, device, dtype, trainable=backward)
    swapped = copy.deepcopy(original)
    swap(swapped, sub)
    inputs = inputs_for(original, batch=batch, seq_len=seq, padding=0, seed=seed, device=device)
    task = task_of(original)
    task.check(original, inputs, generate=0)
    labels = task.labels(inputs, text_config(original))
    contexts: Mapping[str, ContextFactory] = {
        "original": contextlib.nullcontext,
        "swapped": candidate_context(sub),
    }
    models = {"original": original, "swapped": swapped}
    return _Contestants(models, contexts, inputs, labels, task, device)


def _interleaved_samples(
    runs: _Contestants,
    *,
    steps: int,
    warmup: int,
    backward: bool,
    on_step: Callable[[int, int], None] | None,
) -> dict[str, dict[str, list[float]]]:
    """Milliseconds per recorded step, by model and by ``"forward"``/``"train"``: the two
    models alternate, the order flipping every step; warm-up steps are not recorded."""
    total = warmup + steps
    samples: dict[str, dict[str, list[float]]] = {
        name: {"forward": [], "train": []} for name in runs.models
    }
    for index in range(total):
        order = ("original", "swapped") if index % 2 == 0 else ("swapped", "original")
        for name in order:
            forward_ms = runs.timed(runs.forward_step(name))
            train_ms = runs.timed(runs.train_step(name)) if backward else None
            if index >= warmup:
                samples[name]["forward"].append(forward_ms)
                if train_ms is not None:
                    samples[name]["train"].append(train_ms)
        if on_step is not None:
            on_step(index + 1, total)
    return samples


def _result(
    module: nn.Module, samples: dict[str, list[float]], *, peak: int, tokens: int, backward: bool
) -> BenchResult:
    """One model's figures: the medians of its samples, and its peak memory."""
    forward_ms = statistics.median(samples["forward"])
    train_ms = statistics.median(samples["train"]) if backward else None
    return BenchResult(
        forward_ms=forward_ms,
        forward_tokens_per_s=tokens / (forward_ms / 1000.0),
        forward_backward_ms=train_ms,
        forward_backward_tokens_per_s=(
            tokens / (train_ms / 1000.0) if train_ms is not None else None
        ),
        peak_memory_bytes=peak,
        parameter_bytes=_parameter_bytes(module),
        forward_samples_ms=tuple(samples["forward"]),
        forward_backward_samples_ms=tuple(samples["train"]),
    )


def bench(
    model: nn.Module,
    substitution: SubstitutionLike,
    *,
    batch: int = 4,
    seq: int = 128,
    steps: int = 10,
    warmup: int = 3,
    backward: bool = True,
    device: DeviceLike = None,
    dtype: DTypeLike = None,
    seed: int = 0,
    on_step: Callable[[int, int], None] | None = None,
) -> BenchReport:
    """Time ``model`` against ``model`` swapped by ``substitution``.

    ``device="auto"`` picks CUDA when present; ``None`` keeps the model's device and
    dtype. ``backward=False`` skips the forward+backward measurements. ``on_step(done,
    total)`` is called after each step (for progress displays). The caller's model is
    not modified; two working copies are made.

    Example::

        report = layerswap.bench(model, "llama.decoder.fused", batch=2, seq=64, steps=5)
        print(report.table())
    """
    if steps < 1 or warmup < 0 or batch < 1 or seq < 1:
        raise ValueError("bench needs steps >= 1, warmup >= 0, batch >= 1 and seq >= 1")
    sub = resolve_substitution(substitution)
    target_device, target_dtype = target_placement(model, device, dtype)
    runs = _contestants(
        model,
        sub,
        batch=batch,
        seq=seq,
        backward=backward,
        device=target_device,
        dtype=target_dtype,
        seed=seed,
    )
    samples = _interleaved_samples(
        runs, steps=steps, warmup=warmup, backward=backward, on_step=on_step
    )
    probe = _MemoryProbe(target_device)
    results = {
        name: _result(
            module,
            samples[name],
            peak=probe.measure(runs.train_step(name) if backward else runs.forward_step(name)),
            tokens=batch * seq,
            backward=backward,
        )
        for name, module in runs.models.items()
    }
    orig, new = results["original"], results["swapped"]
    return BenchReport(
        substitution=sub.name,
        device=str(target_device),
        dtype=dtype_name(target_dtype),
        batch=batch,
        seq_len=seq,
        steps=steps,
        warmup=warmup,
        memory_method=probe.method,
        original=orig,
        swapped=new,
        forward_speedup=orig.forward_ms / new.forward_ms,
        forward_backward_speedup=(
            orig.forward_backward_ms / new.forward_backward_ms
            if orig.forward_backward_ms is not None and new.forward_backward_ms is not None
            else None
        ),
        peak_memory_ratio=_memory_ratio(orig, new, probe.method),
    )


def _memory_ratio(original: BenchResult, swapped: BenchResult, method: str) -> float | None:
    # below a page-granular noise floor an RSS ratio says nothing
    floor = _RSS_NOISE_FLOOR if method == "rss" else 1
    if original.peak_memory_bytes < floor or swapped.peak_memory_bytes < floor:
        return None
    return swapped.peak_memory_bytes / original.peak_memory_bytes
