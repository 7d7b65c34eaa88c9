"""The ``rotary`` slot: the rotary application an attention's forward calls, read by running
it and swapped for one kernel, on the hybrids, latent-attention and Gemma models the decoder
slot refuses and on every family; the attention stays the original's code and parameters."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import pickle
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from test_mlp_slot import _model, _train_step
from test_norm_slot import _ids, _state, coverage_report, listed_and_swept
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoConfig, AutoModelForCausalLM

import layerswap
from layerswap import sources
from layerswap.backends.fused.rotary import FusedRotary, HalfRotation
from layerswap.backends.rotary import RotaryReplacement
from layerswap.errors import SubstitutionError, UnknownSubstitutionError, UpstreamDriftError
from layerswap.rotaries import RotaryCalls, RotarySpec, classify, rebuilt_forward, rotary_calls

#: the model types people run in late 2026 whose attentions the slot takes
POPULAR = (
    "qwen3_next",
    "qwen3_5_text",
    "falcon_h1",
    "lfm2",
    "bamba",
    "qwen3_moe",
    "gemma4_text",
    "gemma3n_text",
    "olmo3",
)
FAST = ("qwen3_next", "gemma4_text", "bamba")


def _lanes() -> list[Any]:
    return [pytest.param(t, marks=() if t in FAST else pytest.mark.slow, id=t) for t in POPULAR]


def _swapped(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, RotaryReplacement)]


def _attention(model_type: str) -> nn.Module:
    model = _model(model_type)
    return next(m for m in model.modules() if type(m).__name__.endswith("Attention"))


class _Ops(TorchDispatchMode):
    """The aten ops run under it, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.seen.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


# --- what a rotary function computes, by running it ---------------------------------------


@pytest.mark.parametrize(
    ("model_type", "operands", "partial", "upcast"),
    [
        ("llama", 2, False, False),
        ("gpt_neox", 2, True, False),  # the leading cos.shape[-1] channels
        ("modernbert-decoder", 2, False, True),  # in float32, cast back
        ("gemma3n_text", 1, False, False),  # one tensor at a time
    ],
)
def test_a_rotary_function_is_named_by_what_it_computes(
    model_type: str, operands: int, partial: bool, upcast: bool
) -> None:
    found = classify(_attention(model_type))
    assert isinstance(found, RotaryCalls), found
    (spec,) = found.calls
    assert (spec.function, spec.operands, spec.partial, spec.upcast) == (
        "apply_rotary_pos_emb",
        operands,
        partial,
        upcast,
    )


@pytest.mark.parametrize(
    ("model_type", "layout"),
    [("glm", "interleaved_from_half"), ("cohere", "interleaved"), ("nanochat", "half_reversed")],
)
def test_another_rotary_layout_is_refused_naming_it(model_type: str, layout: str) -> None:
    why = classify(_attention(model_type))
    assert why == (
        "apply_rotary_pos_emb does not compute the rotate-half rotation "
        f"(it computes the {layout!r} layout)"
    )


def test_a_rotary_of_another_rounding_in_bfloat16_is_refused() -> None:
    """A function equal to the rotation in float32 but rounding bfloat16 neither as its
    inputs' dtype nor as float32 does (here: through float16) is no kind the kernels
    compute."""

    def apply_rotary_pos_emb(
        q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, unsqueeze_dim: int = 1
    ) -> Any:
        through = torch.float16 if q.dtype == torch.bfloat16 else q.dtype
        cos, sin = (
            cos.unsqueeze(unsqueeze_dim).to(through),
            sin.unsqueeze(unsqueeze_dim).to(through),
        )

        def turn(x: Tensor) -> Tensor:
            half = x.shape[-1] // 2
            rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1).to(through)
            return (x.to(through) * cos + rotated * sin).to(x.dtype)

        return turn(q), turn(k)

    from layerswap.rotaries import _read

    assert _read("apply_rotary_pos_emb", apply_rotary_pos_emb) == (
        "apply_rotary_pos_emb rounds bfloat16 otherwise than in its inputs' dtype or in float32"
    )


def test_classifying_runs_the_function_never_the_module() -> None:
    with torch.device("meta"):
        model = layerswap.get_family("llama").causal_lm_class()(
            layerswap.get_family("llama").tiny_config()
        )
    spec = classify(model.model.layers[0].self_attn)
    assert isinstance(spec, RotaryCalls) and spec.label == "rotate-half, q and k"


