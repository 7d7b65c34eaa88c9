"""layerswap.verify and layerswap.assert_equivalent on real tiny transformers models."""

from __future__ import annotations

import copy
import dataclasses
import json
import math
from typing import Any, cast

import pytest
import torch
from models import swapped_layer_count
from torch import nn

from layerswap.errors import RequirementError, UnknownSubstitutionError, VerificationError
from layerswap.model import decoder_layers
from layerswap.proof import comparing
from layerswap.registry import families, get, get_family
from layerswap.substitution import Substitution
from layerswap.swap import swap
from layerswap.use import use
from layerswap.verify import (
    Tolerance,
    VerificationReport,
    assert_equivalent,
    default_inputs,
    verify,
)
from layerswap.weights import Converter, Custom

FUSED = "llama.decoder.fused"


def _perturbed(base: Substitution, *, layer: int, scale: float, name: str) -> Substitution:
    """``base`` with one layer's attention output projection scaled: a one-layer bug."""
    fused_layer = base.replacement_class()

    class PerturbedLayer(fused_layer):  # type: ignore[misc, valid-type]
        def __init__(self, config: Any, layer_idx: int) -> None:
            super().__init__(config, layer_idx)
            if layer_idx == layer:
                self.self_attn.o_proj.register_forward_hook(
                    lambda module, args, output: output * scale
                )

    return dataclasses.replace(base, name=name, replacement=PerturbedLayer)


@pytest.fixture(scope="module")
def broken() -> Substitution:
    return _perturbed(get(FUSED), layer=2, scale=1.01, name="llama.decoder.broken")


@pytest.fixture
def llama() -> Any:
    return get_family("llama").build(seed=0)


def _hook_count(model: nn.Module) -> int:
    return sum(
        len(getattr(module, name))
        for module in model.modules()
        for name in (
            "_forward_hooks",
            "_forward_pre_hooks",
            "_backward_hooks",
            "_forward_hooks_with_kwargs",
            "_forward_pre_hooks_with_kwargs",
        )
    )


# --- the builtin substitutions pass ------------------------------------------------------


@pytest.mark.one_family  # verify's path is the same for every family
@pytest.mark.parametrize("family", sorted(families()))
def test_fused_substitution_matches_original_for_every_family(family: str) -> None:
    model = get_family(family).build(seed=0)

    report = verify(model, f"{family}.decoder.fused")

    assert report.passed, report.summary()
    assert report.first_divergent_layer is None
    layers = [name for name, _ in decoder_layers(model)]
    assert len(layers) == swapped_layer_count(model)
    assert [layer.name for layer in report.layers] == layers
    assert report.top1_agreement == 1.0
    assert report.kl is not None and report.kl < 1e-8
    assert report.cosine > 0.99999


def test_backward_and_generate_are_compared_when_asked(llama: Any) -> None:
    report = verify(llama, FUSED, backward=True, generate=3)

    assert report.passed, report.summary()
    assert report.backward is not None and report.backward.passed
    assert report.backward.loss_reference == pytest.approx(report.backward.loss_candidate)
    # gradients are keyed in the original layout, one per original parameter
    names = [gradient.name for gradient in report.backward.gradients]
    assert names == [name for name, _ in llama.named_parameters()]
    assert "model.layers.0.self_attn.q_proj.weight" in names
    assert report.generation is not None and report.generation.passed
    assert report.generation.new_tokens == 3
    assert len(report.generation.reference_tokens) == 2
    assert report.generation.reference_tokens == report.generation.candidate_tokens


