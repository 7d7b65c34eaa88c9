"""The model classes verification runs: what each one outputs and the loss it learns from.

A family's ``*ForCausalLM``, ``*ForSequenceClassification``, ``*ForTokenClassification``,
``*ForQuestionAnswering`` and base ``*Model`` share their decoder layers and differ in
their head: the task the model is for. :func:`task_of` names a model's task; a
:class:`ModelTask` says which output is compared (at the valid positions where the
output is per token), which labels the loss takes, and what the loss is. Values at padded positions are never compared or
learnt from: they mean nothing and differ between attention kernels.

Example::

    task = task_of(model)                      # ModelTask(kind="sequence-classification", ...)
    output = model(**batch, **task.labels(batch, model.config))
    compared, is_logits = task.compared(output, batch["attention_mask"].bool())
    loss = task.loss(output, batch)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from layerswap.comparison.inputs import text_config
from layerswap.errors import UnsupportedModelError

__all__ = ["ModelTask", "TaskKind", "task_of"]

TaskKind = Literal[
    "causal-lm",
    "sequence-classification",
    "token-classification",
    "question-answering",
    "base",
    "other",
]

# class-name suffixes transformers gives each task's head, checked along the class's MRO so a
# subclass of a family's class is recognised too
_SUFFIXES: tuple[tuple[str, TaskKind], ...] = (
    ("ForCausalLM", "causal-lm"),
    ("ForSequenceClassification", "sequence-classification"),
    ("ForTokenClassification", "token-classification"),
    ("ForQuestionAnswering", "question-answering"),
)

_SEED = 0


def task_of(model: nn.Module) -> ModelTask:
    """The :class:`ModelTask` of ``model``: its kind from its class, its class name for messages.

    Example::

        task_of(LlamaForSequenceClassification(config)).kind   # "sequence-classification"
    """
    name = type(model).__name__
    for cls in type(model).__mro__:
        for suffix, kind in _SUFFIXES:
            if cls.__name__.endswith(suffix):
                return ModelTask(kind, name)
    base_model = getattr(model, "base_model", None)
    if base_model is model and hasattr(model, "config"):
        return ModelTask("base", name)
    return ModelTask("other", name)


def _generator(device: torch.device) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(_SEED)


@dataclass(frozen=True)
class ModelTask:
    """How verification reads and trains one model class (see the module docstring)."""

    kind: TaskKind
    model_class: str

    @property
    def learns_per_token(self) -> bool:
        """Whether the loss is a mean of per-token terms that :meth:`labels` can leave out
        (``left_out=``): a causal LM's next-token and a token classifier's labels."""
        return self.kind in ("causal-lm", "token-classification", "other")

    @property
    def can_generate(self) -> bool:
        """Whether ``generate=N`` means something for this class (only a causal LM's does)."""
        return self.kind in ("causal-lm", "other")

    def check(self, model: nn.Module, batch: Mapping[str, torch.Tensor], *, generate: int) -> None:
        """Refuse, before any work, what this class cannot run: an error saying what and why."""
        if generate and not self.can_generate:
            raise UnsupportedModelError(
                f"generate={generate} compares generated tokens, but {self.model_class} is a "
                f"{self.kind} model, which does not generate text; use generate=0 (its "
                "outputs, layers and gradients are still compared)"
            )
        if self.kind == "sequence-classification":
            rows = batch["input_ids"].shape[0]
            if rows > 1 and text_config(model).pad_token_id is None:
                raise UnsupportedModelError(
                    f"{self.model_class} reads each sequence at its last non-padding token, "
                    f"which transformers finds through config.pad_token_id; it is None, so "
                    f"a batch of {rows} sequences cannot run (the original refuses it too). "
                    "Set model.config.pad_token_id (the default inputs pad with 0) or pass "
                    "a single sequence"
                )

    def labels(
        self,
        batch: Mapping[str, torch.Tensor],
        config: Any,
        *,
        left_out: torch.Tensor | None = None,
    ) -> dict[str, torch.Tensor]:
        """The labels this class's own loss takes, for ``batch`` (deterministic).

        Empty for a question-answering and a base model, whose loss :meth:`loss`
        computes from the outputs at the valid positions. ``left_out`` (``[batch, seq]``,
        only where :attr:`learns_per_token`) names positions whose output the loss must
        not learn from: their loss terms are masked out.
        """
        ids, mask = batch["input_ids"], batch["attention_mask"]
        if left_out is not None and not self.learns_per_token:
            raise ValueError(f"a {self.kind} model's loss cannot leave out positions")
        if self.kind in ("causal-lm", "other"):
            labels = _next_token_labels(ids, mask)
            if left_out is not None:
                # the model shifts its labels: position p's logits learn label p + 1
                labels[:, 1:] = labels[:, 1:].masked_fill(left_out[:, :-1].to(ids.device), -100)
            return {"labels": labels}
        if self.kind == "token-classification":
            labels = (ids % config.num_labels).masked_fill(mask == 0, -100)
            if left_out is not None:
                labels = labels.masked_fill(left_out.to(ids.device), -100)
            return {"labels": labels}
        if self.kind == "sequence-classification":
            return {"labels": _sequence_labels(ids.shape[0], config, ids.device)}
        return {}

    def loss(self, output: Any, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The scalar the gradients are taken of.

        The model's own loss where it has one; for question answering the cross-entropy of
        fixed start and end positions over the valid positions only (the model's own
        would include padded ones); for a base model, which has no loss, a fixed random
        projection of the last hidden state at the valid positions.
        """
        valid = batch["attention_mask"].bool()
        if self.kind == "question-answering":
            return _span_loss(output.start_logits, output.end_logits, valid)
        if self.kind == "base":
            hidden: torch.Tensor = output.last_hidden_state[valid]
            direction = torch.randn(
                hidden.shape, generator=_generator(torch.device("cpu")), dtype=torch.float32
            ).to(hidden)
            return (hidden * direction).sum() / max(hidden.shape[0], 1)
        loss = getattr(output, "loss", None)
        if loss is None:
            raise UnsupportedModelError(
                f"{self.model_class} returned no loss for labels=...; backward=True needs "
                "one (verify *ForCausalLM, *ForSequenceClassification, "
                "*ForTokenClassification, *ForQuestionAnswering or the base model)"
            )
        result: torch.Tensor = loss
        return result

    def compared(self, output: Any, valid: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """The output compared, at the valid positions where it is per token, and whether
        its rows are class logits (top-1 agreement and KL then mean something)."""
        if self.kind == "question-answering":
            span = torch.stack((output.start_logits, output.end_logits), dim=-1)
            return span[valid], False
        if self.kind == "sequence-classification":
            pooled: torch.Tensor = output.logits
            return pooled, pooled.shape[-1] > 1
        logits = getattr(output, "logits", None)
        is_logits = logits is not None
        if logits is None:
            logits = getattr(output, "last_hidden_state", None)
        if not isinstance(logits, torch.Tensor):
            raise UnsupportedModelError(
                f"{self.model_class} returns {type(output).__name__} with neither logits nor "
                "last_hidden_state, so there is no output to compare"
            )
        if tuple(logits.shape[:2]) != tuple(valid.shape):
            raise UnsupportedModelError(
                f"{self.model_class}'s output has shape {tuple(logits.shape)}, not one row "
                f"per token of the {tuple(valid.shape)} batch; layerswap compares per-token "
                "outputs or the known heads' outputs"
            )
        return logits[valid], is_logits


def _next_token_labels(ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    # A label is predicted from the position before it: with left padding, the first
    # real token is predicted from a padded row, whose value differs between attention
    # kernels and means nothing. Mask those labels as well as the padding itself.
    padded = mask == 0
    labels = ids.masked_fill(padded, -100)
    labels[:, 1:] = labels[:, 1:].masked_fill(padded[:, :-1], -100)
    return labels


def _sequence_labels(rows: int, config: Any, device: torch.device) -> torch.Tensor:
    """Labels of the kind the config's problem type takes (transformers infers it from them)."""
    classes = int(config.num_labels)
    problem = getattr(config, "problem_type", None)
    generator = _generator(torch.device("cpu"))
    if problem == "regression" or (problem is None and classes == 1):
        shape = (rows,) if classes == 1 else (rows, classes)
        return torch.randn(shape, generator=generator).to(device)
    if problem == "multi_label_classification":
        return torch.randint(0, 2, (rows, classes), generator=generator).float().to(device)
    return (torch.arange(rows) % classes).to(device)


def _span_loss(start: torch.Tensor, end: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of a fixed answer span per sequence, over its valid positions only."""
    starts, ends = [], []
    for row in valid:
        positions = row.nonzero().flatten()
        if not len(positions):  # an all-padding row: any position, all equally meaningless
            positions = torch.arange(row.numel(), device=row.device)
        starts.append(positions[len(positions) // 3])
        ends.append(positions[(2 * len(positions)) // 3])
    outside = torch.finfo(start.dtype).min
    loss_start = nn.functional.cross_entropy(
        start.masked_fill(~valid, outside), torch.stack(starts)
    )
    loss_end = nn.functional.cross_entropy(end.masked_fill(~valid, outside), torch.stack(ends))
    return (loss_start + loss_end) / 2
