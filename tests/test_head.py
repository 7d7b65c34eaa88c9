"""The head slot: ``<family>.head.fused`` trains to the original's loss and gradients without
materialising the logits, runs inference exactly like the original, and undoes bitwise."""

from __future__ import annotations

import copy
import dataclasses
import io
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
import torch
from models import FAMILIES, lane_families, left_padded_batch, text_vocab, tiny_model
from transformers import LlamaForCausalLM, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

import layerswap
from layerswap.backends import fused
from layerswap.backends.head import head_class, head_contract
from layerswap.backends.head_fused import FusedHead
from layerswap.errors import SubstitutionError, UnsupportedModelError, UpstreamDriftError
from layerswap.ops import LogitTransform
from layerswap.slots import get_slot
from layerswap.slots.head import HeadSwapHandle, head_substitution_of


def _heads(families: Iterable[str]) -> list[str]:
    """Every head substitution of ``families`` that runs here (the fused ones everywhere;
    the liger ones on a CUDA machine with liger-kernel, where tests/test_liger.py checks
    them too). Listing one reads its family's causal LM (an import of its modeling module)."""
    return sorted(
        sub.name
        for family in families
        for sub in layerswap.substitutions(family=family, slot="head")
        if sub.unmet_requirement() is None
    )


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    # the heads of the families this run tests (the fast lane's: the representatives')
    if "head" in metafunc.fixturenames:
        metafunc.parametrize("head", _heads(lane_families(metafunc.config)))


def _family(name: str) -> str:
    return name.split(".")[0]


def _model(name: str, seed: int = 0, **overrides: Any) -> PreTrainedModel:
    return tiny_model(_family(name), seed=seed, num_hidden_layers=2, **overrides)


def _batch(model: PreTrainedModel) -> dict[str, torch.Tensor]:
    batch = left_padded_batch(text_vocab(model), lengths=(12, 7))
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    return {**batch, "labels": labels}


def _train_pass(model: PreTrainedModel, batch: dict[str, Any], **kwargs: Any) -> Any:
    model.train()
    torch.manual_seed(0)  # the same dropout masks in both models (some families have dropout)
    output = model(**batch, use_cache=False, **kwargs)
    params = {name: p for name, p in model.named_parameters() if p.requires_grad}
    grads = torch.autograd.grad(output.loss, list(params.values()), allow_unused=True)
    return output, dict(zip(params, grads, strict=True))


def _assert_same_training(reference: Any, candidate: Any) -> None:
    (ref_out, ref_grads), (out, grads) = reference, candidate
    torch.testing.assert_close(out.loss, ref_out.loss, rtol=1e-5, atol=1e-6)
    assert grads.keys() == ref_grads.keys()
    for name, want in ref_grads.items():
        got = grads[name]
        if want is None:
            assert got is None, name
            continue
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6, msg=name)


def test_every_registered_family_has_a_fused_head_but_those_adding_to_the_loss() -> None:
    fused = layerswap.get_backend("fused")
    refused = {
        name for name, family in layerswap.families().items() if fused.unsupported(family, "head")
    }
    heads = _heads(FAMILIES)
    assert {f"{name}.head.fused" for name in set(layerswap.families()) - refused} <= set(heads)
    # the mixture-of-experts causal LMs' router loss, added after the head, is reproduced
    assert {"mixtral.head.fused", "qwen3_moe.head.fused", "olmoe.head.fused"} <= set(heads)
    # HY-V3 adds a loss of its own after the head
    assert "hy_v3" in refused
    assert "does more with the loss" in str(
        fused.unsupported(layerswap.get_family("hy_v3"), "head")
    )


def test_training_matches_the_original_loss_and_every_gradient_without_logits(head: str) -> None:
    model = _model(head)
    reference = copy.deepcopy(model)
    layerswap.swap(model, head)
    batch = _batch(model)
    candidate = _train_pass(model, batch)
    assert candidate[0].logits is None
    _assert_same_training(_train_pass(reference, batch), candidate)


