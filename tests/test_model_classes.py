"""verify() and bench() run every model class of a family, or refuse it with a clear error.

A family's causal LM, sequence, token and question-answering classifiers and base model
share the decoder layers that a substitution replaces; each is compared on its own
output, and with ``backward=True`` on the loss its head learns from.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
import transformers
from models import tiny_config
from torch import nn

import layerswap
from layerswap.comparison.model_classes import task_of
from layerswap.errors import UnsupportedModelError
from layerswap.registry import get
from layerswap.substitution import Substitution
from layerswap.use import use
from layerswap.verify import default_inputs

FAMILIES = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3"}
CLASSES = {
    "ForCausalLM": "causal-lm",
    "ForSequenceClassification": "sequence-classification",
    "ForTokenClassification": "token-classification",
    "ForQuestionAnswering": "question-answering",
    "Model": "base",
}


def _model(family: str, suffix: str, seed: int = 0, **overrides: Any) -> nn.Module:
    config = tiny_config(family, num_hidden_layers=2, pad_token_id=0, **overrides)
    cls = getattr(transformers, FAMILIES[family] + suffix)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model: nn.Module = cls(config)
    return model.eval()


def _broken(family: str) -> Substitution:
    """The fused substitution with layer 1's attention output off by 1%."""
    fused_layer = get(f"{family}.decoder.fused").replacement_class()

    class OffLayer(fused_layer):  # type: ignore[misc, valid-type]
        def __init__(self, config: Any, layer_idx: int) -> None:
            super().__init__(config, layer_idx)
            if layer_idx == 1:
                self.self_attn.o_proj.register_forward_hook(lambda m, a, out: out * 1.01)

    return dataclasses.replace(
        get(f"{family}.decoder.fused"), name=f"{family}.decoder.off", replacement=OffLayer
    )


@pytest.mark.parametrize("suffix", CLASSES)
@pytest.mark.parametrize("family", FAMILIES)
def test_every_model_class_verifies_forward_and_backward(family: str, suffix: str) -> None:
    model = _model(family, suffix)
    assert task_of(model).kind == CLASSES[suffix]
    report = layerswap.verify(model, f"{family}.decoder.fused", backward=True)
    assert report.passed, report.summary()
    assert len(report.layers) == 2
    assert report.backward is not None
    assert math_finite(report.backward.loss_reference)


def math_finite(value: float) -> bool:
    return bool(torch.isfinite(torch.tensor(value)))


@pytest.mark.parametrize("suffix", CLASSES)
def test_a_wrong_layer_fails_in_every_model_class(suffix: str) -> None:
    model = _model("llama", suffix)
    report = layerswap.verify(model, _broken("llama"), backward=True)
    assert not report.passed
    assert report.first_divergent_layer == 1


@pytest.mark.parametrize("suffix", CLASSES)
def test_every_model_class_benches(suffix: str) -> None:
    model = _model("qwen2", suffix)
    report = layerswap.bench(model, "qwen2.decoder.fused", batch=2, seq=8, steps=1, warmup=0)
    assert report.original.forward_backward_ms is not None
    assert report.swapped.forward_backward_ms is not None


@pytest.mark.parametrize("suffix", ["ForSequenceClassification", "ForTokenClassification"])
def test_a_classifier_built_inside_use_verifies(suffix: str) -> None:
    with use("qwen3.decoder.fused"):
        model = _model("qwen3", suffix, seed=2)
    report = layerswap.verify(model, "qwen3.decoder.fused", backward=True)
    assert report.passed, report.summary()


@pytest.mark.parametrize(
    ("overrides", "labels"),
    [
        ({"num_labels": 1}, torch.float32),
        ({"num_labels": 3, "problem_type": "multi_label_classification"}, torch.float32),
        ({"num_labels": 3}, torch.int64),
    ],
    ids=["regression", "multi-label", "single-label"],
)
def test_sequence_classification_labels_follow_the_problem_type(
    overrides: dict[str, Any], labels: torch.dtype
) -> None:
    model = _model("llama", "ForSequenceClassification", **overrides)
    batch = default_inputs(model.config.vocab_size)
    made = task_of(model).labels(batch, model.config)["labels"]
    assert made.dtype == labels
    assert layerswap.verify(model, "llama.decoder.fused", backward=True).passed


def test_question_answering_loss_ignores_padded_positions() -> None:
    model = _model("llama", "ForQuestionAnswering")
    batch = default_inputs(model.config.vocab_size)
    task = task_of(model)
    with torch.no_grad():
        output = model(**batch)
        loss = task.loss(output, batch)
        output.start_logits[~batch["attention_mask"].bool()] = 1e4  # padding: ignored
        assert torch.equal(task.loss(output, batch), loss)


def test_generate_on_a_classifier_is_refused_before_any_work() -> None:
    model = _model("llama", "ForSequenceClassification")
    with pytest.raises(UnsupportedModelError, match="does not generate"):
        layerswap.verify(model, "llama.decoder.fused", generate=2)


def test_sequence_classification_without_a_pad_token_is_refused_naming_the_fix() -> None:
    model = _model("llama", "ForSequenceClassification")
    model.config.pad_token_id = None
    with pytest.raises(UnsupportedModelError, match="pad_token_id"):
        layerswap.verify(model, "llama.decoder.fused")
    # one sequence needs no padding token
    ids = default_inputs(model.config.vocab_size, batch=1)
    assert layerswap.verify(model, "llama.decoder.fused", ids).passed
