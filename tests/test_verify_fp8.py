"""FP8 verification against ideal FP8 rounding (the noise floor), on the CPU.

TransformerEngine's FP8 layers need a GPU; what is checked here is the rule they are
judged by: E4M3 rounding with current scaling, the emulated reference pass, and a
tolerance that widens to the noise floor at each layer -- never narrows -- while a
wrong weight still fails and is named.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import pytest
import torch

import layerswap
from layerswap.comparison.compare import Comparison
from layerswap.comparison.forward import Run
from layerswap.comparison.fp8 import E4M3_MAX, FLOOR_FACTOR, ideal_fp8, round_e4m3
from layerswap.errors import VerificationError
from layerswap.registry import get_family
from layerswap.substitution import Substitution
from layerswap.swap import swap
from layerswap.verify import Tolerance, assert_equivalent


def fp8_named_fused(family: str = "llama") -> Substitution:
    """The fused substitution under an FP8 name: what verify treats as FP8 precision."""
    fused = next(s for s in layerswap.substitutions(backend="fused") if s.family == family)
    return dataclasses.replace(fused, name=f"{family}.decoder.fused_fp8", backend="fused_fp8")


# --- rounding ----------------------------------------------------------------------------


def test_round_e4m3_keeps_three_mantissa_bits_and_maps_the_largest_value_to_448() -> None:
    values = torch.randn(4096, generator=torch.Generator().manual_seed(0)) * 3
    rounded = round_e4m3(values)
    amax = values.abs().max()
    scaled = values * (E4M3_MAX / amax)
    normal = scaled.abs() >= 2**-6  # E4M3's smallest normal number
    relative = ((rounded - values).abs() / values.abs())[normal]
    assert float(relative.max()) <= 2**-4 + 1e-6  # half a step of a 3-bit mantissa
    assert float(relative.max()) > 2**-6  # and it does round
    assert float(rounded.abs().max()) == pytest.approx(float(amax))
    assert rounded.dtype == values.dtype


def test_round_e4m3_leaves_zero_and_exactly_representable_tensors_alone() -> None:
    zeros = torch.zeros(8)
    assert round_e4m3(zeros) is zeros
    exact = torch.tensor([448.0, 1.0, -1.125, 0.5])  # amax 448: a scale of one
    assert torch.equal(round_e4m3(exact), exact)


# --- the emulated pass --------------------------------------------------------------------


def test_ideal_fp8_changes_the_output_and_restores_the_model_exactly() -> None:
    model = get_family("llama").build(seed=1)
    ids = torch.randint(1, model.config.vocab_size, (2, 12))
    params = {name: (p, p.detach().clone()) for name, p in model.named_parameters()}
    with torch.no_grad():
        plain = model(ids).logits
        with ideal_fp8(model.model.layers):
            emulated = model(ids).logits
        again = model(ids).logits
    assert not torch.equal(plain, emulated)
    cosine = torch.nn.functional.cosine_similarity(plain.flatten(), emulated.flatten(), dim=0)
    assert 0.99 < float(cosine) < 1.0
    assert torch.equal(plain, again)
    for name, param in model.named_parameters():
        assert param is params[name][0] and torch.equal(param, params[name][1])
    assert all(not layer._forward_pre_hooks for layer in model.model.layers.modules())


def test_ideal_fp8_restores_the_weights_when_the_block_raises() -> None:
    model = get_family("llama").build(seed=1)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    with pytest.raises(RuntimeError, match="inside"), ideal_fp8(model.model.layers):
        raise RuntimeError("inside")
    assert all(torch.equal(p, before[name]) for name, p in model.named_parameters())
    assert all(not module._forward_pre_hooks for module in model.modules())


# --- the rule -------------------------------------------------------------------------------


def _runs(noise: float, floor_noise: float) -> tuple[Comparison, Run, Run, Run]:
    """A reference, a floor off by ``floor_noise`` and a candidate off by ``noise`` (relative)."""
    generator = torch.Generator().manual_seed(0)
    ref = torch.randn(2, 8, 32, generator=generator)
    direction = torch.randn(2, 8, 32, generator=generator)

    def off(amount: float) -> torch.Tensor:
        return ref + amount * direction

    def run(out: torch.Tensor) -> Run:
        return Run(logits=ref.clone(), is_logits=True, layers=[("model.layers.0", out)])

    batch = {"input_ids": torch.ones(2, 8, dtype=torch.long)}
    fp8 = Tolerance.for_dtype("fp8")
    comparison = Comparison("x.decoder.te_fp8", torch.device("cpu"), torch.float32, fp8, batch)
    return comparison, run(ref), run(off(floor_noise)), run(off(noise))


def test_a_layer_as_far_as_the_floor_passes_and_reports_what_it_was_held_to() -> None:
    comparison, reference, floor, candidate = _runs(noise=0.1, floor_noise=0.1)
    report = comparison.report(reference, candidate, mode="full", floor=floor)
    assert report.passed, report.summary()
    layer = report.layers[0]
    assert layer.floor_cosine == pytest.approx(layer.cosine)
    assert layer.min_cosine == pytest.approx(1 - FLOOR_FACTOR * (1 - layer.floor_cosine) - 1e-4)
    assert layer.rtol == pytest.approx(FLOOR_FACTOR * layer.max_rel_error)


def test_a_layer_over_the_fixed_tolerance_passes_within_twice_the_floor() -> None:
    comparison, reference, floor, candidate = _runs(noise=0.36, floor_noise=0.3)
    fixed = comparison.report(reference, candidate, mode="full")
    calibrated = comparison.report(reference, candidate, mode="full", floor=floor)
    assert not fixed.passed and fixed.first_divergent_layer == 0
    assert calibrated.passed, calibrated.summary()
    layer = calibrated.layers[0]
    assert layer.floor_cosine is not None
    assert layer.min_cosine == pytest.approx(1 - FLOOR_FACTOR * (1 - layer.floor_cosine) - 1e-4)
    assert "ideal FP8" in calibrated.summary()


def test_a_layer_over_twice_the_floor_fails_and_is_named_with_the_floor() -> None:
    comparison, reference, floor, candidate = _runs(noise=1.0, floor_noise=0.3)
    report = comparison.report(reference, candidate, mode="full", floor=floor)
    assert not report.passed and report.first_divergent_layer == 0
    assert "ideal FP8 rounding: cosine" in report.summary()


def _decoded(step_logits: list[list[float]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy tokens and the logits they were chosen from, [1, steps] and [1, steps, vocab]."""
    logits = torch.tensor([step_logits])
    return logits.argmax(-1), logits


