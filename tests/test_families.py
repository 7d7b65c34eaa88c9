"""Every registered family, generated from the registry: inference, and the fused layer proven.

The families are the hand-written ones and those inferred from transformers'
modeling modules (``layerswap/families/_inferred.py``); each gets the same checks on a
tiny config built from its config class with random weights (fixed seeds, norms and
biases perturbed): float32 verification on left-padded inputs with gradients and greedy
generation, a training step, save -> plain transformers load, undo bitwise.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import pytest
import torch
from models import FAMILIES, left_padded_batch, text_vocab, tiny_model, tokens
from typer.testing import CliRunner

import layerswap
from layerswap.backends import fused
from layerswap.cli import app
from layerswap.errors import UnsupportedFamilyError
from layerswap.families import INFERRED
from layerswap.families.infer import VERIFIED
from layerswap.inference import infer_family, prove_inferred
from layerswap.registry import families, get_family

# --- inference -----------------------------------------------------------------------------


@pytest.mark.slow  # infers every builtin model type
def test_the_inferred_declarations_are_what_inference_gives_with_this_transformers() -> None:
    inferred = [infer_family(model_type, verify=False) for model_type in VERIFIED]
    assert list(INFERRED) == inferred, "stale: run python scripts/gen_families.py"
    assert [dict(f.tiny) for f in INFERRED] == [dict(f.tiny) for f in inferred]


def test_the_generator_writes_declarations_that_build_the_inferred_families() -> None:
    """``scripts/gen_families.py`` writes each family's features flat, as declarations
    give them (a group written whole named a class the file does not import, and the
    registry could not load it)."""
    import runpy

    script = Path(__file__).resolve().parents[1] / "scripts" / "gen_families.py"
    render = runpy.run_path(str(script))["render"]
    types = ["cohere", "flint", "gpt_oss", "olmo"]  # parallel, sinks, clip_qkv, norm_scale
    namespace: dict[str, object] = {}
    exec(render(types), namespace)
    held = {family.name: family for family in INFERRED}
    for written in namespace["INFERRED"]:  # type: ignore[attr-defined]
        assert written == held[written.name], written.name
        assert dict(written.tiny) == dict(held[written.name].tiny)


def test_a_family_inferred_inside_autocast_is_inferred_in_float32() -> None:
    """Inferred inside ``torch.autocast`` (its probes and its proof compare numbers), a
    family was refused: "the fused layer does not compute what the original does"."""
    with torch.autocast("cpu", dtype=torch.bfloat16):
        family = infer_family("apertus")
    assert family == get_family("apertus")


def test_every_verified_model_type_is_a_builtin_family() -> None:
    registered = {family.model_type for family in families().values()}
    assert set(VERIFIED) <= registered
    assert get_family("gemma3").model_type == "gemma3_text"  # the _text suffix is dropped


def test_inference_reads_norm_placement_qk_norms_offsets_and_bias_switches() -> None:
    olmo2 = infer_family("olmo2", verify=False)
    assert olmo2.normalization.places == (
        ("attn_out", "post_attention_layernorm"),
        ("mlp_out", "post_feedforward_layernorm"),
    )
    assert olmo2.attention.qk_norm == "across" and olmo2.normalization.offset == 0.0
    gemma3 = infer_family("gemma3_text", verify=False)
    assert [place for place, _ in gemma3.normalization.places] == [
        "attn_in",
        "attn_out",
        "mlp_in",
        "mlp_out",
    ]
    assert gemma3.attention.qk_norm is True and gemma3.normalization.offset == 1.0
    assert gemma3.feed_forward.activation == "hidden_activation"
    starcoder2 = infer_family("starcoder2", verify=False)
    assert (
        starcoder2.normalization.kind,
        starcoder2.normalization.offset,
        starcoder2.feed_forward.kind,
    ) == ("layer", 0.0, "plain")
    assert starcoder2.feed_forward.modules == ("c_fc", "c_proj")
    nemotron = infer_family("nemotron", verify=False)
    assert (nemotron.normalization.kind, nemotron.normalization.offset) == (
        "layer",
        1.0,
    )  # LayerNorm1P: 1 + weight
    granite = infer_family("granite", verify=False)
    assert (granite.attention.qkv_bias, granite.feed_forward.bias) == ("attention_bias", "mlp_bias")
    arcee = infer_family("arcee", verify=False)  # down(relu2(up(x))), no gate
    assert (arcee.feed_forward.kind, arcee.feed_forward.modules, arcee.feed_forward.bias) == (
        "plain",
        ("up_proj", "down_proj"),
        "mlp_bias",
    )
    phi3 = infer_family("phi3", verify=False)  # fuses q/k/v and gate/up itself
    assert (phi3.attention.qkv_modules, phi3.feed_forward.modules) == (
        ("qkv_proj",),
        ("gate_up_proj", "down_proj"),
    )


def test_inference_reads_parallel_blocks_bias_free_layernorms_and_per_head_qk_weights() -> None:
    cohere = infer_family("cohere", verify=False)
    # x + attn(norm(x)) + mlp(norm(x)): one norm feeds both branches
    assert cohere.layer.parallel is True
    assert cohere.normalization.places == (
        ("attn_in", "input_layernorm"),
        ("mlp_in", "input_layernorm"),
    )
    # CohereLayerNorm has a weight and no bias, yet centres: a LayerNorm, not an RMSNorm
    assert (cohere.normalization.kind, cohere.normalization.offset) == ("layer_nobias", 0.0)
    # its q/k norms, (heads, head_dim) weights, exist where use_qk_norm switches them on
    assert (cohere.attention.qk_norm, cohere.attention.qk_norm_switch) == (
        "head_weights",
        "use_qk_norm",
    )
    assert cohere.rope.layout == "interleaved"  # its rotary module hands interleaved cos/sin
    assert infer_family("llama", verify=False).layer.parallel is False


def test_inference_reads_the_rotary_layout_and_renamed_norm_places() -> None:
    glm4 = infer_family("glm4", verify=False)
    assert glm4.normalization.places == (
        ("attn_in", "input_layernorm"),
        ("attn_out", "post_self_attn_layernorm"),
        ("mlp_in", "post_attention_layernorm"),
        ("mlp_out", "post_mlp_layernorm"),
    )
    assert (glm4.attention.qkv_bias, glm4.attention.o_bias) == ("attention_bias", False)
    assert glm4.feed_forward.modules == ("gate_up_proj", "down_proj")
    # cos/sin arrive in rotate-half layout; GLM repeats their first half over pairs
    assert glm4.rope.layout == "interleaved_from_half"
    assert [infer_family(t, verify=False).rope.layout for t in ("helium", "llama")] == [
        "interleaved_from_half",
        "half",
    ]


def test_inference_reads_norms_without_parameters_and_the_reversed_rotation() -> None:
    """nanochat: RMSNorms without a weight everywhere (q/k norms too), rotate_half as
    (x2, -x1); OLMo: a LayerNorm without weight or bias, and clip_qkv."""
    nanochat = infer_family("nanochat", verify=False)
    assert (
        nanochat.normalization.kind,
        nanochat.normalization.scale,
        nanochat.attention.qk_norm,
    ) == ("rms", False, True)
    assert nanochat.rope.layout == "half_reversed"
    assert (nanochat.feed_forward.kind, nanochat.feed_forward.modules) == ("plain", ("fc1", "fc2"))
    olmo = infer_family("olmo", verify=False)
    assert (olmo.normalization.kind, olmo.normalization.scale, olmo.attention.clip_qkv) == (
        "layer_nobias",
        False,
        "clip_qkv",
    )
    assert infer_family("llama", verify=False).normalization.scale is True


def test_inference_reads_q_k_norms_under_other_names_and_after_the_rotation() -> None:
    """HunYuan normalises the rotated queries and keys, with a weight, under its own
    names; Qwen3 normalises the projections before the rotation."""
    hunyuan = infer_family("hunyuan_v1_dense", verify=False)
    assert hunyuan.attention.qk_norm_modules == ("query_layernorm", "key_layernorm")
    assert hunyuan.attention.qk_norm_after_rotary is True
    qwen3 = infer_family("qwen3", verify=False)
    assert (qwen3.attention.qk_norm_modules, qwen3.attention.qk_norm_after_rotary) == (
        ("q_norm", "k_norm"),
        False,
    )
    assert infer_family("nanochat", verify=False).attention.qk_norm_after_rotary is True


def test_q_k_norms_with_a_weight_after_the_rotation_are_not_the_same_before_it() -> None:
    """The placement matters once the norm has a weight: HunYuan declared with its norms
    before the rotation computes something else, and the swap says so."""
    hunyuan = get_family("hunyuan_v1_dense")
    model = hunyuan.build(seed=0)
    ids = tokens(text_vocab(hunyuan.tiny_config()), seed=4)
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    swapped = copy.deepcopy(model)
    layerswap.swap(swapped, "hunyuan_v1_dense.decoder.fused")
    norms = {k for k in model.state_dict() if "query_layernorm" in k or "key_layernorm" in k}
    assert norms and norms <= set(swapped.state_dict())  # kept under the original's names
    with torch.no_grad():
        torch.testing.assert_close(swapped(input_ids=ids).logits, expected, rtol=1e-4, atol=1e-4)
    # the same declaration with the norms before the rotation, one layer side by side
    from layerswap.backends import fused
    from layerswap.layers import convert_layer

    before = dataclasses.replace(hunyuan, qk_norm_after_rotary=False)
    layer, config = model.model.layers[0], model.config
    wrong = convert_layer(
        layer, fused.BACKEND.substitution(before), config, layer_idx=0, detach=True
    )
    hidden = torch.randn(1, 6, config.hidden_size, generator=torch.Generator().manual_seed(0))
    cos, sin = model.model.rotary_emb(hidden, torch.arange(6)[None])
    call = {"attention_mask": None, "position_ids": torch.arange(6)[None]}
    with torch.no_grad():
        right = layer(hidden, position_embeddings=(cos, sin), **call)
        moved = wrong(hidden, position_embeddings=(cos, sin), **call)
    right = right[0] if isinstance(right, tuple) else right
    assert (moved - right).abs().max() > 1e-3


@pytest.mark.parametrize(
    ("model_type", "reason"),
    [
        ("granitemoeshared", "shared_intermediate_size > 0 adds shared_mlp, which"),
        ("vit", "no causal LM"),
        # the reason names what the layer has instead of what the replacement reads
        ("deepseek_v3", r"multi-head latent attention \(self_attn.kv_a_proj_with_mqa"),
        ("lfm2", r"its self_attn \(Lfm2Attention\) has q_proj, k_proj, v_proj, out_proj"),
        ("falcon_h1", r"the layer has no mlp \(it has feed_forward, mamba, self_attn"),
        # hybrids: which layers differ, and how
        (
            "qwen3_next",
            r"layers 0-2: linear_attn \(Qwen3NextGatedDeltaNet\); layer 3: self_attn "
            r"\(Qwen3NextAttention\)\); a replacement takes the place of every decoder layer",
        ),
        ("mllama", r"layer 3: MllamaCrossAttentionDecoderLayer, cross_attn"),
        ("lfm2_moe", r"layer 0: conv \(Lfm2MoeShortConv\), feed_forward \(Lfm2MoeMLP\)"),
        # a wrapper whose causal LM is the wrapper: its language model's reason
        ("gemma4", r"a multimodal wrapper whose language model is gemma4_text \(Gemma4Text"),
        # configs whose defaults cannot build their own model get the fields they lack
        ("gemma4_text", r"no counterpart for: self_attn.v_norm"),
        ("dbrx", "no model.layers of decoder layers"),
        # a size the config computes (a property without a setter) is left to it
        ("falcon", "falcon: no model.layers of decoder layers"),
    ],
)
def test_a_family_the_fused_layer_cannot_express_is_refused_with_the_reason(
    model_type: str, reason: str
) -> None:
    with pytest.raises(UnsupportedFamilyError, match=reason):
        infer_family(model_type)


def test_an_activation_with_learned_parameters_is_built_in_the_models_dtype(
    tmp_path: Path,
) -> None:
    """Apertus's xIELU holds learned parameters, which its MLP builds in ``config.dtype``;
    built from its name alone they would be bfloat16 and round a float32 checkpoint. The
    fused MLP builds them as the original does: loaded inside ``use()``, non-default
    values come through exactly."""
    apertus = get_family("apertus")
    assert apertus.feed_forward.activation_dtype and apertus.feed_forward.kind == "plain"
    model = apertus.build(seed=0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".act_fn.alpha_" in name:
                param.fill_(0.31234567)  # not representable in bfloat16
    ids = torch.randint(1, text_vocab(apertus.tiny_config()), (2, 9))
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    model.save_pretrained(tmp_path)
    from transformers import AutoModelForCausalLM

    with layerswap.use("apertus.decoder.fused"):
        loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    activation = loaded.model.layers[0].mlp.act_fn
    assert type(loaded.model.layers[0]).__name__ == "FusedApertusDecoderLayer"
    assert activation.alpha_p.dtype == torch.float32
    assert float(activation.alpha_p) == pytest.approx(0.31234567, abs=1e-7)  # bf16: 0.3125
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, expected, rtol=0, atol=1e-6)
    # the class's own default (bfloat16) is what the declaration avoids
    from layerswap.backends.fused import FusedMLP

    plain = FusedMLP(apertus.tiny_config(), dataclasses.replace(apertus, activation_dtype=False))
    assert plain.act_fn.alpha_p.dtype == torch.bfloat16


def test_a_config_dtype_given_as_a_name_is_read_and_left_as_it_is() -> None:
    """``save_pretrained`` leaves ``dtype="float32"`` (a name) in the model's own config:
    the swap builds Apertus's xIELU in the dtype it names, and the user's config keeps
    its name (layerswap changes no config of the user's)."""
    apertus = get_family("apertus")
    model = apertus.build(seed=0)
    model.config.dtype = "float32"
    ids = torch.randint(1, text_vocab(apertus.tiny_config()), (2, 9))
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    with layerswap.swap(model, "apertus.decoder.fused"):
        assert model.model.layers[0].mlp.act_fn.alpha_p.dtype == torch.float32
        with torch.no_grad():
            torch.testing.assert_close(model(input_ids=ids).logits, expected)
    assert model.config.dtype == "float32"


def test_a_mixture_of_experts_block_under_its_own_name_is_kept_there() -> None:
    """GraniteMoE's layer holds its block as ``block_sparse_moe``: the swapped layer keeps
    it under that name, so the checkpoint's keys and the model's logits stay the same."""
    granitemoe = get_family("granitemoe")
    assert (granitemoe.feed_forward.kind, granitemoe.feed_forward.attribute) == (
        "original",
        "block_sparse_moe",
    )
    model = granitemoe.build(seed=0)
    before = set(model.state_dict())
    ids = torch.randint(1, text_vocab(granitemoe.tiny_config()), (2, 9))
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    layerswap.swap(model, "granitemoe.decoder.fused")
    assert not hasattr(model.model.layers[0], "mlp")
    assert isinstance(model.model.layers[0].block_sparse_moe, torch.nn.Module)
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, expected, rtol=1e-4, atol=1e-4)
    assert {k for k in model.state_dict() if "block_sparse_moe" in k} == {
        k for k in before if "block_sparse_moe" in k
    }