def test_the_rebuilt_forward_keeps_each_decorator_and_calls_the_new_name() -> None:
    """transformers wraps every attention's forward (``deprecate_kwarg``): the rebuilt one is
    that wrapper around the rebuilt function, so a deprecated keyword is still renamed."""
    from transformers.models.llama import modeling_llama

    forward = modeling_llama.LlamaAttention.forward
    made = rebuilt_forward(forward, {"apply_rotary_pos_emb": "_renamed"})
    assert made.__wrapped__ is not forward.__wrapped__
    assert "_renamed" in made.__wrapped__.__code__.co_names
    assert "apply_rotary_pos_emb" not in made.__wrapped__.__code__.co_names
    assert made.__code__ is forward.__code__  # the decorator's own code, as it was
    assert made.__qualname__ == forward.__qualname__
    # the original is untouched
    assert "apply_rotary_pos_emb" in forward.__wrapped__.__code__.co_names


def test_a_forward_reading_the_name_otherwise_than_as_a_global_is_refused() -> None:
    class Attention(nn.Module):
        def forward(self, x: Tensor) -> Tensor:
            return self.apply_rotary_pos_emb(x)  # type: ignore[no-any-return]

    found = rotary_calls(Attention)
    assert isinstance(found, str) and found.startswith(
        "its forward reads apply_rotary_pos_emb otherwise than as a global"
    )


# --- the kernel ---------------------------------------------------------------------------


