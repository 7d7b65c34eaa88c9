"""The ``mlp`` slot: what each gated MLP computes, named by running it; its activation and
product swapped for one kernel, exactly, on the models the decoder slot refuses (hybrids,
multi-head latent attention, Llama 4, Gemma 4) and on every family."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from test_norm_slot import _ids, _liger_reason, _state, coverage_report, listed_and_swept
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM

import layerswap
from layerswap.backends.fused.mlp import FusedMLP
from layerswap.backends.mlp import MLPReplacement
from layerswap.backends.norm import is_replaced_norm
from layerswap.errors import SubstitutionError, UnknownSubstitutionError, UpstreamDriftError
from layerswap.families.infer import model_type_classes, tiny_config_for
from layerswap.mlps import ACTIVATIONS, MLPSpec, classify
from layerswap.model_types import SWITCHED_ON

#: the model types people run in late 2026 whose MLPs the slot swaps (Nemotron-H's are
#: plain: test_a_model_with_plain_mlps_only_is_refused_unchanged)
POPULAR = (
    "qwen3_next",
    "qwen3_5_text",
    "falcon_h1",
    "lfm2",
    "jamba",
    "bamba",
    "granitemoehybrid",
    "deepseek_v2",
    "deepseek_v3",
    "deepseek_v4",
    "llama4_text",
    "gemma4_text",
    "gemma3n_text",
    "granitemoeshared",
    "hyperclovax",
)
FAST = ("qwen3_next", "deepseek_v3", "llama4_text")


def _model(model_type: str, seed: int = 0) -> nn.Module:
    """A tiny model of ``model_type`` as its bare family builds it (GraniteMoE-Shared with its
    shared expert MLP), its biases and norms away from their initial values."""
    classes = model_type_classes(model_type)
    config = tiny_config_for(classes.config_class, **SWITCHED_ON.get(model_type, {}))
    config._attn_implementation = "sdpa" if classes.causal_lm._supports_sdpa else "eager"
    torch.manual_seed(seed)
    model = classes.causal_lm(config)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 1:
                param.add_(torch.randn_like(param), alpha=0.1)
    return model.eval()


def _lanes() -> list[Any]:
    return [pytest.param(t, marks=() if t in FAST else pytest.mark.slow, id=t) for t in POPULAR]


def _mlps(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, MLPReplacement)]


# --- what an MLP computes, by running it --------------------------------------------------


class _Llama(nn.Module):
    def __init__(self, width: int = 16, inner: int = 24) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(width, inner, bias=False)
        self.up_proj = nn.Linear(width, inner, bias=False)
        self.down_proj = nn.Linear(inner, width, bias=False)
        self.act_fn = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class _SwappedNames(_Llama):
    """Called gate and up the other way round: what runs decides, not the names."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.up_proj(x)) * self.gate_proj(x))


