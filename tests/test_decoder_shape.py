"""A family's decoder-layer structure, grouped (layerswap.decoder_shape): declared flat,
held and read by group, the flat names still read with a warning."""

from __future__ import annotations

import dataclasses
import pickle

import pytest

import layerswap
from layerswap.capabilities import Capability, refusal
from layerswap.decoder_shape import FLAT, GROUPS, Attention, FeedForward, Rope
from layerswap.family import Family

LLAMA = dict(
    name="llama_shaped",
    model_type="llama",
    module="transformers.models.llama.modeling_llama",
    decoder="LlamaDecoderLayer",
    config_class="LlamaConfig",
    causal_lm="LlamaForCausalLM",
)


def test_flat_features_land_in_their_groups() -> None:
    family = Family(
        **LLAMA, qkv_bias=True, mlp="plain", mlp_modules=("up", "down"), rotary="interleaved"
    )
    assert family.attention.qkv_bias is True
    assert family.attention.o_bias == "attention_bias"  # the default, untouched
    assert (family.feed_forward.kind, family.feed_forward.modules) == ("plain", ("up", "down"))
    assert family.rope == Rope(layout="interleaved")


def test_every_flat_name_reaches_one_group_field() -> None:
    for flat, (group, attr) in FLAT.items():
        assert attr in {field.name for field in dataclasses.fields(GROUPS[group])}, flat
    assert len(set(FLAT.values())) == len(FLAT)  # no two flat names for one field
    grouped = {(group, f.name) for group, cls in GROUPS.items() for f in dataclasses.fields(cls)}
    assert grouped == set(FLAT.values())  # and every grouped field has its flat name


def test_a_group_given_whole_takes_flat_features_on_top() -> None:
    family = Family(**LLAMA, attention=Attention(qkv_bias=True, qk_norm=True), o_bias=True)
    assert (family.attention.qkv_bias, family.attention.qk_norm, family.attention.o_bias) == (
        True,
        True,
        True,
    )


def test_the_flat_and_the_grouped_declaration_are_one_family() -> None:
    flat = Family(**LLAMA, mlp_bias="mlp_bias", norm_offset=1.0)
    grouped = Family(**LLAMA, feed_forward=FeedForward(bias="mlp_bias"))
    assert flat != grouped
    assert flat == dataclasses.replace(grouped, norm_offset=1.0)
    assert hash(flat) == hash(dataclasses.replace(grouped, norm_offset=1.0))


def test_replace_takes_flat_names_and_keeps_the_rest() -> None:
    qwen3 = layerswap.get_family("qwen3")
    without = qwen3.replace(name="qwen3-plain", qk_norm=False)
    assert without.attention.qk_norm is False and qwen3.attention.qk_norm is True
    assert without.normalization == qwen3.normalization and without.tiny == qwen3.tiny
    assert dataclasses.replace(qwen3, name="qwen3-plain", qk_norm=False) == without


def test_a_flat_read_still_answers_and_says_where_to_read() -> None:
    gemma3 = layerswap.get_family("gemma3")
    with pytest.warns(
        DeprecationWarning, match=r"Family\.norm_offset .* family\.normalization\.offset"
    ):
        assert gemma3.norm_offset == gemma3.normalization.offset == 1.0  # type: ignore[attr-defined]
    with pytest.warns(DeprecationWarning, match=r"family\.feed_forward\.kind"):
        assert gemma3.mlp == "gated"  # type: ignore[attr-defined]


def test_an_unknown_feature_is_refused_naming_the_known_ones() -> None:
    with pytest.raises(TypeError, match=r"qkv_biass.*a feature is one of .*qkv_bias"):
        Family(**LLAMA, qkv_biass=True)
    with pytest.raises(TypeError, match=r"Family\(rope=\.\.\.\) takes a Rope"):
        Family(**LLAMA, rope="half")  # type: ignore[arg-type]


def test_a_family_pickles_and_compares_by_its_groups() -> None:
    family = Family(**LLAMA, parallel=True, tiny={"hidden_size": 8})
    again = pickle.loads(pickle.dumps(family))
    assert again == family and again.layer.parallel is True and again.tiny == {"hidden_size": 8}


def test_a_capability_row_names_a_feature_flat_or_by_its_group() -> None:
    cohere = layerswap.get_family("cohere")
    for field in ("rotary", "rope.layout"):
        row = Capability(field, expresses=("half",), reason="layout {rope.layout}, {rotary}")
        assert refusal((row,), cohere) == "layout interleaved, interleaved"
    assert (
        refusal(
            (Capability("rope.layout", expresses=("half",), reason="x"),),
            layerswap.get_family("llama"),
        )
        is None
    )


def test_a_capability_naming_no_feature_is_refused_when_written() -> None:
    with pytest.raises(ValueError, match=r"Family has no field 'rope\.kind'"):
        Capability("rope.kind", expresses=("half",), reason="x")
    with pytest.raises(ValueError, match=r"reason names rope\.kind"):
        Capability("rope.layout", expresses=("half",), reason="this family's {rope.kind}")