@pytest.mark.parametrize("width", [8, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_the_fused_rotation_and_its_gradient_are_the_originals(
    width: int, dtype: torch.dtype
) -> None:
    from transformers.models.gpt_neox.modeling_gpt_neox import apply_rotary_pos_emb

    generator = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 6, 8, generator=generator, dtype=dtype, requires_grad=True)
    cos = torch.randn(2, 6, width, generator=generator, dtype=dtype)
    sin = torch.randn(2, 6, width, generator=generator, dtype=dtype)
    expected, _ = apply_rotary_pos_emb(q, q, cos, sin)
    got = HalfRotation.apply(q, cos.unsqueeze(1), sin.unsqueeze(1))
    # the same products and sums, rounded alike: bit for bit
    assert torch.equal(got, expected)
    grad = torch.randn_like(got)
    (want,) = torch.autograd.grad(expected, q, grad)
    (have,) = torch.autograd.grad(got, q, grad)
    assert torch.equal(have, want)
    if dtype == torch.float64:
        assert torch.autograd.gradcheck(
            lambda x: HalfRotation.apply(x, cos.unsqueeze(1), sin.unsqueeze(1)),
            (q.detach().requires_grad_(),),
        )


def test_a_swapped_attention_rotates_in_place_without_the_concatenation() -> None:
    model = layerswap.get_family("llama").build()
    ids = _ids(model)
    with _Ops() as before, torch.no_grad():
        model(ids)
    with layerswap.swap(model, "llama.rotary.fused"), _Ops() as after, torch.no_grad():
        model(ids)
    layers = model.config.num_hidden_layers
    # per tensor: two in-place sums over half the head
    assert after.seen.count("aten.add_") + after.seen.count("aten.sub_") >= 4 * layers
    assert after.seen.count("aten.cat") == before.seen.count("aten.cat") - 2 * layers
    assert after.seen.count("aten.neg") == before.seen.count("aten.neg") - 2 * layers


def test_a_call_the_kernel_was_not_read_on_runs_the_modules_own_function() -> None:
    """cos/sin that need a gradient (a learned rotary table), a narrower cos on a function
    that rotates every channel: the module's own function, as bound at the call."""
    from transformers.models.llama import modeling_llama

    model = layerswap.get_family("llama").build()
    handle = layerswap.swap(model, "llama.rotary.fused")
    name = next(n for n in vars(modeling_llama) if n.startswith("_layerswap_FusedRotary_"))
    rotary = vars(modeling_llama)[name]
    q, k = torch.randn(1, 2, 3, 8), torch.randn(1, 1, 3, 8)
    cos = torch.randn(1, 3, 8, requires_grad=True)
    sin = torch.randn(1, 3, 8)
    calls: list[int] = []
    original = modeling_llama.apply_rotary_pos_emb

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return original(*args, **kwargs)

    modeling_llama.apply_rotary_pos_emb = counted
    try:
        out_q, _ = rotary(q, k, cos, sin)
        assert calls == [1]
        torch.autograd.grad(out_q.sum(), cos)  # the gradient reaches cos
        rotary(q, k, cos.detach(), sin)
        assert calls == [1]  # the kernel's call
        rotary(q, k, cos.detach(), sin, unsqueeze_dim=1)
        rotary(q, k, sin=sin, cos=cos.detach())  # named as the original names them
        assert calls == [1]
        # what does not bind to the original's parameters is the original's to refuse
        for args, kwargs in (
            ((q, k, cos.detach()), {}),
            ((q, k, cos, sin), {"position_ids": None}),
        ):
            with pytest.raises(TypeError):
                rotary(*args, **kwargs)
        assert len(calls) == 3
    finally:
        modeling_llama.apply_rotary_pos_emb = original
    handle.undo()


def test_torch_func_transforms_run_the_modules_own_function() -> None:
    """``torch.func.grad`` over a swapped model: the kernel's autograd function has no rule
    for it, so the module's own function runs, and the gradient is the original's."""
    from torch.func import functional_call, grad

    model = layerswap.get_family("llama").build()
    ids = _ids(model)
    params = {name: p.detach() for name, p in model.named_parameters()}

    def loss(weights: dict[str, Tensor]) -> Tensor:
        out: Tensor = functional_call(model, weights, (ids,), {"labels": ids}).loss
        return out

    expected = grad(loss)(params)
    with layerswap.swap(model, "llama.rotary.fused"):
        got = grad(loss)(params)
    assert all(torch.equal(got[name], expected[name]) for name in expected)


def test_reading_is_done_on_the_cpu_whatever_the_default_device() -> None:
    """transformers builds a model inside ``use()`` under ``torch.device("meta")``: the
    function is read there too (first in a process whose verdict was stored before)."""
    from layerswap.rotaries import _read

    attention = _attention("llama")
    _read.cache_clear()
    with torch.device("meta"):
        spec = classify(attention)
    assert isinstance(spec, RotaryCalls) and spec.label == "rotate-half, q and k"


def test_reading_inside_inference_mode_reads_what_it_reads_outside() -> None:
    """A first swap inside ``torch.inference_mode`` (an evaluation loop): the reading (kept
    per process and on disk) is the same as anywhere else, not a refusal."""
    from layerswap.rotaries import _read

    attention = _attention("qwen3_next")
    _read.cache_clear()
    with torch.inference_mode():
        spec = classify(attention)
    assert isinstance(spec, RotaryCalls), spec


def test_a_batched_backward_through_the_kernels_is_the_originals() -> None:
    """``autograd.grad(..., is_grads_batched=True)`` (a jacobian) runs the backward under
    vmap: the kernels' backward is then out of place, and its gradients the original's."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
        apply_rotary_pos_emb_interleave,
    )
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from layerswap.backends.fused.rotary import InterleavedRotation

    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 5, 8, generator=generator, requires_grad=True)
    cos, sin = (torch.randn(2, 5, 8, generator=generator) for _ in "cs")
    grads = torch.randn(4, 2, 3, 5, 8, generator=generator)
    pairs = [
        (
            apply_rotary_pos_emb(x, x, cos, sin)[0],
            HalfRotation.apply(x, cos[:, None], sin[:, None]),
        ),
        (
            apply_rotary_pos_emb_interleave(x, x, cos, sin)[0],
            InterleavedRotation.apply(x, cos[:, None, :, :4], sin[:, None, :, :4]),
        ),
    ]
    for expected, got in pairs:
        (want,) = torch.autograd.grad(expected, x, grads, is_grads_batched=True)
        (have,) = torch.autograd.grad(got, x, grads, is_grads_batched=True)
        assert torch.equal(have, want)


def test_a_tensor_subclass_runs_the_modules_own_function() -> None:
    """A subclass (a tensor-parallel ``DTensor``) is the original's to run: the kernel
    allocates plain tensors."""
    from transformers.models.llama import modeling_llama

    from layerswap.backends.rotary import calls

    class Marked(torch.Tensor):
        pass

    model = layerswap.get_family("llama").build()
    with layerswap.swap(model, "llama.rotary.fused"):
        name = next(n for n in vars(modeling_llama) if n.startswith("_layerswap_FusedRotary_"))
        q = torch.randn(1, 2, 3, 8).as_subclass(Marked)
        cos, sin = torch.randn(1, 3, 8), torch.randn(1, 3, 8)
        before = calls()
        out, _ = vars(modeling_llama)[name](q, q, cos, sin)
        assert type(out) is Marked
        assert calls()[1] == before[1]  # none computed by the kernel
        assert torch.equal(out, modeling_llama.apply_rotary_pos_emb(q, q, cos, sin)[0])


def test_second_derivatives_through_the_kernel_are_the_originals() -> None:
    """A gradient penalty (``create_graph=True``) differentiates the kernel's backward."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 5, 8, generator=generator, dtype=torch.float64, requires_grad=True)
    cos, sin = (torch.randn(2, 1, 5, 8, generator=generator, dtype=torch.float64) for _ in "cs")
    assert torch.autograd.gradgradcheck(lambda t: HalfRotation.apply(t, cos, sin), (x,))
    model = layerswap.get_family("llama").build()
    model.set_attn_implementation("eager")  # SDPA on a CPU has no second derivative
    ids = _ids(model)

    def penalty() -> Tensor:
        model.zero_grad()
        embeddings = model.get_input_embeddings()(ids).detach().requires_grad_()
        loss = model(inputs_embeds=embeddings, labels=ids).loss
        (grad,) = torch.autograd.grad(loss, embeddings, create_graph=True)
        total = grad.square().sum()
        total.backward()
        return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])

    expected = penalty()
    with layerswap.swap(model, "llama.rotary.fused"):
        assert torch.equal(penalty(), expected)


