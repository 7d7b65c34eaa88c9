"""Swapping built models: undo is exact, failures are atomic, errors are clear."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from models import FAMILIES, swapped_layer_count, tiny_config, tiny_model, tokens
from transformers.debug_utils import DebugUnderflowOverflow
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaForCausalLM

import layerswap
from layerswap.backends import fused
from layerswap.errors import (
    ConversionError,
    SubstitutionError,
    SwapWarning,
    UnknownSubstitutionError,
)
from layerswap.proof import proving
from layerswap.swap import SwapHandle, build_replacement_layer, decoder_layers, family_of
from layerswap.weights import Converter


def _snapshot(model: torch.nn.Module) -> dict[str, Any]:
    """Everything undo must give back: layer objects, Parameter objects, values, key order."""
    return {
        "layers": [layer for _, layer in decoder_layers(model)],
        "params": dict(model.named_parameters()),
        "state": {key: value.clone() for key, value in model.state_dict().items()},
    }


def _assert_untouched(model: torch.nn.Module, before: dict[str, Any]) -> None:
    assert [layer for _, layer in decoder_layers(model)] == before["layers"]
    now = [layer for _, layer in decoder_layers(model)]
    assert all(a is b for a, b in zip(before["layers"], now, strict=True))
    params = dict(model.named_parameters())
    assert params.keys() == before["params"].keys()
    assert all(params[key] is param for key, param in before["params"].items())
    state = model.state_dict()
    assert list(state) == list(before["state"])
    for key, value in before["state"].items():
        assert torch.equal(state[key], value), key
        assert state[key].dtype == value.dtype


@pytest.mark.parametrize("name", FAMILIES)
def test_undo_gives_back_the_same_layers_and_bitwise_weights(name: str) -> None:
    model = tiny_model(name)
    before = _snapshot(model)
    handle = layerswap.swap(model, backend="fused")
    assert handle.active
    assert len(handle) == swapped_layer_count(model)
    assert handle.substitution.name == f"{name}.decoder.fused"
    assert all(type(layer) is not LlamaDecoderLayer for _, layer in decoder_layers(model))
    handle.undo()
    assert not handle.active
    _assert_untouched(model, before)
    handle.undo()  # a second undo does nothing
    _assert_untouched(model, before)


def test_swap_is_a_context_manager_undone_on_exceptions() -> None:
    model = tiny_model("llama", num_hidden_layers=2)
    before = _snapshot(model)
    with pytest.raises(ZeroDivisionError), layerswap.swap(model, "llama.decoder.fused") as h:
        assert isinstance(h, SwapHandle)
        assert isinstance(model.model.layers[0], fused.FusedDecoderLayer)
        raise ZeroDivisionError
    _assert_untouched(model, before)


def test_device_maps_keep_swapped_layers_whole_until_undo() -> None:
    model = tiny_model("llama", num_hidden_layers=1)
    before = model._no_split_modules
    with layerswap.swap(model, backend="fused"):
        assert "FusedLlamaDecoderLayer" in model._no_split_modules
        assert "FusedLlamaDecoderLayer" in model.model._no_split_modules
    assert model._no_split_modules is before


def test_report_and_swapped_list_every_layer() -> None:
    model = tiny_model("qwen3", num_hidden_layers=2)
    handle = layerswap.swap(model, backend="fused")
    sub = layerswap.get("qwen3.decoder.fused")
    original, replacement = sub.original_class(), sub.replacement_class()
    assert handle.swapped == [
        ("model.layers.0", original, replacement),
        ("model.layers.1", original, replacement),
    ]
    report = handle.report()
    assert report.splitlines()[0] == "qwen3.decoder.fused: 2 layers swapped (active)"
    assert "model.layers.1  Qwen3DecoderLayer -> FusedQwen3DecoderLayer" in report
    handle.undo()
    assert "(undone)" in handle.report()


def test_untouched_tensors_are_shared_and_fused_originals_are_released() -> None:
    model = tiny_model("llama", num_hidden_layers=2)
    original = model.model.layers[0]
    o_proj, q_proj = original.self_attn.o_proj.weight, original.self_attn.q_proj.weight
    with layerswap.swap(model, backend="fused"):
        swapped = model.model.layers[0]
        assert swapped.self_attn.o_proj.weight is o_proj  # moved, not copied
        assert q_proj.numel() == 0  # its values live in qkv_proj now
        assert swapped.self_attn.qkv_proj.weight.shape == (128 + 32 + 32, 128)
    assert q_proj.shape == (128, 128)


def test_training_while_swapped_carries_into_the_undone_model() -> None:
    model = tiny_model("llama", num_hidden_layers=2).train()
    reference = tiny_model("llama", num_hidden_layers=2).train()
    ids = tokens(model.config.vocab_size)
    with layerswap.swap(model, backend="fused"):
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        model(ids, labels=ids).loss.backward()
        optimizer.step()
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)
    reference(ids, labels=ids).loss.backward()
    optimizer.step()
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(model.state_dict()[key], value, atol=1e-5, rtol=0, msg=key)


def test_frozen_parameters_stay_frozen() -> None:
    model = tiny_model("qwen2", num_hidden_layers=1)
    for param in model.model.layers[0].self_attn.parameters():
        param.requires_grad_(False)
    with layerswap.swap(model, backend="fused"):
        attention = model.model.layers[0].self_attn
        assert not attention.qkv_proj.weight.requires_grad
        assert not attention.qkv_proj.bias.requires_grad
        assert model.model.layers[0].mlp.gate_up_proj.weight.requires_grad
    assert not model.model.layers[0].self_attn.q_proj.weight.requires_grad
    assert model.model.layers[0].mlp.gate_proj.weight.requires_grad


@pytest.mark.parametrize(
    ("frozen", "joined"), [("q_proj", "qkv_proj"), ("up_proj", "gate_up_proj")]
)
def test_a_swap_joining_frozen_and_trained_tensors_is_refused_and_changes_nothing(
    frozen: str, joined: str
) -> None:
    """The decoder swap joins q/k/v (gate/up) into one Parameter: with some parts frozen
    and some not, every row of it would train (the frozen ones moved by the optimizer).
    Refused, naming both tensors, with the model as it was; the qkv slot, which keeps
    each projection's own Parameter, trains only what trained."""
    model = tiny_model("llama", num_hidden_layers=2)
    for name, param in model.named_parameters():
        if "layers.1." in name and frozen in name:
            param.requires_grad_(False)
    before = _snapshot(model)
    with pytest.raises(ConversionError, match=rf"(?s)'model.layers.1'.*{frozen}.*frozen.*{joined}"):
        layerswap.swap(model, "llama.decoder.fused")
    _assert_untouched(model, before)
    if frozen == "q_proj":
        with layerswap.swap(model, "llama.qkv.fused"):
            model(
                tokens(model.config.vocab_size), labels=tokens(model.config.vocab_size)
            ).loss.backward()
            assert model.model.layers[1].self_attn.q_proj.weight.grad is None
            assert model.model.layers[1].self_attn.k_proj.weight.grad is not None