def test_inference_keeps_a_mixture_of_experts_block_as_the_original_has_it() -> None:
    mixtral = infer_family("mixtral", verify=False)
    assert (
        mixtral.feed_forward.kind,
        mixtral.feed_forward.module_class,
        mixtral.feed_forward.modules,
    ) == (
        "original",
        "MixtralSparseMoeBlock",
        (),
    )
    assert (mixtral.tiny["num_local_experts"], mixtral.tiny["num_experts_per_tok"]) == (4, 2)
    assert (
        infer_family("qwen2_moe", verify=False).feed_forward.module_class
        == "Qwen2MoeSparseMoeBlock"
    )
    assert infer_family("llama", verify=False).feed_forward.module_class is None


def test_inference_gives_the_same_declaration_on_every_call() -> None:
    # Cohere 2 MoE: full-attention layers skip the rotary embedding (NoPE); the probe that
    # finds that rule once read the experts' uninitialised memory and flipped from call
    # to call between "sliding" and "all" (a wrong declaration then failed verification)
    first, second = (infer_family("cohere2_moe", verify=False) for _ in range(2))
    assert first == second
    assert first.rope.layers == "sliding_or_forced"


def test_a_dense_first_layer_that_forces_the_rotary_embedding_is_proven() -> None:
    # Cohere 2 MoE's dense first layers rotate although their attention is full
    # (prefix_dense_sliding_window_pattern 1: force_rope), its sparse full layers do not;
    # the family's tiny config has all three kinds, and a user's config with two dense
    # layers is proven and computes as the original (the "sliding" rule was refused)
    family = layerswap.get_family("cohere2_moe")
    assert family.rope.layers == "sliding_or_forced"
    config = family.tiny_config(first_k_dense_replace=2, num_hidden_layers=6)
    model = family.build(config, seed=3)
    kinds = [
        (config.mlp_layer_types[i], config.layer_types[i], layer.self_attn.force_rope)
        for i, layer in enumerate(model.model.layers)
    ]
    assert ("dense", "full_attention", True) in kinds
    assert ("sparse", "full_attention", False) in kinds
    ids = torch.randint(3, config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    with layerswap.swap(model, "cohere2_moe.decoder.fused"), torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, expected, rtol=1e-4, atol=1e-4)


