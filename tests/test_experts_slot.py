"""The ``experts`` slot: the experts of every mixture-of-experts block, their gate read by
running it; ``fused`` recomputes each expert's gate in the backward pass, exactly, on the
MoE models people run (Qwen3-MoE, Mixtral, gpt-oss, Qwen3-Next, DeepSeek V3, Jamba ...)."""

from __future__ import annotations

import copy
import dataclasses
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from test_mlp_slot import (
    _model,
    _train_step,
    compiles_in_one_graph_to_the_same_gradients,
    swaps_exactly,
)
from test_norm_slot import _ids, _liger_reason, coverage_report, listed_and_swept
from torch import nn
from transformers import AutoModelForCausalLM

import layerswap
from layerswap.backends.experts import ExpertsReplacement
from layerswap.backends.fused.experts import FusedExperts
from layerswap.backends.liger.experts import LigerExperts
from layerswap.errors import RequirementError, SubstitutionError, SwapWarning
from layerswap.experts import ExpertsSpec, classify

#: the mixture-of-experts model types people run whose experts the slot swaps (Nemotron-H's
#: are not gated: test_experts_that_are_not_gated_are_refused_unchanged)
POPULAR = (
    "qwen3_moe",
    "gpt_oss",
    "qwen3_next",
    "mixtral",
    "deepseek_v3",
    "deepseek_v2",
    "qwen3_5_moe_text",
    "qwen2_moe",
    "olmoe",
    "jamba",
    "granitemoehybrid",
    "lfm2_moe",
    "glm4_moe",
)
FAST = ("qwen3_moe", "gpt_oss", "qwen3_next")


def _lanes() -> list[Any]:
    return [pytest.param(t, marks=() if t in FAST else pytest.mark.slow, id=t) for t in POPULAR]


def _swapped(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, ExpertsReplacement)]


# --- what the experts compute, by running their gate --------------------------------------


def test_the_gate_is_read_by_running_it() -> None:
    qwen = _model("qwen3_moe").model.layers[0].mlp.experts
    assert classify(qwen) == ExpertsSpec("silu", implementation="grouped_mm")
    gpt_oss = _model("gpt_oss").model.layers[0].mlp.experts
    # gpt-oss: a clamped gate of its own, its gate and up interleaved, weights transposed
    assert classify(gpt_oss) == ExpertsSpec(
        "own", transposed=True, concatenated=False, bias=True, implementation="grouped_mm"
    )
    label = classify(gpt_oss).label  # type: ignore[union-attr]
    assert label == "experts with a gate of their own (transposed, interleaved, biased)"


def test_classifying_touches_nothing_and_reads_a_meta_module() -> None:
    experts = _model("qwen3_moe").model.layers[0].mlp.experts
    before = copy.deepcopy(experts.state_dict())
    classify(experts)
    assert all(torch.equal(experts.state_dict()[k], v) for k, v in before.items())
    family = layerswap.get("qwen3_moe.experts.fused").parts.family
    with torch.device("meta"):
        on_meta = family.causal_lm_class()(family.tiny_config())
    assert classify(on_meta.model.layers[0].mlp.experts) == ExpertsSpec(
        "silu", implementation="grouped_mm"
    )


