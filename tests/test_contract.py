"""The layer contract across transformers releases: read once, checked before a model changes.

Static: an original layer (or attention) called with a parameter the replacement does
not handle is refused, naming it. Behavioural: a replacement that passes the static
check but computes something else (a cache it ignores) is refused by the proof, whose
verdict is stored per versions and config kind. And swapped generation equals the
original's on the installed release, dynamic and static cache, greedy and beam.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from models import tiny_config
from transformers import DynamicCache
from transformers.models.llama import modeling_llama

import layerswap
from layerswap import hf_internals, proof, proof_run, verdicts
from layerswap.comparison.first_difference import decoding_differs
from layerswap.comparison.judgement import proof_batch
from layerswap.comparison.tolerance import Tolerance
from layerswap.errors import UnsupportedFamilyError, UpstreamDriftError
from layerswap.model import decoder_layers
from layerswap.registry import get, get_family, unregister_family
from layerswap.substitution import Substitution, check_call_contract

FUSED = "llama.decoder.fused"


def _snapshot(model: torch.nn.Module) -> tuple[list[type], dict[str, torch.Tensor]]:
    layers = [type(layer) for _, layer in decoder_layers(model)]
    return layers, {key: value.clone() for key, value in model.state_dict().items()}


def _untouched(model: torch.nn.Module, before: tuple[list[type], dict[str, torch.Tensor]]) -> bool:
    layers, state = before
    now = model.state_dict()
    return [type(layer) for _, layer in decoder_layers(model)] == layers and all(
        torch.equal(state[key], now[key]) for key in state
    )


def _with_original(model: torch.nn.Module, cls: type) -> torch.nn.Module:
    """``model`` whose decoder layers are ``cls`` (same tensors): a simulated new release."""
    for _, layer in decoder_layers(model):
        layer.__class__ = cls
    return model


# --- one reader of the call, every release's names ----------------------------------------


def test_a_layer_reads_the_cache_under_either_name() -> None:
    model = get_family("llama").build(tiny_config("llama", num_hidden_layers=1))
    layerswap.swap(model, FUSED)
    layer = model.model.layers[0]
    hidden = torch.randn(1, 5, model.config.hidden_size)
    positions = torch.arange(5)[None]
    cos_sin = model.model.rotary_emb(hidden, positions)
    outputs, caches = [], []
    for name in hf_internals.CACHE_ARGUMENTS:
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            outputs.append(layer(hidden, position_embeddings=cos_sin, **{name: cache}))
        caches.append(cache)
    torch.testing.assert_close(outputs[0], outputs[1], rtol=0, atol=0)
    assert [cache.get_seq_length() for cache in caches] == [5, 5]


def test_read_layer_call_names_the_cache_as_the_caller_did() -> None:
    cache = DynamicCache()
    new = hf_internals.read_layer_call({}, cache=cache, use_cache=True)
    old = hf_internals.read_layer_call({"past_key_values": cache, "output_attentions": True})
    assert new.cache.cache is cache and new.cache.by_name == "cache"
    assert old.cache.cache is cache and old.cache.by_name == "past_key_values"
    assert old.output_attentions and not new.output_attentions
    assert new.cache.passed["use_cache"] is True


# --- the static check: a new or renamed parameter is refused, the model untouched ---------


NEW_PARAMETER = """
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaDecoderLayer

class NextLlamaDecoderLayer(LlamaDecoderLayer):
    def forward(self, hidden_states, attention_mask=None, position_ids=None, cache=None,
                use_cache=False, position_embeddings=None, memory_tokens=None, **kwargs):
        return super().forward(hidden_states, attention_mask, position_ids, cache, use_cache,
                               position_embeddings, **kwargs)

class NextLlamaAttention(LlamaAttention):
    def forward(self, hidden_states, position_embeddings=None, attention_mask=None,
                cache=None, sinks=None, **kwargs):
        return super().forward(hidden_states, position_embeddings, attention_mask, cache,
                               **kwargs)

