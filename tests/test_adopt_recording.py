"""layerswap.adopt's recording: what a patch function changed, and only that, is recorded.

An import the function runs is not its change (what the import did is taken as it
stands when the outermost import ends).
"""

from __future__ import annotations

import importlib
import importlib.machinery
import os
import sys
import types
from pathlib import Path

import pytest
import torch
from fresh import run_json
from torch import nn
from transformers.models.llama import modeling_llama

import layerswap
from layerswap.errors import NoChangeError, UnrecordableChangeError

# --- imports inside the patch function ----------------------------------------------------------


def test_what_an_import_does_is_not_the_functions_change(make_module) -> None:
    """A module the function imports imports another, which a third module imported later
    in the same import registers into; the import also rebinds a name of a module imported
    before. Only the function's own rebinding is its change: the registration and the
    rebinding were credited to it, and undo took them back."""
    existing = importlib.import_module(make_module("existing", "HOOK = 'original'\n"))
    registry = make_module("registry", "HOOKS = None\n")
    plugin = make_module("plugin", f"import {registry}\n{registry}.HOOKS = 'registered'\n")
    user = make_module(
        "user",
        f"""
        import {registry}
        import {plugin}
        import {existing.__name__}
        {existing.__name__}.HOOK = 'set by the import'
        def f():
            return 1
        """,
    )

    def import_and_patch() -> None:
        module = importlib.import_module(user)
        module.f = lambda: 2

    with layerswap.adopt(import_and_patch, prove=False) as adoption:
        assert sys.modules[user].f() == 2
    assert adoption.changes == [f"{user}.f: rebound"], adoption.changes
    assert sys.modules[user].f() == 1
    assert sys.modules[registry].HOOKS == "registered"
    assert existing.HOOK == "set by the import"


def test_a_module_named_otherwise_than_its_spec_is_copied_by_its_spec(
    make_module, tmp_path: Path
) -> None:
    """A module whose ``__name__`` is another module's (``_decimal``'s is "decimal"),
    imported half-way through that module's import: the half-run module was copied as
    the other's state before, and its later names were taken for the function's and
    deleted by undo."""
    outer = make_module("outer", "")
    inner = make_module("inner", f"__name__ = {outer!r}\nVALUE = 1\n")
    (tmp_path / f"{outer}.py").write_text(
        f"from {inner} import *\nLATER = 'defined after the import'\n"
    )

    def import_it() -> None:
        module = importlib.import_module(outer)
        module.patched = True

    with layerswap.adopt(import_it, prove=False) as adoption:
        pass
    assert adoption.changes == [f"{outer}.patched: added"], adoption.changes
    assert sys.modules[outer].LATER == "defined after the import"
    assert sys.modules[outer].VALUE == 1


@pytest.mark.slow
def test_a_patch_importing_its_modeling_module_in_a_fresh_process(tmp_path: Path) -> None:
    """As Liger's ``apply_*`` does: the modeling module imported inside the function. It
    recorded 117 changes (every name of ``decimal``, ``torch.ops``' namespaces ...), its
    undo deleted ``decimal.Decimal``, and a model built after raised (a pytree node
    registered twice); the proof refused the correct patch."""
    found = run_json(
        """
        import json, sys, torch, layerswap
        assert "transformers.models.llama.modeling_llama" not in sys.modules

        def fast_rope():
            from transformers.models.llama import modeling_llama
            original = modeling_llama.apply_rotary_pos_emb
            modeling_llama.apply_rotary_pos_emb = lambda *a, **k: original(*a, **k)

        adoption = layerswap.adopt(fast_rope)
        changes, proven = adoption.changes, adoption.proven
        adoption.undo()
        import decimal
        family = layerswap.get_family("llama")
        family.build(family.tiny_config())(torch.ones(1, 4, dtype=torch.long))
        print(json.dumps([changes, proven, hasattr(decimal, "Decimal")]))
        """,
        tmp_path / "cache",
    )
    assert found == [
        ["transformers.models.llama.modeling_llama.apply_rotary_pos_emb: rebound"],
        "llama",
        True,
    ]