def test_forward_hooks_on_a_layer_keep_firing_after_the_swap() -> None:
    model = tiny_model("llama", num_hidden_layers=2)
    seen: list[str] = []
    model.model.layers[1].register_forward_hook(lambda m, a, out: seen.append(type(m).__name__))
    with torch.no_grad(), layerswap.swap(model, backend="fused"):
        model(tokens(model.config.vocab_size))
    with torch.no_grad():
        model(tokens(model.config.vocab_size))
    assert seen == ["FusedLlamaDecoderLayer", "LlamaDecoderLayer"]


def test_meta_device_models_swap_and_undo_without_data() -> None:
    with torch.device("meta"):
        model = LlamaForCausalLM(tiny_config("llama"))
    names = list(model.state_dict())
    with layerswap.swap(model, backend="fused"):
        assert all(param.is_meta for param in model.parameters())
        assert model.model.layers[0].self_attn.qkv_proj.weight.shape == (192, 128)
    assert list(model.state_dict()) == names
    assert all(param.is_meta for param in model.parameters())
    assert model.model.layers[0].self_attn.q_proj.weight.shape == (128, 128)


class _FailOnThirdLayer(Converter):
    """The fused converter, failing for the third layer with data it converts.

    (The upstream check converts a meta-device layer first, and the first-use proof
    converts its tiny model's layers; those are not counted.)
    """

    def __init__(self, error: BaseException) -> None:
        super().__init__(fused.CONVERTER.rules)
        object.__setattr__(self, "error", error)
        object.__setattr__(self, "calls", 0)

    def to_replacement(self, state: Any, config: Any) -> dict[str, torch.Tensor]:
        if next(iter(state.values())).is_meta or proving():
            return super().to_replacement(state, config)
        object.__setattr__(self, "calls", self.calls + 1)  # type: ignore[has-type]
        if self.calls == 3:  # type: ignore[has-type]
            raise self.error  # type: ignore[has-type]
        return super().to_replacement(state, config)


