"""``layerswap doctor``: what is installed here and what it enables."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import platform
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from layerswap.backend import Backend, Dependency

__all__ = ["backend_problems", "environment"]


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def environment() -> list[dict[str, str]]:
    """One row per component: its status here and what it enables."""
    import torch
    import transformers

    import layerswap
    from layerswap.registry import backends, families

    rows = [
        {"component": "python", "status": platform.python_version(), "enables": ""},
        {"component": "layerswap", "status": layerswap.__version__, "enables": ""},
    ]
    declared = list(backends().values())
    anywhere = [b.name for b in declared if "cpu" in b.devices]
    gpu_only = [b.name for b in declared if "cpu" not in b.devices]
    cuda = torch.cuda.is_available()
    if cuda:
        name = torch.cuda.get_device_name(0)
        major, minor = torch.cuda.get_device_capability(0)
        cuda_status = f"available: {name} (compute capability {major}.{minor})"
        cuda_enables = "--device cuda; bfloat16 at full speed" + "".join(
            f"; the {backend} backend" for backend in gpu_only
        )
        if major < 8:
            cuda_enables = "--device cuda (bfloat16 needs compute capability 8.0+ to be fast)"
    else:
        build = "CPU-only build" if torch.version.cuda is None else "no GPU visible"
        cuda_status = f"not available ({build})"
        if gpu_only:
            names = " and ".join(gpu_only)
            verb = "needs" if len(gpu_only) == 1 else "need"
            cuda_enables = f"CPU only: the {names} backend{'s' * (len(gpu_only) > 1)} {verb} CUDA"
        else:
            cuda_enables = "CPU only"
    rows.append(
        {
            "component": "torch",
            "status": torch.__version__,
            "enables": ", ".join(f"the {b} backend" for b in anywhere if not _needs(b)),
        }
    )
    rows.append({"component": "CUDA", "status": cuda_status, "enables": cuda_enables})
    from layerswap.hf_internals import transformers_support

    supported, why = transformers_support(transformers.__version__)
    rows.append(
        {
            "component": "transformers",
            "status": f"{transformers.__version__} ("
            + ("supported: " if supported else "NOT supported: ")
            + f"{why})",
            "enables": "families: " + ", ".join(sorted(families())),
        }
    )
    for backend in declared:
        for dependency in backend.dependencies:
            rows.append(_dependency_row(backend, dependency, cuda))
    return rows


def _needs(name: str) -> bool:
    """Whether backend ``name`` needs a package beyond torch and transformers."""
    from layerswap.registry import get_backend

    return bool(get_backend(name).dependencies)


def _dependency_row(backend: Backend, dependency: Dependency, cuda: bool) -> dict[str, str]:
    try:
        found = importlib.util.find_spec(dependency.module) is not None
    except (ImportError, ValueError):  # a broken or half-imported package
        found = False
    on_gpu = "cpu" not in backend.devices
    if not found:
        status = "not installed"
        enables = f"{backend.name} backend: {dependency.install}"
    else:
        status = _version(dependency.distribution) or "installed"
        ready = cuda or not on_gpu
        enables = f"{backend.name} backend" + ("" if ready else " once CUDA is there")
    return {"component": dependency.label, "status": status, "enables": enables}


def backend_problems() -> dict[str, str | None]:
    """Per backend and variant (``te_fp8``), why it cannot run here, or None."""
    from layerswap.registry import backends

    problems: dict[str, str | None] = {}
    for backend in backends().values():
        problems[backend.name] = backend.requirement()
        for variant in backend.variants:
            name = f"{backend.name}_{variant.name}"
            problems[name] = problems[backend.name] or variant.unmet_requirement()
    return problems