def test_inference_is_the_original_bitwise(head: str) -> None:
    model = _model(head)
    reference = copy.deepcopy(model).eval()
    layerswap.swap(model, head)
    model.eval()
    batch = _batch(model)
    without_labels = {k: v for k, v in batch.items() if k != "labels"}
    with torch.no_grad():
        for inputs in (without_labels, batch):
            want = reference(**inputs, output_hidden_states=True)
            got = model(**inputs, output_hidden_states=True)
            assert torch.equal(got.logits, want.logits)
            if "labels" in inputs:
                assert torch.equal(got.loss, want.loss)
            for a, b in zip(got.hidden_states, want.hidden_states, strict=True):
                assert torch.equal(a, b)
        generated = model.generate(**without_labels, max_new_tokens=4, do_sample=False)
        expected = reference.generate(**without_labels, max_new_tokens=4, do_sample=False)
    assert torch.equal(generated, expected)


def test_swap_and_undo_change_nothing_but_the_class(head: str) -> None:
    model = _model(head)
    original_class = type(model)
    params = dict(model.named_parameters())
    state = {key: value.clone() for key, value in model.state_dict().items()}
    handle = layerswap.swap(model, head)
    assert isinstance(handle, HeadSwapHandle) and handle.active
    assert isinstance(model, original_class) and type(model) is not original_class
    assert head_substitution_of(model) == head
    assert f"head={head}" in repr(model)
    assert list(model.state_dict()) == list(state)
    handle.undo()
    handle.undo()  # a second undo does nothing
    assert type(model) is original_class and head_substitution_of(model) is None
    now = dict(model.named_parameters())
    assert now.keys() == params.keys() and all(now[k] is p for k, p in params.items())
    for key, value in model.state_dict().items():
        assert torch.equal(value, state[key]), key


def test_save_pretrained_writes_what_the_original_writes(tmp_path: Path) -> None:
    model = _model("llama.head.fused")
    model.save_pretrained(tmp_path / "original")
    with layerswap.swap(model, "llama.head.fused"):
        model.save_pretrained(tmp_path / "swapped")
    configs = [
        json.loads((tmp_path / d / "config.json").read_text()) for d in ("original", "swapped")
    ]
    assert configs[1]["architectures"] == ["LlamaForCausalLM"]
    assert configs[0] == configs[1]
    reloaded = type(model).from_pretrained(tmp_path / "swapped")
    for key, value in model.state_dict().items():
        assert torch.equal(reloaded.state_dict()[key], value), key


def test_tied_embeddings_stay_tied_and_get_both_gradients() -> None:
    model = _model("llama.head.fused", tie_word_embeddings=True)
    reference = copy.deepcopy(model)
    layerswap.swap(model, "llama.head.fused")
    assert model.lm_head.weight is model.model.embed_tokens.weight
    batch = _batch(model)
    _assert_same_training(_train_pass(reference, batch), _train_pass(model, batch))


def test_skip_logits_false_is_the_original_computation() -> None:
    model = _model("llama.head.fused")
    reference = copy.deepcopy(model)
    layerswap.swap(model, "llama.head.fused")
    batch = _batch(model)
    (got, _), (want, _) = (
        _train_pass(model, batch, skip_logits=False),
        _train_pass(reference, batch),
    )
    assert torch.equal(got.loss, want.loss) and torch.equal(got.logits, want.logits)


