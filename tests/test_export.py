"""torch.jit.trace, torch.export and torch.onnx.export(dynamo=False) work on a swapped model
wherever they work on the original, and the exported program computes what the original does.

Each case runs the exporter on the original first, in the same test: where the original
fails (transformers' own code has ops the exporter lacks), the swapped model need not work;
where the original works, the swapped one must, with equal outputs.
"""

from __future__ import annotations

import copy
import io
import warnings
from collections.abc import Callable

import pytest
import torch
from models import left_padded_batch, tiny_model, tokens
from torch import nn

import layerswap

pytestmark = pytest.mark.slow  # torch.export, TorchScript and ONNX exports

FAMILIES = ("llama", "qwen2", "qwen3")


class Logits(nn.Module):
    """The model's logits as a plain tensor, the output form every exporter takes."""

    def __init__(self, model: nn.Module, **options: bool) -> None:
        super().__init__()
        self.model = model
        self.options = options

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.model(*inputs, **self.options).logits
        return logits


def _trace(module: nn.Module, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
    return torch.jit.trace(module, inputs)(*inputs)  # type: ignore[no-any-return]


def _export(module: nn.Module, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
    return torch.export.export(module, inputs).module()(*inputs)  # type: ignore[no-any-return]


def _onnx(module: nn.Module, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
    onnx = pytest.importorskip("onnx")
    from onnx.reference import ReferenceEvaluator

    names = ["input_ids", "attention_mask"][: len(inputs)]
    buffer = io.BytesIO()
    torch.onnx.export(module, inputs, buffer, dynamo=False, input_names=names)
    evaluator = ReferenceEvaluator(onnx.load_from_string(buffer.getvalue()))
    (logits,) = evaluator.run(None, {n: x.numpy() for n, x in zip(names, inputs, strict=True)})
    return torch.from_numpy(logits)


EXPORTERS: dict[str, Callable[[nn.Module, tuple[torch.Tensor, ...]], torch.Tensor]] = {
    "jit.trace": _trace,
    "export": _export,
    "onnx": _onnx,
}


def _outcome(
    exporter: Callable[[nn.Module, tuple[torch.Tensor, ...]], torch.Tensor],
    module: nn.Module,
    inputs: tuple[torch.Tensor, ...],
) -> torch.Tensor | type[BaseException]:
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")  # tracer warnings about shapes, frozen in the trace
        try:
            return exporter(module, inputs)
        except pytest.skip.Exception:
            raise
        except Exception as failure:  # the original's failure is the one to compare with
            return type(failure)


CASES = [
    pytest.param("llama", exporter, use_cache, padded, id=f"llama-{exporter}-{label}")
    for exporter in EXPORTERS
    for use_cache, padded, label in (
        (None, True, "default-padded"),
        (None, False, "default-ids"),
        (False, True, "no-cache-padded"),
        (False, False, "no-cache-ids"),
    )
] + [
    pytest.param(name, exporter, None, True, id=f"{name}-{exporter}-default-padded")
    for name in FAMILIES[1:]
    for exporter in EXPORTERS
]


@pytest.mark.parametrize(("name", "exporter", "use_cache", "padded"), CASES)
def test_exports_wherever_the_original_exports(
    name: str, exporter: str, use_cache: bool | None, padded: bool
) -> None:
    original = tiny_model(name, num_hidden_layers=2)
    swapped = copy.deepcopy(original)
    layerswap.swap(swapped, backend="fused")
    options = {} if use_cache is None else {"use_cache": use_cache}
    if padded:
        batch = left_padded_batch(original.config.vocab_size)
        inputs: tuple[torch.Tensor, ...] = (batch["input_ids"], batch["attention_mask"])
        valid = batch["attention_mask"].bool()
    else:
        inputs = (tokens(original.config.vocab_size),)
        valid = torch.ones(inputs[0].shape, dtype=torch.bool)
    with torch.no_grad():
        expected = original(*inputs, **options).logits
    run = EXPORTERS[exporter]
    reference = _outcome(run, Logits(original, **options), inputs)
    candidate = _outcome(run, Logits(swapped, **options), inputs)
    if not isinstance(reference, torch.Tensor):
        return  # the original cannot be exported this way: nothing to keep
    assert isinstance(candidate, torch.Tensor), f"the original exports, the swapped: {candidate}"
    torch.testing.assert_close(candidate[valid], expected[valid], atol=1e-5, rtol=0)


def test_the_default_cache_path_traces_as_the_original_does() -> None:
    # the reported failure: is_causal became a tensor under torch.jit.trace
    original = tiny_model("llama", num_hidden_layers=1)
    swapped = copy.deepcopy(original)
    layerswap.swap(swapped, backend="fused")
    ids = tokens(original.config.vocab_size)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        traced = torch.jit.trace(Logits(swapped), (ids,))
        torch.testing.assert_close(traced(ids), original(ids).logits, atol=1e-5, rtol=0)
