"""A patch function registered as a substitution of the ``patch`` slot: ``use``, ``swap``,
``verify``, the command line and the pytest plugin take it like any other."""

from __future__ import annotations

import json
import textwrap

import pytest
import torch
from command_line import run
from torch import nn
from transformers.models.llama import modeling_llama

import layerswap
from layerswap.errors import PatchDivergenceError, SubstitutionError
from layerswap.proof import comparing
from layerswap.registry import unregister
from layerswap.slots import get_slot

pytest_plugins = ["pytester"]

ORIGINAL_NORM = modeling_llama.LlamaRMSNorm
ORIGINAL_ROTATE_HALF = modeling_llama.rotate_half


class EquivalentRMSNorm(nn.Module):
    """LlamaRMSNorm written with torch's own rms_norm: the same numbers."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.rms_norm(
            hidden_states, self.weight.shape, self.weight, self.variance_epsilon
        )


class ScaledRMSNorm(EquivalentRMSNorm):
    """A norm that computes something else: its output half as large again."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return super().forward(hidden_states) * 1.5


def _patch_norms(norm: type[nn.Module], model: nn.Module | None) -> None:
    # Liger's convention: the class rebound for models built later, and, given a model,
    # its norms given the new class
    modeling_llama.LlamaRMSNorm = norm
    for module in model.modules() if model is not None else ():
        if type(module) is ORIGINAL_NORM:
            module.__class__ = norm


ORIGINAL_NORM_FORWARD = ORIGINAL_NORM.forward


