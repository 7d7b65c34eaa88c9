"""A family inferred from transformers' modeling module, proven before it is declared.

:func:`~layerswap.families.infer.infer_declaration` reads a model type's declaration off
its modeling module (below the registry: no backend, nothing registered). Structure can
fit while the forward pass differs -- rotary applied to some layers only, another rotary
convention -- so :func:`infer_family` also proves the declaration: the fused layer built
from it against the original on a tiny model (float32, padded inputs, gradients; the
dropout and the q/k/v clamp where the family has them), the family known to the proving
thread alone (:func:`layerswap.registry.visible`). A declaration that does not compute
what the original does is refused with the first difference, never declared.

Example::

    from layerswap.inference import infer_family

    family = infer_family("olmo2")          # Family(name="olmo2", norms=(("attn_out", ...
    layerswap.register_family(family)       # then verify it on your model
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from layerswap.errors import UnsupportedFamilyError
from layerswap.families.infer import (
    CLAMP_THAT_BITES,
    infer_declaration,
    seeded_layer,
    training_output,
)
from layerswap.placement import without_autocast
from layerswap.registry import visible

if TYPE_CHECKING:
    from layerswap.comparison.report import VerificationReport
    from layerswap.family import Family

__all__ = ["infer_family", "prove_inferred"]


def infer_family(model_type: str, *, name: str | None = None, verify: bool = True) -> Family:
    """The :class:`~layerswap.Family` of ``model_type``, read off the installed transformers.

    Raises :class:`~layerswap.errors.UnsupportedFamilyError` with the reason when the
    decoder layer has structure the replacement layers cannot express, or -- with
    ``verify`` (the default) -- when the fused layer built from the inferred declaration
    does not match the original on a tiny model (:func:`prove_inferred`).
    """
    # the probes and the proof compare in float32, whatever the caller's autocast region
    with without_autocast():
        return infer_declaration(model_type, name=name, prove=prove_inferred if verify else None)


def prove_inferred(family: Family, where: str) -> None:
    """Refuse ``family`` unless its fused layer matches the original on a tiny model
    (``where`` names the model type and its layer in the message)."""
    # the backend's layers, imported when a family is proven (coverage lists without them)
    from layerswap.backends import fused

    try:
        # known to this thread alone while it is proven: nothing is registered
        with visible(family):
            report = _report(family, where, fused.BACKEND.substitution(family))
    except Exception as exc:
        raise UnsupportedFamilyError(
            f"{where}: the inferred fused layer cannot run ({exc})"
        ) from exc
    if not report.passed:
        raise UnsupportedFamilyError(
            f"{where}: the structure fits, but the fused layer does not compute what the "
            f"original does: {report.failure_message()}"
        )


def _report(family: Family, where: str, sub: Any) -> VerificationReport:
    """The report on ``family``'s fused layer: forward and backward, dropout and clamps
    where the family has them."""
    from layerswap.verify import verify

    # the structure and the forward and backward passes; decoding is proven at first
    # use (layerswap.proof), once per versions, not here for every model type
    report = verify(family.build(seed=0), sub, backward=True, generate=0)
    if report.passed and family.layer.residual_dropout is not None:
        _prove_training_dropout(family, where, sub)
    if report.passed and family.attention.clip_qkv is not None:
        # the default config leaves the bound unset: prove the clamp where it bites
        bound = {family.attention.clip_qkv: CLAMP_THAT_BITES}
        report = verify(
            family.build(family.tiny_config(**bound), seed=0), sub, backward=True, generate=0
        )
    return report


def _prove_training_dropout(family: Family, where: str, sub: Any) -> None:
    """The fused layer drops what the original drops in training: same places, same draws
    (one layer, attention dropout off, the residual dropout at 0.3, one seed)."""
    from layerswap.layers import convert_layer

    config = family.tiny_config(**{family.layer.residual_dropout or "": 0.3})
    if "attention_dropout" in config.to_dict():
        config.attention_dropout = 0.0
    config._attn_implementation = "sdpa"
    original = seeded_layer(family.decoder_class(), config, 0)
    replacement = convert_layer(original, sub, config, layer_idx=0, detach=True)
    expected = training_output(original, config, seed=7)
    actual = training_output(replacement, config, seed=7)
    if not torch.allclose(actual, expected, atol=1e-5, rtol=1e-5):
        raise UnsupportedFamilyError(
            f"{where}: {family.layer.residual_dropout} drops elsewhere in the original layer than "
            "after the attention's and the MLP's output projections (training outputs "
            f"differ by {float((actual - expected).abs().max()):.3g})"
        )
