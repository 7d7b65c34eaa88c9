"""Substitutions as data: families, the registry, entry points, upstream checks, use()."""

from __future__ import annotations

import dataclasses
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from models import FAMILIES, tiny_config, tiny_model, tokens
from torch import nn
from transformers.models.llama import modeling_llama
from transformers.models.qwen2 import modeling_qwen2

import layerswap
from layerswap.backends import fused
from layerswap.errors import (
    RequirementError,
    SubstitutionError,
    UnknownSubstitutionError,
    UpstreamDriftError,
)
from layerswap.family import Family
from layerswap.model import layer_config
from layerswap.registry import (
    get_family,
    load_entry_points,
    register_family,
    unregister,
    unregister_family,
)
from layerswap.substitution import Substitution
from layerswap.weights import Converter, qkv_concat

# --- families -------------------------------------------------------------------------


def test_builtin_families_are_declared() -> None:
    assert set(FAMILIES) <= set(layerswap.families())
    assert get_family("qwen3").attention.qk_norm and not get_family("llama").attention.qk_norm


@pytest.mark.parametrize("name", FAMILIES)
def test_tiny_configs_have_several_layers_and_grouped_query_attention(name: str) -> None:
    config = layer_config(tiny_config(name))  # a wrapper family's: its text config
    assert config.num_hidden_layers >= 2
    assert config.num_key_value_heads < config.num_attention_heads
    assert type(tiny_config(name)).__name__ == get_family(name).config_class
    assert layer_config(tiny_config(name, num_hidden_layers=1)).num_hidden_layers == 1


def test_build_is_deterministic_and_leaves_the_global_rng_alone() -> None:
    torch.manual_seed(123)
    expected_next = torch.rand(1)
    torch.manual_seed(123)
    first = tiny_model("llama", seed=3, num_hidden_layers=1)
    assert torch.equal(torch.rand(1), expected_next)
    second = tiny_model("llama", seed=3, num_hidden_layers=1)
    other = tiny_model("llama", seed=4, num_hidden_layers=1)
    for key, value in first.state_dict().items():
        assert torch.equal(value, second.state_dict()[key]), key
    assert not torch.equal(first.lm_head.weight, other.lm_head.weight)
    # norms are not left at their initial value, so ignoring one would show
    assert not torch.equal(
        first.model.layers[0].input_layernorm.weight, torch.ones(first.config.hidden_size)
    )


def test_unknown_family_suggests_close_names() -> None:
    with pytest.raises(UnknownSubstitutionError, match="did you mean 'qwen3'"):
        get_family("qwen33")


# --- registry ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", FAMILIES)
def test_every_family_has_a_fused_substitution(name: str) -> None:
    sub = layerswap.get(f"{name}.decoder.fused")
    assert (sub.family, sub.backend) == (name, "fused")
    assert sub.unmet_requirement() is None
    assert sub.original_class() is get_family(name).decoder_class()
    assert issubclass(sub.replacement_class(), fused.FusedDecoderLayer)


def test_unknown_name_lists_close_names() -> None:
    with pytest.raises(UnknownSubstitutionError, match=r"did you mean 'llama\.decoder\.fused'"):
        layerswap.get("llama.decoder.fusd")
    with pytest.raises(LookupError):
        layerswap.get("nothing.like.it")


def test_substitutions_filter_by_family_and_backend() -> None:
    qwen3 = layerswap.substitutions(family="qwen3")
    assert qwen3 and {sub.family for sub in qwen3} == {"qwen3"}
    fused_subs = layerswap.substitutions(backend="fused")
    assert {sub.family for sub in fused_subs} >= set(FAMILIES)
    assert [sub.name for sub in fused_subs] == sorted(sub.name for sub in fused_subs)
    assert layerswap.substitutions(family="qwen3", backend="fused") == [
        layerswap.get("qwen3.decoder.fused"),
        layerswap.get("qwen3.head.fused"),
        layerswap.get("qwen3.mlp.fused"),
        layerswap.get("qwen3.norm.fused"),
        layerswap.get("qwen3.qkv.fused"),
        layerswap.get("qwen3.rotary.fused"),
    ]


def test_substitutions_are_frozen_and_derivable() -> None:
    base = layerswap.get("llama.decoder.fused")
    with pytest.raises(dataclasses.FrozenInstanceError):
        base.name = "other"  # type: ignore[misc]
    derived = dataclasses.replace(base, name="llama.decoder.derived", description="mine")
    assert layerswap.get(derived) is derived
    assert derived.converter is base.converter and base.name == "llama.decoder.fused"