class SinkLlamaDecoderLayer(LlamaDecoderLayer):
    def __init__(self, config, layer_idx):
        super().__init__(config, layer_idx)
        self.self_attn = NextLlamaAttention(config, layer_idx)
"""


@pytest.fixture
def next_release(make_module: Callable[[str, str], str]) -> str:
    return make_module("next_release", NEW_PARAMETER)


def test_a_new_parameter_on_the_original_layer_is_refused_naming_it(next_release: str) -> None:
    drifted = dataclasses.replace(get(FUSED), original=f"{next_release}:NextLlamaDecoderLayer")
    cls = drifted.original_class()
    model = _with_original(get_family("llama").build(seed=1), cls)
    before = _snapshot(model)

    with pytest.raises(UpstreamDriftError) as caught:
        layerswap.swap(model, drifted)

    message = str(caught.value)
    assert "'memory_tokens'" in message and "NextLlamaDecoderLayer.forward" in message
    assert transformers.__version__ in message
    assert _untouched(model, before)


def test_a_new_parameter_on_the_original_attention_is_refused_naming_it(
    next_release: str,
) -> None:
    drifted = dataclasses.replace(get(FUSED), original=f"{next_release}:SinkLlamaDecoderLayer")
    model = _with_original(get_family("llama").build(seed=1), drifted.original_class())
    before = _snapshot(model)

    with pytest.raises(UpstreamDriftError, match=r"NextLlamaAttention\.forward .* 'sinks'"):
        layerswap.swap(model, drifted)
    assert _untouched(model, before)


def test_a_replacement_made_for_the_old_cache_name_is_refused_where_it_is_renamed() -> None:
    base = get(FUSED)

    class BeforeTheRename(base.replacement_class()):  # type: ignore[misc]
        handles = hf_internals.LAYER_CALL_PARAMETERS - {"cache"}

    old = dataclasses.replace(base, name="llama.decoder.old", replacement=BeforeTheRename)
    model = get_family("llama").build(seed=2)
    before = _snapshot(model)
    with pytest.raises(UpstreamDriftError, match=r"LlamaDecoderLayer\.forward .* takes 'cache'"):
        layerswap.swap(model, old)
    assert _untouched(model, before)
    with pytest.raises(UpstreamDriftError, match="'cache'"):
        layerswap.use(old)


class PastKeyValuesOnly(torch.nn.Module):
    """A hand-written layer of the pre-5.24 contract: the cache as ``past_key_values``."""

    def __init__(self, config: Any, layer_idx: int) -> None:
        super().__init__()

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: Any = None,
        position_ids: Any = None,
        past_key_values: Any = None,
        use_cache: bool = False,
        position_embeddings: Any = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        return hidden_states


def test_replace_decoder_refuses_at_once_a_layer_that_misses_a_parameter() -> None:
    original = modeling_llama.LlamaDecoderLayer
    with pytest.raises(UpstreamDriftError, match=r"'cache', which PastKeyValuesOnly"):
        layerswap.replace_decoder(PastKeyValuesOnly, family="llama").start()
    assert modeling_llama.LlamaDecoderLayer is original
    assert not layerswap.active_patches()


def test_every_builtin_fused_substitution_handles_the_installed_call() -> None:
    for name, family in layerswap.families().items():
        check_call_contract(get(f"{name}.decoder.fused"), family.tiny_config())


# --- the behaviour proof -------------------------------------------------------------------


def _cache_blind() -> Substitution:
    """Passes the static check, ignores the cache: what 5.24 made of layerswap's layers."""
    base = get(FUSED)

    class CacheBlind(base.replacement_class()):  # type: ignore[misc]
        def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            for name in hf_internals.CACHE_ARGUMENTS:
                kwargs.pop(name, None)
            return super().forward(hidden_states, *args[:2], **kwargs)

    return dataclasses.replace(base, name="llama.decoder.cache_blind", replacement=CacheBlind)