def test_skip_logits_true_takes_the_fused_loss_in_eval_mode() -> None:
    model = _model("llama.head.fused")
    reference = copy.deepcopy(model).eval()
    layerswap.swap(model, "llama.head.fused")
    model.eval()
    batch = _batch(model)
    with torch.no_grad():
        got = model(**batch, skip_logits=True)
        want = reference(**batch)
    assert got.logits is None
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "extra",
    [
        {"num_items_in_batch": torch.tensor(5)},
        {"num_items_in_batch": 11},
        {"ignore_index": 3},
        {"return_dict": False},
    ],
    ids=["num-items-tensor", "num-items-int", "ignore-index", "tuple"],
)
def test_loss_keywords_follow_transformers(extra: dict[str, Any]) -> None:
    model = _model("qwen2.head.fused")
    reference = copy.deepcopy(model)
    layerswap.swap(model, "qwen2.head.fused")
    batch = _batch(model)
    if "ignore_index" in extra:  # the masked labels carry that index instead of -100
        batch["labels"] = batch["labels"].masked_fill(
            batch["labels"] == -100, extra["ignore_index"]
        )
    got, _ = _train_pass_loss_only(model, batch, extra)
    want, _ = _train_pass_loss_only(reference, batch, extra)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def _train_pass_loss_only(
    model: PreTrainedModel, batch: dict[str, Any], extra: dict[str, Any]
) -> tuple[torch.Tensor, Any]:
    model.train()
    torch.manual_seed(0)
    output = model(**batch, use_cache=False, **extra)
    if isinstance(output, tuple):
        return output[0], output[1:]
    return output.loss, output


def test_shift_labels_are_used_as_given() -> None:
    model = _model("llama.head.fused")
    reference = copy.deepcopy(model)
    layerswap.swap(model, "llama.head.fused")
    batch = _batch(model)
    shifted = torch.nn.functional.pad(batch["labels"], (0, 1), value=-100)[:, 1:].contiguous()
    shifted[:, ::2] = -100
    got, _ = _train_pass_loss_only(model, batch, {"shift_labels": shifted})
    want, _ = _train_pass_loss_only(reference, batch, {"shift_labels": shifted})
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_logits_to_keep_with_full_labels_is_refused_by_name() -> None:
    model = _model("llama.head.fused")
    layerswap.swap(model, "llama.head.fused")
    with pytest.raises(UnsupportedModelError, match="logits_to_keep"):
        _train_pass_loss_only(model, _batch(model), {"logits_to_keep": 1})


def test_logits_to_keep_in_inference_is_the_original() -> None:
    model = _model("llama.head.fused")
    reference = copy.deepcopy(model).eval()
    layerswap.swap(model, "llama.head.fused")
    model.eval()
    ids = left_padded_batch(text_vocab(model))["input_ids"]
    with torch.no_grad():
        assert torch.equal(
            model(ids, logits_to_keep=1).logits, reference(ids, logits_to_keep=1).logits
        )


def test_decoder_and_head_substitutions_compose_in_either_undo_order() -> None:
    model = _model("llama.head.fused")
    reference = copy.deepcopy(model)
    decoder = layerswap.swap(model, "llama.decoder.fused")
    head = layerswap.swap(model, "llama.head.fused")
    batch = _batch(model)
    got, _ = _train_pass_loss_only(model, batch, {})
    want, _ = _train_pass_loss_only(reference, batch, {})
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    decoder.undo()
    head.undo()
    for key, value in reference.state_dict().items():
        assert torch.equal(model.state_dict()[key], value), key
    assert type(model) is type(reference)


def test_use_builds_models_with_the_fused_head(tmp_path: Path) -> None:
    plain = _model("qwen3.head.fused")
    plain.save_pretrained(tmp_path)
    with layerswap.use("qwen3.head.fused"):
        built = type(plain)(plain.config)
        loaded = type(plain).from_pretrained(tmp_path)
    assert head_substitution_of(built) == "qwen3.head.fused"
    assert head_substitution_of(loaded) == "qwen3.head.fused"
    assert head_substitution_of(type(plain)(plain.config)) is None  # outside the block
    batch = _batch(plain)
    _assert_same_training(_train_pass(plain, batch), _train_pass(loaded, batch))


def test_verify_backward_passes(head: str) -> None:
    report = layerswap.verify(_model(head), head, backward=True)
    assert report.passed, report.summary()
    assert report.backward is not None and report.backward.passed


