"""A model an adopted patch runs in, verified layer by layer: the original code against the patched.

:func:`layerswap.verify` compares a model with its swap; an adopted patch changes code,
not layers, so the same model runs twice on the same inputs: with the patch taken back
for the time of the pass (:meth:`~layerswap.adoption.record.Recording.suspended`), then
as patched. The two runs are judged as ``verify`` judges (:mod:`layerswap.comparison.compare`),
so the report names the first divergent decoder layer.

A module the model was *built* with from a class the patch put in place (Liger's
``LigerRMSNorm`` for ``LlamaRMSNorm``) runs the patch's code either way: such a model is
refused rather than compared with itself.

Example::

    adoption = layerswap.adopt(apply_patch, model=model, prove=False)
    report = adoption.verify(model, backward=True)
    report.first_divergent_layer          # 2
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from layerswap.adoption.changes import ClassChange, Rebinding
from layerswap.comparison.compare import Comparison
from layerswap.comparison.forward import forward
from layerswap.comparison.generation import decode_tokens
from layerswap.comparison.placement import model_placement
from layerswap.errors import UnsupportedModelError
from layerswap.placement import without_autocast

if TYPE_CHECKING:
    from torch import nn

    from layerswap.adoption.record import Recording
    from layerswap.comparison.inputs import InputsLike
    from layerswap.comparison.report import VerificationReport
    from layerswap.comparison.tolerance import Tolerance

__all__ = ["verify_adopted"]


def verify_adopted(
    recording: Recording,
    model: nn.Module,
    inputs: InputsLike = None,
    *,
    backward: bool = False,
    generate: int | None = None,
    tolerance: float | Tolerance | None = None,
) -> VerificationReport:
    """``model`` with ``recording``'s changes taken back against ``model`` as patched, on
    the same inputs (default: :func:`~layerswap.comparison.inputs.default_inputs`); the model
    is left as it was."""
    _refuse_built_with_patch(recording, model)
    device, dtype = model_placement(model)
    generate = decode_tokens(model, generate)
    comparison = Comparison.prepare(model, None, device, dtype, tolerance, inputs)
    batch = comparison.batch
    with without_autocast(device):  # compared in the model's dtype, as verify compares
        reference = forward(
            model, batch, backward=backward, generate=generate, context=recording.suspended
        )
        candidate = forward(model, batch, backward=backward, generate=generate)
    return comparison.report(reference, candidate, mode="models")


def _refuse_built_with_patch(recording: Recording, model: nn.Module) -> None:
    put_in_place = {
        change.new: change.old
        for change in recording.changes
        if isinstance(change, Rebinding) and isinstance(change.new, type)
    }
    # an instance whose class the patch changed gets its class back for the reference
    reclassed = {id(change.obj) for change in recording.changes if isinstance(change, ClassChange)}
    for name, module in model.named_modules():
        if id(module) in reclassed:
            continue
        for new, old in put_in_place.items():
            if isinstance(module, new) and not (isinstance(old, type) and isinstance(module, old)):
                raise UnsupportedModelError(
                    f"{name or type(model).__name__} is a {new.__qualname__}, the class "
                    f"{recording.name} put in place of {getattr(old, '__qualname__', old)}: "
                    "the model was built with the patch, so its original code cannot run. "
                    "Verify a model built without it, adopted with model="
                )