def test_gradients_are_mapped_through_the_converters_jacobian(llama: Any) -> None:
    """A replacement that stores o_proj doubled (and halves it when computing) is exact;
    its gradient must be doubled on the way back, not halved like the weight."""
    fused = get(FUSED)

    class HalvingLinear(nn.Linear):
        def forward(self, inputs: torch.Tensor) -> torch.Tensor:
            return nn.functional.linear(inputs, self.weight / 2, self.bias)

    class DoubledOProj(fused.replacement_class()):  # type: ignore[misc]
        def __init__(self, config: Any, layer_idx: int) -> None:
            super().__init__(config, layer_idx)
            o_proj = self.self_attn.o_proj
            self.self_attn.o_proj = HalvingLinear(
                o_proj.in_features, o_proj.out_features, bias=o_proj.bias is not None
            )

    doubled = dataclasses.replace(
        fused,
        name="llama.decoder.doubled",
        replacement=DoubledOProj,
        converter=cast(Converter, fused.converter).derive(
            Custom(
                ("self_attn.o_proj.weight",),
                ("self_attn.o_proj.weight",),
                forward=lambda tensors, config: [tensors[0] * 2],
                backward=lambda tensors, config: [tensors[0] / 2],
            )
        ),
    )

    report = verify(llama, doubled, backward=True)

    assert report.passed, report.summary()


# --- a broken substitution fails and is located ----------------------------------------


@pytest.mark.parametrize("streaming", [False, True], ids=["full", "streaming"])
def test_broken_substitution_fails_naming_its_layer(
    llama: Any, broken: Substitution, streaming: bool
) -> None:
    report = verify(llama, broken, streaming=streaming)

    assert not report.passed
    assert report.first_divergent_layer == 2
    assert [layer.passed for layer in report.layers] == [True, True, False, False]
    assert report.first_divergent is not None
    assert report.first_divergent.name == "model.layers.2"
    assert not report.logits_passed
    assert "first divergent layer: 2 (model.layers.2)" in report.summary()
    assert report.failure_message().startswith("llama.decoder.broken does not match")


def test_streaming_measures_what_full_mode_measures(llama: Any, broken: Substitution) -> None:
    full = verify(llama, broken, backward=True)
    streaming = verify(llama, broken, backward=True, streaming=True)

    assert streaming.mode == "streaming" and full.mode == "full"
    for a, b in zip(full.layers, streaming.layers, strict=True):
        assert a.max_abs_error == pytest.approx(b.max_abs_error, rel=1e-3, abs=1e-7)
    assert full.max_abs_error == pytest.approx(streaming.max_abs_error, rel=1e-3)
    # per-layer gradients: the first one off is the broken layer's input gradient
    assert streaming.backward is not None and streaming.backward.local
    assert streaming.backward.first_divergent_parameter == "model.layers.2.<input>"


def test_streaming_backward_passes_for_a_correct_substitution(llama: Any) -> None:
    report = verify(llama, FUSED, backward=True, streaming=True)

    assert report.passed, report.summary()
    assert report.backward is not None
    names = {gradient.name for gradient in report.backward.gradients}
    assert "model.layers.3.mlp.up_proj.weight" in names  # original layout
    assert "model.layers.0.<input>" in names


def test_a_layer_producing_nan_fails_and_still_serialises(llama: Any) -> None:
    nan_layer = _perturbed(get(FUSED), layer=1, scale=math.nan, name="llama.decoder.nan")

    report = verify(llama, nan_layer)

    assert not report.passed
    assert report.first_divergent_layer == 1
    assert report.layers[1].max_abs_error == math.inf
    data = json.loads(report.to_json())  # strict JSON: no bare NaN/Infinity
    assert data["layers"][1]["max_abs_error"] == "inf"


def test_assert_equivalent_raises_naming_the_first_divergent_layer(
    llama: Any, broken: Substitution
) -> None:
    candidate = copy.deepcopy(llama)
    with comparing():  # a broken swap is refused by the behaviour proof outside a comparison
        swap(candidate, broken)

    with pytest.raises(VerificationError, match=r"first divergent layer: 2 \(model\.layers\.2\)"):
        assert_equivalent(llama, candidate)
    with pytest.raises(AssertionError, match="max abs error"):
        assert_equivalent(llama, candidate, default_inputs(512, seed=3))


def test_assert_equivalent_returns_the_report_for_equivalent_models(llama: Any) -> None:
    candidate = copy.deepcopy(llama)
    swap(candidate, FUSED)

    report = assert_equivalent(
        llama, candidate, tolerance=1e-4, substitution=FUSED, backward=True, generate=2
    )

    assert isinstance(report, VerificationReport)
    assert report.passed and report.mode == "models"
    assert report.backward is not None and report.backward.passed