def test_fp8_decoding_may_part_where_ideal_fp8_parts_but_not_with_wrong_logits() -> None:
    comparison, reference, floor, candidate = _runs(noise=0.1, floor_noise=0.1)
    # the reference's first token is near-tied (3.00 against 2.99): ideal FP8 rounding
    # of the same model already picks the other one, as does the candidate
    reference.tokens, reference.token_logits = _decoded([[0, 3.00, 2.99, 0], [4, 0, 0, 0]])
    floor.tokens, floor.token_logits = _decoded([[0, 2.98, 3.00, 0], [0, 0, 0, 4]])
    candidate.tokens, candidate.token_logits = _decoded([[0, 2.99, 3.00, 0], [0, 0, 0, 4]])
    fixed = comparison.report(reference, candidate, mode="full")
    calibrated = comparison.report(reference, candidate, mode="full", floor=floor)
    assert fixed.generation is not None and not fixed.generation.passed
    assert fixed.generation.first_mismatch == 0  # agreement 0% < the fixed 50%
    assert calibrated.generation is not None and calibrated.generation.passed
    assert calibrated.passed, calibrated.summary()
    # parting at the same token with logits far from the reference's is no rounding flip
    candidate.tokens, candidate.token_logits = _decoded([[0, 0, 9.0, 0], [0, 0, 0, 4]])
    wrong = comparison.report(reference, candidate, mode="full", floor=floor)
    assert wrong.generation is not None and not wrong.generation.logits_passed
    assert not wrong.passed


# --- end to end -----------------------------------------------------------------------------


def _fp8_candidate(model: Any, family: str = "llama") -> Any:
    """The model swapped to fused layers, to be run under ideal_fp8: an FP8 candidate."""
    candidate = copy.deepcopy(model)
    swap(candidate, f"{family}.decoder.fused")
    return candidate


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_an_fp8_candidate_is_judged_against_the_floor_of_every_layer(family: str) -> None:
    spec = get_family(family)
    model = spec.build(spec.tiny_config(num_hidden_layers=8), seed=0)
    candidate = _fp8_candidate(model, family)
    with ideal_fp8(candidate.model.layers):
        report = assert_equivalent(model, candidate, substitution=fp8_named_fused(family))
    assert report.calibrated
    assert all(layer.floor_cosine is not None and layer.floor_cosine < 1 for layer in report.layers)
    # the fused candidate rounds q/k/v (and gate/up) with one scale each, the floor each
    # projection with its own, as TransformerEngine's fused GEMMs differ from the original
    assert any(layer.cosine != layer.floor_cosine for layer in report.layers)


def test_an_explicit_tolerance_is_used_as_given() -> None:
    model = get_family("llama").build(seed=0)
    candidate = _fp8_candidate(model)
    with ideal_fp8(candidate.model.layers):
        report = assert_equivalent(
            model, candidate, substitution=fp8_named_fused(), tolerance=Tolerance.for_dtype("fp8")
        )
    assert report.tolerance == Tolerance.for_dtype("fp8")
    assert not report.calibrated
    assert all(layer.floor_cosine is None for layer in report.layers)


def test_a_wrong_weight_the_fixed_fp8_tolerance_lets_through_fails_at_its_layer() -> None:
    spec = get_family("llama")
    model = spec.build(spec.tiny_config(num_hidden_layers=6), seed=0)
    candidate = _fp8_candidate(model)
    with torch.no_grad():
        candidate.model.layers[3].mlp.down_proj.weight.mul_(-1)
    sub = fp8_named_fused()
    with ideal_fp8(candidate.model.layers):
        # the forward pass alone (decoding, compared by default, would catch it too)
        fixed = assert_equivalent(
            model, candidate, substitution=sub, tolerance=Tolerance.for_dtype("fp8"), generate=0
        )
        with pytest.raises(VerificationError) as caught:
            assert_equivalent(model, candidate, substitution=sub)
    assert fixed.passed  # a cosine of ~0.96 at layer 3 is within the fixed 0.95
    assert "first divergent layer: 3" in str(caught.value)


def test_verify_calibrates_a_substitution_named_fp8() -> None:
    model = get_family("llama").build(seed=0)
    report = layerswap.verify(model, fp8_named_fused())
    assert report.passed and report.calibrated  # fused in float32: far inside the floor
