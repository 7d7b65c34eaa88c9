"""What a GPU backend's package needs at run time, asked the same way for each backend.

A GPU backend (``te``, ``liger``) can run when its package is installed, a CUDA device is
visible, and the package's kernels import (a matching CUDA build, a working Triton). Each
backend states its own wording; the order of the questions and the way each is asked
(nothing imported until the package is known to be there) are here once.

Example::

    GPU_PACKAGE = GpuPackage(
        distribution="liger_kernel",
        kernels="liger_kernel.transformers.functional",
        not_installed="liger-kernel is not installed (pip install 'layerswap[liger]')",
        no_cuda="needs a CUDA GPU (Liger's kernels are Triton)",
        broken="liger-kernel is installed but its kernels cannot be imported",
    )
    GPU_PACKAGE.unmet_requirement()   # None, or the first reason it cannot run here
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["GpuPackage"]


def _no_hint(error: BaseException) -> str:
    return ""


@dataclass(frozen=True)
class GpuPackage:
    """A backend's package: where it is found, the module holding its kernels, and why it
    cannot run here in the backend's words."""

    #: the top-level import name (``"transformer_engine"``)
    distribution: str
    #: the module whose import loads the kernels (``"transformer_engine.pytorch"``)
    kernels: str
    not_installed: str
    no_cuda: str
    #: the start of the reason when the kernels do not import (the error follows)
    broken: str
    #: what to do about a known import failure, appended to the reason
    hint: Callable[[BaseException], str] = _no_hint

    def installed(self) -> bool:
        """Whether the package is there, found without importing it."""
        try:
            return importlib.util.find_spec(self.distribution) is not None
        except (ImportError, ValueError):  # a broken or half-imported package
            return False

    def unmet_requirement(self) -> str | None:
        """Why the backend cannot run here, or ``None`` when it can: installed, a CUDA
        device visible, and its kernels importable, asked in that order."""
        if not self.installed():
            return self.not_installed
        import torch

        if not torch.cuda.is_available():
            return self.no_cuda
        try:
            importlib.import_module(self.kernels)
        except Exception as exc:  # no triton, an ABI mismatch: OSError/RuntimeError too
            return f"{self.broken}: {exc}{self.hint(exc)}"
        return None