def test_verify_runs_the_fused_loss_not_the_original() -> None:
    model = _model("llama.head.fused")
    calls: list[int] = []

    class Counting(FusedHead):
        backend = "counting"

        def _summed_loss(self, *args: Any) -> torch.Tensor:
            calls.append(1)
            return super()._summed_loss(*args)

    family = layerswap.families()["llama"]
    sub = fused.BACKEND.substitution(family, "head")
    counting = dataclasses.replace(
        sub, name="llama.head.counting", replacement=head_class(Counting, family)
    )
    report = layerswap.verify(model, counting, backward=True)
    assert report.passed and calls


def test_a_model_built_in_use_verifies_against_its_original() -> None:
    with layerswap.use("llama.head.fused"):
        model = _model("llama.head.fused")
    assert layerswap.verify(model, "llama.head.fused", backward=True).passed
    assert head_substitution_of(model) == "llama.head.fused"


def test_pickled_model_keeps_its_head() -> None:
    model = _model("gemma.head.fused")
    layerswap.swap(model, "gemma.head.fused")
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert head_substitution_of(loaded) == "gemma.head.fused"


# --- refusals: never a silently different loss --------------------------------------------


def test_swapping_twice_is_refused() -> None:
    model = _model("llama.head.fused")
    layerswap.swap(model, "llama.head.fused")
    with pytest.raises(SubstitutionError, match=r"already swapped by llama\.head\.fused"):
        layerswap.swap(model, "llama.head.fused")


def test_a_subclass_of_the_causal_lm_is_refused() -> None:
    model = _model("llama.head.fused")

    class Custom(type(model)):  # type: ignore[misc]
        pass

    model.__class__ = Custom
    with pytest.raises(SubstitutionError, match="subclass whose own forward"):
        layerswap.swap(model, "llama.head.fused")


def test_a_hook_on_lm_head_is_refused_in_training() -> None:
    model = _model("llama.head.fused")
    layerswap.swap(model, "llama.head.fused")
    model.lm_head.register_forward_hook(lambda module, args, output: output * 2)
    with pytest.raises(UnsupportedModelError, match="hooks on it"):
        _train_pass_loss_only(model, _batch(model), {})


def test_an_lm_head_that_is_not_a_linear_is_refused_in_training() -> None:
    model = _model("llama.head.fused")
    layerswap.swap(model, "llama.head.fused")

    class Scaled(torch.nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x) * 2

    head = Scaled(model.config.hidden_size, text_vocab(model), bias=False)
    head.weight = model.lm_head.weight
    model.lm_head = head
    with pytest.raises(UnsupportedModelError, match="Scaled"):
        _train_pass_loss_only(model, _batch(model), {})


@pytest.mark.parametrize(
    "adapter",
    [
        {"target_modules": ["q_proj", "lm_head"]},
        {"target_modules": ["q_proj"], "modules_to_save": ["lm_head"]},
    ],
    ids=["lora_on_lm_head", "lm_head_in_modules_to_save"],
)
def test_a_peft_adapter_on_lm_head_is_refused_before_the_loss(adapter: dict[str, Any]) -> None:
    # the fused loss reads lm_head.weight: it would bypass the adapter (trl#4612's bug)
    peft = pytest.importorskip("peft")
    model = _model("llama.head.fused")
    layerswap.swap(model, "llama.head.fused")
    tuned = peft.get_peft_model(model, peft.LoraConfig(r=2, init_lora_weights=False, **adapter))
    with pytest.raises(UnsupportedModelError, match=r"PEFT .*lm_head.*merge_and_unload"):
        _train_pass_loss_only(tuned, _batch(model), {})
    tuned.eval()  # inference runs the original forward, adapter included
    assert tuned(**_batch(model)).logits is not None