def test_assert_equivalent_without_substitution_cannot_map_swapped_gradients(
    llama: Any,
) -> None:
    candidate = copy.deepcopy(llama)
    swap(candidate, FUSED)

    with pytest.raises(VerificationError, match="pass substitution="):
        assert_equivalent(llama, candidate, backward=True)


# --- the model passed in is left alone ---------------------------------------------------


@pytest.mark.parametrize("streaming", [False, True], ids=["full", "streaming"])
def test_verify_leaves_the_model_untouched(
    llama: Any, broken: Substitution, streaming: bool
) -> None:
    llama.train()
    llama.model.layers[1].eval()  # mixed flags must come back as they were
    llama.lm_head.weight.grad = torch.full_like(llama.lm_head.weight, 0.5)
    state = {key: value.clone() for key, value in llama.state_dict().items()}
    flags = [module.training for module in llama.modules()]
    requires_grad = [param.requires_grad for param in llama.parameters()]
    hooks = _hook_count(llama)
    layer_types = [type(module) for module in llama.modules()]

    verify(llama, broken, backward=True, streaming=streaming)

    after = llama.state_dict()
    assert state.keys() == after.keys()
    assert all(torch.equal(state[key], after[key]) for key in state)
    assert [module.training for module in llama.modules()] == flags
    assert [param.requires_grad for param in llama.parameters()] == requires_grad
    assert _hook_count(llama) == hooks
    assert [type(module) for module in llama.modules()] == layer_types
    assert torch.equal(llama.lm_head.weight.grad, torch.full_like(llama.lm_head.weight, 0.5))
    assert all(
        param.grad is None for name, param in llama.named_parameters() if name != "lm_head.weight"
    )


# --- options -------------------------------------------------------------------------


def test_low_precision_uses_the_dtypes_looser_tolerance(llama: Any) -> None:
    report = verify(llama, FUSED, dtype="bfloat16", backward=True)

    assert report.passed, report.summary()
    assert report.dtype == "bfloat16"
    assert report.tolerance == Tolerance.for_dtype(torch.bfloat16)
    assert llama.model.embed_tokens.weight.dtype == torch.float32  # cast a copy only


def test_default_tolerances_loosen_with_precision() -> None:
    order = [Tolerance.for_dtype(name) for name in ("float32", "float16", "bfloat16", "fp8")]

    assert [t.rtol for t in order] == sorted(t.rtol for t in order)
    assert [t.min_cosine for t in order] == sorted((t.min_cosine for t in order), reverse=True)
    assert len({t.rtol for t in order}) == 4


def test_tolerance_override_accepts_a_number_or_a_tolerance(
    llama: Any, broken: Substitution
) -> None:
    loose = Tolerance(atol=0.0, rtol=0.1, min_cosine=0.99, gradient_rtol=0.1)

    assert verify(llama, broken, tolerance=loose).passed
    assert verify(llama, broken, tolerance=0.05).tolerance.rtol == 0.05
    assert not verify(llama, broken, tolerance=1e-4).passed
    with pytest.raises(ValueError, match="non-negative"):
        verify(llama, FUSED, tolerance=-1.0)


def test_substitution_is_taken_by_name_or_object(llama: Any) -> None:
    by_object = verify(llama, get(FUSED))

    assert by_object.substitution == FUSED
    with pytest.raises(UnknownSubstitutionError, match="did you mean"):
        verify(llama, "llama.decoder.fusd")


def test_unusable_substitution_is_a_requirement_error(llama: Any) -> None:
    te = get("llama.decoder.te")
    if te.unmet_requirement() is None:
        pytest.skip("TransformerEngine and CUDA are available here")

    with pytest.raises(RequirementError, match=r"llama\.decoder\.te cannot run here"):
        verify(llama, te)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
