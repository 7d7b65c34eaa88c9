"""layerswap.bench: structure and internal consistency of the report (never timing values)."""

from __future__ import annotations

import json
import statistics
from typing import Any

import pytest
import torch

from layerswap.bench import BenchReport, bench
from layerswap.registry import get_family

FUSED = "llama.decoder.fused"


@pytest.fixture(scope="module")
def llama() -> Any:
    return get_family("llama").build(get_family("llama").tiny_config(num_hidden_layers=2))


@pytest.fixture(scope="module")
def report(llama: Any) -> BenchReport:
    return bench(llama, FUSED, batch=2, seq=8, steps=3, warmup=1)


def test_figures_are_medians_of_the_measured_steps(report: BenchReport) -> None:
    for result in (report.original, report.swapped):
        assert len(result.forward_samples_ms) == 3  # warm-up steps are not recorded
        assert len(result.forward_backward_samples_ms) == 3
        assert result.forward_ms == statistics.median(result.forward_samples_ms)
        assert result.forward_backward_ms == statistics.median(result.forward_backward_samples_ms)
        assert all(sample > 0 for sample in result.forward_samples_ms)


def test_throughput_and_ratios_follow_from_the_latencies(report: BenchReport) -> None:
    tokens = report.batch * report.seq_len
    for result in (report.original, report.swapped):
        assert result.forward_tokens_per_s == pytest.approx(tokens / result.forward_ms * 1000)
        assert result.forward_backward_ms is not None
        assert result.forward_backward_tokens_per_s == pytest.approx(
            tokens / result.forward_backward_ms * 1000
        )
    assert report.forward_speedup == pytest.approx(
        report.original.forward_ms / report.swapped.forward_ms
    )
    assert report.original.forward_backward_ms is not None
    assert report.swapped.forward_backward_ms is not None
    assert report.forward_backward_speedup == pytest.approx(
        report.original.forward_backward_ms / report.swapped.forward_backward_ms
    )


def test_memory_is_measured_the_way_the_device_allows(report: BenchReport, llama: Any) -> None:
    assert report.memory_method == ("cuda" if report.device.startswith("cuda") else "rss")
    parameter_bytes = sum(p.numel() * p.element_size() for p in llama.parameters())
    # fusing concatenates weights: same number of parameters, same bytes
    assert report.original.parameter_bytes == parameter_bytes
    assert report.swapped.parameter_bytes == parameter_bytes
    assert report.original.peak_memory_bytes >= 0 and report.swapped.peak_memory_bytes >= 0


def test_table_and_dict_describe_the_same_run(report: BenchReport) -> None:
    table = report.table()
    data = json.loads(report.to_json())

    assert data["substitution"] == FUSED
    assert data["original"]["forward_ms"] == report.original.forward_ms
    assert (data["batch"], data["seq_len"], data["steps"], data["warmup"]) == (2, 8, 3, 1)
    for label in ("forward (ms)", "forward+backward (ms)", "tokens/s", "peak step memory"):
        assert label in table
    assert f"{report.original.forward_ms:.2f}" in table
    assert f"{report.forward_speedup:.2f}x" in table


def test_forward_only_leaves_backward_figures_out(llama: Any) -> None:
    report = bench(llama, FUSED, batch=1, seq=4, steps=1, warmup=0, backward=False)

    assert report.original.forward_backward_ms is None
    assert report.original.forward_backward_samples_ms == ()
    assert report.forward_backward_speedup is None
    assert "forward+backward" not in report.table()


def test_bench_leaves_the_model_untouched(llama: Any) -> None:
    state = {key: value.clone() for key, value in llama.state_dict().items()}
    steps: list[tuple[int, int]] = []

    bench(llama, FUSED, batch=1, seq=4, steps=2, warmup=1, on_step=lambda *s: steps.append(s))

    assert all(torch.equal(value, llama.state_dict()[key]) for key, value in state.items())
    assert all(param.grad is None for param in llama.parameters())
    assert type(llama.model.layers[0]).__name__ == "LlamaDecoderLayer"
    assert steps == [(1, 3), (2, 3), (3, 3)]


def test_bench_rejects_empty_runs(llama: Any) -> None:
    with pytest.raises(ValueError, match="steps >= 1"):
        bench(llama, FUSED, steps=0)


def test_layerswap_bench_is_callable_even_after_its_module_is_imported(llama: Any) -> None:
    import layerswap
    import layerswap.bench  # binds the package attribute to the submodule

    report = layerswap.bench(llama, FUSED, batch=1, seq=4, steps=1, warmup=0, backward=False)  # type: ignore[operator]
    assert isinstance(report, BenchReport)
