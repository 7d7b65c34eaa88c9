"""Mixture-of-experts near-ties: a token routed to other experts where the reference's own
router could not tell them apart is left out (and reported); anything else still fails."""

from __future__ import annotations

import copy
import dataclasses
import json
from typing import Any

import pytest
import torch

from layerswap.comparison import routing
from layerswap.comparison.excused import decoding_excused_from, excused_rows
from layerswap.comparison.model_classes import ModelTask
from layerswap.comparison.routing import Routing, moe_block, near_ties
from layerswap.errors import VerificationError
from layerswap.registry import get, get_family
from layerswap.substitution import Substitution
from layerswap.verify import assert_equivalent, checks, verify

TIED_LAYER = 3  # the tiny Qwen3-MoE's last layer: 4 experts, top 2


def _gate_of(layer: torch.nn.Module) -> Any:
    found = moe_block(layer)
    assert found is not None
    return found[0].gate


def _gate(model: Any, layer: int) -> Any:
    return _gate_of(model.model.layers[layer])


@pytest.fixture
def tied() -> Any:
    """Qwen3-MoE whose experts 0 and 1 have the same router row at :data:`TIED_LAYER`: every
    token for which they sit at the top-2 boundary is an exact tie in the reference."""
    model = get_family("qwen3_moe").build(seed=0)
    with torch.no_grad():
        weight = _gate(model, TIED_LAYER).weight
        weight[1] = weight[0]
    return model


def _nudged(model: Any, layer: int, row: int, factor: float) -> Any:
    candidate = copy.deepcopy(model)
    with torch.no_grad():
        _gate(candidate, layer).weight[row] *= factor
    return candidate