def test_cuda_without_cuda_is_a_requirement_error(llama: Any) -> None:
    with pytest.raises(RequirementError, match="CUDA"):
        verify(llama, FUSED, device="cuda")
    assert verify(llama, FUSED, device="auto").device == "cpu"


def test_streaming_refuses_generation(llama: Any) -> None:
    with pytest.raises(ValueError, match="streaming=False"):
        verify(llama, FUSED, streaming=True, generate=2)


def test_inputs_may_be_token_ids_or_a_mapping(llama: Any) -> None:
    ids = torch.arange(1, 9).unsqueeze(0)

    from_tensor = verify(llama, FUSED, ids)
    from_mapping = verify(llama, FUSED, {"input_ids": ids})

    assert (from_tensor.batch, from_tensor.seq_len) == (1, 8)
    assert from_tensor.to_dict() == from_mapping.to_dict()


def test_default_inputs_are_deterministic_and_left_padded() -> None:
    first, second = default_inputs(512), default_inputs(512)

    assert torch.equal(first["input_ids"], second["input_ids"])
    assert not torch.equal(first["input_ids"], default_inputs(512, seed=1)["input_ids"])
    mask = first["attention_mask"]
    assert mask[0].all()
    assert mask[1, :4].sum() == 0 and mask[1, 4:].all()
    assert int(first["input_ids"].max()) < 512


def test_report_round_trips_through_json(llama: Any) -> None:
    report = verify(llama, FUSED, backward=True, generate=2)

    data = json.loads(report.to_json())

    assert data["passed"] is True
    assert data["substitution"] == FUSED
    assert data["tolerance"] == dataclasses.asdict(report.tolerance)
    assert len(data["layers"]) == 4
    assert set(data["layers"][0]) == {
        "index",
        "name",
        "max_abs_error",
        "max_rel_error",
        "cosine",
        "passed",
        "min_cosine",
        "rtol",
        "floor_cosine",
        "near_ties",
        "excused_rows",
    }
    assert data["layers"][0]["min_cosine"] == report.tolerance.min_cosine
    assert data["layers"][0]["floor_cosine"] is None  # no FP8, no noise floor
    assert data["backward"]["passed"] is True
    assert data["generation"]["new_tokens"] == 2


def test_fp8_substitutions_get_the_fp8_tolerance(llama: Any) -> None:
    fp8_named = dataclasses.replace(get(FUSED), name="llama.decoder.fused_fp8", backend="fused_fp8")

    report = verify(llama, fp8_named)

    assert report.tolerance == Tolerance.for_dtype("fp8")
    assert report.dtype == "float32"


def test_layerswap_verify_is_callable_even_after_its_module_is_imported(llama: Any) -> None:
    import layerswap
    import layerswap.verify  # binds the package attribute to the submodule

    assert layerswap.verify(llama, FUSED).passed  # type: ignore[operator]
    assert layerswap.assert_equivalent(llama, llama).passed


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_a_model_built_inside_use_is_verified_against_rebuilt_original_layers(family):
    spec = get_family(family)
    name = f"{family}.decoder.fused"
    with use(name):
        model = spec.build(spec.tiny_config(num_hidden_layers=2), seed=3)
    layer_types = {type(layer).__name__ for layer in model.model.layers}
    before = {k: v.clone() for k, v in model.state_dict().items()}
    report = verify(model, name, backward=True)
    assert report.passed, report.summary()
    assert len(report.layers) == 2
    # the model given is untouched: still swapped, same weights
    assert {type(layer).__name__ for layer in model.model.layers} == layer_types
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_streaming_refuses_a_model_built_inside_use():
    spec = get_family("llama")
    with use("llama.decoder.fused"):
        model = spec.build(spec.tiny_config(num_hidden_layers=2), seed=0)
    with pytest.raises(ValueError, match="already swapped"):
        verify(model, "llama.decoder.fused", streaming=True)


def test_a_model_built_inside_use_with_a_broken_substitution_fails_at_that_layer(broken):
    spec = get_family("llama")
    with use(broken), comparing():  # outside a comparison, the behaviour proof refuses it
        model = spec.build(seed=0)
    report = verify(model, broken)
    assert not report.passed
    assert report.first_divergent_layer == 2