def test_a_failing_layer_rolls_back_the_layers_already_swapped() -> None:
    model = tiny_model("llama")
    before = _snapshot(model)
    failing = dataclasses.replace(
        layerswap.get("llama.decoder.fused"),
        converter=_FailOnThirdLayer(ConversionError("tensor 'self_attn.q_proj.weight': bad")),
    )
    with pytest.raises(ConversionError, match=r"layer 'model\.layers\.2'.*'self_attn\.q_proj"):
        layerswap.swap(model, failing)
    _assert_untouched(model, before)


def test_an_interrupt_during_the_swap_also_rolls_back() -> None:
    model = tiny_model("llama")
    before = _snapshot(model)
    failing = dataclasses.replace(
        layerswap.get("llama.decoder.fused"), converter=_FailOnThirdLayer(KeyboardInterrupt())
    )
    with pytest.raises(KeyboardInterrupt):
        layerswap.swap(model, failing)
    _assert_untouched(model, before)


def test_a_shape_mismatch_in_one_layer_names_the_layer_and_the_tensor() -> None:
    model = tiny_model("mistral")
    bad = model.model.layers[2].mlp.up_proj
    bad.weight = torch.nn.Parameter(torch.randn(100, model.config.hidden_size))
    before = _snapshot(model)
    with pytest.raises(ConversionError) as caught:
        layerswap.swap(model, backend="fused")
    assert "layer 'model.layers.2'" in str(caught.value)
    assert "'mlp.up_proj.weight' has shape (100, 128)" in str(caught.value)
    _assert_untouched(model, before)


def test_wrong_family_is_a_clear_error() -> None:
    model = tiny_model("qwen3", num_hidden_layers=1)
    with pytest.raises(SubstitutionError, match=r"llama\.decoder\.fused is for llama .* qwen3"):
        layerswap.swap(model, "llama.decoder.fused")
    assert type(model.model.layers[0]).__name__ == "Qwen3DecoderLayer"


def test_unknown_names_are_clear_errors() -> None:
    model = tiny_model("llama", num_hidden_layers=1)
    with pytest.raises(UnknownSubstitutionError, match="did you mean"):
        layerswap.swap(model, "llama.decoder.fuse")
    with pytest.raises(UnknownSubstitutionError, match=r"llama\.decoder\.cuda"):
        layerswap.swap(model, backend="cuda")
    with pytest.raises(TypeError, match="not both"):
        layerswap.swap(model, "llama.decoder.fused", backend="fused")


def test_swapping_twice_is_refused_until_undone() -> None:
    model = tiny_model("llama", num_hidden_layers=1)
    handle = layerswap.swap(model)
    with pytest.raises(SubstitutionError, match=r"already swapped by llama\.decoder\.fused"):
        layerswap.swap(model)
    handle.undo()
    layerswap.swap(model).undo()