def test_reading_an_experts_module_copies_two_of_its_experts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A real model's experts module holds gigabytes (DeepSeek-V3: 22 GB a layer): the
    copy the gate is read on holds two experts, in float32 on the CPU, whatever it has."""
    from layerswap import experts as reader

    copied: list[tuple[int, ...]] = []
    real = reader.random_copy

    def spied(module: nn.Module, dtype: torch.dtype) -> nn.Module:
        copied.append(tuple(module.get_parameter("gate_up_proj").shape))
        return real(module, dtype)

    monkeypatch.setattr(reader, "random_copy", spied)
    model = _model("qwen3_moe").to(torch.bfloat16)
    experts = model.model.layers[0].mlp.experts
    assert experts.gate_up_proj.shape[0] == 4
    assert classify(experts) == ExpertsSpec("silu", implementation="grouped_mm")
    assert copied == [(2, *experts.gate_up_proj.shape[1:])]


def test_a_gate_that_draws_random_numbers_is_kept() -> None:
    experts = copy.deepcopy(_model("qwen3_moe").model.layers[0].mlp.experts)

    class Noisy(type(experts)):  # type: ignore[misc]
        def _apply_gate(self, gate_up: torch.Tensor) -> torch.Tensor:
            gate, up = gate_up.chunk(2, dim=-1)
            return torch.nn.functional.silu(gate) * up * torch.rand_like(up)

    experts.__class__ = Noisy
    reason = classify(experts)
    assert isinstance(reason, str) and "two answers" in reason
    assert "not an experts module" in str(classify(nn.Linear(4, 4)))


def test_whether_the_implementation_reaches_the_gate_is_read_by_running_it() -> None:
    """The fused experts act through ``_apply_gate``: an implementation that computes the
    product inline (the class's own eager loop; a transformers release that inlined it
    in its grouped one) is read as not reaching it, and the fused backend refuses it."""
    experts = _model("qwen3_moe").model.layers[0].mlp.experts
    assert classify(experts).gate_called  # type: ignore[union-attr]
    experts.config._experts_implementation = "eager"
    spec = classify(experts)
    assert isinstance(spec, ExpertsSpec) and not spec.gate_called
    assert "never calls _apply_gate" in str(FusedExperts.refusal(spec))
    assert LigerExperts.refusal(spec) is None  # Liger's kernel replaces the whole forward


def test_experts_that_are_not_gated_are_refused_unchanged() -> None:
    with pytest.raises(layerswap.errors.UnknownSubstitutionError, match="not gated"):
        layerswap.get("nemotron_h.experts.fused")
    with pytest.raises(layerswap.errors.UnknownSubstitutionError, match="no mixture-of-experts"):
        layerswap.get("llama.experts.fused")


# --- swapped exactly ----------------------------------------------------------------------


@pytest.mark.parametrize("model_type", _lanes())
def test_a_moe_model_swaps_its_experts_exactly(model_type: str, tmp_path: Path) -> None:
    swaps_exactly(_model(model_type), f"{model_type}.experts.fused", ExpertsReplacement, tmp_path)


@pytest.mark.parametrize("model_type", ["qwen3_moe", "gpt_oss"])
def test_verify_passes_the_swapped_experts_layer_by_layer(model_type: str) -> None:
    report = layerswap.verify(_model(model_type), f"{model_type}.experts.fused", backward=True)
    assert report.passed, report.summary()


@pytest.mark.parametrize("model_type", ["qwen3_moe", "gpt_oss"])
def test_training_computes_the_original_gradients_keeping_less(model_type: str) -> None:
    """The loss and every gradient are the original's, bit for bit; each expert's gate is
    recomputed in the backward pass, not kept: one ``selected tokens x intermediate`` tensor
    fewer per experts module."""
    model = _model(model_type)
    ids = _ids(model)
    config = model.config

    def saved_bytes() -> int:
        total = [0]

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            total[0] += tensor.numel() * tensor.element_size()
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(ids, labels=ids).loss.backward()
        model.zero_grad()
        return total[0]

    loss, grads = _train_step(model, ids)
    original = saved_bytes()
    with layerswap.swap(model, f"{model_type}.experts.fused") as handle:
        swapped_loss, swapped_grads = _train_step(model, ids)
        swapped = saved_bytes()
    assert torch.equal(swapped_loss, loss)
    assert swapped_grads.keys() == grads.keys()
    assert all(torch.equal(swapped_grads[n], grads[n]) for n in grads)
    intermediate = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
    selected = ids.numel() * config.num_experts_per_tok
    assert original - swapped >= len(handle) * selected * intermediate * 4  # float32


def test_experts_run_eagerly_are_kept_for_fused_and_a_switch_later_is_warned() -> None:
    model = _model("qwen3_moe")
    ids = _ids(model)
    model.set_experts_implementation("eager")
    with pytest.raises(SubstitutionError, match="experts_implementation='eager'"):
        layerswap.swap(model, "qwen3_moe.experts.fused")
    assert not _swapped(model)
    model.set_experts_implementation("grouped_mm")
    with torch.no_grad():
        expected = model(ids).logits
    with layerswap.swap(model, "qwen3_moe.experts.fused"):
        model.set_experts_implementation("eager")
        with pytest.warns(SwapWarning, match="save nothing"), torch.no_grad():
            eager = model(ids).logits
        torch.testing.assert_close(eager, expected, rtol=1e-5, atol=1e-5)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # once per class, not per call
            with torch.no_grad():
                model(ids)


def test_built_and_loaded_inside_use_the_experts_are_swapped(tmp_path: Path) -> None:
    model = _model("qwen3_moe")
    ids = _ids(model)
    with torch.no_grad():
        expected = model(ids).logits
    model.save_pretrained(tmp_path)
    with layerswap.use("qwen3_moe.experts.fused"):
        loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert len(_swapped(loaded)) == model.config.num_hidden_layers
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, expected)


@pytest.mark.parametrize("change", ["eager", "dense"])
def test_a_model_built_in_use_with_no_experts_swapped_is_warned_once(change: str) -> None:
    """Built inside use() with nothing swapped (experts run eagerly, or no MoE layer at
    all): one warning, of the outermost model (its base model is built inside it)."""
    from transformers import Qwen3MoeForCausalLM

    sub = layerswap.get("qwen3_moe.experts.fused")
    config = sub.parts.family.tiny_config()
    if change == "eager":
        config._experts_implementation = "eager"
    else:
        config.mlp_only_layers = list(range(config.num_hidden_layers))
    with layerswap.use(sub), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = Qwen3MoeForCausalLM(config)
    said = [str(w.message) for w in caught if issubclass(w.category, SwapWarning)]
    assert len(said) == 1, said
    assert "this Qwen3MoeForCausalLM was built inside use()" in said[0]
    expected = "experts_implementation='eager'" if change == "eager" else "use() changed nothing"
    assert expected in said[0]
    assert not _swapped(model)


# --- the contract's clients: torch.compile, PEFT ----------------------------------------


@pytest.mark.slow  # compiles twice
def test_compile_trains_the_swapped_experts_to_the_same_gradients_in_one_graph() -> None:
    # the recomputed gate is a checkpoint region dynamo traces: no graph break
    compiles_in_one_graph_to_the_same_gradients(_model("qwen3_moe"), "qwen3_moe.experts.fused")


@pytest.mark.parametrize("swap_first", [True, False], ids=["swap-then-lora", "lora-then-swap"])
def test_a_lora_adapter_on_the_expert_weights_trains_as_on_the_original(swap_first: bool) -> None:
    """PEFT's LoRA on the experts' 3-D weights (``target_parameters``) wraps the experts
    module and reads its weights through a parametrization: with the experts swapped before
    or after it, the loss and every gradient are the original's, bit for bit."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=4,
        target_modules=[],
        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
        init_lora_weights=False,
    )
    plain = _model("qwen3_moe")
    ids = _ids(plain)
    torch.manual_seed(1)  # the same adapter weights on both
    plain = get_peft_model(plain, copy.deepcopy(config))
    expected_loss, expected_grads = _train_step(plain, ids)

    model = _model("qwen3_moe")
    if swap_first:
        layerswap.swap(model, "qwen3_moe.experts.fused")
    torch.manual_seed(1)
    adapted = get_peft_model(model, copy.deepcopy(config))
    if not swap_first:
        layerswap.swap(adapted.base_model.model, "qwen3_moe.experts.fused")
    assert _swapped(adapted)
    loss, grads = _train_step(adapted, ids)
    assert torch.equal(loss, expected_loss)
    assert grads.keys() == expected_grads.keys() and any("lora" in name for name in grads)
    assert all(torch.equal(grads[n], expected_grads[n]) for n in grads)


