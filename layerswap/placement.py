"""Where a model computes and in what: :class:`Placement`, read off its weights (and the
``torch.autocast`` in effect) once and handed down (the first-use proof runs in it)."""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

__all__ = [
    "COMPUTE_DTYPES",
    "LOW_PRECISION",
    "Placement",
    "autocast_dtype",
    "without_autocast",
]

#: the dtypes a model's weights compute in (a quantized weight's storage is none of them)
COMPUTE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
#: the dtypes a model may compute in that a proof runs in besides float32
LOW_PRECISION = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class Placement:
    """What a model computes in and where: the dtype and the device most of its
    floating-point weights hold, by element count (``None`` where it has no such weight;
    a model on the meta device, as ``from_pretrained`` builds one, has a dtype and no
    device), and the dtype ``torch.autocast`` runs its passes in where it is on for that
    device (Trainer's ``bf16=True``: float32 weights, bfloat16 matmuls). The proof runs in
    it (:func:`layerswap.proof.ensure_proven`).

    Example::

        Placement.of(model.to("cuda", torch.bfloat16))
        # Placement(dtype=torch.bfloat16, device=device(type='cuda', index=0), autocast=None)
    """

    dtype: torch.dtype | None = None
    device: torch.device | None = None
    autocast: torch.dtype | None = None

    @classmethod
    def of(cls, model: nn.Module) -> Placement:
        dtypes: Counter[torch.dtype] = Counter()
        devices: Counter[torch.device] = Counter()
        for param in model.parameters():
            if param.dtype in COMPUTE_DTYPES:
                dtypes[param.dtype] += param.numel()
                devices[param.device] += param.numel()
        device = devices.most_common(1)[0][0] if devices else None
        if device is not None and device.type == "meta":
            device = None
        return cls(
            dtype=dtypes.most_common(1)[0][0] if dtypes else None,
            device=device,
            autocast=autocast_dtype(device),
        )


def autocast_dtype(device: torch.device | None) -> torch.dtype | None:
    """The dtype ``torch.autocast`` computes in on ``device``'s type here and now, or
    ``None`` where it is off (or ``device`` is unknown).

    Example::

        with torch.autocast("cpu", dtype=torch.bfloat16):
            autocast_dtype(torch.device("cpu"))     # torch.bfloat16
    """
    if device is None:
        return None
    try:
        if not torch.is_autocast_enabled(device.type):
            return None
        return torch.get_autocast_dtype(device.type)
    except (RuntimeError, TypeError, AttributeError):  # a device type autocast does not know
        return None


@contextlib.contextmanager
def without_autocast(*devices: torch.device) -> Iterator[None]:
    """``torch.autocast`` off inside, on the CPU, on CUDA where present and on each of
    ``devices``' types: a comparison in float32 run from a caller's autocast region (a
    proof at a forward pass under Trainer's ``bf16=True``) would otherwise run in the
    caller's dtype, and judge its rounding as a difference. A device type autocast does
    not know is left as it is."""
    kinds = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]
    kinds += [device.type for device in devices if device.type != "meta"]
    with contextlib.ExitStack() as stack:
        for kind in dict.fromkeys(kinds):
            try:
                off = torch.autocast(kind, enabled=False)
            except RuntimeError:  # a device type autocast does not know (lazy, vulkan)
                continue
            stack.enter_context(off)
        yield