@pytest.mark.parametrize("model_type", ["llama", "modernbert-decoder"])
def test_gradients_round_as_the_originals_under_autocast_and_in_bfloat16(model_type: str) -> None:
    """bfloat16 states with float32 cos/sin (autocast), and a rotary computed in float32 and
    cast back (ModernBERT's decoder, in bfloat16): each term's gradient is rounded to the
    states' dtype before the terms are summed, as the original's autograd rounds it."""
    model = _model(model_type)
    ids = _ids(model)
    runs = [
        lambda: torch.autocast("cpu", dtype=torch.bfloat16),
        lambda: contextlib.nullcontext(),
    ]
    if model_type != "llama":
        model = model.to(torch.bfloat16)
        runs = runs[1:]
    for run in runs:
        with run():
            loss, grads = _train_step(model, ids)
        with layerswap.swap(model, f"{model_type}.rotary.fused"), run():
            swapped_loss, swapped_grads = _train_step(model, ids)
        assert torch.equal(swapped_loss, loss)
        assert all(torch.equal(swapped_grads[n], grads[n]) for n in grads)


@pytest.mark.parametrize("model_type", ["granitemoehybrid", "zamba2"])
def test_a_model_type_whose_attention_calls_its_rotary_only_elsewhere_is_not_offered(
    model_type: str,
) -> None:
    """GraniteMoeHybrid and Zamba2 rotate only with rotary position embeddings (their
    default: none): a swap would report its attentions swapped and compute nothing new."""
    with pytest.raises(UnknownSubstitutionError, match="only under a condition"):
        layerswap.get(f"{model_type}.rotary.fused")


@pytest.mark.parametrize("interleave", [True, False])
def test_deepseek_v3_takes_both_of_its_rotary_functions(interleave: bool) -> None:
    """DeepSeek V3's attention calls ``apply_rotary_pos_emb_interleave`` where
    ``rope_interleave`` is set (its default) and ``apply_rotary_pos_emb`` where not: both
    are read and renamed, and the swapped model is bitwise the original's either way."""
    found = classify(_attention("deepseek_v3"))
    assert isinstance(found, RotaryCalls)
    assert [(c.function, c.kind) for c in found.calls] == [
        ("apply_rotary_pos_emb", "half"),
        ("apply_rotary_pos_emb_interleave", "interleave"),
    ]
    from layerswap.families.infer import model_type_classes, tiny_config_for

    classes = model_type_classes("deepseek_v3")
    config = tiny_config_for(classes.config_class)
    config.rope_interleave = interleave
    torch.manual_seed(0)
    model = classes.causal_lm(config).eval()
    ids = _ids(model)
    with torch.no_grad():
        logits = model(ids).logits
    loss, grads = _train_step(model, ids)
    model.eval()
    with layerswap.swap(model, "deepseek_v3.rotary.fused") as handle:
        assert "apply_rotary_pos_emb_interleave: interleaved pairs, q and k" in handle.report()
        with torch.no_grad():
            assert torch.equal(model(ids).logits, logits)
        swapped_loss, swapped_grads = _train_step(model, ids)
    assert torch.equal(swapped_loss, loss)
    assert all(torch.equal(swapped_grads[n], grads[n]) for n in grads)