def test_register_refuses_a_taken_name_unless_replacing() -> None:
    base = layerswap.get("llama.decoder.fused")
    mine = dataclasses.replace(base, name="llama.decoder.test-register")
    try:
        assert layerswap.register(mine) is mine
        assert layerswap.get("llama.decoder.test-register") is mine
        layerswap.register(mine)  # the same substitution again is fine
        other = dataclasses.replace(mine, description="different")
        with pytest.raises(SubstitutionError, match="already registered"):
            layerswap.register(other)
        layerswap.register(other, replace=True)
        assert layerswap.get("llama.decoder.test-register") is other
    finally:
        unregister("llama.decoder.test-register")
    with pytest.raises(UnknownSubstitutionError):
        layerswap.get("llama.decoder.test-register")
    with pytest.raises(SubstitutionError, match="must be letters"):
        layerswap.register(dataclasses.replace(base, name="has spaces"))


@pytest.fixture
def plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[str], None]]:
    """Install a plugin distribution (a module and its dist-info) into tmp_path."""
    monkeypatch.syspath_prepend(str(tmp_path))
    names = ["llama.decoder.plugin-one", "llama.decoder.plugin-two", "llama.decoder.plugin-three"]

    def install(entry_points: str) -> None:
        (tmp_path / "ls_plugin_mod.py").write_text(
            textwrap.dedent(
                """
                import dataclasses
                import layerswap

                _base = layerswap.get("llama.decoder.fused")
                ONE = dataclasses.replace(_base, name="llama.decoder.plugin-one")
                MANY = [dataclasses.replace(_base, name="llama.decoder.plugin-two")]

                def make():
                    return dataclasses.replace(_base, name="llama.decoder.plugin-three")
                """
            )
        )
        dist = tmp_path / "ls_plugin-0.1.dist-info"
        dist.mkdir()
        (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: ls-plugin\nVersion: 0.1\n")
        (dist / "entry_points.txt").write_text(textwrap.dedent(entry_points))

    yield install
    for name in names:
        if name in {sub.name for sub in layerswap.substitutions()}:
            unregister(name)
    sys.modules.pop("ls_plugin_mod", None)


def test_entry_points_add_a_substitution_an_iterable_and_a_factory(
    plugin: Callable[[str], None],
) -> None:
    plugin(
        """
        [layerswap.substitutions]
        one = ls_plugin_mod:ONE
        many = ls_plugin_mod:MANY
        factory = ls_plugin_mod:make
        """
    )
    added = {sub.name for sub in load_entry_points()}
    assert added == {
        "llama.decoder.plugin-one",
        "llama.decoder.plugin-two",
        "llama.decoder.plugin-three",
    }
    assert layerswap.get("llama.decoder.plugin-three").backend == "fused"
    assert load_entry_points() == []  # loading again adds nothing twice


def test_a_broken_entry_point_is_skipped_with_a_warning_naming_it(
    plugin: Callable[[str], None],
) -> None:
    plugin(
        """
        [layerswap.substitutions]
        broken = ls_plugin_mod:DOES_NOT_EXIST
        one = ls_plugin_mod:ONE
        """
    )
    with pytest.warns(RuntimeWarning, match="'broken'"):
        added = load_entry_points()
    assert [sub.name for sub in added] == ["llama.decoder.plugin-one"]


def test_register_family_adds_its_backend_substitutions() -> None:
    ministral = Family(
        name="ministral-test",
        model_type="ministral",
        module="transformers.models.ministral.modeling_ministral",
        decoder="MinistralDecoderLayer",
        config_class="MinistralConfig",
        causal_lm="MinistralForCausalLM",
        qkv_bias=False,
        o_bias=False,
        tiny={**get_family("mistral").tiny, "head_dim": 16},
    )
    try:
        added = register_family(ministral)
        assert "ministral-test.decoder.fused" in [sub.name for sub in added]
        model = ministral.build()
        ids = tokens(model.config.vocab_size)
        with torch.no_grad():
            expected = model(ids).logits
            with layerswap.swap(model, backend="fused"):
                actual = model(ids).logits
        torch.testing.assert_close(actual, expected, atol=1e-5, rtol=0)
    finally:
        unregister_family("ministral-test")
    assert layerswap.substitutions(family="ministral-test") == []


# --- upstream checks --------------------------------------------------------------------


def test_builtin_substitutions_fit_the_installed_transformers() -> None:
    for name in FAMILIES:
        layerswap.get(f"{name}.decoder.fused").check_upstream(tiny_config(name))
    layerswap.get("llama.decoder.fused").check_upstream(
        tiny_config("llama", attention_bias=True, mlp_bias=True)
    )


def test_a_family_whose_assumption_fails_is_upstream_drift() -> None:
    # declared without q/k norms, while transformers' Qwen3 layer has them
    wrong = dataclasses.replace(get_family("qwen3"), name="qwen3-without-qk-norm", qk_norm=False)
    sub = fused.BACKEND.substitution(wrong)
    with pytest.raises(UpstreamDriftError) as caught:
        sub.check_upstream(tiny_config("qwen3"))
    message = str(caught.value)
    assert "qwen3-without-qk-norm" in message
    assert "'self_attn.q_norm.weight'" in message
    assert transformers.__version__ in message


def test_a_converter_that_misses_tensors_is_upstream_drift_and_swap_refuses_it() -> None:
    base = layerswap.get("llama.decoder.fused")
    partial = dataclasses.replace(base, converter=Converter((qkv_concat("self_attn.qkv_proj"),)))
    with pytest.raises(UpstreamDriftError, match=r"'mlp\.gate_up_proj\.weight' .* gets no tensor"):
        partial.check_upstream(tiny_config("llama"))
    model = tiny_model("llama", num_hidden_layers=2)
    layers = list(model.model.layers)
    with pytest.raises(UpstreamDriftError):
        layerswap.swap(model, partial)
    assert list(model.model.layers) == layers


def test_a_bias_the_family_does_not_declare_is_upstream_drift() -> None:
    # declared without q/k/v bias: with attention_bias on, the bias would be dropped
    wrong = dataclasses.replace(get_family("llama"), name="llama-no-bias", qkv_bias=False)
    with pytest.raises(UpstreamDriftError, match=r"'self_attn\.qkv_proj\.bias' .* no place"):
        fused.BACKEND.substitution(wrong).check_upstream(tiny_config("llama", attention_bias=True))


def test_an_original_without_position_embeddings_is_upstream_drift(
    make_module: Callable[[str, str], str],
) -> None:
    module = make_module(
        "old_layer",
        """
        import torch

        class OldDecoderLayer(torch.nn.Module):
            def __init__(self, config, layer_idx):
                super().__init__()

            def forward(self, hidden_states, attention_mask=None, position_ids=None):
                return (hidden_states,)
        """,
    )
    old = dataclasses.replace(
        layerswap.get("llama.decoder.fused"), original=f"{module}:OldDecoderLayer"
    )
    with pytest.raises(UpstreamDriftError, match="position_embeddings"):
        old.check_upstream(tiny_config("llama"))


def test_a_vanished_original_class_is_upstream_drift() -> None:
    gone = dataclasses.replace(
        layerswap.get("llama.decoder.fused"),
        original="transformers.models.llama.modeling_llama:LlamaDecoderLayerV9",
    )
    with pytest.raises(UpstreamDriftError, match=transformers.__version__):
        gone.original_class()


def test_an_unmet_requirement_is_a_clear_error_everywhere() -> None:
    needs_cuda = dataclasses.replace(
        layerswap.get("llama.decoder.fused"), requirement=lambda: "needs CUDA"
    )
    assert needs_cuda.unmet_requirement() == "needs CUDA"
    with pytest.raises(RequirementError, match="needs CUDA"):
        needs_cuda.replacement_class()
    with pytest.raises(RequirementError, match="needs CUDA"):
        layerswap.use(needs_cuda)
    model = tiny_model("llama", num_hidden_layers=1)
    layer = model.model.layers[0]
    with pytest.raises(RequirementError, match="needs CUDA"):
        layerswap.swap(model, needs_cuda)
    assert model.model.layers[0] is layer


# --- use() and replace_decoder() --------------------------------------------------------


def test_use_builds_replacement_layers_and_restores_the_class() -> None:
    original = modeling_llama.LlamaDecoderLayer
    replacement = layerswap.get("llama.decoder.fused").replacement_class()
    with layerswap.use("llama.decoder.fused"):
        assert modeling_llama.LlamaDecoderLayer is replacement
        model = modeling_llama.LlamaForCausalLM(tiny_config("llama"))
    assert modeling_llama.LlamaDecoderLayer is original
    assert all(type(layer) is replacement for layer in model.model.layers)
    assert "substitution=llama.decoder.fused" in repr(model)


def test_use_restores_the_class_when_the_block_raises() -> None:
    original = modeling_llama.LlamaDecoderLayer
    with pytest.raises(KeyError), layerswap.use("llama.decoder.fused"):
        raise KeyError("inside")
    assert modeling_llama.LlamaDecoderLayer is original


def test_a_model_built_inside_use_records_hidden_states_and_keeps_layers_whole() -> None:
    config = tiny_config("qwen3")
    with layerswap.use("qwen3.decoder.fused"):
        model = get_family("qwen3").build(config)
    ids = tokens(config.vocab_size)
    with torch.no_grad():
        hidden = model(ids, output_hidden_states=True).hidden_states
    assert len(hidden) == config.num_hidden_layers + 1
    assert "FusedQwen3DecoderLayer" in model._no_split_modules


def test_swap_refuses_a_model_built_inside_use() -> None:
    with layerswap.use("llama.decoder.fused"):
        model = get_family("llama").build()
    with pytest.raises(SubstitutionError, match="already swapped"):
        layerswap.swap(model, backend="fused")


class _Passthrough(nn.Module):
    """A stand-in decoder layer: the decoder-layer contract, returning its input."""

    calls = 0
    # it ignores what it is called with on purpose, and says so
    handles = layerswap.LAYER_CALL_PARAMETERS

    def __init__(self, config: Any, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx

    def forward(self, hidden_states: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        type(self).calls += 1
        return hidden_states


class CountingLlamaLayer(modeling_llama.LlamaDecoderLayer):
    calls = 0

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        type(self).calls += 1
        return super().forward(*args, **kwargs)  # type: ignore[no-any-return]


class TEQwen2DecoderLayer(_Passthrough):
    """Named after its family, like TransformerEngine example layers."""


def test_replace_decoder_builds_every_layer_as_the_class_and_restores() -> None:
    original = modeling_llama.LlamaDecoderLayer
    with pytest.raises(RuntimeError), layerswap.replace_decoder(CountingLlamaLayer):
        model = modeling_llama.LlamaForCausalLM(tiny_config("llama"))
        assert modeling_llama.LlamaDecoderLayer is CountingLlamaLayer
        raise RuntimeError("the block fails")
    assert modeling_llama.LlamaDecoderLayer is original
    assert all(type(layer) is CountingLlamaLayer for layer in model.model.layers)
    CountingLlamaLayer.calls = 0
    with torch.no_grad():
        model(tokens(512))
    assert CountingLlamaLayer.calls == model.config.num_hidden_layers


def test_replace_decoder_infers_the_family_from_the_class_name() -> None:
    with layerswap.replace_decoder(TEQwen2DecoderLayer):
        qwen2 = modeling_qwen2.Qwen2ForCausalLM(tiny_config("qwen2"))
        llama = modeling_llama.LlamaForCausalLM(tiny_config("llama"))
    assert all(type(layer) is TEQwen2DecoderLayer for layer in qwen2.model.layers)
    assert all(type(layer) is modeling_llama.LlamaDecoderLayer for layer in llama.model.layers)


def test_replace_decoder_defaults_to_llama_and_accepts_an_explicit_family() -> None:
    with layerswap.replace_decoder(_Passthrough):
        llama = modeling_llama.LlamaForCausalLM(tiny_config("llama", num_hidden_layers=1))
    assert type(llama.model.layers[0]) is _Passthrough
    with layerswap.replace_decoder(_Passthrough, family="qwen2"):
        qwen2 = modeling_qwen2.Qwen2ForCausalLM(tiny_config("qwen2", num_hidden_layers=1))
    assert type(qwen2.model.layers[0]) is _Passthrough
    _Passthrough.calls = 0
    with torch.no_grad():
        qwen2(tokens(512))
    assert _Passthrough.calls == 1


def test_substitution_str_is_its_name() -> None:
    sub = layerswap.get("gemma.decoder.fused")
    assert str(sub) == "gemma.decoder.fused"
    assert isinstance(sub, Substitution) and get_family(sub.family) is get_family("gemma")


def test_use_group_names_its_substitution_and_is_listed_while_applied():
    from layerswap.use import applied

    group = layerswap.use("llama.decoder.fused")
    assert "use('llama.decoder.fused')" in repr(group)
    assert applied() == ()
    with group:
        assert [s.name for s in applied()] == ["llama.decoder.fused"]
        assert "use('llama.decoder.fused')" in repr(group) and "active" in repr(group)
    assert applied() == ()


def test_an_unknown_name_gets_the_nearest_names_not_every_name() -> None:
    """Hundreds of substitution names would bury the suggestion: the error names the
    nearest ones, says how many there are and where they are listed."""
    with pytest.raises(LookupError) as info:
        layerswap.get("lama.decoder.fused")
    message = str(info.value)
    assert "did you mean 'llama.decoder.fused'" in message
    assert "are known: `layerswap list` lists them" in message
    assert len(message) < 300 and "qwen3.head.fused" not in message
    with pytest.raises(LookupError, match=r"\(known: fused, liger, te\)"):
        layerswap.get_backend("fusd")  # a short list is still given whole
