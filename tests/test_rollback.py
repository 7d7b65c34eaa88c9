"""A swap that fails half-way puts the model back whole, whichever slot: every change it
recorded is taken back, past a step that fails in turn (told as a SwapWarning), and the
failure that started the rollback is the one raised."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from models import tiny_model

import layerswap
from layerswap.errors import SwapWarning
from layerswap.patching.undo import UndoLog
from layerswap.slots import class_swap


def _guarded(model: torch.nn.Module) -> bool:
    return "_apply" in model.__dict__


def test_a_head_swap_failing_half_way_leaves_no_guard_and_no_mark(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model = tiny_model("llama")
    original = type(model)

    def fail(self: UndoLog, obj: Any, cls: type) -> None:
        raise RuntimeError("class change refused")

    monkeypatch.setattr(UndoLog, "set_class", fail)
    with pytest.raises(RuntimeError, match="class change refused"):
        layerswap.swap(model, "llama.head.fused")
    monkeypatch.undo()
    assert type(model) is original
    assert not _guarded(model) and not any("head" in key for key in model.__dict__)
    with layerswap.swap(model, "llama.head.fused"):  # nothing left to clash with
        assert type(model) is not original
    assert type(model) is original


def test_a_class_swap_rollback_goes_on_past_a_failing_step_and_raises_the_first_failure(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model = tiny_model("llama")
    real = class_swap._apply

    def half_way(plan: Any, changes: UndoLog) -> None:
        real(plan, changes)

        def broken() -> None:
            raise ValueError("a step that cannot be taken back")

        changes.record(broken)
        raise RuntimeError("failed half-way")

    monkeypatch.setattr(class_swap, "_apply", half_way)
    with (
        pytest.warns(
            SwapWarning, match="rolling back llama.norm.fused: a step that cannot"
        ) as seen,
        pytest.raises(RuntimeError, match="failed half-way"),
    ):
        layerswap.swap(model, "llama.norm.fused")
    monkeypatch.undo()
    # the warning names the line that called swap, not a line inside layerswap
    assert [warning.filename for warning in seen] == [__file__]
    kinds = {type(module).__name__ for module in model.modules()}
    assert "LlamaRMSNorm" in kinds and not any("Fused" in kind for kind in kinds)
    assert not _guarded(model)
    with layerswap.swap(model, "llama.norm.fused") as handle:
        assert len(handle) > 0