def test_the_interleaved_rotation_and_its_gradients_are_the_originals() -> None:
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
        apply_rotary_pos_emb_interleave,
    )

    from layerswap.backends.fused.rotary import InterleavedRotation

    generator = torch.Generator().manual_seed(0)
    for states, tables in [
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.bfloat16),
        (torch.bfloat16, torch.float32),  # autocast
    ]:
        q = torch.randn(2, 3, 5, 8, generator=generator).to(states).requires_grad_()
        cos, sin = (torch.randn(2, 5, 8, generator=generator).to(tables) for _ in "cs")
        expected, _ = apply_rotary_pos_emb_interleave(q, q, cos, sin)
        got = InterleavedRotation.apply(q, cos[..., :4].unsqueeze(1), sin[..., :4].unsqueeze(1))
        assert torch.equal(got, expected)
        grad = torch.randn(expected.shape, generator=generator).to(expected.dtype)
        (want,) = torch.autograd.grad(expected, q, grad)
        (have,) = torch.autograd.grad(got, q, grad)
        assert torch.equal(have, want)
    x = torch.randn(2, 3, 5, 8, generator=generator, dtype=torch.float64, requires_grad=True)
    cos, sin = (torch.randn(2, 1, 5, 4, generator=generator, dtype=torch.float64) for _ in "cs")
    assert torch.autograd.gradgradcheck(lambda t: InterleavedRotation.apply(t, cos, sin), (x,))


def test_a_config_under_which_the_kernel_never_runs_is_refused_unchanged() -> None:
    """Falcon with ALiBi: its attention calls the rotary only where ``alibi is None`` (a
    local, not a switch of the module), so the proof counts the kernel's calls, finds
    none, and refuses."""
    from layerswap.families.infer import model_type_classes, tiny_config_for

    classes = model_type_classes("falcon")
    config = tiny_config_for(classes.config_class)
    config.alibi = True
    torch.manual_seed(0)
    model = classes.causal_lm(config).eval()
    with pytest.raises(layerswap.errors.LayerswapError, match="would change nothing in this model"):
        layerswap.swap(model, "falcon.rotary.fused")
    assert not _swapped(model)