def slightly_wrong_norm_forward() -> None:
    """Every RMSNorm's forward, the built ones' too, a fifth off: past bfloat16's fixed
    tolerance, within what a float32 rerun of the patched code itself would excuse."""

    def forward(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
        return ORIGINAL_NORM_FORWARD(self, hidden_states) * SLIGHT

    ORIGINAL_NORM.forward = forward


SLIGHT = 1.2


def fast_norm(model: nn.Module | None = None) -> None:
    _patch_norms(EquivalentRMSNorm, model)


def wrong_norm(model: nn.Module | None = None) -> None:
    _patch_norms(ScaledRMSNorm, model)


def flipped_rotate_half(x: torch.Tensor) -> torch.Tensor:
    return -ORIGINAL_ROTATE_HALF(x)


def wrong_rotary() -> None:
    modeling_llama.rotate_half = flipped_rotate_half


@pytest.fixture
def registered():
    """``llama.patch.mine`` (an equivalent norm) and ``llama.patch.wrong`` (a wrong one),
    registered for the test."""
    subs = [
        layerswap.register(
            layerswap.patch_substitution(fast_norm, "llama", name="llama.patch.mine")
        ),
        layerswap.register(
            layerswap.patch_substitution(wrong_norm, "llama", name="llama.patch.wrong")
        ),
    ]
    yield subs
    for sub in subs:
        unregister(sub.name)
    assert modeling_llama.LlamaRMSNorm is ORIGINAL_NORM


@pytest.fixture
def model() -> nn.Module:
    return layerswap.get_family("llama").build(seed=0)


def _modeling_llama_entries() -> dict[str, object]:
    return dict(vars(modeling_llama))


# --- the substitution, as data ------------------------------------------------------------


def test_a_patch_substitution_names_its_function_and_keeps_its_arguments(registered):
    sub = layerswap.get("llama.patch.mine")
    assert sub is registered[0]
    assert (sub.slot, sub.family, sub.backend) == ("patch", "llama", "mine")
    assert sub.replacement == "test_adopt_substitution:fast_norm"
    assert sub.original == "transformers.models.llama.modeling_llama:LlamaForCausalLM"
    assert sub.parts.slot is get_slot("patch")
    options = layerswap.patch_substitution(wrong_rotary, "llama", flag=True)
    assert options.name == "llama.patch.wrong_rotary"
    assert dict(options.variant.options) == {"flag": True}
    assert dict(options.with_options(flag=False).variant.options) == {"flag": False}


def test_a_function_that_cannot_be_imported_by_name_is_refused():
    def local_patch() -> None:
        pass

    with pytest.raises(SubstitutionError, match="define the function at a module's top level"):
        layerswap.patch_substitution(local_patch, "llama")


# --- use ----------------------------------------------------------------------------------


def test_use_builds_patched_models_and_leaves_transformers_as_before(registered):
    before = _modeling_llama_entries()
    family = layerswap.get_family("llama")
    with layerswap.use("llama.patch.mine"):
        assert modeling_llama.LlamaRMSNorm is EquivalentRMSNorm
        built = family.build(seed=0)
    assert type(built.model.norm) is EquivalentRMSNorm
    assert get_slot("patch").swapped_by(built) == "llama.patch.mine"
    after = _modeling_llama_entries()
    assert after.keys() == before.keys()
    assert all(after[name] is value for name, value in before.items())
    assert type(family.build(seed=0).model.norm) is ORIGINAL_NORM

    with pytest.raises(RuntimeError, match="inside"), layerswap.use("llama.patch.mine"):
        raise RuntimeError("inside the block")
    assert modeling_llama.LlamaRMSNorm is ORIGINAL_NORM


def test_use_refuses_a_wrong_patch_and_changes_nothing(registered):
    with pytest.raises(PatchDivergenceError) as refused, layerswap.use("llama.patch.wrong"):
        pass  # pragma: no cover - the block is not entered
    assert refused.value.layer == "model.layers.0"
    assert modeling_llama.LlamaRMSNorm is ORIGINAL_NORM


# --- swap and undo ------------------------------------------------------------------------


def test_swap_patches_a_built_model_and_undo_puts_every_object_back(registered, model):
    norms = [module for module in model.modules() if type(module) is ORIGINAL_NORM]
    handle = layerswap.swap(model, "llama.patch.mine")
    assert handle.active
    assert all(type(norm) is EquivalentRMSNorm for norm in norms)
    assert modeling_llama.LlamaRMSNorm is EquivalentRMSNorm
    assert ("model.norm", ORIGINAL_NORM, EquivalentRMSNorm) in handle.swapped
    assert len(handle) == len(norms) + 1  # the module's class too
    assert "llama.patch.mine: fast_norm" in handle.report()
    assert get_slot("patch").swapped_by(model) == "llama.patch.mine"
    with pytest.raises(SubstitutionError, match=r"already patched by llama\.patch\.mine"):
        layerswap.swap(model, "llama.patch.mine")
    handle.undo()
    assert not handle.active
    assert all(type(norm) is ORIGINAL_NORM for norm in norms)
    assert [m for m in model.modules() if isinstance(m, ORIGINAL_NORM)] == norms
    assert modeling_llama.LlamaRMSNorm is ORIGINAL_NORM
    assert get_slot("patch").swapped_by(model) is None


def test_a_wrong_patch_is_refused_at_swap_naming_the_first_divergent_layer(registered, model):
    with pytest.raises(PatchDivergenceError, match=r"model\.layers\.0") as refused:
        layerswap.swap(model, "llama.patch.wrong")
    assert refused.value.layer == "model.layers.0"
    assert modeling_llama.LlamaRMSNorm is ORIGINAL_NORM
    assert type(model.model.norm) is ORIGINAL_NORM
    assert get_slot("patch").swapped_by(model) is None


def test_the_original_code_runs_inside_the_handle_s_original_code(model):
    sub = layerswap.patch_substitution(wrong_rotary, "llama")  # not proven: prepared by hand
    with comparing(), layerswap.swap(model, sub) as handle:
        assert modeling_llama.rotate_half is flipped_rotate_half
        with handle.original_code():
            assert modeling_llama.rotate_half is ORIGINAL_ROTATE_HALF
        assert modeling_llama.rotate_half is flipped_rotate_half
    assert modeling_llama.rotate_half is ORIGINAL_ROTATE_HALF


# --- verify -------------------------------------------------------------------------------


def test_verify_passes_an_equivalent_patch_and_leaves_transformers_as_before(registered, model):
    report = layerswap.verify(model, "llama.patch.mine", backward=True)
    assert report.passed, report.summary()
    assert modeling_llama.LlamaRMSNorm is ORIGINAL_NORM
    assert type(model.model.norm) is ORIGINAL_NORM


def test_verify_fails_a_wrong_patch_naming_the_first_divergent_layer(registered, model):
    report = layerswap.verify(model, "llama.patch.wrong")
    assert not report.passed
    assert report.first_divergent_layer == 0
    assert "model.layers.0" in report.summary()
    assert modeling_llama.LlamaRMSNorm is ORIGINAL_NORM


@pytest.mark.parametrize("backward", [False, True], ids=["forward", "backward"])
def test_a_wrong_patch_fails_in_bfloat16_where_the_original_is_run_again_in_float32(
    registered, model, backward
):
    """In bfloat16 a comparison over the fixed tolerance is judged again against the
    original run in float32 (its own rounding). That run is made with the patch taken
    back: made with the patched code it would vouch for the patch, and the wrong one
    would pass."""
    sub = layerswap.patch_substitution(
        slightly_wrong_norm_forward, "llama", name="llama.patch.slight"
    )
    report = layerswap.verify(model, sub, dtype=torch.bfloat16, backward=backward)
    assert not report.passed
    assert report.first_divergent_layer == 0
    assert ORIGINAL_NORM.forward is ORIGINAL_NORM_FORWARD


def test_verify_refuses_what_it_cannot_compare(registered, model):
    with pytest.raises(ValueError, match="streaming mode"):
        layerswap.verify(model, "llama.patch.mine", streaming=True)
    model.__dict__["_layerswap_patched_by"] = "llama.patch.mine"  # as built inside use()
    with pytest.raises(SubstitutionError, match="cannot be rebuilt"):
        layerswap.verify(model, "llama.patch.mine", generate=0)
    assert modeling_llama.LlamaRMSNorm is ORIGINAL_NORM


# --- the command line ---------------------------------------------------------------------


def test_cli_verify_takes_a_patch_substitution_by_name(registered, capsys):
    code, out, _ = run(capsys, "verify", "--substitution", "llama.patch.mine", "--json")
    assert code == 0, out
    assert json.loads(out)["passed"] is True
    code, out, _ = run(capsys, "verify", "--substitution", "llama.patch.wrong", "--json")
    assert code == 1
    assert json.loads(out)["first_divergent_layer"] == 0
    assert modeling_llama.LlamaRMSNorm is ORIGINAL_NORM


def test_cli_check_proves_a_patch_substitution_by_name(registered, capsys):
    names = ("--substitution", "llama.patch.mine", "--substitution", "llama.patch.wrong")
    code, out, _ = run(capsys, "check", *names, "--json")
    assert code == 1
    rows = {row["substitution"]: row for row in json.loads(out)}
    assert rows["llama.patch.mine"]["status"] == "proven"
    assert rows["llama.patch.wrong"]["status"] == "failed"
    assert "model.layers.0" in rows["llama.patch.wrong"]["detail"]
    code, _, err = run(capsys, "check", "--substitution", "llama.patch.nothing")
    assert code == 2
    assert "llama.patch.nothing" in err


# --- the pytest plugin --------------------------------------------------------------------


def test_the_pytest_plugin_uses_a_patch_substitution_by_name(registered, pytester):
    pytester.makepyfile(
        textwrap.dedent(
            """
            import pytest
            from transformers.models.llama import modeling_llama

            import layerswap

            ORIGINAL = modeling_llama.LlamaRMSNorm

            def test_fixture_use(layerswap):
                layerswap.use("llama.patch.mine")
                assert modeling_llama.LlamaRMSNorm.__name__ == "EquivalentRMSNorm"

            def test_fixture_swap(layerswap):
                import layerswap as api
                model = api.get_family("llama").build(seed=0)
                layerswap.swap(model, "llama.patch.mine")
                assert type(model.model.norm).__name__ == "EquivalentRMSNorm"

            @pytest.mark.layerswap("llama.patch.mine")
            def test_marker():
                assert modeling_llama.LlamaRMSNorm.__name__ == "EquivalentRMSNorm"

            def test_after():
                assert modeling_llama.LlamaRMSNorm is ORIGINAL
            """
        )
    )
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "-p", "no:randomly")
    result.assert_outcomes(passed=4)
    assert modeling_llama.LlamaRMSNorm is ORIGINAL_NORM