# --- a model's weights changed in place -------------------------------------------------------


@pytest.mark.parametrize("prove", [False, None])
@pytest.mark.parametrize("how", ["scaled", "reversed"])
def test_a_weight_changed_through_data_is_refused(how: str, prove: bool | None) -> None:
    """``.data`` has a version counter of its own: a weight scaled (or its values moved)
    through it was neither refused nor taken back, and the adoption reported 0 changes."""
    family = layerswap.get_family("llama")
    model = family.build(family.tiny_config(), seed=0)
    original = modeling_llama.LlamaRMSNorm

    def change_weight(model: nn.Module) -> None:
        modeling_llama.LlamaRMSNorm = type("Norm", (original,), {})
        data = model.model.norm.weight.data
        data.mul_(1.5) if how == "scaled" else data.copy_(data.flip(0))

    with torch.no_grad():
        weight = model.model.norm.weight
        weight.copy_(torch.arange(float(weight.numel())))  # its values told apart
    with pytest.raises(UnrecordableChangeError, match=r"model\.norm\.weight .*through \.data"):
        layerswap.adopt(change_weight, model=model, prove=prove)
    assert modeling_llama.LlamaRMSNorm is original


def test_a_weight_left_as_it_was_is_not_refused() -> None:
    family = layerswap.get_family("llama")
    model = family.build(family.tiny_config(), seed=0)

    def rewrite_the_same(model: nn.Module) -> None:
        data = model.model.norm.weight.data
        data.copy_(data.clone())
        model.model.norm.patched = True

    with layerswap.adopt(rewrite_the_same, model=model, prove=False) as adoption:
        assert adoption.changes == ["model.norm.patched: added"]


# --- process-wide state ------------------------------------------------------------------------


def _switches() -> list[object]:
    matmul = torch.backends.cuda.matmul
    return [
        matmul.allow_tf32,
        torch.get_float32_matmul_precision(),
        torch.backends.cudnn.benchmark,
        torch.backends.mkldnn.enabled,
        torch.are_deterministic_algorithms_enabled(),
        torch.backends.cuda.flash_sdp_enabled(),
        torch.get_num_threads(),
        torch.get_default_dtype(),
    ]


def test_torch_switches_the_environment_and_sys_modules_are_recorded_and_undone(
    monkeypatch: pytest.MonkeyPatch, make_module
) -> None:
    """None of these was recorded: the adoption reported no change and undo left them
    all as the function set them (a module the function put in ``sys.modules`` itself,
    and on a package imported before, too)."""
    monkeypatch.setenv("LS_ADOPT_REMOVED", "before")
    monkeypatch.delenv("TOKENIZERS_PARALLELISM", raising=False)
    switches = _switches()
    threads, storage = torch.get_num_threads(), torch.Storage
    package = importlib.import_module(make_module("package", ""))
    fake = types.ModuleType("ls_fake_flash_attn")
    fake.__spec__ = importlib.machinery.ModuleSpec(fake.__name__, None)

    def process_wide() -> None:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.benchmark = True
        torch.backends.mkldnn.enabled = False
        torch.set_float32_matmul_precision("medium")
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cuda.enable_flash_sdp(False)
        torch.set_num_threads(threads + 1)
        torch.set_default_dtype(torch.float64)
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
        del os.environ["LS_ADOPT_REMOVED"]
        sys.modules[fake.__name__] = fake
        sys.modules[f"{package.__name__}.ops"] = fake
        package.ops = fake  # as an import binds a submodule

    try:
        with layerswap.adopt(process_wide, prove=False) as adoption:
            assert torch.get_default_dtype() is torch.float64
            report = adoption.report()
    finally:
        torch.set_default_dtype(torch.float32)
    for line in (
        "torch.backends.cuda.matmul.allow_tf32: False -> True",
        "torch.get_float32_matmul_precision(): 'highest' -> 'medium'",
        "torch.backends.cudnn.benchmark: False -> True",
        "torch.backends.mkldnn.enabled: True -> False",
        "torch.are_deterministic_algorithms_enabled(): False -> True",
        "torch.is_deterministic_algorithms_warn_only_enabled(): False -> True",
        "torch.backends.cuda.flash_sdp_enabled(): True -> False",
        f"torch.get_num_threads(): {threads} -> {threads + 1}",
        "torch.get_default_dtype(): torch.float32 -> torch.float64",
        "os.environ['TOKENIZERS_PARALLELISM']: added",
        "os.environ['LS_ADOPT_REMOVED']: removed",
        "sys.modules['ls_fake_flash_attn']: added",
        f"sys.modules['{package.__name__}.ops']: added",
        f"{package.__name__}.ops: added",
    ):
        assert f"  {line}" in report, report
    assert "'false'" not in report  # an environment variable's value is not shown
    assert "torch.Storage" not in report  # set_default_dtype's, set back with it
    assert _switches() == switches and torch.Storage is storage
    assert "TOKENIZERS_PARALLELISM" not in os.environ
    assert os.environ["LS_ADOPT_REMOVED"] == "before"
    assert fake.__name__ not in sys.modules and f"{package.__name__}.ops" not in sys.modules
    assert not hasattr(package, "ops")