def test_nope_layers_are_kept_and_named() -> None:
    """SmolLM3's NoPE layers (``use_rope`` off) are kept, with the switch that makes them
    so, and the report counts only the attentions that rotate; every layer NoPE is
    refused, naming it, with the model unchanged."""
    from layerswap.families.infer import model_type_classes, tiny_config_for

    classes = model_type_classes("smollm3")
    config = tiny_config_for(classes.config_class)
    config.no_rope_layers = [1, 0] * (config.num_hidden_layers // 2)
    torch.manual_seed(0)
    model = classes.causal_lm(config).eval()
    rotating = sum(1 for layer in model.model.layers if layer.self_attn.use_rope)
    assert 0 < rotating < config.num_hidden_layers
    expected = model(input_ids=torch.tensor([[1, 2, 3, 4]])).logits
    with layerswap.swap(model, "smollm3.rotary.fused") as handle:
        assert len(handle) == rotating
        kept = handle.kept["SmolLM3Attention"]
        assert kept[0] == config.num_hidden_layers - rotating
        assert "NoPE layer: self.use_rope fails here" in kept[1]
        assert f"{rotating} attentions swapped" in handle.report()
        got = model(input_ids=torch.tensor([[1, 2, 3, 4]])).logits
    assert torch.equal(got, expected)
    config.no_rope_layers = [0] * config.num_hidden_layers
    model = classes.causal_lm(config).eval()
    with pytest.raises(SubstitutionError, match=r"NoPE layer: self\.use_rope fails here"):
        layerswap.swap(model, "smollm3.rotary.fused")
    assert not _swapped(model)


def test_a_nope_switch_is_read_from_the_source_or_left_to_a_run() -> None:
    """Conditions of the module's own attributes are read (Llama 4's ``use_rope``, Cohere
    2's ``sliding_window is not None``, Exaone 4's ``or``); any other condition (Falcon's
    local ``alibi``, Zamba2's config switch) is left to the proof's run."""
    from transformers.models.cohere2.modeling_cohere2 import Cohere2Attention
    from transformers.models.exaone4.modeling_exaone4 import Exaone4Attention
    from transformers.models.falcon.modeling_falcon import FalconAttention

    from layerswap.rotaries import never_rotates

    def bare(cls: type, **held: object) -> torch.nn.Module:
        module = torch.nn.Module.__new__(cls)
        torch.nn.Module.__init__(module)
        vars(module).update(held)
        return module

    assert never_rotates(bare(Cohere2Attention, sliding_window=None)) is not None
    assert never_rotates(bare(Cohere2Attention, sliding_window=4)) is None
    assert never_rotates(bare(Exaone4Attention, sliding_window=4, is_sliding=False)) is not None
    assert never_rotates(bare(Exaone4Attention, sliding_window=None, is_sliding=False)) is None
    assert never_rotates(bare(Exaone4Attention, sliding_window=4, is_sliding=True)) is None
    # an attribute the module lacks: not decided here
    assert never_rotates(bare(Exaone4Attention, sliding_window=4)) is None
    assert never_rotates(bare(FalconAttention)) is None


def test_a_rotary_function_rebound_since_is_read_again() -> None:
    """Another library rebinding the module's function (here: to GLM's interleaved one):
    what a swap reads is the function bound now, refused naming its layout."""
    from transformers.models.glm import modeling_glm
    from transformers.models.llama import modeling_llama

    model = layerswap.get_family("llama").build()
    layerswap.swap(model, "llama.rotary.fused").undo()
    original = modeling_llama.apply_rotary_pos_emb
    modeling_llama.apply_rotary_pos_emb = modeling_glm.apply_rotary_pos_emb
    try:
        with pytest.raises(SubstitutionError, match="'interleaved_from_half' layout"):
            layerswap.swap(model, "llama.rotary.fused")
    finally:
        modeling_llama.apply_rotary_pos_emb = original
    assert not _swapped(model)


# --- the swap, on the models people run ---------------------------------------------------


@pytest.mark.parametrize("model_type", _lanes())
def test_a_popular_model_swaps_its_rotary_exactly(model_type: str, tmp_path: Path) -> None:
    model = _model(model_type)
    ids = _ids(model)
    before = _state(model)
    params = dict(model.named_parameters())
    with torch.no_grad():
        logits = model(ids).logits
    tokens = model.generate(ids, max_new_tokens=4, do_sample=False)
    loss, grads = _train_step(model, ids)
    model.eval()

    handle = layerswap.swap(model, f"{model_type}.rotary.fused")
    assert len(handle) > 0
    for name, original, made in handle.swapped:
        module = model.get_submodule(name)
        assert type(module) is made and isinstance(module, original)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, logits)
    assert torch.equal(model.generate(ids, max_new_tokens=4, do_sample=False), tokens)
    swapped_loss, swapped_grads = _train_step(model, ids)
    model.eval()
    assert torch.equal(swapped_loss, loss)
    assert swapped_grads.keys() == grads.keys()
    for name in grads:  # the same products and sums, rounded alike
        assert torch.equal(swapped_grads[name], grads[name]), name
    # the very same parameters under the same names: the original layout is what is saved
    assert all(p is params[n] for n, p in model.named_parameters())
    model.save_pretrained(tmp_path)
    plain = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert not _swapped(plain)

    handle.undo()
    assert not _swapped(model)
    after = _state(model)
    assert all(torch.equal(after[k], before[k]) for k in before)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, logits)


def test_the_report_names_what_was_swapped_and_what_stays() -> None:
    model = _model("qwen3_next")
    with layerswap.swap(model, "qwen3_next.rotary.fused") as handle:
        assert "Qwen3NextAttention -> rotate-half, q and k" in handle.report()
    assert not handle.active


def test_a_model_type_whose_rotary_no_kernel_computes_is_refused_unchanged() -> None:
    model = _model("glm")
    classes = {name: type(m) for name, m in model.named_modules()}
    with pytest.raises(SubstitutionError, match="does not compute the rotate-half rotation"):
        layerswap.swap(model, "glm.rotary.fused")
    assert {name: type(m) for name, m in model.named_modules()} == classes


def test_use_builds_and_loads_with_the_rotary_swapped(tmp_path: Path) -> None:
    original = _model("qwen3_next")
    ids = _ids(original)
    with torch.no_grad():
        expected = original(ids).logits
    original.save_pretrained(tmp_path)
    with layerswap.use("qwen3_next.rotary.fused"):
        loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
        built = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tmp_path))
    for model in (loaded, built):
        assert _swapped(model)
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, expected, rtol=1e-5, atol=1e-5)
    assert not _swapped(AutoModelForCausalLM.from_config(original.config))


def test_verify_compares_a_rotary_swap_with_the_original() -> None:
    report = layerswap.verify(_model("falcon_h1"), "falcon_h1.rotary.fused")
    assert report.passed, report