class _InlinePacked(nn.Module):
    """Up first in one packed projection, GELU's tanh form applied inline, square: the
    inner width equals the model width, so every role fits every projection's shape."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.fc_in = nn.Linear(width, 2 * width)
        self.fc_out = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        up, gate = self.fc_in(x).chunk(2, dim=-1)
        return self.fc_out(F.gelu(gate, approximate="tanh") * up)


class _Scaled(_Llama):
    def __init__(self) -> None:
        super().__init__()
        self.gate_multiplier, self.down_multiplier = 0.5, 3.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.up_proj(x) * self.act_fn(self.gate_proj(x) * self.gate_multiplier)
        return self.down_proj(y) * self.down_multiplier


class _Clamped(_Llama):
    """Bounds the gate from above and up on both sides (DeepSeek V4's ``swiglu_limit``)."""

    def __init__(self) -> None:
        super().__init__()
        self.limit = 2.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.gate_proj(x).clamp(max=self.limit)
        up = self.up_proj(x).clamp(min=-self.limit, max=self.limit)
        return self.down_proj(self.act_fn(gate) * up)


class _PlainMLP(nn.Module):
    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.up_proj, self.down_proj = nn.Linear(width, 32), nn.Linear(32, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.relu(self.up_proj(x)))


class _DropoutMLP(_Llama):
    def __init__(self) -> None:
        super().__init__()
        self.dropout = nn.Dropout(0.1)


class _TopK(_Llama):
    """Keeps the largest activations only (as Gemma 3n's sparse layers do)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.gate_proj(x)
        gate = gate * (gate > gate.mean(-1, keepdim=True))
        return self.down_proj(self.act_fn(gate) * self.up_proj(x))


def test_a_gated_mlp_is_read_by_what_it_computes_not_by_its_names() -> None:
    llama = classify(_Llama())
    assert not isinstance(llama, str)
    assert (llama.kind, llama.gate, llama.up, llama.down, llama.act) == (
        "silu",
        "gate_proj",
        "up_proj",
        "down_proj",
        "act_fn",
    )
    swapped = classify(_SwappedNames())
    assert not isinstance(swapped, str) and (swapped.gate, swapped.up) == ("up_proj", "gate_proj")
    packed = classify(_InlinePacked())
    assert not isinstance(packed, str)
    assert (packed.kind, packed.layout, packed.gate, packed.down, packed.act) == (
        "gelu_tanh",
        "packed_up_first",
        "fc_in",
        "fc_out",
        "",
    )
    clamped = classify(_Clamped())
    assert not isinstance(clamped, str) and clamped.limit == "limit"
    assert clamped.label == "gated silu, clamped"
    # a module holding a bound it does not apply is read without it
    unused = _Llama()
    unused.limit = 2.0  # type: ignore[assignment]
    spec = classify(unused)
    assert not isinstance(spec, str) and spec.limit == ""
    scaled = classify(_Scaled())
    assert not isinstance(scaled, str)
    assert (scaled.gate_scale, scaled.down_scale) == ("gate_multiplier", "down_multiplier")


@pytest.mark.parametrize(
    ("module", "why"),
    [
        (_PlainMLP(), "plain MLP"),
        (_DropoutMLP(), "dropout"),
        (_TopK(), "no gated MLP"),
    ],
    ids=["plain", "dropout", "top-k"],
)
def test_what_the_slot_does_not_read_is_refused_with_the_reason(
    module: nn.Module, why: str
) -> None:
    reason = classify(module)
    assert isinstance(reason, str) and why in reason


def test_classifying_touches_nothing_and_reads_a_meta_module() -> None:
    mlp = _Llama()
    before = copy.deepcopy(mlp.state_dict())
    classify(mlp)
    assert all(torch.equal(mlp.state_dict()[k], v) for k, v in before.items())
    with torch.device("meta"):
        on_meta = _Llama()
    spec = classify(on_meta)
    assert not isinstance(spec, str) and spec.kind == "silu"


def test_the_fused_backend_computes_every_activation() -> None:
    assert set(FusedMLP.kernels) == {*ACTIVATIONS, "other"}


# --- swapped exactly ----------------------------------------------------------------------


def swaps_exactly(model: nn.Module, name: str, base: type, tmp_path: Path) -> None:
    """Swapping ``name`` into ``model`` leaves its logits, its greedy generation and its
    parameters as they were, saves the original layout, and undoes bitwise; the swapped
    modules are ``base``'s (a class-swapping slot's replacement base)."""

    def swapped() -> list[nn.Module]:
        return [m for m in model.modules() if isinstance(m, base)]

    ids = _ids(model)
    before = _state(model)
    params = dict(model.named_parameters())
    with torch.no_grad():
        logits = model(ids).logits
    tokens = model.generate(ids, max_new_tokens=4, do_sample=False)

    handle = layerswap.swap(model, name)
    assert len(handle) > 0
    for module_name, original, made in handle.swapped:
        module = model.get_submodule(module_name)
        assert type(module) is made and isinstance(module, original)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, logits)
    assert torch.equal(model.generate(ids, max_new_tokens=4, do_sample=False), tokens)
    # the very same parameters under the same names: the original layout is what is saved
    assert all(p is params[n] for n, p in model.named_parameters())
    model.save_pretrained(tmp_path)
    plain = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert not [m for m in plain.modules() if isinstance(m, base)]
    with torch.no_grad():
        torch.testing.assert_close(plain(ids).logits, logits, rtol=1e-5, atol=1e-5)

    handle.undo()
    assert not swapped()
    after = _state(model)
    assert all(torch.equal(after[k], before[k]) for k in before)


@pytest.mark.parametrize("model_type", _lanes())
def test_a_popular_model_swaps_its_mlps_exactly(model_type: str, tmp_path: Path) -> None:
    swaps_exactly(_model(model_type), f"{model_type}.mlp.fused", MLPReplacement, tmp_path)


def _train_step(model: nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
    model.train()
    model.zero_grad()
    loss = model(ids, labels=ids).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads


def test_training_computes_the_original_gradients_keeping_less() -> None:
    """The loss and every gradient are the original's, bit for bit; the activation's output
    is recomputed in the backward pass, not kept: one ``tokens x intermediate`` tensor fewer
    per MLP, for every one of them."""
    family = layerswap.get_family("llama")
    model = family.build(seed=0)
    config = model.config
    ids = _ids(model)

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
    with layerswap.swap(model, "llama.mlp.fused"):
        swapped_loss, swapped_grads = _train_step(model, ids)
        swapped = saved_bytes()
    assert torch.equal(swapped_loss, loss)
    assert swapped_grads.keys() == grads.keys()
    assert all(torch.equal(swapped_grads[n], grads[n]) for n in grads)
    per_mlp = ids.numel() * config.intermediate_size * 4  # float32
    assert original - swapped == config.num_hidden_layers * per_mlp


def test_gradient_checkpointing_around_the_layers_still_gives_the_same_gradients() -> None:
    model = layerswap.get_family("qwen3").build(seed=0)
    ids = _ids(model)
    model.gradient_checkpointing_enable()
    loss, grads = _train_step(model, ids)
    with layerswap.swap(model, "qwen3.mlp.fused"):
        swapped_loss, swapped_grads = _train_step(model, ids)
    assert torch.equal(swapped_loss, loss)
    assert all(torch.equal(swapped_grads[n], grads[n]) for n in grads)


def test_the_report_names_what_was_swapped_and_what_stays() -> None:
    model = _model("gemma3n_text")
    with layerswap.swap(model, "gemma3n_text.mlp.fused") as handle:
        report = handle.report()
        assert "Gemma3nTextMLP -> gated gelu_tanh" in report
        # its first layer keeps its largest activations only: kept, with the reason
        count, reason = handle.kept["Gemma3nTextMLP"]
        assert count == 1 and "no gated MLP" in reason
        assert not isinstance(model.model.layers[0].mlp, MLPReplacement)
    assert not handle.active


def test_falcon_h1s_multipliers_are_kept_in_their_places() -> None:
    model = _model("falcon_h1")
    mlp = model.model.layers[0].feed_forward
    assert (mlp.gate_multiplier, mlp.down_multiplier) == (0.5, 0.75)
    ids = _ids(model)
    with torch.no_grad():
        expected = model(ids).logits
    with layerswap.swap(model, "falcon_h1.mlp.fused") as handle:
        assert "FalconH1MLP -> gated silu, scaled" in handle.report()
        with torch.no_grad():
            assert torch.equal(model(ids).logits, expected)


def test_use_builds_and_loads_with_the_mlps_swapped(tmp_path: Path) -> None:
    original = _model("deepseek_v3")
    ids = _ids(original)
    with torch.no_grad():
        expected = original(ids).logits
    original.save_pretrained(tmp_path)
    with layerswap.use("deepseek_v3.mlp.fused"):
        loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
        built = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tmp_path))
    assert _mlps(loaded) and _mlps(built)
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, expected)
    assert not _mlps(AutoModelForCausalLM.from_config(original.config))


def test_verify_compares_an_mlp_swap_with_the_original() -> None:
    report = layerswap.verify(_model("llama4_text"), "llama4_text.mlp.fused", backward=True)
    assert report.passed, report.summary()


@pytest.mark.parametrize(
    ("model_type", "other", "rtol", "mlps_first"),
    [("qwen3_next", "norm", 1e-5, False), ("llama", "decoder", 1e-4, True)],
    ids=["norms", "decoder-after"],
)
def test_another_slot_swapped_after_the_mlps_composes_and_both_undo_in_any_order(
    model_type: str, other: str, rtol: float, mlps_first: bool
) -> None:
    """The norms beside the MLPs, or the decoder layers taking layers whose MLPs are
    swapped: the model computes the same, and undoing both, in either order, gives back
    the original bit for bit."""
    model = _model(model_type) if model_type != "llama" else layerswap.get_family("llama").build()
    ids, before = _ids(model), _state(model)
    with torch.no_grad():
        expected = model(ids).logits
    mlps = layerswap.swap(model, f"{model_type}.mlp.fused")
    second = layerswap.swap(model, f"{model_type}.{other}.fused")
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, expected, rtol=rtol, atol=1e-5)
    for handle in (mlps, second) if mlps_first else (second, mlps):
        handle.undo()
    assert not _mlps(model)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, expected)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())


# --- refused, changing nothing ------------------------------------------------------------


def test_swapping_twice_is_refused() -> None:
    model = _model("qwen3_next")
    with (
        layerswap.swap(model, "qwen3_next.mlp.fused"),
        pytest.raises(SubstitutionError, match=r"already swapped by qwen3_next\.mlp\.fused"),
    ):
        layerswap.swap(model, "qwen3_next.mlp.fused")


def test_a_model_with_plain_mlps_only_is_refused_with_the_reason() -> None:
    with pytest.raises(UnknownSubstitutionError, match="plain MLP"):
        layerswap.get("nemotron_h.mlp.fused")


def test_an_mlp_applying_dropout_as_a_function_in_training_is_refused() -> None:
    """Seed-OSS's MLP ends with ``F.dropout(down, residual_dropout, training=...)``: read in
    eval mode it is a gated MLP, but a replacement would drop that dropout in training."""
    with pytest.raises(UnknownSubstitutionError, match="random in training"):
        layerswap.get("seed_oss.mlp.fused")


def test_the_users_hooks_neither_see_the_reading_nor_change_it() -> None:
    """Reading what a module computes runs copies of it on random weights: a hook on the
    module (capturing activations, steering them) is not called by those runs, and one
    that changes the output does not make the module unreadable."""
    model = layerswap.get_family("mistral").build()
    calls: list[str] = []
    mlp = model.model.layers[0].mlp
    mlp.register_forward_hook(lambda module, args, out: calls.append("mlp"))
    steering = model.model.layers[1].mlp.register_forward_hook(lambda module, a, out: out * 2)
    norm = model.model.norm
    norm.register_forward_hook(lambda module, args, out: calls.append("norm"))
    with layerswap.swap(model, "mistral.mlp.fused") as handle:
        assert len(handle) == model.config.num_hidden_layers
    with layerswap.swap(model, "mistral.norm.fused"):
        pass
    assert calls == []
    steering.remove()


def test_a_hook_on_the_activation_runs_once_and_a_random_one_gives_the_same_gradients() -> None:
    """The activation is recomputed in the backward pass, except where its module has
    hooks: they run once per step, as in the original, and a random one (dropout on the
    activation's output) draws once, so the gradients are the original's."""
    original = layerswap.get_family("llama").build()
    swapped = copy.deepcopy(original)
    layerswap.swap(swapped, "llama.mlp.fused")
    ids = _ids(original)
    calls = {"original": 0, "swapped": 0}
    grads = {}
    for name, model in (("original", original), ("swapped", swapped)):

        def noisy(module: nn.Module, args: Any, out: torch.Tensor, name: str = name) -> Any:
            calls[name] += 1
            return F.dropout(out, 0.5, training=True)

        model.model.layers[0].mlp.act_fn.register_forward_hook(noisy)
        torch.manual_seed(0)
        _, grads[name] = _train_step(model, ids)
    assert calls["original"] == calls["swapped"] == 1
    for key, expected in grads["original"].items():
        assert torch.equal(grads["swapped"][key], expected), key


def test_the_projections_are_called_in_the_originals_order() -> None:
    """Falcon-H1 calls its up projection before the gate: the swapped MLP does too, so a
    random layer wrapping both (LoRA's dropout) draws as in the original, and training
    gives the original's loss bit for bit."""
    from peft import LoraConfig, get_peft_model

    model = _model("falcon_h1")
    spec = classify(model.model.layers[0].feed_forward)
    assert isinstance(spec, MLPSpec) and spec.up_first
    llama = classify(layerswap.get_family("llama").build().model.layers[0].mlp)
    assert isinstance(llama, MLPSpec) and not llama.up_first
    original = copy.deepcopy(model)
    layerswap.swap(model, "falcon_h1.mlp.fused")
    config = {"target_modules": ["gate_proj", "up_proj"], "lora_dropout": 0.3}
    losses = []
    for each in (original, model):
        torch.manual_seed(0)
        adapted = get_peft_model(each, LoraConfig(**config, init_lora_weights=False))
        adapted.train()
        torch.manual_seed(5)
        losses.append(adapted(input_ids=_ids(each), labels=_ids(each)).loss)
    assert torch.equal(losses[0], losses[1])


def test_undo_after_accelerate_hooks_refuses_then_works_once_they_are_removed() -> None:
    """accelerate's hooks, added after the swap as docs advise, set each module's forward
    on the instance, calling the replacement's: undo refuses (changing nothing) until they
    are removed, then leaves the original classes and a model that runs."""
    from accelerate import cpu_offload
    from accelerate.hooks import remove_hook_from_module

    model = layerswap.get_family("llama").build()
    ids = _ids(model)
    with torch.no_grad():
        expected = model(ids).logits
    # the norms hold their weights themselves: accelerate hooks them (an MLP's linears)
    handle = layerswap.swap(model, "llama.norm.fused")
    cpu_offload(model, execution_device=torch.device("cpu"))
    with pytest.raises(SubstitutionError, match="remove_hook_from_module"):
        handle.undo()
    assert any(map(is_replaced_norm, model.modules()))
    remove_hook_from_module(model, recurse=True)
    handle.undo()
    assert not any(map(is_replaced_norm, model.modules()))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, expected)


def test_after_the_decoder_slot_no_original_mlp_is_left_to_swap() -> None:
    model = layerswap.get_family("llama").build()
    classes = {type(m) for m in model.modules()}
    with layerswap.swap(model, "llama.decoder.fused"):
        classes = {type(m) for m in model.modules()}
        with pytest.raises(SubstitutionError, match=r"decoder layers are llama\.decoder\.fused's"):
            layerswap.swap(model, "llama.mlp.fused")
        assert {type(m) for m in model.modules()} == classes


def test_a_decoder_swap_that_rebuilds_moe_blocks_refuses_a_swapped_shared_expert() -> None:
    """Qwen2-MoE's fused layer builds its MoE block anew from the original's classes: the
    shared expert's MLP swapped before would silently run the original's code while the
    layers are swapped, so the decoder swap is refused, naming it, and changes nothing."""
    model = layerswap.get_family("qwen2_moe").build(seed=0)
    ids = _ids(model)
    with torch.no_grad():
        expected = model(ids).logits
    with layerswap.swap(model, "qwen2_moe.mlp.fused") as handle:
        assert any("shared_expert" in name for name, _, _ in handle.swapped)
        with pytest.raises(
            SubstitutionError, match=r"shared_expert is swapped by qwen2_moe\.mlp\.fused"
        ):
            layerswap.swap(model, "qwen2_moe.decoder.fused")
        assert layerswap.get_slot("decoder").swapped_by(model) is None
    with torch.no_grad():
        assert torch.equal(model(ids).logits, expected)


def test_an_mlp_inside_a_layer_a_live_decoder_swap_rebuilt_is_refused() -> None:
    """Qwen2-MoE's fused layer builds its MoE block anew: its shared expert's MLP swapped
    after the decoder swap would leave the model with the decoder's undo (the original
    layers come back), the mlp handle still saying "active" over nothing. Refused, naming
    the decoder swap, and nothing changes; after its undo the mlp slot swaps alone."""
    model = layerswap.get_family("qwen2_moe").build(seed=0)
    ids = _ids(model)
    with torch.no_grad():
        expected = model(ids).logits
    with layerswap.swap(model, "qwen2_moe.decoder.fused"):
        classes = [type(m) for m in model.modules()]
        with pytest.raises(
            SubstitutionError,
            match=r"shared_expert is inside model\.layers\.0, which qwen2_moe\.decoder\.fused "
            r"swapped: .*undo qwen2_moe\.decoder\.fused first",
        ):
            layerswap.swap(model, "qwen2_moe.mlp.fused")
        assert [type(m) for m in model.modules()] == classes
    with layerswap.swap(model, "qwen2_moe.mlp.fused") as handle:
        assert _mlps(model) and handle.active
        with torch.no_grad():
            torch.testing.assert_close(model(ids).logits, expected, rtol=1e-5, atol=1e-5)


def test_a_model_built_inside_use_of_a_decoder_swap_takes_the_mlp_slot() -> None:
    """A model built inside ``use()`` of the decoder slot has no swap to undo: its rebuilt
    MoE blocks are the model's own, and their MLPs swap and undo as anywhere else."""
    reference = layerswap.get_family("qwen2_moe").build(seed=0)
    ids = _ids(reference)
    with torch.no_grad():
        expected = reference(ids).logits
    with layerswap.use("qwen2_moe.decoder.fused"):
        model = layerswap.get_family("qwen2_moe").build(seed=0)
    model.load_state_dict(reference.state_dict())  # the original layout, converted on load
    with layerswap.swap(model, "qwen2_moe.mlp.fused") as handle:
        assert _mlps(model) and all("shared_expert" in name for name, _, _ in handle.swapped)
        with torch.no_grad():
            torch.testing.assert_close(model(ids).logits, expected, rtol=1e-4, atol=1e-4)
    assert not _mlps(model)


def test_a_slot_first_asked_inside_a_use_of_its_family_is_not_read_off_that_use(
    tmp_path: Path,
) -> None:
    """Asked first inside ``use("llama.decoder.fused")``, the mlp slot's reading of Llama
    would build a tiny model of fused layers (no LlamaMLP) and keep "no MLP class" on disk
    for every later process: it is not read there, and a later process reads Llama."""
    import os
    import subprocess
    import sys

    code = (
        "import layerswap\n"
        "with layerswap.use('llama.decoder.fused'):\n"
        "    print(layerswap.get('llama.mlp.fused').name)\n"
        "print(layerswap.get('llama.mlp.fused').name)\n"
    )
    env = {**os.environ, "LAYERSWAP_CACHE": str(tmp_path)}
    for _ in range(2):  # the second process reads what the first one kept
        done = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=False
        )
        assert done.returncode == 0, done.stderr[-2000:]
        assert done.stdout.split() == ["llama.mlp.fused", "llama.mlp.fused"]