# --- bfloat16: the original's own rounding as the floor ----------------------------------


def test_bfloat16_over_the_fixed_tolerance_is_judged_against_the_originals_own_rounding() -> None:
    # gemma2's tiny random model has near-tied next tokens: in bfloat16 greedy decoding
    # flips on the original's side as on the swap's (measured against float32)
    model = get_family("gemma2").build(seed=0).to(torch.bfloat16)
    fixed = verify(
        model, "gemma2.decoder.fused", generate=8, tolerance=Tolerance.for_dtype("bfloat16")
    )
    assert not fixed.passed and fixed.floor is None

    report = verify(model, "gemma2.decoder.fused", generate=8)

    assert report.passed, report.summary()
    assert report.floor == "float32" and not report.calibrated
    assert "2x the original's own bfloat16 error against float32" in report.summary()
    assert next(model.parameters()).dtype == torch.bfloat16  # the caller's model is untouched


@pytest.mark.parametrize("scale", [1.25, 0.5])
def test_a_broken_layer_still_fails_in_bfloat16_against_the_float32_floor(
    llama: Any, scale: float
) -> None:
    broken = _perturbed(get(FUSED), layer=2, scale=scale, name="llama.decoder.broken")
    report = verify(llama.to(torch.bfloat16), broken, backward=True, generate=4)

    assert not report.passed
    assert report.floor == "float32"
    assert report.first_divergent_layer == 2
    assert "the original in bfloat16: cosine" in report.summary()


