"""What the ``liger`` backend needs at run time: liger-kernel, a GPU, and its kernels.

Shared by the declaration (:mod:`layerswap.backends.liger.declaration`), the decoder
layer (:mod:`layerswap.backends.liger.decoder`) and the head
(:mod:`layerswap.backends.liger.head`). Nothing here imports Liger-Kernel until asked.
"""

from __future__ import annotations

import functools
import importlib
from types import ModuleType
from typing import TYPE_CHECKING

from layerswap.backends._runtime import GpuPackage
from layerswap.errors import RequirementError

if TYPE_CHECKING:
    import torch

__all__ = ["NOT_INSTALLED", "NO_CUDA", "kernels", "require_cuda", "unmet_requirement"]

NOT_INSTALLED = "liger-kernel is not installed (pip install 'layerswap[liger]')"
NO_CUDA = "needs a CUDA GPU (Liger's kernels are Triton)"

#: Liger-Kernel's functional API: its kernels as autograd functions
_FUNCTIONAL = "liger_kernel.transformers.functional"

# --- requirements ------------------------------------------------------------------------


#: liger-kernel, its questions asked the way every GPU backend's are
PACKAGE = GpuPackage(
    distribution="liger_kernel",
    kernels=_FUNCTIONAL,
    not_installed=NOT_INSTALLED,
    no_cuda=NO_CUDA,
    broken="liger-kernel is installed but its kernels cannot be imported",
)


def unmet_requirement() -> str | None:
    """Why the ``liger`` layers and head cannot run here, or ``None`` when they can.

    Checked in order: liger-kernel installed, a CUDA (or ROCm) GPU visible, and Liger's
    kernels importable (Triton installed and working).

    Example::

        from layerswap.backends.liger import runtime
        runtime.unmet_requirement()   # "liger-kernel is not installed (pip install ...)"
    """
    return PACKAGE.unmet_requirement()


@functools.cache
def kernels() -> ModuleType:
    """``liger_kernel.transformers.functional``, or :class:`RequirementError` with the reason.

    Example::

        liger.kernels().liger_swiglu(gate, up)
    """
    reason = unmet_requirement()
    if reason is not None:
        raise RequirementError(f"the liger backend cannot run here: {reason}")
    return importlib.import_module(_FUNCTIONAL)


def require_cuda(tensor: torch.Tensor, where: object) -> None:
    """:class:`RequirementError` unless Liger can run and ``tensor`` is on the GPU."""
    kernels()
    if not tensor.is_cuda:
        # Triton's own failure on a CPU tensor is a pointer error deep in a kernel launch
        raise RequirementError(
            f"{type(where).__name__} runs Liger's Triton kernels on CUDA tensors; move the "
            "model to the GPU (model.cuda())"
        )