def test_a_peft_adapter_elsewhere_trains_to_the_original_loss_and_gradients() -> None:
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=2, init_lora_weights=False, target_modules=["q_proj", "v_proj"])
    reference = peft.get_peft_model(_model("llama.head.fused"), config)
    swapped = _model("llama.head.fused")
    layerswap.swap(swapped, "llama.head.fused")
    candidate = peft.get_peft_model(swapped, config)
    candidate.load_state_dict(reference.state_dict())
    batch = _batch(swapped)
    losses, grads = [], []
    for model in (reference, candidate):
        loss, output = _train_pass_loss_only(model, batch, {})
        assert (output.logits is None) == (model is candidate)  # the fused loss ran
        loss.backward()
        losses.append(loss)
        grads.append({n: p.grad for n, p in model.named_parameters() if p.requires_grad})
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-6)
    assert grads[1].keys() == grads[0].keys() and any("lora_A" in name for name in grads[0])
    for name, want in grads[0].items():
        torch.testing.assert_close(grads[1][name], want, rtol=1e-4, atol=1e-6, msg=name)


def test_a_custom_loss_function_is_refused_in_training() -> None:
    model = _model("llama.head.fused")
    layerswap.swap(model, "llama.head.fused")
    model.loss_function = lambda logits, labels, vocab_size, **kwargs: logits.sum()
    with pytest.raises(UnsupportedModelError, match="loss_function"):
        _train_pass_loss_only(model, _batch(model), {})


def test_a_head_that_adds_to_the_loss_is_refused_by_the_contract() -> None:
    from transformers import BambaForCausalLM, MixtralForCausalLM

    with pytest.raises(UpstreamDriftError, match="does more with the loss"):
        head_contract(BambaForCausalLM)  # a z-loss on the logits, inside the loss block
    # the router loss is read, with the attribute that scales it
    assert head_contract(MixtralForCausalLM).aux_coef == "router_aux_loss_coef"


class _ScaledUnderAnotherName(LlamaForCausalLM):
    """Returns ``lm_logits``, a scaled copy, while its loss reads the unscaled ``logits``:
    a forward whose two names a renaming would merge."""

    def forward(self, input_ids=None, labels=None, **kwargs):  # type: ignore[no-untyped-def]
        outputs = self.model(input_ids=input_ids, **kwargs)
        logits = self.lm_head(outputs.last_hidden_state)
        lm_logits = logits * self.config.scale
        loss = None
        if labels is not None:
            loss = self.loss_function(logits, labels, self.config.vocab_size, **kwargs)
        return CausalLMOutputWithPast(loss=loss, logits=lm_logits, cache=outputs.cache)


class _Reshaped(LlamaForCausalLM):
    """Reshapes the projection in its own statement: not the logits the fused loss computes."""

    def forward(self, input_ids=None, labels=None, **kwargs):  # type: ignore[no-untyped-def]
        outputs = self.model(input_ids=input_ids, **kwargs)
        logits = self.lm_head(outputs.last_hidden_state).view(-1, 2, self.config.vocab_size)
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, **kwargs)
        return CausalLMOutputWithPast(loss=loss, logits=logits, cache=outputs.cache)


def test_a_model_whose_forward_is_set_on_the_instance_is_refused_unchanged() -> None:
    """accelerate's hooks (dispatch_model, an offloading device_map) set ``forward`` on the
    model itself, which runs the original whatever its class: a head swap would do
    nothing, so it is refused; built inside use() and dispatched after, it is swapped."""
    from accelerate.hooks import ModelHook, add_hook_to_module

    model = tiny_model("llama", seed=0)
    add_hook_to_module(model, ModelHook())
    with pytest.raises(SubstitutionError, match="forward is set on the instance"):
        layerswap.swap(model, "llama.head.fused")
    assert head_substitution_of(model) is None
    family = layerswap.get_family("llama")
    with layerswap.use("llama.head.fused"):
        built = family.causal_lm_class()(family.tiny_config())
    add_hook_to_module(built, ModelHook())
    batch = _batch(built)
    built.train()
    assert built(**batch).logits is None  # the fused loss ran through the hook


