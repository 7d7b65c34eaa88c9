"""What the ``te`` backend needs at run time: TransformerEngine, a GPU, and FP8 recipes.

Requirements (:func:`unmet_requirement`, :func:`fp8_unmet_requirement`), FP8 recipes by
name (:func:`fp8_recipe`) and the FP8 autocast (:func:`fp8_autocast`); shared by the
declaration (:mod:`layerswap.backends.te.declaration`) and the layer
(:mod:`layerswap.backends.te.decoder`; the package :mod:`layerswap.backends.te` gives all of
it). Nothing here imports torch
or TransformerEngine until asked.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

from layerswap.backends._runtime import GpuPackage
from layerswap.errors import RequirementError

if TYPE_CHECKING:
    import torch

__all__ = [
    "NOT_INSTALLED",
    "NO_CUDA",
    "fp8_autocast",
    "fp8_recipe",
    "fp8_unmet_requirement",
    "require_cuda",
    "unmet_requirement",
]

NOT_INSTALLED = "TransformerEngine is not installed (pip install 'layerswap[te]')"
NO_CUDA = "needs CUDA (no CUDA device visible)"

# recipe name -> (TransformerEngine class in transformer_engine.common.recipe, minimum
# compute capability); FP8 tensor cores start with Ada (8.9), block scaling needs Hopper,
# MX formats need Blackwell
_RECIPES: dict[str, tuple[str, tuple[int, int]]] = {
    "delayed": ("DelayedScaling", (8, 9)),
    "current": ("Float8CurrentScaling", (8, 9)),
    "block": ("Float8BlockScaling", (9, 0)),
    "mxfp8": ("MXFP8BlockScaling", (10, 0)),
    "nvfp4": ("NVFP4BlockScaling", (10, 0)),
}


# --- requirements ------------------------------------------------------------------------


def _import_hint(exc: BaseException) -> str:
    """What to do about a known import failure of ``transformer_engine.pytorch``."""
    message = str(exc)
    if "undefined symbol" in message and "cudnn" in message.lower():
        # Seen on a GPU machine with a system cuDNN beside torch's nvidia-cudnn wheel: once
        # torch had run a cuDNN kernel (SDPA's cuDNN attention), TE's import bound the
        # system's libcudnn_cnn to torch's already loaded libcudnn_graph.
        return (
            " (two cuDNN builds were mixed: import transformer_engine.pytorch before the "
            "first model runs on the GPU, or put torch's nvidia/cudnn/lib first on "
            "LD_LIBRARY_PATH)"
        )
    return ""


#: TransformerEngine, its questions asked the way every GPU backend's are
PACKAGE = GpuPackage(
    distribution="transformer_engine",
    kernels="transformer_engine.pytorch",
    not_installed=NOT_INSTALLED,
    no_cuda=NO_CUDA,
    broken="TransformerEngine is installed but cannot be imported",
    hint=_import_hint,
)


def unmet_requirement() -> str | None:
    """Why the ``te`` layers cannot run here, or ``None`` when they can.

    Checked in order: TransformerEngine installed, a CUDA device visible, and
    ``transformer_engine.pytorch`` importable (a CUDA build of torch and TE's
    extension matching it).

    Example::

        from layerswap.backends import te
        te.unmet_requirement()    # "TransformerEngine is not installed (pip install ...)"
    """
    return PACKAGE.unmet_requirement()


def _te() -> Any:
    """``transformer_engine.pytorch``, or :class:`RequirementError` with the reason."""
    reason = unmet_requirement()
    if reason is not None:
        raise RequirementError(f"the te backend cannot run here: {reason}")
    return importlib.import_module("transformer_engine.pytorch")


def require_cuda(tensor: torch.Tensor, what: str) -> None:
    """:class:`RequirementError` unless ``tensor`` is on the GPU (TE's own failure on a CPU
    tensor is an error deep in its extension); ``what`` names the module that runs TE."""
    if not tensor.is_cuda:
        raise RequirementError(
            f"{what} runs TransformerEngine's kernels on CUDA tensors; move the model to the "
            "GPU (model.cuda())"
        )


def _recipe_kind(recipe: Any) -> str:
    """The :data:`_RECIPES` key of a recipe given by name or as a TE recipe object."""
    if isinstance(recipe, str):
        return recipe
    class_name = type(recipe).__name__
    for kind, (name, _) in _RECIPES.items():
        if name == class_name:
            return kind
    return "current"  # an unknown (custom) recipe needs at least FP8 tensor cores


def fp8_unmet_requirement(recipe: Any = None) -> str | None:
    """Why FP8 (with ``recipe``, a name or a TE recipe) cannot run here, or ``None``.

    Example::

        te.fp8_unmet_requirement("mxfp8")   # "FP8 recipe 'mxfp8' needs compute capability ..."
    """
    reason = unmet_requirement()
    if reason is not None:
        return reason
    import torch

    kind = "auto" if recipe is None else _recipe_kind(recipe)
    needed = _RECIPES.get(kind, _RECIPES["current"])[1]
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) >= needed:
        return None
    if needed == (8, 9):
        return f"FP8 needs compute capability >= 8.9 (found {major}.{minor})"
    return (
        f"FP8 recipe {kind!r} needs compute capability >= {needed[0]}.{needed[1]} "
        f"(found {major}.{minor})"
    )


# --- FP8 ----------------------------------------------------------------------------------


def fp8_recipe(name: str = "auto", **options: Any) -> Any:
    """A TransformerEngine FP8 recipe by short name; ``options`` go to its constructor.

    Names: ``"current"`` (``Float8CurrentScaling``: scales from each tensor as it is
    quantized; no warm-up, the default below Blackwell), ``"delayed"``
    (``DelayedScaling``: scales from an amax history, so the first iterations run with
    scale 1), ``"block"`` (``Float8BlockScaling``, Hopper+), ``"mxfp8"``
    (``MXFP8BlockScaling``, Blackwell, the default there), ``"nvfp4"`` (Blackwell), and
    ``"auto"``. ``fp8_format`` may be given as a string (``"hybrid"``, ``"e4m3"``).

    Example::

        recipe = te.fp8_recipe("delayed", amax_history_len=16, fp8_format="hybrid")
    """
    _te()
    from transformer_engine.common import recipe as te_recipe

    if name == "auto":
        import torch

        major, _ = torch.cuda.get_device_capability()
        name = "mxfp8" if major == 10 else "current"
    if name not in _RECIPES:
        raise ValueError(f"unknown FP8 recipe {name!r}; choose one of {sorted(_RECIPES)} or 'auto'")
    class_name = _RECIPES[name][0]
    recipe_class = getattr(te_recipe, class_name, None)
    if recipe_class is None:
        raise RequirementError(
            f"the installed TransformerEngine has no {class_name} (FP8 recipe {name!r})"
        )
    if isinstance(options.get("fp8_format"), str):
        options["fp8_format"] = te_recipe.Format[options["fp8_format"].upper()]
    return recipe_class(**options)


def fp8_autocast(
    recipe: Any = None, *, enabled: bool = True, **options: Any
) -> AbstractContextManager[Any]:
    """Run the TE layers' GEMMs in FP8 inside the block.

    ``recipe`` is a name for :func:`fp8_recipe` (``options`` go there) or a
    TransformerEngine recipe object; ``None`` picks the device's default. Raises
    :class:`RequirementError` when FP8 cannot run here ("FP8 needs compute capability
    >= 8.9 (found 8.0)"). TE's FP8 GEMMs need the token count to be a multiple of 16
    (32 for MXFP8); a layer call that is not (a decode step of ``generate()``) runs in
    BF16 instead. Run the backward pass after the block ends, as TransformerEngine
    requires.

    Example::

        with te.fp8_autocast("delayed", amax_history_len=16):
            loss = model(**batch, use_cache=False).loss
        loss.backward()
    """
    if not enabled:
        if not PACKAGE.installed():
            return contextlib.nullcontext()
        return _autocast(_te(), enabled=False, recipe=None)
    reason = unmet_requirement()
    if reason is not None:
        raise RequirementError(f"fp8_autocast cannot run here: {reason}")
    if recipe is None or isinstance(recipe, str):
        recipe = fp8_recipe(recipe or "auto", **options)
    elif options:
        raise TypeError("recipe options apply to a recipe given by name, not to a recipe object")
    reason = fp8_unmet_requirement(recipe)
    if reason is not None:
        raise RequirementError(f"fp8_autocast cannot run here: {reason}")
    return _autocast(_te(), enabled=True, recipe=recipe)


def _autocast(te: Any, *, enabled: bool, recipe: Any) -> AbstractContextManager[Any]:
    # TE >= 2.8 names it autocast(recipe=...); older releases only have fp8_autocast
    if hasattr(te, "autocast"):
        return te.autocast(enabled=enabled, recipe=recipe)  # type: ignore[no-any-return]
    return te.fp8_autocast(enabled=enabled, fp8_recipe=recipe)  # type: ignore[no-any-return]


# --- FP8 at run time -----------------------------------------------------------------------


@functools.cache
def _rope_kernel() -> Callable[..., torch.Tensor] | None:
    """TE's ``apply_rotary_pos_emb`` (its module moved between releases), or ``None``."""
    for module_name in (
        "transformer_engine.pytorch.attention.rope",
        "transformer_engine.pytorch.attention",
    ):
        try:
            kernel = getattr(importlib.import_module(module_name), "apply_rotary_pos_emb", None)
        except ImportError:
            continue
        if kernel is not None:
            return kernel  # type: ignore[no-any-return]
    return None


@functools.cache
def _fp8_state() -> Any:
    """TE's FP8 global state manager (its module moved between releases), or ``None``."""
    for module_name in (
        "transformer_engine.pytorch.quantization",
        "transformer_engine.pytorch.fp8",
    ):
        try:
            return importlib.import_module(module_name).FP8GlobalStateManager
        except (ImportError, AttributeError):
            continue
    return None


def _fp8_alignment(recipe: Any) -> int:
    """The token-count multiple TE's FP8 GEMMs need under ``recipe``."""
    for predicate, size in (("nvfp4", 128), ("mxfp8", 32)):
        check = getattr(recipe, predicate, None)
        if callable(check) and check():
            return size
    return 16


def _precision_for(tokens: int) -> AbstractContextManager[Any]:
    """BF16 for this call when FP8 is on but ``tokens`` cannot be quantized.

    TE refuses FP8 GEMMs whose token count is not a multiple of the recipe's block
    (16; 32 for MXFP8). Decode steps of ``generate()`` feed one token per sequence, so
    inside :func:`fp8_autocast` they run in BF16 instead of failing; prefill and
    training steps (long, aligned sequences) keep FP8. Running only aligned calls in
    FP8 also keeps delayed scaling's rule of one FP8 call per module per region.
    """
    state = _fp8_state()
    if state is None or not state.is_fp8_enabled():
        return contextlib.nullcontext()
    recipe = state.get_fp8_recipe()
    if tokens % _fp8_alignment(recipe) == 0:
        return contextlib.nullcontext()
    # the active recipe, not None: TE would build its default recipe object on every call
    te = importlib.import_module("transformer_engine.pytorch")
    return _autocast(te, enabled=False, recipe=recipe)