@pytest.mark.parametrize("decoder_first", [True, False], ids=["decoder-first", "mlp-first"])
def test_use_of_the_decoder_and_mlp_slots_together_is_refused_at_build(decoder_first: bool) -> None:
    """The decoder slot's layers compute their own MLPs: a model built under both would
    have no MLP the mlp slot swapped, so building it is refused, not passed over."""
    family = layerswap.get_family("llama")
    first, second = "llama.decoder.fused", "llama.mlp.fused"
    if not decoder_first:
        first, second = second, first
    with (
        layerswap.use(first),
        layerswap.use(second),
        pytest.raises(SubstitutionError, match=r"llama\.mlp\.fused inside use\(\): .*decoder"),
    ):
        family.build(seed=0)
    # each alone builds
    with layerswap.use("llama.mlp.fused"):
        assert _mlps(family.build(seed=0))


def test_a_proof_refused_by_another_use_leaves_no_verdict(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under ``use("llama.mlp.fused")`` the decoder's first-use proof could not build its
    tiny original (the mlp slot refuses a model whose layers are fused): that was taken
    for a failed proof of ``llama.decoder.fused``, named so ("does not behave like the
    original") and kept, so every later swap in the process was refused. The mlp slot's
    own error is raised, and the decoder is proven at its next use."""
    from layerswap import proof

    monkeypatch.setenv("LAYERSWAP_CACHE", str(tmp_path / "proofs"))
    monkeypatch.setattr(proof, "_MEMO", {})
    family = layerswap.get_family("llama")
    with (
        layerswap.use("llama.mlp.fused"),
        pytest.raises(SubstitutionError) as refused,
        layerswap.use("llama.decoder.fused"),
    ):
        family.build(seed=0)
    assert not isinstance(refused.value, UpstreamDriftError), refused.value
    assert "llama.mlp.fused inside use()" in str(refused.value)
    assert proof._MEMO == {}
    layerswap.swap(family.build(seed=0), "llama.decoder.fused").undo()


def test_the_first_use_proof_catches_a_wrong_kernel() -> None:
    """A backend whose kernel forgets the activation's gradient: its proof fails and the
    swap is refused before the model changes."""

    def detached(gate: torch.Tensor, up: torch.Tensor, act: Any) -> torch.Tensor:
        return act(gate).detach() * up

    class Forgetful(MLPReplacement):
        backend = "forgetful"
        kernels = {"silu": detached}

    base = layerswap.get("llama.mlp.fused")
    sub = dataclasses.replace(base, name="llama.mlp.forgetful", replacement=Forgetful)
    model = layerswap.get_family("llama").build()
    with pytest.raises(UpstreamDriftError, match=r"llama\.mlp\.forgetful"):
        layerswap.swap(model, sub)
    assert not _mlps(model)


def test_the_liger_mlp_needs_a_gpu_here_and_names_what_it_lacks() -> None:
    from layerswap.backends.liger.mlp import LigerMLP
    from layerswap.mlps import MLPSpec

    relu = MLPSpec("relu", "separate", "gate_proj", "up_proj", "down_proj")
    assert "relu" in str(LigerMLP.refusal(relu))
    assert LigerMLP.refusal(dataclasses.replace(relu, kind="gelu_tanh")) is None
    sub = layerswap.get("qwen3_next.mlp.liger")
    assert sub.devices == ("cuda",)
    if not torch.cuda.is_available():
        model = _model("qwen3_next")
        with pytest.raises(layerswap.errors.RequirementError, match="cannot run here"):
            layerswap.swap(model, sub)
        assert not _mlps(model)


@pytest.mark.gpu
@pytest.mark.skipif(_liger_reason() is not None, reason=f"needs CUDA and liger ({_liger_reason()})")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("backend", ["fused", "liger"])
@pytest.mark.parametrize("model_type", POPULAR)
def test_on_a_gpu_the_mlps_verify(model_type: str, backend: str, dtype: torch.dtype) -> None:
    report = layerswap.verify(
        _model(model_type),
        f"{model_type}.mlp.{backend}",
        dtype=dtype,
        device="cuda",
        backward=True,
    )
    assert report.passed, report.summary()


# --- the contract's clients: torch.compile, PEFT, pickle ----------------------------------


def compiles_in_one_graph_to_the_same_gradients(model: nn.Module, substitution: str) -> None:
    """Swapped by ``substitution`` (its recomputed region a checkpoint dynamo traces),
    ``model`` compiles to one graph with no break and trains to its unswapped loss and
    gradients."""
    ids = _ids(model)
    loss, grads = _train_step(model, ids)

    def training_loss(ids: torch.Tensor) -> torch.Tensor:
        return model(ids, labels=ids).loss

    with layerswap.swap(model, substitution):
        torch._dynamo.reset()
        explained = torch._dynamo.explain(training_loss)(ids)
        assert (explained.graph_count, explained.graph_break_count) == (1, 0)
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="aot_eager")
        compiled_loss, compiled_grads = _train_step(compiled, ids)
    torch.testing.assert_close(compiled_loss, loss, rtol=1e-5, atol=1e-6)
    for name, grad in grads.items():
        torch.testing.assert_close(compiled_grads[f"_orig_mod.{name}"], grad, rtol=1e-4, atol=1e-6)


@pytest.mark.slow  # compiles three times
def test_compile_trains_the_swapped_model_to_the_same_gradients_in_one_graph() -> None:
    # the recomputed product is a checkpoint region dynamo traces: no graph break
    compiles_in_one_graph_to_the_same_gradients(
        layerswap.get_family("qwen3").build(seed=0), "qwen3.mlp.fused"
    )


def test_a_lora_adapter_on_the_projections_trains_and_moves_to_the_original(
    tmp_path: Path,
) -> None:
    from peft import LoraConfig, PeftModel, get_peft_model

    family = layerswap.get_family("llama")
    ids = _ids(family.build())
    config = LoraConfig(
        r=4, target_modules=["gate_proj", "up_proj", "down_proj"], init_lora_weights=False
    )
    torch.manual_seed(1)  # the adapter's random weights
    plain_peft = get_peft_model(family.build(seed=0), copy.deepcopy(config))
    expected_loss, expected_grads = _train_step(plain_peft, ids)

    swapped = family.build(seed=0)
    handle = layerswap.swap(swapped, "llama.mlp.fused")
    torch.manual_seed(1)
    peft_model = get_peft_model(swapped, config)
    # the LoRA layers run inside the swapped MLPs: same loss, same adapter gradients
    loss, grads = _train_step(peft_model, ids)
    assert _mlps(peft_model)
    torch.testing.assert_close(loss, expected_loss, rtol=0, atol=0)
    assert grads.keys() == expected_grads.keys()
    assert all(torch.equal(grads[n], expected_grads[n]) for n in grads)
    peft_model.eval()
    with torch.no_grad():
        expected = peft_model(ids).logits
    peft_model.save_pretrained(tmp_path)
    handle.undo()
    plain = PeftModel.from_pretrained(family.build(seed=0), tmp_path).eval()
    with torch.no_grad():
        torch.testing.assert_close(plain(ids).logits, expected, rtol=1e-5, atol=1e-5)


def test_mlps_whose_projections_an_adapter_wraps_already_are_refused_with_the_order() -> None:
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(
        layerswap.get_family("llama").build(seed=0),
        LoraConfig(r=4, target_modules=["gate_proj", "down_proj"]),
    )
    with pytest.raises(
        SubstitutionError,
        match=r"gate_proj \(peft\.tuners\.lora\.layer\.Linear\).*swap the mlp slot before",
    ):
        layerswap.swap(model.base_model.model, "llama.mlp.fused")
    assert not _mlps(model)


@pytest.mark.parametrize("slot", ["norm", "mlp", "experts"])
def test_a_model_whose_classes_are_swapped_pickles_and_copies_with_them(slot: str) -> None:
    """The class-swapping slots' classes are made at run time: torch.save and deepcopy
    of a swapped model make them again, and the copy computes the same."""
    import io

    model = _model("qwen3_next")
    ids = _ids(model)
    handle = layerswap.swap(model, f"qwen3_next.{slot}.fused")
    with torch.no_grad():
        expected = model(ids).logits
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    for again in (torch.load(buffer, weights_only=False), copy.deepcopy(model)):
        kinds = {name: type(again.get_submodule(name)) for name, _, _ in handle.swapped}
        assert kinds == {name: made for name, _, made in handle.swapped}
        with torch.no_grad():
            assert torch.equal(again(ids).logits, expected)


def test_model_coverage_names_the_mlps_the_slot_replaces() -> None:
    from layerswap.coverage import model_coverage

    row = {r.substitution: r for r in model_coverage("qwen3").rows}["qwen3.mlp.fused"]
    assert row.unsupported is None
    layers = layerswap.get_family("qwen3").tiny_config().num_hidden_layers
    assert row.replaces == (f"the MLPs (Qwen3MLP x{layers})",)


@pytest.mark.slow  # every model type of the installed transformers, on the meta device
def test_list_all_names_the_model_types_whose_mlps_are_swapped() -> None:
    # every model type the list says the fused MLP takes was proven by the sweep
    # (scripts/norm_sweep.py --slot mlp) on this transformers release
    listed = listed_and_swept("mlp", "mlps")
    # transformers 5.24: 101 model types, every popular one among them
    assert len(listed) >= 101, len(listed)
    assert set(POPULAR) <= listed
    assert "plain MLP" in str(coverage_report()["nemotron_h"].slots["mlp"]["fused"])


def test_the_command_line_patches_a_model_types_mlps() -> None:
    from typer.testing import CliRunner

    from layerswap.cli import app

    result = CliRunner().invoke(app, ["patch", "--substitution", "qwen3_next.mlp.fused"])
    assert result.exit_code == 0, result.output
    assert "4 MLPs swapped: Qwen3NextMLP -> FusedMLP[Qwen3NextMLP]" in result.output
    assert "PASS: the swapped model matches the original" in result.output


def test_undo_gives_copies_made_since_the_swap_their_original_class() -> None:
    """PEFT's ``modules_to_save`` deep-copies each swapped MLP into the model: undo gives
    the copies their original class too (they stayed swapped), and the merged model holds
    no replacement."""
    from peft import LoraConfig, get_peft_model

    model = layerswap.get_family("llama").build()
    handle = layerswap.swap(model, "llama.mlp.fused")
    adapted = get_peft_model(model, LoraConfig(target_modules=["q_proj"], modules_to_save=["mlp"]))
    assert len(_mlps(model)) == 2 * model.config.num_hidden_layers
    handle.undo()
    assert _mlps(model) == []
    assert _mlps(adapted.merge_and_unload()) == []