def test_a_head_read_under_another_name_is_refused_where_two_names_would_merge() -> None:
    from transformers import FalconForCausalLM, OPTForCausalLM

    assert head_contract(FalconForCausalLM).head == "lm_head"  # lm_logits = self.lm_head(...)
    assert head_contract(OPTForCausalLM).steps == ()  # self.lm_head(h).contiguous()
    with pytest.raises(UpstreamDriftError, match="returns lm_logits as its logits and names"):
        head_contract(_ScaledUnderAnotherName)
    with pytest.raises(UpstreamDriftError, match="does not compute its logits in one"):
        head_contract(_Reshaped)


def test_a_soft_cap_named_first_and_read_through_the_text_config_is_reproduced() -> None:
    """Gemma 4's multimodal model: ``if (cap := self.config.get_text_config().cap) ...``."""
    from types import SimpleNamespace

    from transformers import Gemma4Config
    from transformers.models.gemma4.modeling_gemma4 import Gemma4ForConditionalGeneration

    contract = head_contract(Gemma4ForConditionalGeneration)
    assert contract.steps == (("softcap", "config.get_text_config().final_logit_softcapping"),)
    config = Gemma4Config()
    config.get_text_config().final_logit_softcapping = 7.0
    assert contract.transforms(SimpleNamespace(config=config)) == (LogitTransform("softcap", 7.0),)


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_the_router_loss_is_added_as_the_original_adds_it(family: str) -> None:
    """With ``output_router_logits`` the original adds ``coef * aux_loss`` to its loss: so
    does the fused head, and every gradient (the routers' too) matches."""
    model = tiny_model(family, seed=0, num_hidden_layers=2)
    reference = copy.deepcopy(model)
    layerswap.swap(model, f"{family}.head.fused")
    batch = _batch(model)
    got = _train_pass(model, batch, output_router_logits=True)
    want = _train_pass(reference, batch, output_router_logits=True)
    assert want[0].aux_loss is not None and float(want[0].aux_loss) > 0
    torch.testing.assert_close(got[0].aux_loss, want[0].aux_loss)
    _assert_same_training(want, got)
    # without it (the config's default), no router loss on either side
    _assert_same_training(_train_pass(reference, batch), _train_pass(model, batch))


@pytest.mark.parametrize(
    ("module", "cls", "config_changes", "transform"),
    [
        ("gemma2", "Gemma2ForCausalLM", {"final_logit_softcapping": 3.0}, ("softcap", 3.0)),
        ("granite", "GraniteForCausalLM", {"logits_scaling": 4.0}, ("div", 4.0)),
        ("cohere", "CohereForCausalLM", {"logit_scale": 0.5}, ("mul", 0.5)),
    ],
    ids=["gemma2-softcap", "granite-scaling", "cohere-scale"],
)
def test_a_family_logit_transform_is_read_and_reproduced(
    module: str, cls: str, config_changes: dict[str, float], transform: tuple[str, float]
) -> None:
    import importlib

    from layerswap.families._tiny import TINY
    from layerswap.family import Family

    modeling = importlib.import_module(f"transformers.models.{module}.modeling_{module}")
    causal_lm = getattr(modeling, cls)
    config_class = causal_lm.config_class
    settings = {**TINY, "num_hidden_layers": 2, **config_changes}
    family = Family(
        name=module,
        model_type=module,
        module=modeling.__name__,
        decoder=cls.replace("ForCausalLM", "DecoderLayer"),
        config_class=config_class.__name__,
        causal_lm=cls,
        tiny=settings,
    )
    model = family.build(seed=0)
    assert head_contract(causal_lm).transforms(model) == (LogitTransform(*transform),)  # type: ignore[arg-type]
    reference = copy.deepcopy(model)
    # an unregistered family: the class given directly, not looked up by name
    sub = dataclasses.replace(
        fused.BACKEND.substitution(family, "head"), replacement=head_class(FusedHead, family)
    )
    get_slot("head").swap(model, sub)
    batch = _batch(model)
    _assert_same_training(_train_pass(reference, batch), _train_pass(model, batch))


