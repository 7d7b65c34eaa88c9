"""The ``te`` backend below the decoder layer: its ``norm`` slot (TransformerEngine's
RMSNorm kernel on the model's own norms) and its ``qkv`` slot (each attention's packed
projections as one TE ``Linear`` GEMM on the model's own weights).

Everything above the GPU section runs on any machine: the declaration, and the refusal
without TransformerEngine or CUDA with the model untouched. What the slots compute is
proven on a GPU only: the GPU section runs where CUDA and TransformerEngine are present
and is skipped (with the reason) elsewhere.
"""

from __future__ import annotations

import importlib.util
import sys
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import layerswap
from layerswap.backends import te
from layerswap.backends.norm import NormReplacement
from layerswap.backends.projections import is_packed
from layerswap.backends.te.norm import TENorm
from layerswap.backends.te.qkv import TEPackedGroup, TEProjections
from layerswap.errors import RequirementError
from layerswap.norms import KINDS, NormSpec
from layerswap.registry import families

te_installed = importlib.util.find_spec("transformer_engine") is not None
without_te = pytest.mark.skipif(te_installed, reason="TransformerEngine is installed here")

#: the model types whose tiny models the slots are checked on: Llama (rms), Gemma
#: ((1 + w) in float32), Qwen2 (q/k/v biases)
NORM_TYPES = ("llama", "gemma")
QKV_TYPES = ("llama", "qwen2")


def _model(name: str, seed: int = 0) -> nn.Module:
    family = families()[name]
    model = family.build(seed=seed)
    with torch.no_grad():
        for key, param in model.named_parameters():
            if "norm" in key and param.dim() == 1:
                param.add_(torch.randn_like(param), alpha=0.1)
    return model.eval()


def _snapshot(model: nn.Module) -> dict[str, tuple[torch.Tensor, int, torch.Tensor]]:
    return {
        key: (value, value.data_ptr(), value.detach().clone())
        for key, value in model.state_dict(keep_vars=True).items()
    }


def _unchanged(model: nn.Module, before: dict[str, Any], classes: dict[str, type]) -> None:
    """``model`` holds the very tensors it held, at the same addresses and bitwise the same
    values, and every module its class."""
    after = model.state_dict(keep_vars=True)
    assert sorted(after) == sorted(before)
    for key, (tensor, address, values) in before.items():
        assert after[key] is tensor, key
        assert after[key].data_ptr() == address, key
        assert torch.equal(after[key], values), key
    assert {name: type(m) for name, m in model.named_modules()} == classes


# --- the declaration -----------------------------------------------------------------------


def test_te_declares_the_norm_and_qkv_slots_and_no_mlp() -> None:
    slots = te.BACKEND.slots
    assert {"decoder", "norm", "qkv"} <= set(slots)
    # TE's gated activations take gate and up as the halves of one tensor: the mlp slot
    # keeps the model's gate and up projections apart, so TE would need a copy of both
    assert "mlp" not in slots and "experts" not in slots
    assert "RMSNorm kernel" in slots["norm"].description
    assert "TE Linear GEMM" in slots["qkv"].description
    for slot in ("norm", "qkv"):
        assert "GPU only" in slots[slot].description


def test_the_te_slots_take_the_model_types_the_other_backends_take() -> None:
    def types(backend: str, slot: str) -> set[str]:
        return {offer.family for offer in layerswap.registry.offers(backend=backend, slot=slot)}

    norms = types("te", "norm")
    assert {"llama", "qwen3", "gemma", "mistral"} <= norms
    # TE computes every RMS kind but one (all in the input's dtype), which no model
    # type's norms compute alone
    assert norms <= types("liger", "norm")
    assert not norms & {"gpt2", "opt"}  # torch's own LayerNorms only
    qkv = types("te", "qkv")
    # the packing is the fused backend's: the same attentions, another GEMM
    assert qkv == types("fused", "qkv")
    assert {"llama", "qwen2", "qwen3"} <= qkv
    # and model types no family covers, by name: a hybrid, multi-head latent attention
    for name in (
        "llama.norm.te",
        "gemma.norm.te",
        "llama.qkv.te",
        "qwen3_next.norm.te",
        "qwen3_next.qkv.te",
        "deepseek_v3.qkv.te",
    ):
        sub = layerswap.get(name)
        assert sub.backend == "te" and sub.devices == ("cuda",)