def test_the_fused_moe_layer_keeps_the_original_block_with_its_dense_layers() -> None:
    # Qwen2-MoE: layer 1 dense (mlp_only_layers), the others sparse with a shared expert
    model = tiny_model("qwen2_moe", seed=7, num_hidden_layers=3, mlp_only_layers=[1])
    originals = [type(layer.mlp) for layer in model.model.layers]
    before = {name for name in model.state_dict() if ".mlp." in name}
    batch = left_padded_batch(text_vocab(model))
    report = layerswap.verify(model, "qwen2_moe.decoder.fused", batch, backward=True)
    assert report.passed, report.summary()
    layerswap.swap(model, "qwen2_moe.decoder.fused")
    assert [type(layer.mlp) for layer in model.model.layers] == originals
    assert originals[1].__name__ == "Qwen2MoeMLP" and "shared_expert" in dir(
        model.model.layers[0].mlp
    )
    assert {name for name in model.state_dict() if ".mlp." in name} == before


@pytest.mark.parametrize("hooked_first", [False, True], ids=["fresh", "hooked-before-swap"])
def test_router_logits_and_the_aux_loss_are_the_originals(hooked_first: bool) -> None:
    reference = tiny_model("mixtral", seed=8, num_hidden_layers=2)
    candidate = copy.deepcopy(reference)
    ids = tokens(text_vocab(reference))
    if hooked_first:  # transformers installs its recording hooks on the first such call
        candidate(ids, output_router_logits=True)
    layerswap.swap(candidate, "mixtral.decoder.fused")
    with torch.no_grad():
        want = reference(ids, labels=ids, output_router_logits=True)
        got = candidate(ids, labels=ids, output_router_logits=True)
    assert len(got.router_logits) == len(want.router_logits) == 2
    torch.testing.assert_close(got.aux_loss, want.aux_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-5, atol=1e-6)


