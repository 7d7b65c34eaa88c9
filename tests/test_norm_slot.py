"""The ``norm`` slot: what each norm computes, named by running it; swapped exactly on the
models the decoder slot refuses (hybrids, multi-head latent attention, Llama 4, Gemma 4)."""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM

import layerswap
from layerswap.backends.fused.norm import FusedNorm
from layerswap.backends.norm import NormReplacement
from layerswap.errors import SubstitutionError, UnknownSubstitutionError, UpstreamDriftError
from layerswap.families.infer import model_type_classes, tiny_config_for
from layerswap.norms import GROUPED_KINDS, KINDS, classify
from layerswap.proof import comparing

#: the model types people run in late 2026 that no decoder substitution takes
POPULAR = (
    "qwen3_next",
    "qwen3_5_text",
    "falcon_h1",
    "lfm2",
    "jamba",
    "bamba",
    "nemotron_h",
    "granitemoehybrid",
    "deepseek_v2",
    "deepseek_v3",
    "llama4_text",
    "gemma4_text",
    "gemma3n_text",
    "granitemoeshared",
    "hyperclovax",
)
#: the fast lane's share of them: a linear-attention hybrid, latent attention, Llama 4
FAST = ("qwen3_next", "deepseek_v3", "llama4_text")


def _model(model_type: str, seed: int = 0) -> nn.Module:
    classes = model_type_classes(model_type)
    config = tiny_config_for(classes.config_class)
    config._attn_implementation = "sdpa" if classes.causal_lm._supports_sdpa else "eager"
    torch.manual_seed(seed)
    model = classes.causal_lm(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name and param.dim() == 1:
                param.add_(torch.randn_like(param), alpha=0.1)
    return model.eval()


def _ids(model: nn.Module) -> torch.Tensor:
    vocab = model.config.get_text_config().vocab_size
    return torch.randint(3, vocab, (2, 9), generator=torch.Generator().manual_seed(0))


@functools.lru_cache(maxsize=1)
def coverage_report() -> Any:
    """``layerswap.coverage.coverage()`` of the installed transformers, made once per test
    process for every slot's test that reads it (about 15 s on one core)."""
    from layerswap.coverage import coverage

    return coverage(jobs=1)


def listed_and_swept(slot: str, page: str) -> set[str]:
    """The model types ``list --all`` says the fused ``slot`` takes; where ``docs/<page>.md``
    was swept on the installed transformers (``scripts/norm_sweep.py``), every one of them
    and no other was proven there."""
    import transformers

    report = coverage_report()
    listed = {t for t, row in report.items() if "fused" in row.below_decoder.get(slot, [])}
    doc = Path(__file__).resolve().parent.parent / "docs"
    if f"transformers {transformers.__version__}," in (doc / f"{page}.md").read_text():
        rows = {row["model_type"]: row for row in json.loads((doc / f"{page}.json").read_text())}
        assert listed == set(rows)
        assert all(row["passed"] for row in rows.values())
    return listed


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


def _lanes() -> list[Any]:
    return [pytest.param(t, marks=() if t in FAST else pytest.mark.slow, id=t) for t in POPULAR]


# --- what a norm computes, by running it --------------------------------------------------


class _Llama(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.variance_epsilon = 1e-6

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        dtype = hidden_states.dtype
        x = hidden_states.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * x.to(dtype)


class _NamedRMSButOffset(nn.Module):
    """Called an RMSNorm; scales by (1 + w) in float32, as Gemma's does."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(width))
        self.eps = 1e-6

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * (1.0 + self.weight.float())).type_as(x)


class _Gated(_Llama):
    def forward(self, hidden_states: torch.Tensor, gate: Any = None) -> torch.Tensor:  # type: ignore[override]
        out = super().forward(hidden_states)
        return out if gate is None else out * F.silu(gate)


class _MeanAbs(_Llama):
    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        scale = hidden_states.abs().mean(-1, keepdim=True) + self.variance_epsilon
        return self.weight * hidden_states / scale


def test_a_norm_is_named_by_what_it_computes_not_by_its_class_name() -> None:
    llama = classify(_Llama(16))
    assert not isinstance(llama, str) and llama.kind == "rms"
    assert llama.eps_name == "variance_epsilon"
    offset = classify(_NamedRMSButOffset(16))
    assert not isinstance(offset, str) and offset.kind == "rms_offset"


def test_the_cast_order_shows_in_bfloat16() -> None:
    # float32-then-cast and cast-then-scale agree in float32; bfloat16 tells them apart
    class FloatThenCast(_Llama):
        def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
            x = hidden_states.float()
            x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
            return (self.weight.float() * x).to(hidden_states.dtype)

    spec = classify(FloatThenCast(64))
    assert not isinstance(spec, str) and spec.kind == "rms_float"


@pytest.mark.parametrize(
    ("module", "why"),
    [
        (_Gated(16), "not one tensor alone"),
        (_MeanAbs(16), "none of the norms"),
        (nn.LayerNorm(16), "torch's own one-kernel norm"),
    ],
    ids=["gated", "mean-abs", "torch-layer-norm"],
)
def test_what_no_kind_computes_is_refused_with_the_reason(module: nn.Module, why: str) -> None:
    reason = classify(module)
    assert isinstance(reason, str) and why in reason


def test_classifying_touches_nothing_and_reads_a_meta_module() -> None:
    norm = _Llama(16)
    before = norm.weight.detach().clone()
    classify(norm)
    assert torch.equal(norm.weight, before) and norm.variance_epsilon == 1e-6
    with torch.device("meta"):
        on_meta = _Llama(16)
    spec = classify(on_meta)
    assert not isinstance(spec, str) and spec.kind == "rms"


def test_the_copy_a_norm_is_read_on_copies_none_of_its_parameters() -> None:
    """Reading copies a module's structure, never its weights (a GPU module is not copied
    on the GPU first): a parameter that refuses to be copied is not asked to be, and a
    buffer keeps its value and dtype."""
    from layerswap.trials import random_copy

    class Uncopyable(nn.Parameter):
        def __deepcopy__(self, memo: dict[int, Any]) -> Any:
            raise AssertionError("a parameter's values were copied")

    norm = nn.LayerNorm(8)
    norm.weight = Uncopyable(torch.ones(8))
    norm.register_buffer("steps", torch.tensor([3]))
    trial = random_copy(norm, torch.bfloat16)
    assert trial.weight.dtype == torch.bfloat16 and not torch.equal(
        trial.weight.float(), torch.ones(8)
    )
    assert trial.steps.dtype == torch.int64 and trial.steps.tolist() == [3]
    assert norm.weight.dtype == torch.float32  # the original untouched


def test_every_kind_is_one_the_fused_backend_computes() -> None:
    assert set(FusedNorm.kernels) == set(KINDS) | set(GROUPED_KINDS)


# --- swapped exactly on the models the decoder slot refuses -------------------------------


@pytest.mark.parametrize("model_type", _lanes())
def test_a_popular_model_swaps_its_norms_exactly(model_type: str, tmp_path: Path) -> None:
    model = _model(model_type)
    ids = _ids(model)
    before = _state(model)
    params = dict(model.named_parameters())
    with torch.no_grad():
        logits = model(ids).logits
    tokens = model.generate(ids, max_new_tokens=4, do_sample=False)

    handle = layerswap.swap(model, f"{model_type}.norm.fused")
    assert len(handle) > 0
    for name, original, made in handle.swapped:
        module = model.get_submodule(name)
        assert type(module) is made and issubclass(made, NormReplacement)
        assert isinstance(module, original)  # transformers' _init_weights still knows it
    with torch.no_grad():
        swapped = model(ids).logits
    torch.testing.assert_close(swapped, logits, rtol=1e-5, atol=1e-5)
    assert torch.equal(model.generate(ids, max_new_tokens=4, do_sample=False), tokens)
    # the very same parameters under the same names: the original layout is what is saved
    assert dict(model.named_parameters()).keys() == params.keys()
    assert all(p is params[n] for n, p in model.named_parameters())
    model.save_pretrained(tmp_path)
    plain = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert not any(isinstance(m, NormReplacement) for m in plain.modules())
    with torch.no_grad():
        torch.testing.assert_close(plain(ids).logits, logits, rtol=1e-5, atol=1e-5)

    handle.undo()
    assert not any(isinstance(m, NormReplacement) for m in model.modules())
    after = _state(model)
    assert after.keys() == before.keys()
    assert all(torch.equal(after[k], before[k]) for k in before)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, logits)


def test_the_report_names_what_was_swapped_and_what_stays() -> None:
    model = _model("qwen3_next")
    with layerswap.swap(model, "qwen3_next.norm.fused") as handle:
        report = handle.report()
        assert "Qwen3NextRMSNorm -> rms_offset" in report
        # the gated norm of the linear-attention layers takes a second tensor: kept
        assert "Qwen3NextRMSNormGated" in handle.kept
        assert "not one tensor alone" in handle.kept["Qwen3NextRMSNormGated"][1]
    assert not handle.active


def test_use_builds_and_loads_with_the_norms_swapped(tmp_path: Path) -> None:
    original = _model("deepseek_v3")
    ids = _ids(original)
    with torch.no_grad():
        expected = original(ids).logits
    original.save_pretrained(tmp_path)
    with layerswap.use("deepseek_v3.norm.fused"):
        loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
        built = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tmp_path))
    for model in (loaded, built):
        assert any(isinstance(m, NormReplacement) for m in model.modules())
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, expected, rtol=1e-5, atol=1e-5)
    # a model built after the block has the original norms
    assert not any(
        isinstance(m, NormReplacement)
        for m in AutoModelForCausalLM.from_config(original.config).modules()
    )


def test_verify_compares_a_norm_swap_with_the_original() -> None:
    report = layerswap.verify(_model("llama4_text"), "llama4_text.norm.fused")
    assert report.passed, report


def test_a_registered_family_takes_the_norm_slot_beside_its_decoder() -> None:
    model = layerswap.get_family("llama").build()
    ids = _ids(model)
    with torch.no_grad():
        expected = model(ids).logits
    decoder = layerswap.swap(model, "llama.decoder.fused")
    norms = layerswap.swap(model, "llama.norm.fused")
    # the fused layers have their own norms; the final norm is the original's class
    assert [name for name, _, _ in norms.swapped] == ["model.norm"]
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, expected, rtol=1e-4, atol=1e-5)
    norms.undo()
    decoder.undo()
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, expected, rtol=0, atol=0)


# --- refused, changing nothing ------------------------------------------------------------


def test_swapping_twice_is_refused() -> None:
    model = _model("qwen3_next")
    with (
        layerswap.swap(model, "qwen3_next.norm.fused"),
        pytest.raises(SubstitutionError, match=r"already swapped by qwen3_next\.norm\.fused"),
    ):
        layerswap.swap(model, "qwen3_next.norm.fused")


def test_two_threads_swapping_one_model_do_not_both_succeed() -> None:
    """Each round, two threads swap the same model at once: one swap takes it, the other
    is refused as already swapped, and undoing the one that took it leaves the original."""
    import sys
    import threading

    model = layerswap.get_family("llama").build(seed=0)
    originals = {name: type(m) for name, m in model.named_modules()}
    layerswap.swap(model, "llama.norm.fused").undo()  # proven once, before the rounds
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as the interpreter can
    try:
        for _ in range(30):
            barrier = threading.Barrier(2)
            handles: list[Any] = []
            refused: list[BaseException] = []

            def one(barrier: Any, handles: list[Any], refused: list[BaseException]) -> None:
                barrier.wait()
                try:
                    handles.append(layerswap.swap(model, "llama.norm.fused"))
                except SubstitutionError as exc:
                    refused.append(exc)

            threads = [
                threading.Thread(target=one, args=(barrier, handles, refused)) for _ in range(2)
            ]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            assert len(handles) == 1 and len(refused) == 1, (handles, refused)
            assert "already swapped" in str(refused[0])
            handles[0].undo()
            assert {name: type(m) for name, m in model.named_modules()} == originals
    finally:
        sys.setswitchinterval(interval)


def test_a_norm_whose_forward_is_set_on_the_instance_is_kept_with_the_reason() -> None:
    """accelerate's hooks (dispatch_model, an offloading device_map) set ``forward`` on the
    instance, which a class swap would not reach: that norm is kept, the others swapped."""
    from accelerate.hooks import ModelHook, add_hook_to_module

    model = layerswap.get_family("llama").build(seed=0)
    add_hook_to_module(model.model.norm, ModelHook())
    ids = torch.randint(3, 500, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = model(ids).logits
    with layerswap.swap(model, "llama.norm.fused") as handle:
        assert not isinstance(model.model.norm, NormReplacement)
        assert isinstance(model.model.layers[0].input_layernorm, NormReplacement)
        count, reason = handle.kept["LlamaRMSNorm"]
        assert count == 1 and "forward is set on the instance (an accelerate hook)" in reason
        with torch.no_grad():
            torch.testing.assert_close(model(ids).logits, expected, rtol=0, atol=0)
    add_hook_to_module(model.model.layers[0].input_layernorm, ModelHook())
    for layer in model.model.layers:
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            add_hook_to_module(norm, ModelHook())
    with pytest.raises(SubstitutionError, match="forward is set on the instance"):
        layerswap.swap(model, "llama.norm.fused")


def test_a_model_type_without_norms_of_its_own_is_refused_with_the_reason() -> None:
    with pytest.raises(UnknownSubstitutionError, match="no norm class"):
        layerswap.get("gpt2.norm.fused")


def test_a_model_whose_norms_none_computes_is_refused_unchanged() -> None:
    model = _model("dory")
    classes = {type(m) for m in model.modules()}
    with pytest.raises(SubstitutionError, match="DoryL2Norm"):
        layerswap.swap(model, layerswap.get("dory.norm.fused"))
    assert {type(m) for m in model.modules()} == classes


def test_a_class_computing_another_kind_under_other_settings_gets_the_kernel_of_each() -> None:
    """Qwen4-Exp's RMSNorm normalises each group of channels on its own in its
    hyper-connections (``group_size``) and all channels together in its attention: each
    instance gets the kind its setting computes, grouped or not."""
    model = _model("qwen4_exp_text")
    ids, before = _ids(model), _state(model)
    with torch.no_grad():
        expected = model(ids).logits

    handle = layerswap.swap(model, "qwen4_exp_text.norm.fused")

    swapped = [m for m in model.modules() if isinstance(m, NormReplacement)]
    grouped = [m for m in swapped if getattr(m, "group_size", None) is not None]
    plain = [m for m in swapped if getattr(m, "group_size", None) is None]
    assert grouped and plain
    assert {m._layerswap_spec.kind for m in grouped} == {"rms_offset_grouped"}
    assert {m._layerswap_spec.kind for m in plain} == {"rms_offset"}
    assert "Qwen4ExpTextRMSNorm -> rms_offset_grouped, rms_offset" in handle.report()
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, expected)
    handle.undo()
    assert not any(isinstance(m, NormReplacement) for m in model.modules())
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())


def test_a_grouped_norm_is_read_with_its_group_size_and_liger_keeps_it() -> None:
    from layerswap.backends.liger.norm import LigerNorm

    class Grouped(_NamedRMSButOffset):
        def __init__(self) -> None:
            super().__init__(16)
            self.group_size = 4

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            parts = x.float().reshape(*x.shape[:-1], -1, self.group_size)
            normed = parts * torch.rsqrt(parts.pow(2).mean(-1, keepdim=True) + self.eps)
            return (normed.flatten(-2) * (1.0 + self.weight.float())).type_as(x)

    spec = classify(Grouped())
    assert not isinstance(spec, str)
    assert (spec.kind, spec.group_name) == ("rms_offset_grouped", "group_size")
    assert "liger backend lacks" in str(LigerNorm.refusal(spec))


@pytest.mark.parametrize("model_type", ["beam", "blt"])
def test_model_types_whose_defaults_build_no_tiny_model_swap_their_norms(model_type: str) -> None:
    """Beam keys its rotary parameters per layer type, full attention to none; BLT's hashed
    byte-group embeddings hold 500,002 rows each by default: both get a tiny model."""
    from layerswap.model_types import bare_family

    family = bare_family(model_type)
    model = family.build(seed=0)
    assert sum(p.numel() for p in model.parameters()) < 10_000_000
    if model_type == "beam":
        assert family.tiny_config().rope_parameters["full_attention"] is None

    report = layerswap.verify(model, f"{model_type}.norm.fused")

    assert report.passed, report.summary()
    handle = layerswap.swap(model, f"{model_type}.norm.fused")
    assert len(handle) > 0 and not handle.kept
    handle.undo()


def test_the_first_use_proof_catches_a_wrong_kernel() -> None:
    """A backend whose kernel for Llama's norm forgets the weight: its proof fails and the
    swap is refused before the model changes."""

    class Forgetful(NormReplacement):
        backend = "forgetful"
        kernels = {"rms": lambda x, w, b, eps: KINDS["rms"](x, None, b, eps)}

    base = layerswap.get("llama.norm.fused")
    sub = dataclasses.replace(base, name="llama.norm.forgetful", replacement=Forgetful)
    model = layerswap.get_family("llama").build()
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(UpstreamDriftError, match=r"llama\.norm\.forgetful"):
        layerswap.swap(model, sub)
    assert not any(isinstance(m, NormReplacement) for m in model.modules())
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())


def test_inside_a_proof_a_swap_is_not_proven_again() -> None:
    model = _model("qwen3_next")
    with comparing():
        handle = layerswap.swap(model, "qwen3_next.norm.fused")
    assert len(handle) > 0
    handle.undo()


# --- what coverage says -------------------------------------------------------------------


def test_model_coverage_names_the_norms_the_slot_replaces() -> None:
    from layerswap.coverage import model_coverage

    row = {r.substitution: r for r in model_coverage("qwen3").rows}["qwen3.norm.fused"]
    assert row.unsupported is None
    layers = layerswap.get_family("qwen3").tiny_config().num_hidden_layers
    # two per layer and its q/k norms, and the final norm
    assert row.replaces == (f"the norms (Qwen3RMSNorm x{4 * layers + 1})",)


@pytest.mark.slow  # every model type of the installed transformers, on the meta device
def test_list_all_counts_the_model_types_with_something_swapped() -> None:
    report = coverage_report()
    swapped = [t for t, row in report.items() if row.swapped]
    alone = [t for t in swapped if not report[t].covered]
    # transformers 5.24: 75 by a family's decoder layers, 126 more by their norms, MLPs,
    # experts, attention projections or head alone (77 of them by their norms)
    assert len(swapped) >= 201, (len(swapped), len(alone))
    assert sum("norm" in report[t].below_decoder for t in alone) >= 77
    for model_type in POPULAR:
        assert "fused" in report[model_type].below_decoder["norm"], model_type
    assert "torch's own norms" in str(report["gpt2"].slots["norm"]["fused"])
    # every model type the list says the fused norm takes was proven by the sweep
    listed_and_swept("norm", "norms")


def test_the_liger_norm_expresses_every_rms_kind_and_needs_a_gpu_here() -> None:
    from layerswap.backends.liger.norm import LigerNorm

    assert {k for k in KINDS if k.startswith("rms")} == set(LigerNorm.kernels)
    sub = layerswap.get("qwen3_next.norm.liger")
    assert sub.devices == ("cuda",)
    if not torch.cuda.is_available():
        assert sub.unmet_requirement() is not None
        model = _model("qwen3_next")
        with pytest.raises(layerswap.errors.RequirementError, match="cannot run here"):
            layerswap.swap(model, sub)
        assert not any(isinstance(m, NormReplacement) for m in model.modules())


def _liger_reason() -> str | None:
    from layerswap.backends.liger.runtime import unmet_requirement

    return unmet_requirement()


@pytest.mark.gpu
@pytest.mark.skipif(_liger_reason() is not None, reason=f"needs CUDA and liger ({_liger_reason()})")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("backend", ["fused", "liger"])
@pytest.mark.parametrize("model_type", POPULAR)
def test_on_a_gpu_the_norms_verify(model_type: str, backend: str, dtype: torch.dtype) -> None:
    report = layerswap.verify(
        _model(model_type),
        f"{model_type}.norm.{backend}",
        dtype=dtype,
        device="cuda",
        backward=True,
    )
    assert report.passed, report.summary()


# --- the contract's clients: torch.compile, PEFT -----------------------------------------


def _breaks(model: nn.Module, ids: torch.Tensor) -> tuple[int, int]:
    torch._dynamo.reset()
    explained = torch._dynamo.explain(model)(ids)
    return explained.graph_count, explained.graph_break_count


@pytest.mark.slow  # compiles twice
def test_compile_adds_no_graph_break_and_computes_the_same() -> None:
    model = layerswap.get_family("qwen3").build()
    ids = _ids(model)
    with torch.no_grad():
        expected = model(ids).logits
        before = _breaks(model, ids)
        with layerswap.swap(model, "qwen3.norm.fused"):
            assert _breaks(model, ids) == before
            compiled = torch.compile(model, backend="eager", fullgraph=True)
            torch.testing.assert_close(compiled(ids).logits, expected, rtol=1e-5, atol=1e-5)


def test_a_lora_adapter_moves_between_the_swapped_and_the_original_model(
    tmp_path: Path,
) -> None:
    from peft import LoraConfig, PeftModel, get_peft_model

    family = layerswap.get_family("llama")
    ids = _ids(family.build())
    swapped = family.build(seed=0)
    handle = layerswap.swap(swapped, "llama.norm.fused")
    config = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    peft_model = get_peft_model(swapped, config)
    with torch.no_grad():
        expected = peft_model(ids).logits
    peft_model.save_pretrained(tmp_path)
    handle.undo()
    # the adapter saved from the swapped model loads, every tensor, into a plain one
    plain = PeftModel.from_pretrained(family.build(seed=0), tmp_path)
    with torch.no_grad():
        torch.testing.assert_close(plain(ids).logits, expected, rtol=1e-5, atol=1e-5)


def test_the_command_line_patches_a_model_type_no_family_covers() -> None:
    from typer.testing import CliRunner

    from layerswap.cli import app

    result = CliRunner().invoke(app, ["patch", "--substitution", "qwen3_next.norm.fused"])
    assert result.exit_code == 0, result.output
    assert "11 norms swapped: Qwen3NextRMSNorm -> FusedNorm[Qwen3NextRMSNorm]" in result.output
    assert "PASS: the swapped model matches the original" in result.output
    wrong = CliRunner().invoke(
        app, ["patch", "--model", "llama", "--substitution", "qwen3_next.norm.fused"]
    )
    assert wrong.exit_code == 2 and "is for qwen3_next, not --model llama" in wrong.output


def test_a_model_built_inside_use_verifies_against_its_original() -> None:
    family = layerswap.get("llama4_text.norm.fused").parts.family
    with layerswap.use("llama4_text.norm.fused"):
        model = family.build(seed=0)
    assert any(isinstance(m, NormReplacement) for m in model.modules())
    report = layerswap.verify(model, "llama4_text.norm.fused", generate=2)
    assert report.passed, report.summary()
    # the model is left as it was built: its norms still swapped
    assert any(isinstance(m, NormReplacement) for m in model.modules())


def test_a_model_built_in_use_with_no_norm_the_backend_computes_says_so() -> None:
    from transformers.models.qwen3_next import modeling_qwen3_next as qwen3_next

    from layerswap.errors import SwapWarning

    class OnlyGated(qwen3_next.Qwen3NextPreTrainedModel):  # type: ignore[misc]
        """A model of the family whose only norm is a gated one (none computes it)."""

        def __init__(self, config: Any) -> None:
            super().__init__(config)
            self.gated = qwen3_next.Qwen3NextRMSNormGated(16)
            self.post_init()

    OnlyGated.__module__ = qwen3_next.__name__
    sub = layerswap.get("qwen3_next.norm.fused")
    with (
        layerswap.use(sub),
        pytest.warns(SwapWarning, match=r"built inside use\(\) with its original norms"),
    ):
        model = OnlyGated(sub.parts.family.tiny_config())
    assert type(model.gated) is qwen3_next.Qwen3NextRMSNormGated


def test_a_parametrized_norm_is_reported_kept_with_the_reason() -> None:
    """A norm ``torch.nn.utils.parametrize`` gave a class of its own is no candidate (its
    class is parametrize's): the report counts it among the kept ones, saying why, where it
    was left out without a word."""
    from torch.nn.utils import parametrize

    class Identity(nn.Module):
        def forward(self, weight: torch.Tensor) -> torch.Tensor:
            return weight

    model = layerswap.get_family("llama").build()
    parametrize.register_parametrization(
        model.model.layers[0].input_layernorm, "weight", Identity()
    )
    with layerswap.swap(model, "llama.norm.fused") as handle:
        assert handle.kept["LlamaRMSNorm"][0] == 1
        assert "parametrize" in handle.kept["LlamaRMSNorm"][1]
        assert "parametrize" in handle.report()


def test_a_model_swapped_without_a_handle_is_refused_with_the_way_back() -> None:
    """A model built inside use() has no handle to undo: the refusal of a second swap says
    how to give it its originals back, and that way works."""
    family = layerswap.get_family("llama")
    with layerswap.use("llama.norm.fused"):
        model = family.causal_lm_class()(family.tiny_config())
    advice = r"rebuild_originals\(model, 'llama\.norm\.fused'\)"
    with pytest.raises(SubstitutionError, match=advice):
        layerswap.swap(model, "llama.norm.fused")
    from layerswap.swap import rebuild_originals

    assert rebuild_originals(model, "llama.norm.fused") > 0
    layerswap.swap(model, "llama.norm.fused").undo()