def test_the_te_norm_computes_the_rms_kinds_te_normalises_in_float32() -> None:
    assert set(TENorm.kernels) == {"rms", "rms_float", "rms_offset", "rms_offset_cast"}
    assert set(TENorm.kernels) < set(KINDS)
    native = NormSpec("rms_native", "eps")
    assert "rms_native, which the te backend lacks" in str(TENorm.refusal(native))
    assert "te backend lacks" in str(TENorm.refusal(NormSpec("layer_float", "eps")))
    assert TENorm.refusal(NormSpec("rms_offset", "eps")) is None
    assert TEProjections.refusal(SimpleNamespace(kind="packed")) is None


@without_te
def test_on_this_machine_the_te_slots_say_transformer_engine_is_missing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # what another test's stand-in package may have left imported is not an installation
    for name in [m for m in sys.modules if m.partition(".")[0] == "transformer_engine"]:
        monkeypatch.delitem(sys.modules, name)
    for name in ("llama.norm.te", "qwen3_next.norm.te", "llama.qkv.te"):
        assert layerswap.get(name).unmet_requirement() == te.NOT_INSTALLED, name
    assert "TransformerEngine" in te.NOT_INSTALLED


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is visible here")
@pytest.mark.parametrize("slot", ["norm", "qkv"])
@pytest.mark.parametrize("name", ["llama", "gemma"])
def test_without_a_gpu_a_te_slot_swap_is_refused_and_the_model_is_untouched(
    name: str, slot: str
) -> None:
    model = _model(name)
    before = _snapshot(model)
    classes = {key: type(m) for key, m in model.named_modules()}
    sub = layerswap.get(f"{name}.{slot}.te")
    reason = sub.unmet_requirement()
    assert reason is not None
    # TE not installed, or installed without a visible CUDA device
    assert reason in (te.NOT_INSTALLED, te.NO_CUDA)
    with pytest.raises(RequirementError, match="cannot run here") as refused:
        layerswap.swap(model, sub)
    assert reason in str(refused.value)
    _unchanged(model, before, classes)
    assert not any(isinstance(m, NormReplacement) or is_packed(m) for m in model.modules())


def test_the_list_shows_the_te_slots_with_their_reason() -> None:
    from typer.testing import CliRunner

    from layerswap.cli import app

    result = CliRunner().invoke(app, ["list", "--family", "llama"])
    assert result.exit_code == 0, result.output
    lines = {line.split()[0]: line for line in result.output.splitlines() if line.strip()}
    for name in ("llama.norm.te", "llama.qkv.te"):
        assert name in lines, result.output
        reason = layerswap.get(name).unmet_requirement()
        if reason is not None:
            assert "no: " in lines[name] and reason[:30] in lines[name]


# --- on a CPU tensor ----------------------------------------------------------------------


def test_a_te_product_on_a_cpu_tensor_is_refused_with_the_way_out() -> None:
    q, k = nn.Linear(8, 8, bias=False), nn.Linear(8, 8, bias=False)
    group = TEPackedGroup([q, k], ("q_proj", "k_proj"), False, "llama.qkv.te")
    with pytest.raises(RequirementError, match=r"llama\.qkv\.te \(TEProjections\) runs Transf"):
        group.product(torch.randn(1, 8), [q.weight, k.weight], tracked=False)


# --- GPU: CUDA and TransformerEngine --------------------------------------------------------