@pytest.fixture
def proofs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh proof store for this test, and no verdict remembered from earlier ones."""
    monkeypatch.setenv("LAYERSWAP_CACHE", str(tmp_path / "proofs"))
    monkeypatch.setattr(proof, "_MEMO", {})
    return tmp_path / "proofs"


def test_a_layer_that_ignores_the_cache_is_refused_by_the_proof_before_the_swap(
    proofs: Path,
) -> None:
    blind = _cache_blind()
    model = get_family("llama").build(seed=4)
    before = _snapshot(model)

    with pytest.raises(UpstreamDriftError) as caught:
        layerswap.swap(model, blind)

    message = str(caught.value)
    assert "prefill and decode with a dynamic cache differs" in message
    assert f"transformers {transformers.__version__}" in message
    assert _untouched(model, before)


def test_the_proof_refuses_inside_use_too(proofs: Path) -> None:
    with pytest.raises(UpstreamDriftError, match="dynamic cache"), layerswap.use(_cache_blind()):
        get_family("llama").build(seed=4)


def test_the_verdict_is_stored_reused_and_proven_again_for_a_new_version(
    proofs: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tiny_config("qwen3")
    first = proof.prove("qwen3.decoder.fused", config)
    assert first.passed and first.check is None
    stored = list(proofs.glob("*.json"))
    assert len(stored) == 1
    assert json.loads(stored[0].read_text())["versions"]["transformers"] == transformers.__version__

    calls: list[str] = []
    real = proof.run
    monkeypatch.setattr(proof, "run", lambda *a: calls.append("proved") or real(*a))
    monkeypatch.setattr(proof, "_MEMO", {})
    again = proof.prove("qwen3.decoder.fused", config)  # read back from disk
    assert again == first and calls == []

    newer = {**verdicts.versions(), "transformers": "5.99.0"}
    monkeypatch.setattr(verdicts, "versions", lambda: newer)
    fresh = proof.prove("qwen3.decoder.fused", config)
    assert calls == ["proved"] and fresh.versions["transformers"] == "5.99.0"
    assert len(list(proofs.glob("*.json"))) == 2


def test_a_config_kind_is_its_non_size_fields(proofs: Path) -> None:
    base = tiny_config("llama")
    bigger = tiny_config("llama", hidden_size=256, intermediate_size=512)
    other_eps = tiny_config("llama", rms_norm_eps=1e-5)
    sub = get(FUSED)
    assert proof.proof_key(sub, base) == proof.proof_key(sub, bigger)
    assert proof.proof_key(sub, base) != proof.proof_key(sub, other_eps)


def test_the_proven_config_is_the_users_with_only_sizes_shrunk() -> None:
    family = get_family("llama")
    users = transformers.LlamaConfig(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        rms_norm_eps=1e-5,
        attention_bias=True,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
        bos_token_id=128000,
        eos_token_id=128001,
    )
    shrunk = proof.shrunk_config(family, users)
    tiny = family.tiny_config()
    assert (shrunk.hidden_size, shrunk.num_hidden_layers, shrunk.vocab_size) == (
        tiny.hidden_size,
        tiny.num_hidden_layers,
        tiny.vocab_size,
    )
    assert shrunk.rms_norm_eps == 1e-5 and shrunk.attention_bias is True
    assert shrunk.rope_parameters["rope_theta"] == 500000.0
    assert shrunk.bos_token_id is None  # outside the tiny vocabulary
    assert proof.prove(FUSED, users).passed


def test_the_proof_runs_on_the_users_config_switches(proofs: Path) -> None:
    # a feature only the user's config switches on is proven with it on: qkv biases here
    verdict = proof.prove(FUSED, tiny_config("llama", attention_bias=True, mlp_bias=True))
    assert verdict.passed and verdict.config == "shrunk"


def test_xdg_cache_home_is_honoured_and_layerswap_cache_moves_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("LAYERSWAP_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert verdicts.directory() == tmp_path / "xdg" / "layerswap" / "proofs"
    monkeypatch.setenv("LAYERSWAP_CACHE", str(tmp_path / "moved"))
    assert verdicts.directory() == tmp_path / "moved"


def test_an_unwritable_store_still_proves_and_remembers_in_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("LAYERSWAP_CACHE", str(blocker / "proofs"))
    monkeypatch.setattr(proof, "_MEMO", {})
    assert proof.prove(FUSED, tiny_config("llama")).passed
    assert len(proof._MEMO) == 1


# --- verification's defaults decode with the cache -----------------------------------------


def test_default_verification_compares_cached_decoding(proofs: Path) -> None:
    model = get_family("llama").build(seed=5)
    blind = _cache_blind()
    candidate = copy.deepcopy(model)
    with proof.comparing():
        layerswap.swap(candidate, blind)
    with torch.no_grad():  # the forward pass alone cannot tell them apart
        ids = torch.randint(3, 512, (2, 12))
        torch.testing.assert_close(candidate(ids).logits, model(ids).logits)

    report = layerswap.verify(model, blind)

    assert not report.passed
    assert report.generation is not None and not report.generation.passed
    assert "cached decoding" in report.failure_message()
    assert layerswap.verify(model, blind, generate=0).passed  # what the old default said
    with pytest.raises(layerswap.errors.VerificationError, match="cached decoding"):
        layerswap.assert_equivalent(model, candidate)


def test_default_verification_passes_and_reports_decoding_for_fused() -> None:
    report = layerswap.verify(get_family("qwen3").build(seed=6), "qwen3.decoder.fused")
    assert report.passed
    assert report.generation is not None and report.generation.new_tokens == 4
    assert report.generation.max_abs_error is not None
    assert report.generation.max_abs_error < 1e-4


# --- generation equals the original on the installed release ------------------------------

GENERATION_FAMILIES = ["llama", "qwen2", "qwen3", "gemma2", "mistral", "mixtral"]


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("family", GENERATION_FAMILIES)
def test_swapped_generation_equals_the_original(family: str, cache: str) -> None:
    model = get_family(family).build(seed=7)
    prompt = torch.randint(3, model.config.vocab_size, (2, 9))
    mask = torch.ones_like(prompt)
    mask[1, :3] = 0
    options: dict[str, Any] = {
        "attention_mask": mask,
        "max_new_tokens": 6,
        "min_new_tokens": 6,
        "pad_token_id": 0,
        **({"cache_implementation": "static"} if cache == "static" else {}),
    }
    with torch.no_grad():
        greedy = model.generate(prompt, do_sample=False, **options)
        beam = model.generate(prompt, do_sample=False, num_beams=3, **options)
        with layerswap.swap(model, f"{family}.decoder.fused"):
            assert torch.equal(model.generate(prompt, do_sample=False, **options), greedy)
            assert torch.equal(
                model.generate(prompt, do_sample=False, num_beams=3, **options), beam
            )


def test_a_layer_built_inside_use_is_put_back_as_an_original_for_the_proof(proofs: Path) -> None:
    # the proof runs while use() has patched the class name: it must still compare originals
    with layerswap.use(FUSED):
        model = get_family("llama").build(seed=8)
    assert all(
        type(layer).__name__ == "FusedLlamaDecoderLayer" for _, layer in decoder_layers(model)
    )
    (verdict,) = (proof.Verdict.from_dict(json.loads(p.read_text())) for p in proofs.glob("*"))
    assert verdict.passed and verdict.substitution == FUSED


# --- the supported range -----------------------------------------------------------------


def test_a_transformers_below_the_lowest_supported_is_refused_before_the_swap(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(hf_internals, "LOWEST_TRANSFORMERS", "99.0.0")
    model = get_family("llama").build(seed=9)
    before = _snapshot(model)
    with pytest.raises(UpstreamDriftError, match=r"lowest release layerswap supports \(99\.0\.0\)"):
        layerswap.swap(model, FUSED)
    assert _untouched(model, before)


@pytest.mark.parametrize(
    ("version", "supported", "says"),
    [
        ("4.57.3", False, "older than the lowest"),
        (hf_internals.SWEPT_TRANSFORMERS, True, "release sweep"),
        ("5.99.0", True, "proven at first use"),
        ("6.0.0.dev0", True, "proven at first use"),
    ],
)
def test_transformers_support_says_how_a_release_is_known(
    version: str, supported: bool, says: str
) -> None:
    verdict, why = hf_internals.transformers_support(version)
    assert verdict is supported and says in why


def test_the_proof_inside_from_pretrained_builds_on_a_real_device(
    proofs: Path, tmp_path: Path
) -> None:
    # from_pretrained constructs under torch.device("meta"): the proof, which runs there
    # at first use, must build and run its tiny models on the CPU regardless
    original = get_family("mistral").build(seed=10)
    original.save_pretrained(tmp_path / "checkpoint")
    with layerswap.use("mistral.decoder.fused"):
        loaded = transformers.MistralForCausalLM.from_pretrained(tmp_path / "checkpoint")
    assert [v.passed for v in proof._MEMO.values()] == [True]
    ids = torch.randint(3, 512, (1, 7))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, original(ids).logits)


def test_a_config_asking_for_attention_weights_is_proven_as_the_model_it_is(proofs: Path) -> None:
    # output_attentions is a call-time switch: same kind, same verdict, and the proof's
    # loss counts no prediction made from a padded position (where layers may differ)
    asking = tiny_config("qwen2", output_attentions=True)
    sub = get("qwen2.decoder.fused")
    assert proof.proof_key(sub, asking) == proof.proof_key(sub, tiny_config("qwen2"))
    assert proof.prove(sub, asking).passed


def test_a_family_whose_tiny_model_cannot_be_built_is_refused_with_the_reason(
    proofs: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    family = get_family("llama")

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise AttributeError("'str' object has no attribute 'get'")

    monkeypatch.setattr(proof_run, "original_model", broken)
    with pytest.raises(UpstreamDriftError, match=r"building the tiny original model .*'str'"):
        proof.ensure_proven(get(FUSED), family.tiny_config())


def test_a_config_that_selects_structure_the_family_does_not_describe_is_refused_as_such(
    proofs: Path,
) -> None:
    # a family that reads its activation from a field the model ignores: right for its own
    # tiny config (both say silu), wrong for a config whose hidden_act is gelu
    llama = get_family("llama")
    variant = dataclasses.replace(
        llama,
        name="llama_fixed_act",
        activation="fixed_act",
        tiny={**llama.tiny, "fixed_act": "silu"},
    )
    layerswap.register_family(variant)
    try:
        sub = get("llama_fixed_act.decoder.fused")
        with pytest.raises(UnsupportedFamilyError, match="selects structure the family does not"):
            proof.ensure_proven(sub, variant.tiny_config(hidden_act="gelu_new"))
        proof.ensure_proven(sub, variant.tiny_config())  # its own tiny config holds
    finally:
        unregister_family("llama_fixed_act")


def test_the_proof_compares_static_cache_decoding_eagerly_where_generate_would_compile(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On a GPU, generate() with a static cache compiles the model's forward (transformers'
    auto-compile). The proof compares what the layers compute, eagerly: TransformerEngine's
    attention cannot be traced by dynamo, and the GPU refused te for that, not for the
    contract. ``_compile_all_devices`` makes the CPU behave as the GPU does."""
    compiled: list[dict[str, Any]] = []

    def record(function: Any = None, **options: Any) -> Any:
        compiled.append(options)
        return function

    config = tiny_config("llama")
    torch.manual_seed(0)
    reference = transformers.LlamaForCausalLM(config).eval()
    candidate = copy.deepcopy(reference)
    for model in (reference, candidate):
        model.generation_config.compile_config = transformers.CompileConfig()
        model.generation_config.compile_config._compile_all_devices = True
    batch = proof_batch(reference, torch.device("cpu"))
    monkeypatch.setattr(torch, "compile", record)
    # the original's own generate() compiles here: the condition the proof must not follow
    reference.generate(
        **batch, max_new_tokens=2, do_sample=False, cache_implementation="static", pad_token_id=0
    )
    assert compiled, "auto-compile did not trigger: this test no longer shows anything"
    compiled.clear()
    tolerance = Tolerance.scaled(1e-4)
    assert (
        decoding_differs(reference, candidate, batch, tolerance, new_tokens=2, cache="static")
        is None
    )
    assert compiled == []