def test_a_family_whose_structure_fits_but_computes_otherwise_is_refused() -> None:
    # EXAONE 4 looks like OLMo 2 but skips the rotary embedding on its full-attention
    # layers; declared as rotating every layer, its structure still fits: only the
    # verification inference ends with can tell
    wrong = dataclasses.replace(infer_family("exaone4", verify=False), rotary_layers="all")
    with pytest.raises(UnsupportedFamilyError, match="does not compute what the original does"):
        prove_inferred(wrong, "exaone4 (declared to rotate every layer)")
    assert families()["exaone4"].rope.layers == "sliding_or_unwindowed"  # left as it was


@pytest.mark.slow
@pytest.mark.xdist_group("coverage")  # shares its stored answers with the docs' list --all
def test_list_all_names_every_decoder_family_and_why_not() -> None:
    result = CliRunner().invoke(app, ["list", "--all", "--json"])
    assert result.exit_code == 0, result.output
    rows = {row["model_type"]: row for row in json.loads(result.output)}
    assert len(rows) > 100  # every causal-LM model type of the installed transformers
    for family in families().values():
        # under its own model type, or the one whose causal LM it is (Mllama's text model)
        row = rows.get(family.model_type) or next(
            row for row in rows.values() if row["family"] == family.name
        )
        assert row["reason"] is None and row["family"] == family.name
        assert "fused" in row["backends"]
    assert "te" in rows["llama"]["backends"] and "te" not in rows["olmo2"]["backends"]
    # per backend: why one does not cover a family another covers
    assert rows["olmo2"]["not_covered"]["te"] == layerswap.get_backend("te").unsupported(
        families()["olmo2"]
    )
    assert "fused" not in rows["olmo2"]["not_covered"]
    assert "shared_intermediate_size > 0 adds shared_mlp" in rows["granitemoeshared"]["reason"]
    assert rows["granitemoe"]["family"] == "granitemoe"
    assert "multi-head latent attention" in rows["deepseek_v3"]["reason"]
    # the multimodal wrappers proven on image prompts, through their language model
    for model_type, family_name in (
        ("llava", "llama"),
        ("gemma3", "gemma3"),
        ("mistral3", "mistral"),
    ):
        row = rows[model_type]
        assert row["family"] == family_name and row["reason"] is None, row
        assert "vision tower" in row["wrapper"] and "fused" in row["backends"]
    assert rows["llama"]["wrapper"] is None
    # a model of two layer kinds: the kept kind is named
    assert rows["mllama"]["family"] == "mllama" and "fused" in rows["mllama"]["backends"]
    assert "cross-attention layers" in rows["mllama"]["kept"]
    assert rows["llama"]["kept"] is None