@pytest.mark.filterwarnings("ignore:.*torch.jit:DeprecationWarning")
@pytest.mark.slow  # torch.compile
def test_a_compiled_model_is_swapped_through_orig_mod_with_a_warning() -> None:
    model = tiny_model("llama", num_hidden_layers=1)
    compiled = torch.compile(model)
    with pytest.warns(SwapWarning, match="compile"):
        handle = layerswap.swap(compiled, backend="fused")
    assert isinstance(model.model.layers[0], fused.FusedDecoderLayer)
    assert handle.model is model
    handle.undo()
    assert type(model.model.layers[0]) is LlamaDecoderLayer


def test_undo_refuses_when_a_swapped_layer_was_replaced_since() -> None:
    model = tiny_model("llama", num_hidden_layers=1)
    handle = layerswap.swap(model)
    model.model.layers[0] = torch.nn.Identity()
    with pytest.raises(SubstitutionError, match=r"model\.layers\.0"):
        handle.undo()


def test_family_of_and_decoder_layers_see_through_swaps() -> None:
    model = tiny_model("gemma", num_hidden_layers=2)
    assert family_of(model).name == "gemma"
    with layerswap.swap(model):
        assert family_of(model).name == "gemma"
        assert [name for name, _ in decoder_layers(model)] == ["model.layers.0", "model.layers.1"]


def test_build_replacement_layer_leaves_the_original_untouched() -> None:
    model = tiny_model("qwen2", num_hidden_layers=1)
    layer = model.model.layers[0]
    before = {key: value.clone() for key, value in layer.state_dict().items()}
    replacement = build_replacement_layer("qwen2.decoder.fused", layer, config=model.config)
    assert isinstance(replacement, fused.FusedDecoderLayer)
    assert replacement.self_attn.o_proj.weight is not layer.self_attn.o_proj.weight
    assert (
        replacement.self_attn.o_proj.weight.data_ptr() == layer.self_attn.o_proj.weight.data_ptr()
    )
    for key, value in layer.state_dict().items():
        assert torch.equal(value, before[key])
    hidden = torch.randn(1, 5, model.config.hidden_size)
    position_ids = torch.arange(5)[None]
    cos_sin = model.model.rotary_emb(hidden, position_ids)
    with torch.no_grad():
        expected = layer(hidden, position_embeddings=cos_sin)
        actual = replacement(hidden, position_embeddings=cos_sin)
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=0)


