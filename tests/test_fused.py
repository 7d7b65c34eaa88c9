"""The fused backend computes what the original layers compute, on every family."""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from models import FAMILIES, left_padded_batch, text_vocab, tiny_config, tiny_model, tokens

import layerswap
from layerswap.backends import fused
from layerswap.errors import RequirementError
from layerswap.swap import decoder_layers, family_of

ATOL = 1e-5

# llama with every optional bias switched on, besides the plain families
CASES = [pytest.param(name, {}, id=name) for name in FAMILIES] + [
    pytest.param("llama", {"attention_bias": True, "mlp_bias": True}, id="llama-biases"),
]


@pytest.mark.parametrize(("name", "overrides"), CASES)
def test_logits_equal_original_with_left_padding(name: str, overrides: dict[str, bool]) -> None:
    model = tiny_model(name, **overrides)
    batch = left_padded_batch(text_vocab(model))
    with torch.no_grad():
        expected = model(**batch).logits
        with layerswap.swap(model, backend="fused"):
            assert all(
                isinstance(layer, fused.FusedDecoderLayer) for _, layer in decoder_layers(model)
            )
            actual = model(**batch).logits
    valid = batch["attention_mask"].bool()
    torch.testing.assert_close(actual[valid], expected[valid], atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", FAMILIES)
def test_greedy_generate_equal_with_left_padding(name: str) -> None:
    model = tiny_model(name)
    batch = left_padded_batch(text_vocab(model), lengths=(9, 5))
    settings = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": 0}
    expected = model.generate(**batch, **settings)
    with layerswap.swap(model, backend="fused"):
        actual = model.generate(**batch, **settings)
    assert actual.shape == expected.shape == (2, 9 + 6)
    assert torch.equal(actual, expected)


def test_sliding_window_is_honoured() -> None:
    # the window (8) is shorter than the sequence: attention beyond it must be masked
    model = tiny_model("mistral")
    assert model.config.sliding_window == 8
    ids = tokens(text_vocab(model), (1, 20))
    with torch.no_grad():
        expected = model(ids).logits
        unwindowed = copy.deepcopy(model)
        unwindowed.config.sliding_window = None
        full_attention = unwindowed(ids).logits
        with layerswap.swap(model, backend="fused"):
            actual = model(ids).logits
    assert not torch.allclose(expected, full_attention, atol=1e-3)  # the window matters here
    torch.testing.assert_close(actual, expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", FAMILIES)
def test_training_step_gives_equal_loss_gradients_and_weights(name: str) -> None:
    reference = tiny_model(name, num_hidden_layers=2).train()
    candidate = copy.deepcopy(reference)
    handle = layerswap.swap(candidate, backend="fused")
    ids = tokens(text_vocab(reference), (2, 10))
    results = []
    for model in (reference, candidate):
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        torch.manual_seed(0)  # the same random draws where the original routes at random (PhiMoE)
        loss = model(ids, labels=ids).loss
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        optimizer.step()
        results.append((loss.detach(), grads))
    (loss_ref, grads_ref), (loss_new, grads_new) = results
    torch.testing.assert_close(loss_new, loss_ref, atol=ATOL, rtol=0)

    # map the replacement's gradients through the converter, layer by layer
    converter = handle.substitution.converter
    mapped = {n: g for n, g in grads_new.items() if ".layers." not in n}
    for layer_name, _ in decoder_layers(candidate):
        prefix = layer_name + "."
        local = {n[len(prefix) :]: g for n, g in grads_new.items() if n.startswith(prefix)}
        for key, grad in converter.to_original(local, candidate.config).items():
            mapped[prefix + key] = grad
    assert mapped.keys() == grads_ref.keys()
    for key, grad in grads_ref.items():
        torch.testing.assert_close(mapped[key], grad, atol=ATOL, rtol=1e-4, msg=key)

    handle.undo()
    updated = reference.state_dict()
    for key, value in candidate.state_dict().items():
        torch.testing.assert_close(value, updated[key], atol=ATOL, rtol=0, msg=key)


def test_gradient_checkpointing_keeps_working_after_swap() -> None:
    reference = tiny_model("llama", num_hidden_layers=2).train()
    reference.activation_checkpointing_enable()
    candidate = copy.deepcopy(reference)
    layerswap.swap(candidate, backend="fused")
    assert all(layer.gradient_checkpointing for _, layer in decoder_layers(candidate))
    ids = tokens(text_vocab(reference))
    losses = []
    for model in (reference, candidate):
        loss = model(ids, labels=ids).loss
        loss.backward()
        losses.append(loss.detach())
    torch.testing.assert_close(losses[1], losses[0], atol=ATOL, rtol=0)
    torch.testing.assert_close(
        candidate.model.embed_tokens.weight.grad, reference.model.embed_tokens.weight.grad
    )


def test_eager_attention_masks_give_equal_logits() -> None:
    # eager builds additive float masks instead of sdpa's boolean ones
    model = tiny_model("qwen3", attn_implementation="eager")
    batch = left_padded_batch(text_vocab(model))
    valid = batch["attention_mask"].bool()
    with torch.no_grad():
        expected = model(**batch).logits
        with layerswap.swap(model, backend="fused"):
            actual = model(**batch).logits
    torch.testing.assert_close(actual[valid], expected[valid], atol=ATOL, rtol=0)


def test_hidden_states_equal_original() -> None:
    model = tiny_model("qwen2")
    ids = tokens(text_vocab(model))
    with torch.no_grad():
        expected = model(ids, output_hidden_states=True).hidden_states
        with layerswap.swap(model, backend="fused"):
            actual = model(ids, output_hidden_states=True).hidden_states
        after_undo = model(ids, output_hidden_states=True).hidden_states
    assert len(actual) == len(expected) == model.config.num_hidden_layers + 1
    for got, want, again in zip(actual, expected, after_undo, strict=True):
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
        torch.testing.assert_close(again, want, atol=0, rtol=0)


def test_hidden_states_asked_first_while_swapped_still_work_after_undo() -> None:
    # transformers hooks the model on the first output_hidden_states call, which here
    # happens while the original layers are out of the model
    model = tiny_model("llama")
    ids = tokens(text_vocab(model))
    with torch.no_grad():
        with layerswap.swap(model, backend="fused"):
            swapped = model(ids, output_hidden_states=True).hidden_states
        restored = model(ids, output_hidden_states=True).hidden_states
    assert len(swapped) == len(restored) == model.config.num_hidden_layers + 1
    for got, want in zip(swapped, restored, strict=True):
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


@pytest.mark.slow  # a fresh interpreter
def test_a_swapped_model_pickles_and_loads_in_a_fresh_process(tmp_path: Path) -> None:
    model = tiny_model("qwen3", num_hidden_layers=1)
    ids = tokens(text_vocab(model))
    layerswap.swap(model, backend="fused")
    with torch.no_grad():
        expected = model(ids).logits
    torch.save({"model": model, "ids": ids, "expected": expected}, tmp_path / "model.pt")
    check = (
        "import torch; saved = torch.load(r'{}', weights_only=False); "
        "model = saved['model']; assert type(model.model.layers[0]).__name__ == "
        "'FusedQwen3DecoderLayer'; "
        "assert torch.equal(model(saved['ids']).logits, saved['expected'])"
    ).format(tmp_path / "model.pt")
    subprocess.run([sys.executable, "-c", check], check=True)


def test_bfloat16_stays_close() -> None:
    model = tiny_model("llama").to(torch.bfloat16)
    ids = tokens(text_vocab(model))
    with torch.no_grad():
        expected = model(ids).logits.float()
        with layerswap.swap(model, backend="fused"):
            assert next(model.model.layers[0].parameters()).dtype == torch.bfloat16
            actual = model(ids).logits.float()
    torch.testing.assert_close(actual, expected, atol=2e-2, rtol=2e-2)


def _relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.double() - expected).norm() / expected.norm())