def _generation(step_logits: list[list[float]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy tokens and their logits, [1, steps] and [1, steps, vocab]."""
    logits = torch.tensor([step_logits])
    return logits.argmax(-1), logits


def test_decoding_may_part_only_at_a_near_tie_when_judged_against_the_float32_floor() -> None:
    from layerswap.comparison.generation import compare_generation

    tolerance = Tolerance.for_dtype("bfloat16")
    reference, ref_logits = _generation([[0, 5, 0, 0], [0, 0, 3.00, 2.99], [4, 0, 0, 0]])
    # the same first step; at the second the two best tokens swap places (0.01 apart),
    # and after it the prefixes differ, so the third step is not comparable
    tied, tied_logits = _generation([[0, 5, 0, 0], [0, 0, 2.99, 3.00], [0, 0, 0, 4]])
    # at the second step a token whose logit is 3 below the reference's best: no tie
    apart, apart_logits = _generation([[0, 5, 0, 0], [0, 4, 0, 0], [0, 0, 0, 4]])
    floor = (reference, ref_logits)  # the original agrees with its float32 self

    fixed = compare_generation(reference, tied, tolerance, ref_logits, tied_logits)
    assert not fixed.passed and fixed.first_mismatch == 1  # agreement 1/3 < 0.75

    judged = compare_generation(reference, tied, tolerance, ref_logits, tied_logits, floor=floor)
    assert judged.passed and judged.agreement == pytest.approx(1 / 3)

    refused = compare_generation(reference, apart, tolerance, ref_logits, apart_logits, floor=floor)
    assert not refused.passed and not refused.logits_passed


def test_a_gradient_zero_at_working_precision_is_not_compared_by_its_direction() -> None:
    """A router renormalising its top-1 weight to 1 (HunYuan MoE) gets no gradient; what
    the two backward passes leave there is rounding in unrelated directions. Both under
    16 float32 epsilons of the model's largest gradient pass; a small but real gradient
    that differs does not."""
    from layerswap.comparison.compare import compare_gradients

    tolerance = Tolerance.for_dtype("float32")
    g = torch.Generator().manual_seed(0)
    big = torch.randn(8, 8, generator=g) * 10
    noise_a, noise_b = (torch.randn(4, 8, generator=g) * 1e-8 for _ in range(2))
    reference = {"w": big, "router": noise_a}
    report = compare_gradients(
        reference, {"w": big.clone(), "router": noise_b}, 1.0, 1.0, tolerance, local=False
    )
    assert report.passed, report
    # the same noise with no large gradient beside it is a gradient of its own: compared
    alone = compare_gradients(
        {"router": noise_a}, {"router": noise_b}, 1.0, 1.0, tolerance, local=False
    )
    assert not alone.passed and alone.first_divergent_parameter == "router"
    # a real gradient 1e4 times smaller than the largest, computed wrong, is caught
    small = torch.randn(4, 8, generator=g) * 1e-3
    wrong = compare_gradients(
        {"w": big, "router": small},
        {"w": big.clone(), "router": -small},
        1.0,
        1.0,
        tolerance,
        local=False,
    )
    assert not wrong.passed and wrong.first_divergent_parameter == "router"


def test_where_the_originals_own_gradient_is_nan_the_candidate_is_held_to_the_same() -> None:
    """Gemma 3n's own gradients are NaN on left-padded inputs: a candidate with NaN in the
    same places reproduces the original (judged on the finite elements, with a warning
    naming the parameters); NaN anywhere else, or a finite value where the original has
    NaN, is an infinite error."""
    from layerswap.comparison.compare import compare_gradients
    from layerswap.comparison.distance import diff
    from layerswap.comparison.tolerance import Tolerance
    from layerswap.errors import SwapWarning

    nan = float("nan")
    reference = torch.tensor([1.0, nan, 3.0])
    assert diff(reference, torch.tensor([1.0, nan, 3.0]), rowwise=False).max_abs_error == 0.0
    assert diff(reference, torch.tensor([1.0, 2.0, 3.0]), rowwise=False).max_abs_error == math.inf
    assert diff(torch.ones(3), torch.tensor([1.0, nan, 1.0]), rowwise=False).max_abs_error == (
        math.inf
    )
    assert diff(reference, torch.tensor([1.0, nan, 3.5]), rowwise=False).max_abs_error == 0.5

    with pytest.warns(SwapWarning, match=r"not finite on these inputs for 1 parameters \(w\)"):
        report = compare_gradients(
            {"w": reference, "b": torch.ones(2)},
            {"w": torch.tensor([1.0, nan, 3.0]), "b": torch.ones(2)},
            1.0,
            1.0,
            Tolerance(atol=1e-6, rtol=1e-5, min_cosine=0.9999, gradient_rtol=1e-4),
            local=False,
        )
    assert report.passed


def test_a_layer_wrong_only_in_cached_decoding_is_named(llama: Any) -> None:
    """The forward pass agrees; decoding one token at a time with the cache does not. The
    report names the first layer whose output differs at the first step that differs."""
    fused_layer = get(FUSED).replacement_class()

    class DecodeOnlyBug(fused_layer):  # type: ignore[misc, valid-type]
        def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            output = super().forward(hidden_states, *args, **kwargs)
            if self.layer_idx == 1 and hidden_states.shape[1] == 1:
                output = output * 1.05
            return output

    sub = dataclasses.replace(
        get(FUSED), name="llama.decoder.decode_only", replacement=DecodeOnlyBug
    )
    report = verify(llama, sub)

    assert not report.passed and report.logits_passed and report.first_divergent_layer is None
    assert report.generation is not None
    assert report.generation.first_divergent_layer == "model.layers.1 (decoding step 1)"
    assert "first decoder layer whose output differs is model.layers.1" in report.failure_message()
    assert verify(llama, FUSED).generation.first_divergent_layer is None  # passing: none


def test_verify_inside_autocast_compares_in_the_dtype_asked() -> None:
    """Called inside a training step's ``torch.autocast``, verify compared both models in
    bfloat16 and judged that rounding against float32's tolerance: a correct swap of
    qwen3 failed (max abs 0.0078). It compares in ``dtype`` (the model's), autocast off."""
    model = get_family("qwen3").build(seed=0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        report = verify(model, "qwen3.decoder.fused", backward=True)
        assert torch.is_autocast_enabled("cpu")  # the caller's region, as it was
    assert report.passed, report.summary()