# --- with the decoder slot -------------------------------------------------------------------


def test_the_decoder_slot_and_the_experts_slot_are_not_swapped_over_each_other() -> None:
    """A decoder substitution that keeps the original's MoE blocks builds them anew: an
    experts swap inside them would go with the decoder's undo, one before it would be left
    out while the decoder is swapped. Both orders are refused and change nothing."""
    model = _model("qwen3_moe")
    ids = _ids(model)
    with torch.no_grad():
        expected = model(ids).logits
    with layerswap.swap(model, "qwen3_moe.decoder.fused"):
        with pytest.raises(SubstitutionError, match=r"undo qwen3_moe\.decoder\.fused first"):
            layerswap.swap(model, "qwen3_moe.experts.fused")
        assert not _swapped(model)
    with layerswap.swap(model, "qwen3_moe.experts.fused"):
        with pytest.raises(SubstitutionError, match=r"mlp\.experts is swapped by qwen3_moe\.ex"):
            layerswap.swap(model, "qwen3_moe.decoder.fused")
        assert layerswap.get_slot("decoder").swapped_by(model) is None
    with torch.no_grad():
        assert torch.equal(model(ids).logits, expected)


@pytest.mark.parametrize("decoder_first", [True, False], ids=["decoder-first", "experts-first"])
def test_use_of_the_decoder_and_experts_slots_together_composes(
    decoder_first: bool, tmp_path: Path
) -> None:
    model = _model("qwen3_moe")
    ids = _ids(model)
    with torch.no_grad():
        expected = model(ids).logits
    model.save_pretrained(tmp_path)
    names = ["qwen3_moe.decoder.fused", "qwen3_moe.experts.fused"]
    first, second = names if decoder_first else names[::-1]
    with layerswap.use(first), layerswap.use(second):
        loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert layerswap.get_slot("decoder").swapped_by(loaded) == "qwen3_moe.decoder.fused"
    assert len(_swapped(loaded)) == model.config.num_hidden_layers
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, expected, rtol=1e-4, atol=1e-4)