def test_a_token_routed_otherwise_at_a_near_tie_is_excused_and_reported(
    tied: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 1e-5 relative on expert 1's row breaks the exact ties towards expert 1 where the
    # shared score is positive, and moves every other output by ~1e-5: within float32's 1e-4
    candidate = _nudged(tied, TIED_LAYER, row=1, factor=1 + 1e-5)

    report = assert_equivalent(tied, candidate, generate=0)

    layer = report.layers[TIED_LAYER]
    assert report.passed, report.summary()
    assert layer.near_ties > 0 and layer.excused_rows == layer.near_ties
    assert report.near_ties == layer.near_ties  # no other layer routes differently
    assert all(earlier.excused_rows == 0 for earlier in report.layers[:TIED_LAYER])
    assert f"(layer {TIED_LAYER}: {layer.near_ties})" in report.summary()
    assert json.loads(report.to_json())["layers"][TIED_LAYER]["near_ties"] == layer.near_ties
    # the same candidate with no margin counted as a near-tie: those tokens fail the layer
    monkeypatch.setattr(routing, "NEAR_TIE_EPSILONS", -1)
    with pytest.raises(VerificationError, match=f"first divergent layer: {TIED_LAYER} "):
        assert_equivalent(tied, candidate, generate=0)


@pytest.mark.parametrize(
    ("layer", "wrong"),
    [
        (1, "rows swapped"),  # tokens sent to other experts, none of them at a near-tie
        (1, "noise"),  # 5% noise on the router: its weights move, tokens go elsewhere
        (1, "top-1"),  # the block keeps one expert per token instead of two
        (TIED_LAYER, "nudged 5%"),  # flips the tied tokens, and moves every other weight
    ],
)
def test_a_router_computed_wrong_still_fails_at_its_layer(
    tied: Any, layer: int, wrong: str
) -> None:
    candidate = copy.deepcopy(tied)
    gate = _gate(candidate, layer)
    with torch.no_grad():
        if wrong == "rows swapped":
            gate.weight[[2, 3]] = gate.weight[[3, 2]].clone()
        elif wrong == "noise":
            noise = torch.randn(gate.weight.shape, generator=torch.Generator().manual_seed(0))
            gate.weight += 0.05 * gate.weight.abs().mean() * noise
        elif wrong == "top-1":
            gate.top_k = 1
        else:
            gate.weight[1] *= 1.05

    with pytest.raises(VerificationError, match=f"first divergent layer: {layer} "):
        assert_equivalent(tied, candidate, generate=0)


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe", "granitemoe", "glm4_moe"])
def test_a_fused_swap_of_a_moe_family_passes_in_float32_with_nothing_excused(
    family: str,
) -> None:
    model = get_family(family).build(seed=0)

    report = verify(model, f"{family}.decoder.fused", generate=2)

    assert report.passed, report.summary()
    assert report.near_ties == 0
    assert all(layer.excused_rows == 0 for layer in report.layers)
    assert "near-tie" not in report.summary()


def test_the_tied_model_swapped_passes_in_float32(tied: Any) -> None:
    report = verify(tied, "qwen3_moe.decoder.fused")

    assert report.passed, report.summary()
    assert report.near_ties == 0  # the swap keeps the block: its ties break the same way


def _nudging(factor: float) -> Substitution:
    """The fused Qwen3-MoE layer whose router at :data:`TIED_LAYER` computes with expert 1's
    row times ``factor`` (the weights it holds, and converts back, stay the original's)."""
    base = get("qwen3_moe.decoder.fused")
    fused_layer = base.replacement_class()

    class NudgingLayer(fused_layer):  # type: ignore[misc, valid-type]
        def __init__(self, config: Any, layer_idx: int) -> None:
            super().__init__(config, layer_idx)
            if layer_idx != TIED_LAYER:
                return
            gate, kept = _gate_of(self), []

            def nudge(module: Any, args: Any) -> None:
                kept.append(module.weight.detach().clone())
                module.weight.data[1] *= factor

            def restore(module: Any, args: Any, output: Any) -> None:
                module.weight.data.copy_(kept.pop())

            gate.register_forward_pre_hook(nudge)
            gate.register_forward_hook(restore)

    return dataclasses.replace(base, name="qwen3_moe.decoder.nudging", replacement=NudgingLayer)


def test_verify_excuses_a_swap_that_breaks_near_ties_otherwise(tied: Any) -> None:
    report = verify(tied, _nudging(1 + 1e-5), generate=2)

    assert report.passed, report.summary()
    assert report.layers[TIED_LAYER].near_ties == report.near_ties > 0

    wrong = verify(tied, _nudging(1.05), generate=2)
    assert not wrong.passed and wrong.first_divergent_layer == TIED_LAYER


def test_a_near_tie_is_a_margin_within_a_few_epsilons_of_the_rows_largest_score() -> None:
    scores = torch.tensor([[4.0, 1.0, 1.0, 0.0], [4.0, 1.01, 1.0, 0.0], [4.0, 1.2, 1.0, 0.0]])
    # bfloat16: 4 x 2**-7 x 4 = 0.125 of margin is within rounding; float32 resolves 1e-2
    assert near_ties(scores, 2, torch.bfloat16).tolist() == [True, True, False]
    assert near_ties(scores, 2, torch.float32).tolist() == [True, False, False]
    # every expert kept: no boundary, no tie
    assert near_ties(scores, 4, torch.bfloat16).tolist() == [False, False, False]


def _routing(selected: list[list[int]], tie: list[bool]) -> Routing:
    return Routing(torch.tensor(selected).sort(dim=-1).values, torch.tensor(tie))


def test_a_near_tie_excuses_its_token_then_its_sequences_later_tokens_from_the_next_layer() -> None:
    # two sequences of 3 positions, the second left-padded by one: 5 valid rows
    valid = torch.tensor([[True, True, True], [False, True, True]])
    same = [[0, 1]] * 5
    ties = [False, True, False, True, False]
    reference = [_routing(same, ties)] * 3
    flipped_at_1 = [[0, 1], [0, 2], [0, 1], [0, 1], [0, 1]]  # row 1: seq 0, position 1
    flipped_at_3 = [[0, 1], [0, 1], [0, 1], [0, 2], [0, 2]]  # rows 3 (a tie) and 4 (none)
    candidate = [_routing(flipped_at_1, ties), _routing(same, ties), _routing(flipped_at_3, ties)]

    excused = excused_rows(reference, candidate, valid)

    assert excused is not None
    assert excused.near_ties == [1, 0, 1]
    assert [rows.tolist() for rows in excused.rows] == [
        [False, True, False, False, False],  # the token itself where it flipped
        [False, True, True, False, False],  # then it and its sequence's later tokens
        [False, True, True, True, False],  # row 4 flipped with a clear margin: compared
    ]
    assert excused.sequences(2).tolist() == [True, False]  # seq 0's last token is reached


def test_nothing_is_excused_without_a_near_tie_or_without_routing() -> None:
    valid = torch.ones(1, 2, dtype=torch.bool)
    reference = [_routing([[0, 1], [0, 1]], [False, False])]
    candidate = [_routing([[0, 2], [0, 2]], [True, True])]  # the candidate's ties count not
    assert excused_rows(reference, candidate, valid) is None
    assert excused_rows(None, candidate, valid) is None
    unseen = [Routing(reference[0].selected, None)]  # a block ranking without topk
    assert excused_rows(unseen, candidate, valid) is None


def test_gradients_are_compared_over_the_positions_a_near_tie_leaves_in(
    tied: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    report = verify(tied, _nudging(1 + 1e-5), generate=2, backward=True)

    assert report.passed, report.summary()
    assert report.backward is not None and report.backward.passed
    left_out = report.backward.excused_positions
    assert left_out == report.layers[-1].excused_rows > 0
    assert f"loss and gradients over the other positions ({left_out} left out)" in (
        report.summary()
    )
    # the whole loss learnt from: the flipped tokens' gradients land on other experts
    monkeypatch.setattr(checks, "left_out_positions", lambda *args: None)
    whole = verify(tied, _nudging(1 + 1e-5), generate=2, backward=True)
    assert not whole.passed and whole.first_divergent_layer is None
    assert whole.backward is not None and not whole.backward.passed
    assert whole.backward.excused_positions == 0


def test_assert_equivalent_learns_over_the_positions_a_near_tie_leaves_in(tied: Any) -> None:
    candidate = _nudged(tied, TIED_LAYER, row=1, factor=1 + 1e-5)

    report = assert_equivalent(tied, candidate, generate=0, backward=True)

    assert report.backward is not None
    assert report.backward.excused_positions == report.layers[-1].excused_rows > 0


@pytest.mark.parametrize(
    ("layer", "factor"),
    [(TIED_LAYER, 1.05), (1, 1.05)],  # flips the tied tokens too / a layer with no ties
)
def test_a_router_computed_wrong_still_fails_with_backward(
    tied: Any, layer: int, factor: float
) -> None:
    candidate = _nudged(tied, layer, row=1, factor=factor)

    with pytest.raises(VerificationError, match=f"first divergent layer: {layer} .*gradients"):
        assert_equivalent(tied, candidate, generate=0, backward=True)

    if layer == TIED_LAYER:
        wrong = verify(tied, _nudging(factor), generate=2, backward=True)
        assert not wrong.passed and wrong.first_divergent_layer == TIED_LAYER
        assert wrong.backward is not None and not wrong.backward.passed


def test_the_loss_leaves_out_the_terms_read_at_left_out_positions() -> None:
    ids = torch.arange(1, 6).reshape(1, 5)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    left_out = torch.tensor([[False, True, False, False, True]])
    # a causal LM learns label p + 1 from position p: positions 1 and 4 teach labels 2 and
    # (past the end) none; a flip at the last layer leaves position 2 learning from 1's keys
    labels = ModelTask("causal-lm", "M").labels(batch, None, left_out=left_out)["labels"]
    assert labels.tolist() == [[1, 2, -100, 4, 5]]
    config = type("Config", (), {"num_labels": 3})()
    labels = ModelTask("token-classification", "M").labels(batch, config, left_out=left_out)
    assert labels["labels"].tolist() == [[1, -100, 0, 1, -100]]
    with pytest.raises(ValueError, match="cannot leave out"):
        ModelTask("sequence-classification", "M").labels(batch, config, left_out=left_out)


def test_hy_v3_fused_in_bfloat16_passes_with_gradients() -> None:
    model = get_family("hy_v3").build()

    report = verify(model, "hy_v3.decoder.fused", dtype=torch.bfloat16, backward=True)

    assert report.passed, report.summary()


#: prompts whose tokens route clear of the tied experts at :data:`TIED_LAYER`, while the
#: first token the first one generates sits at their exact tie (found by search; asserted)
_DECODE_TIE_PROMPTS = [[355, 137, 421, 458, 324], [429, 113, 68, 503, 417]]


def test_a_generated_token_routed_otherwise_at_a_near_tie_leaves_out_the_rest_of_its_decoding(
    tied: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    ids = torch.tensor(_DECODE_TIE_PROMPTS)
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}

    report = verify(tied, _nudging(1 + 1e-5), inputs=inputs, generate=4)

    assert report.passed, report.summary()
    assert report.near_ties == 0  # the prompt: nothing routed otherwise
    assert report.generation is not None
    assert report.generation.excused_steps == ((0, 1),)  # sequence 0, from its 2nd step
    assert report.generation.excused_sequences == 1
    assert "(sequence 0 at decode step 1)" in report.summary()
    # the rule switched off: that step's logits differ by an expert's output
    monkeypatch.setattr(routing, "NEAR_TIE_EPSILONS", -1)
    off = verify(tied, _nudging(1 + 1e-5), inputs=inputs, generate=4)
    assert not off.passed and off.first_divergent_layer is None
    assert off.generation is not None and not off.generation.logits_passed
    assert off.generation.excused_steps == ()


def test_a_router_computed_wrong_still_fails_with_those_prompts(tied: Any) -> None:
    ids = torch.tensor(_DECODE_TIE_PROMPTS)
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    candidate = copy.deepcopy(tied)
    gate = _gate(candidate, 1)
    with torch.no_grad():
        gate.weight[[2, 3]] = gate.weight[[3, 2]].clone()  # no near-tie at layer 1

    with pytest.raises(VerificationError, match="first divergent layer: 1 "):
        assert_equivalent(tied, candidate, inputs=inputs, generate=4)


def test_decoding_is_left_out_from_the_step_a_generated_token_flips_at_a_near_tie() -> None:
    # two sequences, the second left-padded by one: the prompt's 5 valid rows at step 0
    prompt = torch.tensor([[True, True, True], [False, True, True]])
    tokens = torch.tensor([[7, 8, 9, 10], [7, 8, 9, 10]])
    parted = torch.tensor([[7, 8, 9, 10], [7, 5, 9, 10]])  # sequence 1 parts at step 1
    clear = [_routing([[0, 1]] * 5, [False] * 5)]
    step = [_routing([[0, 1]] * 2, [True, True])]
    flipped = [_routing([[0, 2], [0, 2]], [True, True])]
    reference = [clear, step, step, step]
    candidate = [clear, step, flipped, step]  # both sequences flip at step 2

    from_step = decoding_excused_from(reference, candidate, tokens, tokens, prompt)
    assert from_step is not None and from_step.tolist() == [2, 2]
    # sequence 1 generated another token before: its routing at step 2 is not excused
    from_step = decoding_excused_from(reference, candidate, tokens, parted, prompt)
    assert from_step is not None and from_step.tolist() == [2, 4]
    assert decoding_excused_from(reference, reference, tokens, tokens, prompt) is None
    assert decoding_excused_from(None, candidate, tokens, tokens, prompt) is None
    # a prompt token flipping while decoding runs the prompt: the whole sequence
    prompt_flip = [_routing([[0, 1], [0, 2], [0, 1], [0, 1], [0, 1]], [True] * 5)]
    from_step = decoding_excused_from(
        [prompt_flip, *reference[1:]], [clear, *reference[1:]], tokens, tokens, prompt
    )
    assert from_step is not None and from_step.tolist() == [0, 4]