def test_an_accelerate_hook_on_a_layer_runs_the_replacement_layer() -> None:
    """accelerate's hooks (dispatch_model, an offloading device_map) set ``forward`` on each
    layer they wrap: the swap hooks the replacement layer the same way, so the hook runs
    the replacement's forward (not the original's, which would make the swap a no-op)."""
    from accelerate.hooks import ModelHook, add_hook_to_module

    class Counting(ModelHook):  # type: ignore[misc]
        calls = 0

        def pre_forward(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
            Counting.calls += 1
            return args, kwargs

    model = tiny_model("llama", seed=0)
    ids = tokens(model.config.vocab_size)
    with torch.no_grad():
        expected = model(ids).logits
    for layer in model.model.layers:
        add_hook_to_module(layer, Counting())
    with layerswap.swap(model, "llama.decoder.fused"):
        for layer in model.model.layers:
            assert str(layerswap.model.substitution_of(layer)) == "llama.decoder.fused"
            # the hook's forward calls the replacement's own
            assert layer._old_forward.__func__ is type(layer).forward
        with torch.no_grad():
            got = model(ids).logits
    assert Counting.calls == len(model.model.layers)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


_EDITS = {
    # LLM2Vec-style: a decoder made to attend both ways on its attention modules
    "is_causal": (
        lambda layer: setattr(layer.self_attn, "is_causal", False),
        r"self_attn\.is_causal is False on the layer, where its config builds True",
    ),
    "scaling": (
        lambda layer: setattr(layer.self_attn, "scaling", 0.1),
        r"self_attn\.scaling is 0\.1 on the layer",
    ),
    "epsilon": (
        lambda layer: setattr(layer.input_layernorm, "variance_epsilon", 0.1),
        r"input_layernorm\.variance_epsilon is 0\.1",
    ),
    "module": (
        lambda layer: setattr(layer.mlp, "act_fn", torch.nn.GELU()),
        r"mlp\.act_fn is a GELU, where its config builds a SiLUActivation",
    ),
    "forward": (
        lambda layer: setattr(layer.mlp, "forward", lambda x: x),
        r"mlp has a forward set on the instance",
    ),
    "hook": (
        lambda layer: layer.self_attn.register_forward_hook(_log_attention),
        r"self_attn holds a hook of its own \(_log_attention\), which the replacement would "
        r"not run",
    ),
    # the layer's own forward hooks are carried over; its backward hooks are not
    "backward": (
        lambda layer: layer.register_full_backward_hook(_log_gradient),
        r"the layer holds a hook of its own \(_log_gradient\)",
    ),
    # transformers' own, but not its output capture: the debugger's hooks would be lost
    "debugger": (
        lambda layer: layer.mlp.register_forward_hook(DebugUnderflowOverflow.forward_hook),
        r"mlp holds a hook of its own \(DebugUnderflowOverflow\.forward_hook\)",
    ),
}


def _log_gradient(module: torch.nn.Module, grad_input: Any, grad_output: Any) -> None:
    """A user's backward hook on a decoder layer (a gradient logger)."""


def _log_attention(module: torch.nn.Module, args: Any, output: Any) -> None:
    """A user's forward hook on an attention module (an activation logger)."""


@pytest.mark.parametrize("edit", sorted(_EDITS))
def test_a_layer_changed_since_its_config_built_it_is_refused(edit: str) -> None:
    """The replacement is built from the config and the original's classes, and the
    first-use proof too: a change made on a layer object was dropped without a word (the
    swapped model computed something else: ``is_causal=False`` 0.94 apart in the logits).
    It is refused, naming the layer and the change, with the model untouched; the same
    model without the change swaps."""
    change, said = _EDITS[edit]
    model = tiny_model("llama", num_hidden_layers=2).eval()
    change(model.model.layers[1])
    before = _snapshot(model)
    with pytest.raises(SubstitutionError, match=rf"layer 'model\.layers\.1': {said}"):
        layerswap.swap(model, "llama.decoder.fused")
    _assert_untouched(model, before)
    plain = tiny_model("llama", num_hidden_layers=2).eval()
    # transformers' own output-capture hooks (on the attentions) are followed, not changes
    plain(tokens(plain.config.vocab_size), output_attentions=True, output_hidden_states=True)
    with layerswap.swap(plain, "llama.decoder.fused"):
        assert isinstance(plain.model.layers[1], fused.FusedDecoderLayer)


def test_a_layer_whose_accelerate_hooks_were_removed_swaps() -> None:
    """Removing accelerate's hooks (``remove_hook_from_submodules``, as PEFT's loading of an
    offloaded model does) leaves each module its class's ``forward`` bound on the
    instance: no change of the layer, so the swap goes ahead, exact."""
    from accelerate.hooks import attach_align_device_hook, remove_hook_from_submodules

    model = tiny_model("llama", num_hidden_layers=2).eval()
    attach_align_device_hook(model, execution_device="cpu")
    remove_hook_from_submodules(model)
    assert "forward" in vars(model.model.layers[0].self_attn.q_proj)
    ids = tokens(model.config.vocab_size)
    with torch.no_grad():
        expected = model(ids).logits
    with layerswap.swap(model, "llama.decoder.fused"), torch.no_grad():
        torch.testing.assert_close(model(ids).logits, expected, atol=1e-5, rtol=1e-5)