def test_cli_verifies_a_head_substitution() -> None:
    from typer.testing import CliRunner

    from layerswap.cli import app

    result = CliRunner().invoke(
        app, ["verify", "--substitution", "llama.head.fused", "--backward", "--json"]
    )
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["passed"] is True


def test_a_trainer_step_gives_the_original_losses(tmp_path: Path) -> None:
    from transformers import Trainer, TrainingArguments

    class Rows(torch.utils.data.Dataset):  # type: ignore[type-arg]
        def __init__(self, vocab: int) -> None:
            self.ids = torch.randint(1, vocab, (8, 10), generator=torch.Generator().manual_seed(0))

        def __len__(self) -> int:
            return len(self.ids)

        def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
            return {"input_ids": self.ids[index], "labels": self.ids[index]}

    def losses(model: PreTrainedModel, out: Path) -> list[float]:
        args = TrainingArguments(
            output_dir=str(out),
            max_steps=2,
            per_device_train_batch_size=4,
            gradient_accumulation_steps=2,
            learning_rate=1e-2,
            logging_steps=1,
            save_strategy="no",
            report_to=[],
            use_cpu=True,
            seed=0,
            disable_tqdm=True,
        )
        trainer = Trainer(model=model, args=args, train_dataset=Rows(text_vocab(model)))
        trainer.train()
        return [log["loss"] for log in trainer.state.log_history if "loss" in log]

    original = _model("llama.head.fused")
    fused = copy.deepcopy(original)
    layerswap.swap(fused, "llama.head.fused")
    want, got = losses(original, tmp_path / "a"), losses(fused, tmp_path / "b")
    assert len(got) == 2
    assert got == pytest.approx(want, rel=1e-5)


# --- FSDP2 (fully_shard) on two CPU ranks --------------------------------------------------


def _fsdp_head_rank(rank: int, port: int, out_dir: str) -> None:
    import datetime
    import os

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from layerswap.errors import ParallelismError

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
    try:
        mesh = init_device_mesh("cpu", (2,))
        report: dict[str, Any] = {}
        models = {"original": _model("llama.head.fused"), "fused": _model("llama.head.fused")}
        layerswap.swap(models["fused"], "llama.head.fused")
        batch = _batch(models["original"])
        for label, model in models.items():
            for layer in model.model.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)  # lm_head in the root unit: whole in its forward
            loss, output = _train_pass_loss_only(model, batch, {})
            loss.backward()
            report[label] = (
                loss.detach(),
                output.logits is None,
                {n: p.grad.full_tensor() for n, p in model.named_parameters()},
            )
        own_unit = _model("llama.head.fused")
        layerswap.swap(own_unit, "llama.head.fused")
        fully_shard(own_unit.lm_head, mesh=mesh)
        fully_shard(own_unit, mesh=mesh)
        try:
            _train_pass_loss_only(own_unit, batch, {})
            report["own_unit"] = ""
        except ParallelismError as exc:
            report["own_unit"] = str(exc)
        torch.save(report, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # spawned processes
def test_fsdp2_sharded_head_trains_to_the_original_loss_and_gradients(tmp_path: Path) -> None:
    from ranks import free_port, run_ranks

    run_ranks(_fsdp_head_rank, (free_port(), str(tmp_path)), nprocs=2, timeout_s=120)
    for rank in range(2):
        report = torch.load(tmp_path / f"rank{rank}.pt")
        (want_loss, kept_logits, want), (loss, skipped_logits, got) = (
            report["original"],
            report["fused"],
        )
        assert not kept_logits and skipped_logits  # the fused loss ran, not the original's
        torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-6)
        assert got.keys() == want.keys()
        for name, grad in want.items():
            torch.testing.assert_close(got[name], grad, rtol=1e-4, atol=1e-6, msg=name)
        # lm_head sharded on its own: its weight is sharded where the loss reads it
        assert "own FSDP unit" in report["own_unit"], report["own_unit"]