_TE_REASON = te.unmet_requirement()
requires_te = pytest.mark.skipif(
    _TE_REASON is not None, reason=f"needs CUDA and TransformerEngine ({_TE_REASON})"
)

GPU_CASES = [(name, "norm") for name in NORM_TYPES] + [(name, "qkv") for name in QKV_TYPES]


def _ids(model: nn.Module, length: int = 32) -> torch.Tensor:
    vocab = model.config.get_text_config().vocab_size
    gen = torch.Generator().manual_seed(0)
    return torch.randint(3, vocab, (2, length), generator=gen).cuda()


@pytest.mark.gpu
@requires_te
@pytest.mark.parametrize(("name", "slot"), GPU_CASES, ids=[f"{n}.{s}" for n, s in GPU_CASES])
def test_on_a_gpu_each_te_slot_matches_the_original_in_bf16_and_undoes_bitwise(
    name: str, slot: str
) -> None:
    model = _model(name).to("cuda", torch.bfloat16)
    ids = _ids(model)
    with torch.no_grad():
        expected = model(ids, use_cache=False).logits.float()
    before = {key: value.clone() for key, value in model.state_dict().items()}
    classes = {key: type(m) for key, m in model.named_modules()}
    handle = layerswap.swap(model, f"{name}.{slot}.te")
    if slot == "norm":
        assert any(isinstance(m, TENorm) for m in model.modules())
    else:
        attention = next(m for m in model.modules() if isinstance(m, TEProjections))
        with torch.no_grad():
            model(ids, use_cache=False)
        group = attention._layerswap_groups[0]
        linear = group._linear[1]
        # one TE GEMM on the model's own, packed parameters
        for weight_name, member in zip(linear.weight_names, group.members, strict=True):
            assert linear._parameters[weight_name] is member.weight
        assert group.packed()
    with torch.no_grad():
        got = model(ids, use_cache=False).logits.float()
    scale = expected.abs().max().item()
    assert (got - expected).abs().max().item() <= 2e-2 * scale + 1e-2
    cosine = F.cosine_similarity(got.flatten(0, 1), expected.flatten(0, 1), dim=-1)
    assert cosine.min().item() > 0.995
    handle.undo()
    after = model.state_dict()
    for key, value in before.items():
        assert torch.equal(after[key], value), key
    assert {key: type(m) for key, m in model.named_modules()} == classes


@pytest.mark.gpu
@requires_te
@pytest.mark.parametrize(("name", "slot"), GPU_CASES, ids=[f"{n}.{s}" for n, s in GPU_CASES])
def test_on_a_gpu_each_te_slot_verifies_with_gradients(name: str, slot: str) -> None:
    report = layerswap.verify(
        _model(name), f"{name}.{slot}.te", dtype=torch.bfloat16, device="cuda", backward=True
    )
    assert report.passed, report.summary()


@pytest.mark.gpu
@requires_te
def test_on_a_gpu_the_packed_projections_run_in_fp8_inside_the_autocast() -> None:
    reason = te.fp8_unmet_requirement("current")
    if reason is not None:
        pytest.skip(reason)
    model = _model("llama").to("cuda", torch.bfloat16)
    ids = _ids(model, 64)
    with torch.no_grad():
        expected = model(ids, use_cache=False).logits.float()
    with layerswap.swap(model, "llama.qkv.te"), torch.no_grad():
        bf16 = model(ids, use_cache=False).logits.float()
        with te.fp8_autocast("current"):
            fp8 = model(ids, use_cache=False).logits.float()
        attention = next(m for m in model.modules() if isinstance(m, TEProjections))
        linear = attention._layerswap_groups[0]._linear[1]
        assert linear.fp8  # the last call ran TE's FP8 GEMM
    assert not torch.equal(fp8, bf16)
    cosine = F.cosine_similarity(fp8.flatten(0, 1), expected.flatten(0, 1), dim=-1)
    assert cosine.min().item() > 0.95