# --- liger ------------------------------------------------------------------------------


def test_the_liger_experts_need_a_gpu_here_and_name_what_they_lack() -> None:
    assert LigerExperts.refusal(ExpertsSpec("silu")) is None
    own = ExpertsSpec("own", transposed=True, concatenated=False, bias=True)
    assert "a gate of their own" in str(LigerExperts.refusal(own))
    transposed = dataclasses.replace(own, kind="silu")
    reason = str(LigerExperts.refusal(transposed))
    assert "transposed weights" in reason and "interleaved" in reason and "biases" in reason
    assert FusedExperts.refusal(own) is None
    sub = layerswap.get("qwen3_moe.experts.liger")
    assert sub.devices == ("cuda",)
    if not torch.cuda.is_available():
        model = _model("qwen3_moe")
        with pytest.raises(RequirementError, match="cannot run here"):
            layerswap.swap(model, sub)
        assert not _swapped(model)


@pytest.mark.gpu
@pytest.mark.skipif(_liger_reason() is not None, reason=f"needs CUDA and liger ({_liger_reason()})")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("backend", ["fused", "liger"])
@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral", "qwen3_next", "deepseek_v3"])
def test_on_a_gpu_the_experts_verify(model_type: str, backend: str, dtype: torch.dtype) -> None:
    report = layerswap.verify(
        _model(model_type),
        f"{model_type}.experts.{backend}",
        dtype=dtype,
        device="cuda",
        backward=True,
    )
    assert report.passed, report.summary()


# --- coverage and the command line ------------------------------------------------------


@pytest.mark.slow  # every model type of the installed transformers, on the meta device
def test_list_all_names_the_model_types_whose_experts_are_swapped() -> None:
    # every model type the list says the fused experts take was proven by the sweep
    # (scripts/norm_sweep.py --slot experts) on this transformers release
    listed = listed_and_swept("experts", "experts")
    # transformers 5.24: 59 model types, every popular one among them, and Gemma 4's
    # experts, which its default config leaves out (switched on in its tiny model)
    assert len(listed) >= 59, len(listed)
    assert set(POPULAR) | {"gemma4", "gemma4_text"} <= listed
    assert "not gated" in str(coverage_report()["nemotron_h"].slots["experts"]["fused"])


def test_the_command_line_patches_a_model_types_experts() -> None:
    from typer.testing import CliRunner

    from layerswap.cli import app

    result = CliRunner().invoke(app, ["patch", "--substitution", "qwen3_moe.experts.fused"])
    assert result.exit_code == 0, result.output
    assert "experts modules swapped: Qwen3MoeExperts -> FusedExperts[Qwen3MoeExperts]" in (
        result.output
    )
    assert "PASS: the swapped model matches the original" in result.output