@pytest.mark.parametrize("name", FAMILIES)
def test_bfloat16_is_as_close_to_float32_as_the_original(name: str) -> None:
    """In bfloat16 the swapped model is as far from the float32 original as the original
    itself is in bfloat16: rounding, nothing more (some families pass float32 cos/sin to
    bfloat16 layers, whose rotation is then computed in float32 and cast back).

    A mixture-of-experts block routes each token to its top experts; in bfloat16 a
    rounding can flip a near-tie and send a token elsewhere, on either side, so there the
    bound is at least 0.1 (a wrong weight moves the logits by order 1).
    """
    model = tiny_model(name)
    ids = tokens(text_vocab(model))
    with torch.no_grad():
        exact = model(ids).logits.double()
        model.to(torch.bfloat16)
        original = _relative_error(model(ids).logits, exact)
        with layerswap.swap(model, backend="fused"):
            swapped = _relative_error(model(ids).logits, exact)
    routed = layerswap.registry.families()[name].feed_forward.kind == "original"
    bound = max(2 * original + 1e-3, 0.1 if routed else 0.0)
    assert swapped <= bound, (swapped, original)


def test_repr_names_the_original_class_and_the_substitution() -> None:
    model = tiny_model("qwen3", num_hidden_layers=1)
    layerswap.swap(model, backend="fused")
    text = repr(model)
    assert "FusedQwen3DecoderLayer(" in text
    assert "replaces=Qwen3DecoderLayer, substitution=qwen3.decoder.fused" in text


