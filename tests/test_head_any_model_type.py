"""The ``head`` slot on model types no family covers: GPT-2, OPT, Llama 4, Qwen3-Next's
kin. The fused loss is proven at first use on the type's tiny model (no test of
layerswap's covers its family), and a head the source shows adding to the loss is
refused by name."""

from __future__ import annotations

import copy
import dataclasses
import io
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

import layerswap
from layerswap.backends.head import head_class
from layerswap.backends.head_fused import FusedHead
from layerswap.errors import UnknownSubstitutionError, UpstreamDriftError
from layerswap.model_types import bare_family
from layerswap.proof import prove
from layerswap.slots.head import head_substitution_of

#: no registered family covers these: a GPT-2 block, OPT's, and Llama 4's hybrid layers
TYPES = ("gpt2", "opt", "llama4_text")


def _model(model_type: str) -> PreTrainedModel:
    model: PreTrainedModel = bare_family(model_type).build(seed=0)
    return model


def _batch(model: PreTrainedModel) -> dict[str, torch.Tensor]:
    vocab = model.config.get_text_config().vocab_size
    ids = torch.randint(3, vocab, (2, 10), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def _train_pass(model: PreTrainedModel, batch: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    model.train()
    torch.manual_seed(0)  # the same dropout masks in both models
    output = model(**batch, use_cache=False)
    params = {name: p for name, p in model.named_parameters() if p.requires_grad}
    grads = torch.autograd.grad(output.loss, list(params.values()), allow_unused=True)
    return output, dict(zip(params, grads, strict=True))


@pytest.mark.parametrize("model_type", TYPES)
def test_a_model_type_no_family_covers_trains_to_the_original_loss(model_type: str) -> None:
    assert model_type not in layerswap.families()
    model = _model(model_type)
    reference = copy.deepcopy(model)
    batch = _batch(model)

    handle = layerswap.swap(model, f"{model_type}.head.fused")

    assert head_substitution_of(model) == f"{model_type}.head.fused"
    out, grads = _train_pass(model, batch)
    want_out, want_grads = _train_pass(reference, batch)
    assert out.logits is None  # the fused loss computed no logits
    torch.testing.assert_close(out.loss, want_out.loss, rtol=1e-5, atol=1e-6)
    for name, want in want_grads.items():
        if want is not None:
            torch.testing.assert_close(grads[name], want, rtol=1e-4, atol=1e-6, msg=name)
    handle.undo()
    assert type(model) is type(reference)


#: heads under other names, read off each forward: (model type, the projection's module).
#: Falcon names its logits ``lm_logits``; the rest name the projection otherwise.
NAMED_OTHERWISE = (
    ("falcon", "lm_head"),
    ("gpt_neox_japanese", "embed_out"),
    ("rwkv", "head"),
    ("biogpt", "output_projection"),
    ("electra", "generator_lm_head"),
)


@pytest.mark.parametrize(("model_type", "head"), NAMED_OTHERWISE)
def test_a_head_under_another_name_trains_to_the_original_loss(model_type: str, head: str) -> None:
    from layerswap.backends.head import head_contract

    family = bare_family(model_type)
    assert head_contract(family.causal_lm_class()).head == head
    model = _model(model_type)
    reference = copy.deepcopy(model)
    batch = _batch(model)
    layerswap.swap(model, f"{model_type}.head.fused")
    out, grads = _train_pass(model, batch)
    want_out, want_grads = _train_pass(reference, batch)
    assert out.logits is None and want_out.logits is not None
    torch.testing.assert_close(out.loss, want_out.loss, rtol=1e-5, atol=1e-6)
    for name, want in want_grads.items():
        if want is not None:  # to rounding, on the gradient's scale (RWKV's embeddings: ~50)
            scale = max(1.0, want.abs().max().item())
            torch.testing.assert_close(grads[name], want, rtol=1e-4, atol=1e-6 * scale, msg=name)


def test_a_head_under_another_name_that_is_no_linear_is_refused_by_its_name() -> None:
    """BERT's causal LM projects with ``self.cls``, a transform and a decoder: the fused
    loss cannot compute it, and the refusal names it."""
    with pytest.raises(UnknownSubstitutionError, match=r"its cls is a .*BertOnlyMLMHead, not"):
        layerswap.get("bert.head.fused")


def test_it_saves_what_plain_transformers_loads_and_pickles_with_its_head(
    tmp_path: Path,
) -> None:
    model = _model("gpt2")
    layerswap.swap(model, "gpt2.head.fused")
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert type(loaded).__name__ == "GPT2LMHeadModel" and head_substitution_of(loaded) is None
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name

    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    assert head_substitution_of(torch.load(buffer, weights_only=False)) == "gpt2.head.fused"


def test_use_builds_it_with_the_fused_head_and_verify_passes() -> None:
    family = bare_family("opt")
    with layerswap.use("opt.head.fused"):
        built = family.causal_lm_class()(family.tiny_config())
    assert head_substitution_of(built) == "opt.head.fused"
    report = layerswap.verify(_model("opt"), "opt.head.fused", backward=True)
    assert report.passed, report.summary()


def test_a_head_is_named_by_the_substitution_that_swapped_it() -> None:
    """One head class serves every model type of a causal LM: Gemma3ForCausalLM is
    gemma3's and gemma3_text's. The model names the substitution it was given, not the
    first family of its class."""
    from layerswap.errors import SubstitutionError

    model = _model("gemma3_text")
    with layerswap.swap(model, "gemma3_text.head.fused"):
        assert head_substitution_of(model) == "gemma3_text.head.fused"
        with pytest.raises(SubstitutionError, match=r"already swapped by gemma3_text\.head"):
            layerswap.swap(model, "gemma3_text.head.fused")
    assert head_substitution_of(model) is None and "_layerswap_head_by" not in vars(model)
    family = bare_family("gemma3_text")
    with layerswap.use("gemma3_text.head.fused"):
        built = family.causal_lm_class()(family.tiny_config())
    assert head_substitution_of(built) == "gemma3_text.head.fused"


def test_the_first_use_proof_catches_a_wrong_loss() -> None:
    """A head whose loss is 1% off: its proof fails at the backward check, and the swap is
    refused before the model changes."""

    class Wrong(FusedHead):
        backend = "wrong"

        def _summed_loss(self, *args: Any) -> torch.Tensor:
            return super()._summed_loss(*args) * 1.01

    sub = layerswap.get("gpt2.head.fused")
    assert sub.parts.slot.proves(sub)  # a model type no family covers
    wrong = dataclasses.replace(
        sub, name="gpt2.head.wrong", replacement=head_class(Wrong, sub.parts.family)
    )
    verdict = prove(wrong, force=True)
    assert not verdict.passed and verdict.check == "backward", verdict.detail
    model = _model("gpt2")
    with pytest.raises(UpstreamDriftError, match=r"gpt2\.head\.wrong"):
        layerswap.swap(model, wrong)
    assert head_substitution_of(model) is None


def test_a_family_head_is_not_proven_again_and_a_loss_adding_head_is_refused() -> None:
    sub = layerswap.get("llama.head.fused")
    assert not sub.parts.slot.proves(sub)  # its family's tests cover it
    # Bamba's causal LM adds a z-loss on the logits inside its loss block
    with pytest.raises(UnknownSubstitutionError, match="does more with the loss"):
        layerswap.get("bamba.head.fused")


def test_qwen3_next_trains_to_the_original_loss_with_its_router_loss() -> None:
    model = _model("qwen3_next")
    reference = copy.deepcopy(model)
    layerswap.swap(model, "qwen3_next.head.fused")
    batch = {**_batch(model), "output_router_logits": True}
    out, grads = _train_pass(model, batch)
    want_out, want_grads = _train_pass(reference, batch)
    assert want_out.aux_loss is not None
    torch.testing.assert_close(out.loss, want_out.loss, rtol=1e-5, atol=1e-6)
    for name, want in want_grads.items():
        if want is not None:
            torch.testing.assert_close(grads[name], want, rtol=1e-4, atol=1e-6, msg=name)


def test_a_projection_scaled_in_its_own_statement_is_read() -> None:
    """Falcon-H1: ``logits = self.lm_head(h) * self.model.lm_head_multiplier``."""
    from transformers.models.falcon_h1.modeling_falcon_h1 import FalconH1ForCausalLM

    from layerswap.backends.head import head_contract

    assert head_contract(FalconH1ForCausalLM).steps == (("mul", "model.lm_head_multiplier"),)
    # its tiny config sets the multiplier to 0.5, so that a proof of a head dropping it fails
    assert bare_family("falcon_h1").tiny_config().lm_head_multiplier == 0.5


@pytest.mark.slow  # Falcon-H1's Mamba layers run transformers' PyTorch fallback: a minute
def test_a_projection_scaled_in_its_own_statement_is_reproduced() -> None:
    model = _model("falcon_h1")
    assert model.model.lm_head_multiplier == 0.5
    reference = copy.deepcopy(model)
    layerswap.swap(model, "falcon_h1.head.fused")
    batch = _batch(model)
    out, _ = _train_pass(model, batch)
    want, _ = _train_pass(reference, batch)
    torch.testing.assert_close(out.loss, want.loss, rtol=1e-5, atol=1e-6)


def test_a_forward_returning_a_tuple_for_return_dict_false_is_taken() -> None:
    """BLOOM's forward builds a tuple itself where ``return_dict`` is false; the head
    calls it for a dict and gives the tuple the original gives (the loss first)."""
    model = _model("bloom")
    reference = copy.deepcopy(model)
    layerswap.swap(model, "bloom.head.fused")
    batch = _batch(model)
    model.train()
    reference.train()
    got = model(**batch, use_cache=False, return_dict=False)
    want = reference(**batch, use_cache=False, return_dict=False)
    assert isinstance(got, tuple) and isinstance(want, tuple)
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)
    # the logits not computed keep their place: every other position is the original's
    assert len(got) == len(want) and got[1] is None and want[1] is not None


@pytest.mark.slow  # every model type of the installed transformers, on the meta device
def test_every_model_type_listed_with_a_fused_head_was_proven_by_the_sweep() -> None:
    import json

    import transformers

    from layerswap.coverage import coverage

    report = coverage(jobs=1)
    listed = {
        model_type
        for model_type, row in report.items()
        if not row.covered and "fused" in row.below_decoder.get("head", [])
    }
    assert {"gpt2", "opt", "llama4_text"} <= listed
    assert {"qwen3_next", "bloom"} <= listed  # the router's loss; a tuple for return_dict
    assert "bamba" not in listed  # a z-loss of its own
    assert {model_type for model_type, _ in NAMED_OTHERWISE} <= listed
    docs = Path(__file__).resolve().parent.parent / "docs"
    if f"transformers {transformers.__version__}," in (docs / "heads.md").read_text():
        rows = {row["model_type"]: row for row in json.loads((docs / "heads.json").read_text())}
        assert listed == set(rows)
        assert all(row["passed"] for row in rows.values())