def test_switches_are_set_back_inside_a_suspended_window_and_made_again_after() -> None:
    from layerswap.adoption.record import record

    def high_precision() -> None:
        torch.set_float32_matmul_precision("high")

    recording, _ = record(high_precision, (), {})
    try:
        assert torch.get_float32_matmul_precision() == "high"
        with recording.suspended():
            assert torch.get_float32_matmul_precision() == "highest"
            assert not torch.backends.cuda.matmul.allow_tf32
        assert torch.get_float32_matmul_precision() == "high"
    finally:
        recording.undo()
    assert torch.get_float32_matmul_precision() == "highest"
    assert torch.backends.cuda.matmul.fp32_precision in ("none", "ieee")


@pytest.mark.slow
def test_deterministic_algorithms_switched_on_in_a_fresh_process(tmp_path: Path) -> None:
    """``use_deterministic_algorithms`` imports torch's expanded-weights module, which
    fills ``HANDLED_FUNCTIONS``: undo emptied it, and left the switch on."""
    found = run_json(
        """
        import json, torch, layerswap

        def deterministic():
            torch.use_deterministic_algorithms(True)

        with layerswap.adopt(deterministic, prove=False) as adoption:
            changes = adoption.changes
        from torch.nn.utils._expanded_weights import expanded_weights_impl as impl
        print(json.dumps(
            [changes, torch.are_deterministic_algorithms_enabled(), len(impl.HANDLED_FUNCTIONS)]
        ))
        """,
        tmp_path / "cache",
    )
    changes, enabled, handled = found
    assert changes == ["torch.are_deterministic_algorithms_enabled(): False -> True"]
    assert not enabled and handled > 0


# --- a function that changed nothing ----------------------------------------------------------


def noop(model: nn.Module | None = None) -> None:
    pass


@pytest.mark.parametrize("given", ["config", "model", "model unproven", "nothing"])
def test_a_function_that_changed_nothing_is_refused(given: str) -> None:
    """It was reported "0 changes, in effect; proven equal to the original": a patch that
    quietly did nothing passed for one that works."""
    family = layerswap.get_family("llama")
    kwargs: dict[str, object] = {
        "config": {"config": family.tiny_config()},
        "model": {"model": family.build(family.tiny_config(), seed=0)},
        "model unproven": {"model": family.build(family.tiny_config(), seed=0), "prove": False},
        "nothing": {},
    }[given]
    with pytest.raises(NoChangeError, match=r"^noop changed nothing layerswap records"):
        layerswap.adopt(noop, **kwargs)  # type: ignore[arg-type]
    assert not layerswap.active_patches()


def test_a_function_that_only_imports_changed_nothing(make_module) -> None:
    name = make_module("imported_only", "VALUE = 1\n")

    def only_imports() -> None:
        importlib.import_module(name)

    with pytest.raises(NoChangeError, match="only_imports"):
        layerswap.adopt(only_imports, prove=False)
    assert sys.modules[name].VALUE == 1  # the import stays