def test_unsupported_attention_implementation_is_a_clear_error() -> None:
    config = tiny_config("llama")
    config._attn_implementation = "flash_attention_2"
    layer_cls = fused.layer_class(family_of(tiny_model("llama", num_hidden_layers=1)))
    with pytest.raises(RequirementError, match="attn_implementation='sdpa'"):
        layer_cls(config, 0)


def test_generic_fused_layer_needs_a_family() -> None:
    with pytest.raises(TypeError, match="layer_class"):
        fused.FusedDecoderLayer(tiny_config("llama"), 0)


def test_layer_classes_are_importable_by_name_for_pickling() -> None:
    from layerswap.registry import get_family

    cls = fused.layer_class(get_family("gemma"))
    assert fused.FusedGemmaDecoderLayer is cls
    assert cls.__module__ == "layerswap.backends.fused.decoder"
    from layerswap.backends.fused.decoder import FusedGemmaDecoderLayer  # type: ignore[attr-defined]

    assert FusedGemmaDecoderLayer is cls


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ["llama", "qwen3", "gemma"])
def test_fused_layers_match_on_the_gpu(name: str) -> None:
    model = tiny_model(name).cuda()
    batch = {k: v.cuda() for k, v in left_padded_batch(text_vocab(model)).items()}
    ids = tokens(text_vocab(model)).cuda()  # no mask: the enable_gqa path
    settings = {"max_new_tokens": 5, "do_sample": False, "pad_token_id": 0}
    with torch.no_grad():
        expected_masked, expected_plain = model(**batch).logits, model(ids).logits
        expected_tokens = model.generate(**batch, **settings)
        with layerswap.swap(model, backend="fused"):
            assert next(model.model.layers[0].parameters()).is_cuda
            masked, plain = model(**batch).logits, model(ids).logits
            generated = model.generate(**batch, **settings)
    valid = batch["attention_mask"].bool()
    torch.testing.assert_close(masked[valid], expected_masked[valid], atol=1e-4, rtol=0)
    torch.testing.assert_close(plain, expected_plain, atol=1e-4, rtol=0)
    assert torch.equal(generated, expected_tokens)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("name", ["llama", "gemma2", "granite", "qwen3"])