def test_attention_logit_soft_capping_is_computed_as_the_original_does() -> None:
    # weights and a cap that bend the scores (the tiny config's cap of 50 barely does)
    bent = {"attn_logit_softcapping": 1.0, "initializer_range": 0.2}
    model = tiny_model("gemma2", seed=4, **bent)
    assert model.config._attn_implementation == "eager"  # Gemma 2 refuses SDPA
    batch = left_padded_batch(text_vocab(model))
    report = layerswap.verify(model, "gemma2.decoder.fused", batch, backward=True)
    assert report.passed, report.summary()
    uncapped = tiny_model("gemma2", seed=4, **{**bent, "attn_logit_softcapping": None})
    with torch.no_grad():
        assert not torch.allclose(model(**batch).logits, uncapped(**batch).logits, atol=1e-3)


@pytest.mark.parametrize("factor", [0.5, 0.75])
def test_partial_rotary_embeddings_rotate_the_first_dims_of_each_head(factor: float) -> None:
    rope = {"rope_type": "default", "rope_theta": 10000.0}
    model = tiny_model("phi3", seed=5, rope_parameters={**rope, "partial_rotary_factor": factor})
    batch = left_padded_batch(text_vocab(model))
    report = layerswap.verify(model, "phi3.decoder.fused", batch, backward=True, generate=4)
    assert report.passed, report.summary()
    full = tiny_model("phi3", seed=5, rope_parameters={**rope, "partial_rotary_factor": 1.0})
    with torch.no_grad():
        assert not torch.allclose(model(**batch).logits, full(**batch).logits, atol=1e-4)


