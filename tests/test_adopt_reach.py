"""What an adoption's proof reaches: the code a patch changes, wherever the tiny models run it.

Each test here is a patch that computes otherwise only where an earlier proof did not
look (a config built with it, a model built with it, a later layer, a longer prompt, a
single sequence, Trainer's loss normaliser) and was reported proven."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from transformers import LlamaForSequenceClassification
from transformers.models.llama import configuration_llama, modeling_llama

import layerswap
from layerswap.errors import AdoptionError, PatchDivergenceError

_POST_INIT = configuration_llama.LlamaConfig.__post_init__


def _eps_in_config(model: Any = None) -> None:
    """A patch of the config class: every config built after it has another epsilon."""

    def __post_init__(self: Any, **kwargs: Any) -> None:
        _POST_INIT(self, **kwargs)
        self.rms_norm_eps = 0.1

    configuration_llama.LlamaConfig.__post_init__ = __post_init__


@pytest.mark.parametrize("given", ["config", "nothing"])
def test_a_patch_of_the_config_class_is_refused(given: str) -> None:
    """The original's tiny config is built with the patch taken back, the candidate's with
    it in effect (both were built with it, and every model they built differed); without
    a config, the family is found from the configuration module the patch changed."""
    family = layerswap.get_family("llama")
    where = {"config": family.tiny_config()} if given == "config" else {}
    with pytest.raises(PatchDivergenceError, match="forward on a left-padded batch") as refused:
        layerswap.adopt(_eps_in_config, **where)
    assert refused.value.layer == "model.layers.0"
    assert configuration_llama.LlamaConfig.__post_init__ is _POST_INIT
    assert family.tiny_config().rms_norm_eps != 0.1


class _FastRMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = (x.shape[-1],)
        return nn.functional.rms_norm(x, shape, self.weight, self.variance_epsilon)


def _forgot_epsilon(model: Any = None) -> None:
    modeling_llama.LlamaRMSNorm = lambda hidden_size, eps=1e-6: _FastRMSNorm(hidden_size, 0.1)


def _fast_norm(model: Any = None) -> None:
    modeling_llama.LlamaRMSNorm = _FastRMSNorm


def test_a_wrong_class_rebinding_adopted_with_a_model_is_refused() -> None:
    """Given ``model=``, a rebound constructor runs only in models built after the patch,
    which the proof's copy (built before) is not: the class-level changes are proven as
    without a model too, a tiny model built with them against one built without. The
    user's model is left as it was; a right rebinding is still proven."""
    family = layerswap.get_family("llama")
    model = family.build(seed=0)
    original = modeling_llama.LlamaRMSNorm
    with pytest.raises(PatchDivergenceError, match="forward on a left-padded batch") as refused:
        layerswap.adopt(_forgot_epsilon, model=model)
    assert refused.value.layer == "model.layers.0"
    assert modeling_llama.LlamaRMSNorm is original
    with layerswap.adopt(_fast_norm, model=model) as adoption:
        assert adoption.proven == "llama"
        assert isinstance(family.build().model.norm, _FastRMSNorm)


def _scale_from_layer_4(model: Any = None) -> None:
    for layer in list(model.model.layers)[4:]:
        mlp = layer.mlp
        mlp.forward = lambda x, mlp=mlp: modeling_llama.LlamaMLP.forward(mlp, x) * 1.01


def test_a_patch_of_layers_past_the_tiny_depth_is_proven_on_each() -> None:
    """The proof's copy keeps every layer of the model given (its widths shrunk): a patch
    wrong from layer 4 on, on an 8-layer model, is refused naming layer 4, where a copy
    cut to 4 layers ran none of its changes and reported it proven."""
    family = layerswap.get_family("llama")
    model = family.build(family.tiny_config(num_hidden_layers=8), seed=0)
    with pytest.raises(PatchDivergenceError) as refused:
        layerswap.adopt(_scale_from_layer_4, model=model)
    assert refused.value.layer == "model.layers.4"
    assert all("forward" not in vars(layer.mlp) for layer in model.model.layers)