def test_fused_head_loss_and_gradients_match_on_the_gpu(name: str, dtype: torch.dtype) -> None:
    """The head's chunked loss on CUDA: in bfloat16 the weight gradient's chunk products
    run on the tensor cores and add into a float32 sum (see linear_cross_entropy)."""
    from layerswap.verify import verify

    report = verify(
        tiny_model(name), f"{name}.head.fused", dtype=dtype, device="cuda", backward=True
    )
    assert report.passed, report.summary()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_chunked_loss_accumulates_bfloat16_products_in_float32_on_the_gpu() -> None:
    from layerswap.ops.linear_cross_entropy import _wide_addmm_works, linear_cross_entropy

    generator = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(4096, 256, device="cuda", generator=generator).to(torch.bfloat16)
    weight = (torch.randn(32000, 256, device="cuda", generator=generator) * 0.02).to(torch.bfloat16)
    targets = torch.randint(0, 32000, (4096,), device="cuda", generator=generator)
    assert _wide_addmm_works(hidden.device)
    weight.requires_grad_(True)
    linear_cross_entropy(hidden, weight, targets, chunk_size=256).backward()
    exact = weight.detach().double().requires_grad_(True)
    torch.nn.functional.cross_entropy(hidden.double() @ exact.t(), targets).backward()
    error = (weight.grad.double() - exact.grad).abs().max() / exact.grad.abs().max()
    assert error < 1e-2, error


def test_attention_sinks_join_the_softmax_as_gpt_oss_takes_them() -> None:
    """gpt-oss: each head's learned sink logit joins the softmax as one more key with a
    zero value; with a sliding window shorter than the prompt, left padding, cached
    decoding and the attention weights asked for (the eager path), the swap equals the
    original, and the sinks it carries are the ones it uses."""
    from layerswap.registry import get_family
    from layerswap.verify import verify

    family = get_family("gpt_oss")
    assert family.attention.sinks and family.rope.layout == "half_narrow"
    model = family.build(family.tiny_config(sliding_window=4), seed=0)
    report = verify(model, "gpt_oss.decoder.fused", generate=4)
    assert report.passed, report.summary()

    batch = left_padded_batch(text_vocab(model))
    valid = batch["attention_mask"].bool()
    swapped = copy.deepcopy(model)
    layerswap.swap(swapped, "gpt_oss.decoder.fused")
    with torch.no_grad():
        expected = model(**batch, output_attentions=True)
        actual = swapped(**batch, output_attentions=True)
        for theirs, ours in zip(expected.attentions, actual.attentions, strict=True):
            torch.testing.assert_close(
                ours[valid[:, None, :, None].expand_as(ours)],
                theirs[valid[:, None, :, None].expand_as(theirs)],
                atol=1e-6,
                rtol=0,
            )
        torch.testing.assert_close(actual.logits[valid], expected.logits[valid], atol=ATOL, rtol=0)
        swapped.model.layers[0].self_attn.sinks.add_(1.0)
        moved = swapped(**batch).logits
    assert (moved[valid] - expected.logits[valid]).abs().max() > 1e-2