def test_cohere_q_k_norms_with_a_weight_per_head_are_computed_as_the_original_does() -> None:
    model = tiny_model("cohere", seed=6, use_qk_norm=True)
    layer = model.model.layers[0]
    assert tuple(layer.self_attn.q_norm.weight.shape) == (8, 16)
    batch = left_padded_batch(text_vocab(model))
    report = layerswap.verify(model, "cohere.decoder.fused", batch, backward=True, generate=4)
    assert report.passed, report.summary()
    # the per-head weights count: the same model with one head's weight changed differs
    changed = copy.deepcopy(model)
    with torch.no_grad():
        changed.model.layers[0].self_attn.q_norm.weight[3].mul_(3.0)
        assert not torch.allclose(model(**batch).logits, changed(**batch).logits, atol=1e-4)
    layerswap.swap(changed, "cohere.decoder.fused")
    with torch.no_grad():
        assert not torch.allclose(model(**batch).logits, changed(**batch).logits, atol=1e-4)


@pytest.mark.parametrize(
    ("feature", "reason"),
    [
        ({"parallel": True}, "in parallel"),
        ({"rotary": "interleaved"}, "rotary layout is interleaved"),
        ({"rotary": "interleaved_from_half"}, "rotary layout is interleaved_from_half"),
        ({"rotary": "half_reversed"}, "rotary layout is half_reversed"),
        ({"qk_norm": "head_weights"}, "one per head"),
        ({"qk_norm": True, "qk_norm_switch": "use_qk_norm"}, "follow use_qk_norm"),
        ({"norm_scale": False}, "norms have none"),
        ({"clip_qkv": "clip_qkv"}, "clamps them where clip_qkv is set"),
    ],
    ids=[
        "parallel",
        "interleaved",
        "interleaved_from_half",
        "half_reversed",
        "head_weights",
        "qk_norm_switch",
        "norm_scale",
        "clip_qkv",
    ],
)
def test_te_and_liger_refuse_what_their_layers_do_not_compute(
    feature: dict[str, object], reason: str
) -> None:
    from layerswap.backends import liger
    from layerswap.backends.te_layout import unexpressible

    # Llama but for one feature: both backends build Llama, so only that feature refuses
    llama = get_family("llama")
    assert unexpressible(llama) is None and liger.unsupported(llama) is None
    family = dataclasses.replace(llama, name="llama_variant", **feature)
    assert reason in str(unexpressible(family))
    assert reason in str(liger.unsupported(family))