def test_changes_to_a_model_where_the_copy_was_not_changed_are_refused() -> None:
    """A change the function made to the user's model but not to the proof's copy (here a
    head only a classifier has) was not proven: refused, the model left as it was."""
    family = layerswap.get_family("llama")
    config = family.tiny_config(pad_token_id=0)
    model = LlamaForSequenceClassification(config).eval()

    def patch_score(model: nn.Module) -> None:
        score = getattr(model, "score", None)
        if score is not None:
            score.forward = lambda x, score=score: nn.Linear.forward(score, x) * 2

    with pytest.raises(AdoptionError, match=r"score: Rebinding forward"):
        layerswap.adopt(patch_score, model=model)
    assert "forward" not in vars(model.score)


_ROTARY = modeling_llama.LlamaRotaryEmbedding.forward
_MLP = modeling_llama.LlamaMLP.forward


def _positions_past_15_clamped(model: Any = None) -> None:
    def forward(self: Any, x: torch.Tensor, position_ids: torch.Tensor) -> Any:
        return _ROTARY(self, x, position_ids.clamp(max=15))

    modeling_llama.LlamaRotaryEmbedding.forward = forward


def _off_for_one_sequence(model: Any = None) -> None:
    def forward(self: Any, x: torch.Tensor) -> torch.Tensor:
        out = _MLP(self, x)
        return out * 1.01 if x.shape[0] == 1 else out

    modeling_llama.LlamaMLP.forward = forward


@pytest.mark.parametrize(
    "patch", [_positions_past_15_clamped, _off_for_one_sequence], ids=["long", "one sequence"]
)
@pytest.mark.parametrize("given", ["model", "config"])
def test_a_patch_wrong_past_position_15_or_for_one_sequence_is_refused(
    patch: Any, given: str
) -> None:
    """The proof runs one sequence of 64 tokens alone too: the padded batch (two prompts
    of 8 tokens, 3 decoded) reached neither position 16 nor a batch of one row."""
    family = layerswap.get_family("llama")
    where = (
        {"model": family.build(seed=0)} if given == "model" else {"config": family.tiny_config()}
    )
    with pytest.raises(PatchDivergenceError, match="one long sequence") as refused:
        layerswap.adopt(patch, **where)
    assert refused.value.check == "forward on one long sequence"
    assert refused.value.layer == "model.layers.0"
    assert modeling_llama.LlamaRotaryEmbedding.forward is _ROTARY
    assert modeling_llama.LlamaMLP.forward is _MLP


def _loss_ignoring_items(model: Any = None) -> None:
    from transformers.loss.loss_utils import ForCausalLMLoss

    def loss(logits: Any, labels: Any, vocab_size: int, **kwargs: Any) -> torch.Tensor:
        kwargs.pop("num_items_in_batch", None)  # a mean over this batch alone
        return ForCausalLMLoss(logits, labels, vocab_size, **kwargs)

    modeling_llama.LlamaForCausalLM.loss_function = property(lambda self: loss)


def test_a_loss_ignoring_num_items_in_batch_is_refused() -> None:
    """Trainer passes ``num_items_in_batch`` under gradient accumulation; a loss that
    ignores it is a mean over one micro-batch, several times the original's sum over all
    of them: the proof compares the loss given it, and an equal patch names the check."""
    config = layerswap.get_family("llama").tiny_config()
    with pytest.raises(PatchDivergenceError, match="loss with num_items_in_batch") as refused:
        layerswap.adopt(_loss_ignoring_items, config=config)
    assert refused.value.check == "loss with num_items_in_batch"
    assert "loss_function" not in vars(modeling_llama.LlamaForCausalLM)

    def same() -> None:
        modeling_llama.LlamaMLP.forward = lambda self, x: _MLP(self, x)

    with layerswap.adopt(same, config=config) as adoption:
        assert "loss with num_items_in_batch" in adoption.checks
        assert "forward on one long sequence" in adoption.checks