@pytest.mark.parametrize("name", ["gpt_oss", "flint"])
def test_attention_sinks_with_grouped_keys_on_the_expanding_path(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a mask on a GPU (and on a torch without SDPA's ``enable_gqa``) grouped keys
    and values are expanded to every head before attention; with sinks they already are,
    and expanding them again broke every padded call (flint on an H100: "size of tensor a
    (8) must match ... (32)"). The tiny models share each key head among 4 query heads."""
    from layerswap.backends import _layer

    monkeypatch.setattr(_layer, "_SDPA_GQA", False)
    family = layerswap.families()[name]
    config = family.tiny_config()
    assert config.num_attention_heads // config.num_key_value_heads > 1
    report = layerswap.verify(family.build(config, seed=0), f"{name}.decoder.fused", generate=2)
    assert report.passed, report.summary()


CLAMPED = sorted(name for name, family in layerswap.families().items() if family.attention.clip_qkv)


def test_the_families_that_clamp_q_k_v_are_declared_so() -> None:
    assert {"olmo", "olmoe"} <= set(CLAMPED)


@pytest.mark.parametrize("name", CLAMPED)
def test_q_k_v_are_clamped_where_the_config_sets_clip_qkv(name: str) -> None:
    """OLMo's and OLMoE's ``clip_qkv`` (8 in released configs): the original clamps q, k
    and v after their projections. A tiny model's random values stay under such a bound, so
    v is scaled until it does not; without the clamp the swap was off by 0.78 in silence."""
    family = layerswap.get_family(name)

    def build(bound: float | None) -> torch.nn.Module:
        model = family.build(family.tiny_config(clip_qkv=bound), seed=0)
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.v_proj.weight.mul_(400.0)
        return model

    ids = tokens(text_vocab(family.tiny_config()), seed=1)
    model = build(8.0)
    with torch.no_grad():
        expected = model(input_ids=ids).logits
        unclamped = build(None)(input_ids=ids).logits
    assert (expected - unclamped).abs().max() > 0.1, "the bound no longer bites: test shows nothing"
    layerswap.swap(model, f"{name}.decoder.fused")
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, expected, rtol=1e-4, atol=1e-4)


def test_a_norm_without_parameters_has_its_epsilon_read_off_its_output() -> None:
    from transformers.models.nanochat.modeling_nanochat import NanoChatRMSNorm
    from transformers.models.olmo.modeling_olmo import OlmoLayerNorm

    from layerswap.family import probed_eps

    assert probed_eps(OlmoLayerNorm(96), 96) == 1e-5  # written into its forward()
    assert probed_eps(NanoChatRMSNorm(eps=1e-6), 96) == 1e-6
    assert probed_eps(torch.nn.LayerNorm(32, eps=3e-5, elementwise_affine=False), 32) == 3e-5


DROPPING = sorted(n for n, f in layerswap.families().items() if f.layer.residual_dropout)


def test_the_families_that_drop_after_the_output_projections_are_declared_so() -> None:
    assert {"phi3", "seed_oss"} <= set(DROPPING)


@pytest.mark.parametrize("name", DROPPING)
def test_training_drops_what_the_original_drops(name: str) -> None:
    """Seed-OSS's residual_dropout (0.1 by default), Phi-3's resid_pdrop: in training the
    swapped model drops the same elements as the original (same places, same draws), so
    a training step is the same step."""
    family = layerswap.get_family(name)
    config = family.tiny_config(**{family.layer.residual_dropout or "": 0.3}, attention_dropout=0.0)
    model = family.build(config, seed=0).train()
    ids = tokens(text_vocab(config), seed=2)

    def loss_and_logits(m: torch.nn.Module, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        torch.manual_seed(seed)
        out = m(input_ids=ids, labels=ids)
        return out.loss.detach(), out.logits.detach()

    expected = loss_and_logits(model, seed=5)
    assert not torch.equal(expected[1], loss_and_logits(model, seed=6)[1]), "nothing dropped"
    layerswap.swap(model, f"{name}.decoder.fused")
    assert model.training
    actual = loss_and_logits(model, seed=5)
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


def test_te_and_liger_refuse_a_config_that_drops_after_the_output_projections() -> None:
    from layerswap.backends import liger, te

    assert "residual_dropout=0.1" in str(te.unsupported(layerswap.get_family("seed_oss")))
    assert "residual_dropout=0.1" in str(liger.unsupported(layerswap.get_family("seed_oss")))
    assert liger.unsupported(layerswap.get_family("phi3")) is None  # resid_pdrop 0 by default


def test_queries_scaled_by_position_match_the_original_in_prefill_and_decoding() -> None:
    """Ministral 3 multiplies each query by 1 + beta * log(1 + floor(position / span)):
    the tiny config's span of 4 positions makes it bite on a 12-token prompt and on every
    decoding step after it."""
    family = layerswap.get_family("ministral3")
    config = family.tiny_config()
    assert family.query_scaling(config) == (0.1, 4.0)
    model = family.build(config, seed=0)
    unscaled = family.build(
        family.tiny_config(rope_parameters={**config.rope_parameters, "llama_4_scaling_beta": 0.0}),
        seed=0,
    )
    ids = tokens(text_vocab(config), shape=(2, 12), seed=3)
    with torch.no_grad():
        expected = model(input_ids=ids).logits
        assert (expected - unscaled(input_ids=ids).logits).abs().max() > 1e-3, "no scaling"
        generated = model.generate(input_ids=ids, max_new_tokens=6, do_sample=False)
    layerswap.swap(model, "ministral3.decoder.fused")
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, expected, rtol=1e-4, atol=1e-4)
        assert torch.equal(
            model.generate(input_ids=ids, max_new_tokens=6, do_sample=False), generated
        )