def test_te_and_liger_refuse_a_mixture_of_experts_block() -> None:
    from layerswap.backends import liger
    from layerswap.backends.te_layout import unexpressible

    assert "original" in str(unexpressible(get_family("mixtral")))
    assert "original" in str(liger.unsupported(get_family("mixtral")))
    assert not {"te", "te_fp8", "liger"} & {
        sub.backend for sub in layerswap.substitutions(slot="decoder") if sub.family == "qwen3_moe"
    }


def test_the_new_families_are_refused_by_te_and_liger_with_their_reason() -> None:
    from layerswap.backends import liger
    from layerswap.backends.te_layout import unexpressible

    assert "parallel" in str(unexpressible(get_family("cohere")))
    assert "LayerNorm" in str(liger.unsupported(get_family("cohere")))
    for name in ("glm4", "glm", "helium", "ernie4_5"):
        assert "interleaved" in str(unexpressible(get_family(name))), name
        assert "interleaved" in str(liger.unsupported(get_family(name))), name
    te_layers = layerswap.substitutions(backend="te", slot="decoder")
    assert {sub.family for sub in te_layers}.isdisjoint(
        {"cohere", "glm4", "glm", "helium", "ernie4_5"}
    )


# --- the fused layer, for every registered family -------------------------------------------


