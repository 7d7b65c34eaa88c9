"""Adopting Liger-Kernel's ``apply_liger_kernel_to_*``: every key, undone object for object;
refused on a machine without a GPU with the requirement; proven on a GPU."""

from __future__ import annotations

import importlib
import sys
import types

import pytest
import torch
from test_adopt import differences, state_of

import layerswap
from layerswap.errors import RequirementError

try:
    monkey_patch = importlib.import_module("liger_kernel.transformers.monkey_patch")
except Exception as exc:  # not installed, or no Triton to import its kernels with
    pytest.skip(f"liger_kernel is not importable here: {exc}", allow_module_level=True)

APPLY = dict(sorted(monkey_patch.MODEL_TYPE_TO_APPLY_LIGER_FN.items()))


@pytest.mark.parametrize("model_type", list(APPLY))
def test_adopting_and_undoing_leaves_transformers_as_before(model_type: str) -> None:
    apply = APPLY[model_type]
    before = state_of()
    try:
        adoption = layerswap.adopt(apply, prove=False)
    except ImportError as exc:
        # Liger's own imports do not fit this transformers: what it changed before failing
        # is taken back all the same
        assert differences(before, state_of()) == []
        pytest.skip(f"{apply.__name__} fails on this transformers: {exc}")
    assert adoption.changes, f"{apply.__name__} changed nothing that was recorded"
    assert liger_objects_in_transformers(), "Liger's objects are in transformers while adopted"
    adoption.undo()
    assert differences(before, state_of()) == []
    # the modeling modules Liger imported itself, and patched, are back too
    assert liger_objects_in_transformers() == []


def liger_objects_in_transformers() -> list[str]:
    """Names in transformers' modules and classes bound to one of Liger's objects."""
    found = []
    for name, module in list(sys.modules.items()):
        if not name.startswith("transformers") or not isinstance(module, types.ModuleType):
            continue
        owners = [(name, vars(module))] + [
            (f"{name}.{value.__qualname__}", dict(value.__dict__))
            for value in list(vars(module).values())
            if isinstance(value, type) and value.__module__ == name
        ]
        for where, entries in owners:
            for key, value in entries.items():
                origin = getattr(value, "__module__", None) or ""
                if isinstance(origin, str) and origin.startswith("liger_kernel"):
                    found.append(f"{where}.{key}")
    return found


def test_adopting_with_a_model_undoes_every_instance() -> None:
    model = layerswap.get_family("llama").build(seed=0)
    before = state_of(model)
    apply = monkey_patch.apply_liger_kernel_to_llama
    with layerswap.adopt(apply, model=model, prove=False) as adoption:
        assert "forward" in model.model.norm.__dict__
        assert any(line.startswith("model.layers.0.mlp.forward") for line in adoption.changes)
    assert differences(before, state_of(model)) == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: Liger's kernels run")
@pytest.mark.parametrize("with_model", [False, True], ids=["classes", "model"])
def test_refused_without_a_gpu_with_the_requirement_after_undoing(with_model: bool) -> None:
    # built either way first: transformers fills caches of its own when a model is first
    # built (the output-capturing registry), which the proof's tiny model would do here
    built = layerswap.get_family("llama").build(seed=0)
    model = built if with_model else None
    before = state_of(model)
    apply = monkey_patch.apply_liger_kernel_to_llama
    with pytest.raises(RequirementError, match="needs CUDA"):
        if model is None:
            layerswap.adopt(apply, rope=True, swiglu=True)
        else:
            layerswap.adopt(apply, model=model)
    assert differences(before, state_of(model)) == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA for Liger's kernels")
def test_proven_on_a_gpu() -> None:
    config = layerswap.get_family("llama").tiny_config()
    with layerswap.adopt(monkey_patch.apply_liger_kernel_to_llama, config=config) as adoption:
        assert adoption.proven == "llama"
