"""Slots as objects: swap, use, verify and coverage ask the slot, and a new slot is one class.

The test adds a third slot — the model's final norm — as a user would: one ``Slot``
subclass, registered, and a backend that implements it. Nothing else in layerswap knows
about it, yet ``swap``, ``use``, ``coverage`` and ``get`` serve it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from transformers.models.llama import modeling_llama

import layerswap
from layerswap.backend import Backend, Implementation
from layerswap.coverage import model_coverage
from layerswap.errors import SubstitutionError
from layerswap.handle import SwapHandle
from layerswap.patching import Scoped, patch
from layerswap.patching.undo import UndoLog
from layerswap.registry import register_backend, unregister_backend
from layerswap.slots import ModelParts, Slot, get_slot, register_slot, slot_names, unregister_slot
from layerswap.weights import Converter


class TorchRMSNorm(modeling_llama.LlamaRMSNorm):
    """The same norm through ``torch.nn.functional.rms_norm``."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.rms_norm(
            hidden_states.float(), self.weight.shape, self.weight.float(), self.variance_epsilon
        ).to(hidden_states.dtype)


class NormSwap(SwapHandle):
    def __init__(self, model: Any, sub: Any, changes: UndoLog) -> None:
        self.model, self.substitution, self._changes, self._active = model, sub, changes, True

    @property
    def swapped(self) -> list[tuple[str, type, type]]:
        return [("model.norm", modeling_llama.LlamaRMSNorm, TorchRMSNorm)]

    def undo(self) -> None:
        self._changes.undo()
        self._active = False

    def report(self) -> str:
        return f"{self.substitution.name}: final norm swapped"


class FinalNormSlot(Slot):
    """The model's last norm, before the head: the whole new slot."""

    name = "final_norm"
    description = "the norm after the last decoder layer"

    def original(self, family: Any) -> str:
        return f"{family.module}:LlamaRMSNorm"

    def swap(self, model: Any, sub: Any) -> SwapHandle:
        base = model.get_submodule("model")
        norm = base.norm
        replacement = sub.replacement_class()(norm.weight.shape[0], eps=norm.variance_epsilon)
        replacement.weight = norm.weight
        changes = UndoLog()
        changes.set_item(base._modules, "norm", replacement)
        return NormSwap(model, sub, changes)

    def rebuild_originals(self, model: Any, sub: Any) -> int:
        return 0

    def construction(self, sub: Any) -> list[Scoped]:
        return [patch(sub.original, sub.replacement_class())]

    def swapped_by(self, model: Any) -> str | None:
        return "final_norm" if isinstance(model.model.norm, TorchRMSNorm) else None

    def coverage(self, parts: ModelParts) -> tuple[tuple[str, ...], tuple[str, ...]]:
        return ("model.norm (LlamaRMSNorm)",), (parts.layers_text,)


@pytest.fixture
def final_norm_backend() -> Iterator[str]:
    register_slot(FinalNormSlot())
    backend = Backend(
        name="torchnorm",
        slots={
            "final_norm": Implementation(
                replacement=lambda family: TorchRMSNorm,
                converter=lambda family: Converter(),
                description="torch's rms_norm",
                supports=lambda family: None if family.name == "llama" else "llama only",
                upstream=None,
            )
        },
    )
    try:
        register_backend(backend)
        yield "llama.final_norm.torchnorm"
    finally:
        unregister_backend("torchnorm")
        unregister_slot("final_norm")