@pytest.mark.parametrize("name", FAMILIES)
def test_fused_matches_in_float32_with_gradients_and_generation(name: str) -> None:
    model = tiny_model(name, seed=1)
    report = layerswap.verify(
        model,
        f"{name}.decoder.fused",
        left_padded_batch(text_vocab(model)),
        backward=True,
        generate=4,
    )
    assert report.passed, report.summary()
    assert report.max_rel_error < 1e-4


@pytest.mark.parametrize("name", FAMILIES)
def test_a_training_step_gives_the_same_loss(name: str) -> None:
    reference = tiny_model(name, seed=2, num_hidden_layers=2).train()
    candidate = copy.deepcopy(reference)
    layerswap.swap(candidate, f"{name}.decoder.fused")
    ids = tokens(text_vocab(reference), (2, 12))
    losses = []
    for model in (reference, candidate):
        torch.manual_seed(0)  # the same dropout draws, where a family has attention dropout
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        for _ in range(2):
            loss = model(ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        losses.append(float(loss.detach()))
    assert losses[1] == pytest.approx(losses[0], rel=1e-5)


@pytest.mark.parametrize("name", FAMILIES)
def test_save_loads_in_plain_transformers_and_undo_is_bitwise(name: str, tmp_path: Path) -> None:
    model = tiny_model(name, seed=3)
    before = {key: value.clone() for key, value in model.state_dict().items()}
    ids = tokens(text_vocab(model))
    handle = layerswap.swap(model, f"{name}.decoder.fused")
    with torch.no_grad():
        swapped = model(ids).logits
    model.save_pretrained(tmp_path)
    plain = get_family(name).causal_lm_class().from_pretrained(tmp_path).eval()
    with torch.no_grad():
        torch.testing.assert_close(plain(ids).logits, swapped, atol=1e-5, rtol=1e-5)
    handle.undo()
    after = model.state_dict()
    assert after.keys() == before.keys()
    assert all(torch.equal(after[key], value) for key, value in before.items())


@pytest.mark.parametrize(
    ("name", "rule", "skipping"),
    [
        ("cohere2", "sliding", [3]),
        ("exaone4", "sliding_or_unwindowed", [3]),
        ("smollm3", "use_rope", [3]),
    ],
)
def test_layers_that_skip_the_rotary_embedding_skip_it_in_the_fused_layer_too(
    name: str, rule: str, skipping: list[int]
) -> None:
    family = families()[name]
    model = tiny_model(name, seed=6)
    assert family.rope.layers == rule
    with layerswap.swap(model, backend="fused"):
        skipped = [i for i, layer in enumerate(model.model.layers) if not layer.self_attn.rotates]
    assert skipped == skipping
    # rotating every layer is what the original does not: verification names the first one
    everywhere = fused.BACKEND.substitution(dataclasses.replace(family, rotary_layers="all"))
    report = layerswap.verify(model, everywhere)
    assert not report.passed
    assert report.first_divergent_layer == skipping[0]


def test_a_norm_a_config_field_switches_is_declared_and_followed() -> None:
    """Cohere 2 MoE builds a bias-free LayerNorm where rms_norm_eps is unset (its default)
    and an RMSNorm where it is set; the family says so and the swap follows the config."""
    from layerswap.backends.fused import FusedLayerNorm, FusedRMSNorm
    from layerswap.registry import get_family
    from layerswap.verify import verify

    family = get_family("cohere2_moe")
    assert family.normalization.switch == ("rms_norm_eps", "layer_nobias")
    assert infer_family("llama", verify=False).normalization.switch is None
    for eps, expected in ((None, FusedLayerNorm), (1e-5, FusedRMSNorm)):
        model = family.build(family.tiny_config(rms_norm_eps=eps), seed=0)
        report = verify(model, "cohere2_moe.decoder.fused", generate=4)
        assert report.passed, report.summary()
        swapped = copy.deepcopy(model)
        layerswap.swap(swapped, "cohere2_moe.decoder.fused")
        norm = swapped.model.layers[0].input_layernorm
        assert type(norm) is expected and getattr(norm, "bias", None) is None