def test_the_rotary_slot_composes_with_the_norm_and_mlp_slots_and_the_head() -> None:
    model = _model("qwen3_next")
    ids = _ids(model)
    with torch.no_grad():
        expected = model(ids).logits
    handles = [
        layerswap.swap(model, f"qwen3_next.{slot}.fused")
        for slot in ("norm", "mlp", "rotary", "head")
    ]
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, expected, rtol=1e-5, atol=1e-5)
    for handle in reversed(handles):
        handle.undo()
    with torch.no_grad():
        assert torch.equal(model(ids).logits, expected)


@pytest.mark.parametrize("first", ["qkv", "rotary"])
def test_the_qkv_and_rotary_slots_on_one_attention_are_refused_in_either_order(first: str) -> None:
    """Both give an attention a class of its own; the second would have replaced the first's
    class without a word (its undo then failing): it is refused, naming the first."""
    second = "rotary" if first == "qkv" else "qkv"
    model = layerswap.get_family("llama").build()
    handle = layerswap.swap(model, f"llama.{first}.fused")
    classes = {name: type(m) for name, m in model.named_modules()}
    with pytest.raises(SubstitutionError, match=f"llama.{first}.fused gave it a class of its own"):
        layerswap.swap(model, f"llama.{second}.fused")
    assert {name: type(m) for name, m in model.named_modules()} == classes
    handle.undo()


@pytest.mark.parametrize("inner", ["qkv", "rotary"])
def test_use_of_the_qkv_and_rotary_slots_together_is_refused(inner: str) -> None:
    outer = "rotary" if inner == "qkv" else "qkv"
    family = layerswap.get_family("llama")
    with (
        pytest.raises(SubstitutionError, match="gave it a class of its own"),
        layerswap.use(f"llama.{outer}.fused"),
        layerswap.use(f"llama.{inner}.fused"),
    ):
        family.causal_lm_class()(family.tiny_config())


def test_the_first_use_proof_catches_a_wrong_kernel() -> None:
    """A backend whose kernel turns the other way: its proof fails and the swap is refused
    before the model changes."""

    def wrong(given: Any, spec: RotarySpec) -> Any:
        *tensors, cos, sin, dim = given
        cos, sin = cos.unsqueeze(dim), sin.unsqueeze(dim)
        return tuple(HalfRotation.apply(x, cos, -sin) for x in tensors)

    class Backwards(FusedRotary):
        backend = "backwards"
        kernels = {"half": wrong}

    base = layerswap.get("llama.rotary.fused")
    sub = dataclasses.replace(base, name="llama.rotary.backwards", replacement=Backwards)
    model = layerswap.get_family("llama").build()
    with pytest.raises(UpstreamDriftError, match=r"llama\.rotary\.backwards"):
        layerswap.swap(model, sub)
    assert not _swapped(model)


def test_the_name_bound_in_the_modeling_module_changes_no_digest() -> None:
    """The kernel's global in transformers' module is layerswap's own, called only by the
    made classes: the code a verdict vouches for is the same with it."""
    import transformers.models.mistral.modeling_mistral as modeling

    model = _model("mistral")
    handle = layerswap.swap(model, "mistral.rotary.fused")
    bound = {
        name: value for name, value in vars(modeling).items() if name.startswith("_layerswap_")
    }
    assert bound
    with_names = sources.live_digest(modeling.__name__)
    for name in bound:
        delattr(modeling, name)
    try:
        assert sources.live_digest(modeling.__name__) == with_names
    finally:
        for name, value in bound.items():
            setattr(modeling, name, value)
    handle.undo()


def test_a_swapped_model_copies_and_pickles_with_its_classes() -> None:
    model = layerswap.get_family("llama").build()
    ids = _ids(model)
    layerswap.swap(model, "llama.rotary.fused")
    with torch.no_grad():
        expected = model(ids).logits
    for copied in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert len(_swapped(copied)) == model.config.num_hidden_layers
        with torch.no_grad():
            torch.testing.assert_close(copied(ids).logits, expected, rtol=0, atol=0)