def test_a_new_slot_is_served_by_swap_use_and_coverage(final_norm_backend: str) -> None:
    assert slot_names() == (
        "decoder",
        "head",
        "patch",
        "norm",
        "mlp",
        "experts",
        "qkv",
        "rotary",
        "final_norm",
    )
    family = layerswap.get_family("llama")
    model = family.build(seed=0).eval()
    ids = torch.randint(
        0, model.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        expected = model(ids).logits
    original_norm = model.model.norm

    sub = layerswap.get(final_norm_backend)
    assert (sub.slot, sub.original) == ("final_norm", f"{family.module}:LlamaRMSNorm")
    handle = layerswap.swap(model, final_norm_backend)
    assert (
        type(model.model.norm) is TorchRMSNorm and model.model.norm.weight is original_norm.weight
    )
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, expected)
    handle.undo()
    assert model.model.norm is original_norm

    with layerswap.use(final_norm_backend):
        built = family.causal_lm_class()(family.tiny_config())
    assert type(built.model.norm) is TorchRMSNorm
    assert type(family.causal_lm_class()(family.tiny_config()).model.norm) is not TorchRMSNorm

    row = next(r for r in model_coverage("llama").rows if r.substitution == final_norm_backend)
    assert row.replaces == ("model.norm (LlamaRMSNorm)",)
    assert row.keeps[0].startswith("model.layers.0-")


def test_an_unknown_slot_is_refused_with_the_slots_there_are() -> None:
    with pytest.raises(
        SubstitutionError, match="unknown slot 'embeddings'; slots are decoder, head, patch"
    ):
        get_slot("embeddings")
    with pytest.raises(SubstitutionError, match=r"unknown slots \['embeddings'\]"):
        Backend(
            name="x", slots={"embeddings": Implementation(lambda f: object, lambda f: Converter())}
        )
    with pytest.raises(SubstitutionError, match="exists"):
        register_slot(get_slot("decoder"))
    with pytest.raises(SubstitutionError, match="builtin slots stay"):
        unregister_slot("head")
    assert slot_names() == (
        "decoder",
        "head",
        "patch",
        "norm",
        "mlp",
        "experts",
        "qkv",
        "rotary",
    )


@pytest.mark.parametrize("slot", ["decoder", "head"])
def test_the_builtin_slots_answer_what_a_model_runs(slot: str) -> None:
    model = layerswap.get_family("llama").build(seed=0)
    assert get_slot(slot).swapped_by(model) is None
    with layerswap.swap(model, f"llama.{slot}.fused"):
        assert get_slot(slot).swapped_by(model) == f"llama.{slot}.fused"
        other = "head" if slot == "decoder" else "decoder"
        assert get_slot(other).swapped_by(model) is None
    assert get_slot(slot).swapped_by(model) is None


# --- the undo log ---------------------------------------------------------------------------


class Thing:
    pass


class Other(Thing):
    pass


def test_the_undo_log_puts_every_kind_of_change_back_newest_first() -> None:
    thing = Thing()
    thing.kept = 1
    table: dict[str, int] = {"a": 1}
    log = UndoLog()
    log.set_attribute(thing, "kept", 2)
    log.set_attribute(thing, "added", 3)
    log.set_attribute(thing, "kept", 4)  # twice: the first value comes back
    log.set_item(table, "a", 5)
    log.set_item(table, "b", 6)
    log.set_class(thing, Other)
    order: list[str] = []
    log.record(lambda: order.append("last recorded, first undone"))
    assert (thing.kept, thing.added, table, type(thing)) == (4, 3, {"a": 5, "b": 6}, Other)
    log.undo()
    assert order == ["last recorded, first undone"]
    assert thing.__dict__ == {"kept": 1} and type(thing) is Thing and table == {"a": 1}
    assert len(log) == 0
    log.undo()  # nothing left: a no-op


def test_a_failing_step_stops_the_undo_unless_a_rollback_goes_on() -> None:
    thing = Thing()
    log = UndoLog()
    log.set_attribute(thing, "first", 1)

    def fails() -> None:
        raise RuntimeError("cannot")

    log.record(fails)
    log.set_attribute(thing, "last", 2)
    with pytest.raises(RuntimeError, match="cannot"):
        log.undo()
    # the newest change is back, the failing step and the one before it stay recorded
    assert thing.__dict__ == {"first": 1} and len(log) == 2
    seen: list[BaseException] = []
    log.undo(on_error=seen.append)
    assert [str(e) for e in seen] == ["cannot"] and thing.__dict__ == {} and len(log) == 0
