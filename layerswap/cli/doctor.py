"""``layerswap doctor``: what is installed here and what it enables."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import platform

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
    from layerswap.substitution import families

    rows = [
        {"component": "python", "status": platform.python_version(), "enables": ""},
        {"component": "layerswap", "status": layerswap.__version__, "enables": ""},
    ]
    cuda = torch.cuda.is_available()
    if cuda:
        name = torch.cuda.get_device_name(0)
        major, minor = torch.cuda.get_device_capability(0)
        cuda_status = f"available: {name} (compute capability {major}.{minor})"
        cuda_enables = "--device cuda; bfloat16 at full speed; the te backend"
        if major < 8:
            cuda_enables = "--device cuda (bfloat16 needs compute capability 8.0+ to be fast)"
    else:
        build = "CPU-only build" if torch.version.cuda is None else "no GPU visible"
        cuda_status = f"not available ({build})"
        cuda_enables = "CPU only: the te backend needs CUDA"
    rows.append({"component": "torch", "status": torch.__version__, "enables": "the fused backend"})
    rows.append({"component": "CUDA", "status": cuda_status, "enables": cuda_enables})
    major_version = int(transformers.__version__.split(".")[0])
    supported = "supported" if major_version == 5 else "NOT supported (need >=5,<6)"
    rows.append(
        {
            "component": "transformers",
            "status": f"{transformers.__version__} ({supported})",
            "enables": "families: " + ", ".join(sorted(families())),
        }
    )
    te_version = _version("transformer_engine") or _version("transformer-engine")
    te_found = importlib.util.find_spec("transformer_engine") is not None
    if te_found:
        rows.append(
            {
                "component": "TransformerEngine",
                "status": te_version or "installed",
                "enables": "te backend (bfloat16, FP8)"
                if cuda
                else "te backend once CUDA is there",
            }
        )
    else:
        rows.append(
            {
                "component": "TransformerEngine",
                "status": "not installed",
                "enables": "te backend: pip install 'layerswap[te]' on a CUDA machine",
            }
        )
    liger_found = importlib.util.find_spec("liger_kernel") is not None
    rows.append(
        {
            "component": "Liger-Kernel",
            "status": (_version("liger-kernel") or "installed") if liger_found else "not installed",
            "enables": (
                ("liger backend (needs Triton)" if cuda else "liger backend once CUDA is there")
                if liger_found
                else "liger backend: pip install 'layerswap[liger]' on a CUDA machine"
            ),
        }
    )
    return rows


def backend_problems() -> dict[str, str | None]:
    """Per backend, why it cannot run here (its first substitution's reason), or None."""
    from layerswap.substitution import substitutions

    reasons: dict[str, list[str | None]] = {}
    for sub in substitutions():
        reasons.setdefault(sub.backend, []).append(sub.unmet_requirement())
    return {name: next((r for r in found if r), None) for name, found in reasons.items()}
