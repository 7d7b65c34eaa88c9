"""Where a model computes and in what: :class:`Placement`, read off its weights once and
handed down (the first-use proof runs in it)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["COMPUTE_DTYPES", "LOW_PRECISION", "Placement"]

#: the dtypes a model's weights compute in (a quantized weight's storage is none of them)
COMPUTE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
#: the dtypes a model may compute in that a proof runs in besides float32
LOW_PRECISION = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class Placement:
    """What a model computes in and where: the dtype and the device most of its
    floating-point weights hold, by element count (``None`` where it has no such weight;
    a model on the meta device, as ``from_pretrained`` builds one, has a dtype and no
    device). The proof runs in it (:func:`layerswap.proof.ensure_proven`).

    Example::

        Placement.of(model.to("cuda", torch.bfloat16))
        # Placement(dtype=torch.bfloat16, device=device(type='cuda', index=0))
    """

    dtype: torch.dtype | None = None
    device: torch.device | None = None

    @classmethod
    def of(cls, model: nn.Module) -> Placement:
        dtypes: Counter[torch.dtype] = Counter()
        devices: Counter[torch.device] = Counter()
        for param in model.parameters():
            if param.dtype in COMPUTE_DTYPES:
                dtypes[param.dtype] += param.numel()
                devices[param.device] += param.numel()
        device = devices.most_common(1)[0][0] if devices else None
        return cls(
            dtype=dtypes.most_common(1)[0][0] if dtypes else None,
            device=None if device is None or device.type == "meta" else device,
        )
