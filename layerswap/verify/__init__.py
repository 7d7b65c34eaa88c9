"""Proof that a swapped model still computes what the original computes.

:func:`verify` runs the original model and the model with a substitution applied on the
same inputs and the same weights, and compares the logits (max absolute and relative
error, cosine similarity, top-1 agreement, KL divergence) and the output of every
decoder layer, captured with forward hooks. It names the first decoder layer whose
output is over tolerance, which is where a wrong weight mapping or a wrong kernel shows
up first. ``backward=True`` also compares the loss and every gradient (the candidate's
gradients mapped back to the original layout through the substitution's converter);
``generate=N`` compares ``N`` greedily generated tokens.

Two designs, one report:

* **full** (default): the model is deep-copied (and cast to ``dtype`` / moved to
  ``device``); the copy runs as the reference, is swapped in place, and runs again as the
  candidate. The candidate therefore holds exactly the reference's weights, converted.
  Memory: the model plus one copy.
* **streaming** (``streaming=True``): nothing is copied when the model already lives on
  the target device in the target dtype. A reference pass records every layer's output;
  a second pass replaces each decoder layer's output, through a forward hook, by the
  output of a replacement layer built from that layer's weights on the fly and dropped
  right after. The second pass therefore computes the swapped model's activations while
  only one replacement layer exists at a time. Memory: one model plus one layer.

The model passed in is never modified: its weights, gradients, hooks and training flags
are as they were when :func:`verify` returns, whatever happened inside.

One module per concern: ``checks`` (:func:`verify`, :func:`assert_equivalent`),
``streaming``, ``gradients`` (a swapped model's gradients in the original layout),
``kept_loss`` (with ``backward=True``, both models learn again from the positions still
compared, on one more working copy, only where a near-tie left some out) and
``candidate`` (the working copy, the substitution checked for this machine, which
:mod:`layerswap.bench` shares). The passes and the judging are the comparison core's
(:mod:`layerswap.comparison`), which the first-use proof (:mod:`layerswap.proof`) runs
its checks with too.

Example::

    import layerswap

    model = layerswap.families()["llama"].build()      # tiny config, random weights
    report = layerswap.verify(model, "llama.decoder.fused")
    assert report.passed, report.summary()
"""

from __future__ import annotations

from layerswap.comparison.inputs import InputsLike as InputsLike
from layerswap.comparison.inputs import default_inputs
from layerswap.comparison.placement import DTYPE_CHOICES as DTYPE_CHOICES
from layerswap.comparison.placement import DeviceLike as DeviceLike
from layerswap.comparison.placement import DTypeLike as DTypeLike
from layerswap.comparison.placement import resolve_device, resolve_dtype
from layerswap.comparison.report import (
    BackwardReport,
    GenerationReport,
    GradientReport,
    LayerReport,
    VerificationReport,
)
from layerswap.comparison.tolerance import Tolerance
from layerswap.verify.candidate import SubstitutionLike as SubstitutionLike
from layerswap.verify.checks import assert_equivalent, verify

__all__ = [
    "BackwardReport",
    "GenerationReport",
    "GradientReport",
    "LayerReport",
    "Tolerance",
    "VerificationReport",
    "assert_equivalent",
    "default_inputs",
    "resolve_device",
    "resolve_dtype",
    "verify",
]