def test_two_threads_swapping_one_model_do_not_both_succeed() -> None:
    model = layerswap.get_family("llama").build()
    layerswap.swap(model, "llama.rotary.fused").undo()  # proven once, before the race
    results: list[Any] = []
    barrier = threading.Barrier(2)

    def swap() -> None:
        barrier.wait()
        try:
            results.append(layerswap.swap(model, "llama.rotary.fused"))
        except SubstitutionError as exc:
            results.append(exc)

    threads = [threading.Thread(target=swap) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sum(isinstance(r, SubstitutionError) for r in results) == 1


def test_a_lora_adapter_on_the_projections_trains_through_the_swapped_rotary(
    tmp_path: Path,
) -> None:
    from peft import LoraConfig, PeftModel, get_peft_model

    family = layerswap.get_family("llama")
    ids = _ids(family.build())
    swapped = family.build(seed=0)
    handle = layerswap.swap(swapped, "llama.rotary.fused")
    config = LoraConfig(r=4, target_modules=["q_proj", "k_proj"], init_lora_weights=False)
    peft_model = get_peft_model(swapped, config)
    with torch.no_grad():
        expected = peft_model(ids).logits
    peft_model.save_pretrained(tmp_path)
    handle.undo()
    plain = PeftModel.from_pretrained(family.build(seed=0), tmp_path)
    with torch.no_grad():
        torch.testing.assert_close(plain(ids).logits, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # compiles
def test_compile_adds_no_graph_break_and_computes_the_same() -> None:
    model = layerswap.get_family("qwen3").build()
    ids = _ids(model)
    torch._dynamo.reset()
    with torch.no_grad():
        expected = model(ids).logits
        with layerswap.swap(model, "qwen3.rotary.fused"):
            compiled = torch.compile(model, backend="eager", fullgraph=True)
            torch.testing.assert_close(compiled(ids).logits, expected, rtol=1e-5, atol=1e-5)


def _liger_reason() -> str | None:
    from layerswap.backends.liger.runtime import unmet_requirement

    return unmet_requirement()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("backend", ["fused", "liger"])
@pytest.mark.parametrize("model_type", [*POPULAR, "llama4_text"])
def test_on_a_gpu_the_rotary_verifies(model_type: str, backend: str, dtype: torch.dtype) -> None:
    if backend == "liger" and _liger_reason() is not None:
        pytest.skip(f"needs liger ({_liger_reason()})")
    sub = layerswap.get(f"{model_type}.rotary.{backend}")
    refused = layerswap.get_backend(backend).unsupported(sub.parts.family, "rotary")
    if refused is not None:  # Liger's rotates q and k together; fused has no complex kernel
        pytest.skip(refused)
    report = layerswap.verify(_model(model_type), sub, dtype=dtype, device="cuda", backward=True)
    assert report.passed, report.summary()


# --- what list --all and coverage say -----------------------------------------------------


def test_list_all_counts_the_model_types_whose_rotary_is_swapped() -> None:
    """Every model type the slot takes is proven (``docs/rotary.md``, swept on the installed
    transformers); the popular ones are among them."""
    listed = listed_and_swept("rotary", "rotary")
    assert len(listed) >= 100
    assert set(POPULAR) <= listed
    report = coverage_report()
    assert "liger" in report["qwen3_next"].below_decoder["rotary"]


def test_llama4s_complex_rotary_is_read_and_taken_by_liger_alone() -> None:
    """Llama 4 rotates adjacent pairs by a complex product (``apply_rotary_emb``): Liger's
    patch binds its own kernel there, and so does ``rotary.liger``; the fused backend has
    nothing to spare over one complex product."""
    from layerswap.backends.liger.rotary import LigerRotary

    spec = classify(_attention("llama4_text"))
    assert isinstance(spec, RotaryCalls)
    assert (spec.calls[0].function, spec.calls[0].kind, spec.label) == (
        "apply_rotary_emb",
        "complex",
        "complex pairs, q and k, in float32",
    )
    assert LigerRotary.refusal(spec) is None
    assert "one complex product already" in str(FusedRotary.refusal(spec))
    # DeepSeek V2's apply_rotary_emb broadcasts over bhsd states: not Llama 4's, kept
    assert "does not compute Llama 4's product" in str(classify(_attention("deepseek_v2")))
    row = coverage_report()["llama4_text"]
    assert row.below_decoder["rotary"] == ["liger"]


def test_the_liger_rotary_takes_q_and_k_together_and_needs_a_gpu_here() -> None:
    from layerswap.backends.liger.rotary import LigerRotary

    spec = classify(_attention("gemma3n_text"))
    assert isinstance(spec, RotaryCalls)
    assert "rotates one tensor at a time" in str(LigerRotary.refusal(spec))
    if not torch.cuda.is_available():
        sub = layerswap.get("qwen3_next.rotary.liger")
        assert sub.unmet_requirement() is not None
