"""One proof run: what it builds (a tiny model of the user's config, original and swapped)
and the verdict the comparison core gives it (:mod:`layerswap.comparison.judgement`).

:mod:`layerswap.proof` decides when a substitution is proven and keeps the verdicts;
this module runs one proof, in isolation: its own random state, on its device, with the
caller's autocast off, and inside :func:`comparing` (the models it builds are not proven
again).

Example::

    verdict = run(plan(layerswap.get("llama.decoder.fused"), model.config, Placement()))
    verdict.passed      # True
"""

from __future__ import annotations

import contextvars
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch
from torch import nn

from layerswap import verdicts
from layerswap.comparison.gradients import gradients_to_original
from layerswap.comparison.judgement import Pair, judge
from layerswap.comparison.placement import dtype_name
from layerswap.errors import LayerswapError
from layerswap.layers import converted_copy, normal_tensors, originals_in_place
from layerswap.placement import LOW_PRECISION, without_autocast
from layerswap.proof_key import ProofPlan
from layerswap.shrink import proof_config
from layerswap.use import applied
from layerswap.verdict import Verdict

if TYPE_CHECKING:
    from transformers import PreTrainedConfig

    from layerswap.substitution import Substitution

__all__ = ["Verdict", "comparing", "proving", "run"]


# a proof builds models: the use() hooks it passes through must not prove again
_PROVING: contextvars.ContextVar[bool] = contextvars.ContextVar("layerswap_proving", default=False)


@contextmanager
def comparing() -> Iterator[None]:
    """Inside, :func:`layerswap.proof.ensure_proven` proves nothing: for a proof's own
    models, and for a comparison that is itself the proof (:func:`layerswap.verify`
    compares the user's model, its decoding included, and names the first divergent layer).

    Example::

        with comparing():
            swap(copy_of_model, sub)       # verify's candidate: its report is the verdict
    """
    token = _PROVING.set(True)
    try:
        yield
    finally:
        _PROVING.reset(token)


def proving() -> bool:
    """Whether this runs inside :func:`comparing` (a proof's own models, or a comparison
    that is itself the proof): a slot that proves at each swap proves nothing there.

    Example::

        with comparing():
            proving()      # True
    """
    return _PROVING.get()


@normal_tensors
def run(proof: ProofPlan) -> Verdict:
    """The verdict of the ``proof``'s substitution on its config shrunk (``None``, or a
    config the shrink breaks: the family's tiny config), on its device, in float32 and
    in the low-precision dtype and autocast dtype it names."""
    started = time.perf_counter()
    sub, config, device = proof.sub, proof.config, proof.device
    dtype, autocast = proof.dtype, proof.autocast
    family = sub.parts.family
    proven, kind = proof_config(family, config)
    # on ``device`` even inside from_pretrained, which builds under torch.device("meta"):
    # the proof's models, and every tensor their forward passes create
    # and in float32 even inside the caller's torch.autocast (a proof at a forward pass
    # under Trainer's bf16=True): the autocast run is a check of its own, at the end
    with (
        torch.random.fork_rng(devices=[device] if device.type == "cuda" else []),
        torch.device(device),
        without_autocast(device),
        comparing(),
    ):
        check: str | None
        reference: nn.Module | None
        try:
            reference = original_model(sub, proven, device)
        except Exception as exc:
            _raise_if_another_use_refused(exc, sub)
            # the shrunk config does not build (a size the shrink broke): the family's tiny
            proven, kind = family.tiny_config(), "family"
            reference = None
        try:
            if reference is None:
                reference = original_model(sub, proven, device)
        except Exception as exc:  # nothing can be proven here: refused, with the reason
            _raise_if_another_use_refused(exc, sub)
            check, detail = "building the tiny original model", f"{type(exc).__name__}: {exc}"
        else:
            # the replacement's own errors (its constructor, its converter) are raised
            # as they are: neither a reason to prove another config, nor a verdict
            idle = sub.parts.slot.proof_watch(sub)
            check, detail = judge(
                _pair(reference, sub, proven),
                proven,
                device,
                rebuild=lambda alone: _pair(original_model(sub, alone, device), sub, alone),
                dtype=dtype,
                autocast=autocast,
            )
            unchanged = None if check is not None or idle is None else idle()
            if unchanged is not None:  # equal, since nothing was swapped in: refused
                check, detail = "idle", unchanged
    return Verdict(
        substitution=sub.name,
        passed=check is None,
        check=check,
        detail=detail,
        seconds=round(time.perf_counter() - started, 3),
        versions=verdicts.versions(),
        config=kind,
        module=proof.module,
        source=proof.source,
        attention=getattr(proven, "_attn_implementation", None),
        dtype=dtype_name(dtype) if dtype in LOW_PRECISION else None,
        autocast=dtype_name(autocast) if autocast in LOW_PRECISION else None,
    )


def _pair(reference: nn.Module, sub: Substitution, config: PreTrainedConfig) -> Pair:
    """``reference`` (:func:`original_model` of ``config``) and its copy with ``sub`` in
    place, holding its weights."""
    slot = sub.parts.slot
    if slot.replaces_layers:  # layer by layer, as a swap converts them
        candidate = converted_copy(reference, sub, config)
    else:
        candidate = slot.proof_candidate(reference, sub, config)
    return Pair(
        reference,
        candidate,
        slot.proof_context(sub),
        lambda model, grads: gradients_to_original(model, grads, sub),
    )


def original_model(sub: Substitution, config: PreTrainedConfig, device: torch.device) -> nn.Module:
    """A causal LM of ``config`` with the originals in ``sub``'s slot, random from the
    seed (set here), in float32 on ``device``, in eval mode."""
    torch.manual_seed(0)
    model = sub.parts.family.causal_lm_class()(config)
    # built inside a use(): the originals back (the weights are drawn after)
    if sub.parts.slot.replaces_layers:
        originals_in_place(model, sub.original_class(), config)
    else:
        sub.parts.slot.proof_reference(model, sub, config)
    _randomize(model)
    placed: nn.Module = model.to(device=device, dtype=torch.float32)
    return placed.eval()


def _randomize(model: nn.Module) -> None:
    """Every tensor from the seeded generator: norms near their identity, biases small."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() >= 2:
                param.normal_(0.0, 0.05)
            elif "norm" in name:
                param.add_(torch.randn_like(param), alpha=0.1)
            else:
                param.normal_(0.0, 0.1)


def _raise_if_another_use_refused(exc: Exception, sub: Substitution) -> None:
    """Raise ``exc``, a refusal of layerswap's own, where another substitution's
    :func:`~layerswap.use` is in effect: it refused the proof's tiny model (the mlp slot
    refuses a model whose layers are the decoder slot's), which says nothing of ``sub``,
    and no verdict of ``sub`` may be kept for it."""
    if isinstance(exc, LayerswapError) and any(other.name != sub.name for other in applied()):
        raise exc
