"""Running a copy of a model's module to learn what it computes: what the slots that read a
module by running it (:mod:`layerswap.norms`, :mod:`layerswap.mlps`) share.

Example::

    trial = random_copy(model.model.norm, torch.bfloat16)   # the model's norm untouched
    one_tensor_input(model.model.norm)                      # None: forward(hidden_states)
"""

from __future__ import annotations

import copy
import inspect
import math
import re

import torch
from torch import nn

from layerswap.zero3 import full_shape

__all__ = [
    "not_built",
    "one_tensor_input",
    "random_copy",
    "random_in_training",
    "relative_difference",
    "without_hooks",
]


def one_tensor_input(module: nn.Module) -> str | None:
    """Why ``module``'s forward does not take one tensor alone (``None``: it does). An
    optional second argument (a gate: ``forward(x, gate=None)``) is a reason: a
    replacement taking one tensor would drop it."""
    try:
        parameters = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        return "its forward has no signature to read"
    if len(parameters) != 1 or parameters[0].kind not in (
        inspect.Parameter.POSITIONAL_ONLY,
        inspect.Parameter.POSITIONAL_OR_KEYWORD,
    ):
        names = ", ".join(p.name for p in parameters)
        return f"its forward takes ({names}), not one tensor alone"
    return None


def random_copy(module: nn.Module, dtype: torch.dtype) -> nn.Module:
    """A copy of ``module`` on the CPU in ``dtype``, in eval mode, its parameters random
    (``N(0, 0.25)``, from a fixed seed, drawn in float32 so that every dtype gets the same
    values); its buffers are copied as they are. A module on a GPU is not copied there
    first, and none of its parameters' values is copied; one on the meta device is copied
    with empty storage."""
    # the copy's parameters are made empty on the CPU (their values are drawn below)
    memo: dict[int, object] = {}
    for param in module.parameters():
        # a ZeRO-3 parameter's whole shape: its own is this rank's partition
        empty = torch.empty(full_shape(param), dtype=torch.float32, device="cpu")
        memo[id(param)] = nn.Parameter(empty, requires_grad=param.requires_grad)
    for buffer in module.buffers():  # kept as they are (a constant the module computes with)
        memo[id(buffer)] = (
            torch.empty_like(buffer, device="cpu")
            if buffer.is_meta
            else buffer.detach().to("cpu", copy=True)
        )
    trial = without_hooks(copy.deepcopy(module, memo))
    trial = trial.to(device="cpu", dtype=torch.float32)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in trial.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.5)
    return trial.to(dtype).eval()


#: a module's own hook tables (a copy holds copies of them)
_HOOK_TABLES = (
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_backward_hooks",
    "_backward_pre_hooks",
)


def without_hooks(trial: nn.Module) -> nn.Module:
    """``trial`` (a copy of a model's module) with no hook of its modules left: a reading
    runs a copy on random weights, and a hook the user put on the module (capturing
    activations, steering outputs) must neither see those runs nor change what is read.
    The copy's tables are emptied; the module's own are not touched."""
    for module in trial.modules():
        for table in _HOOK_TABLES:
            found = module.__dict__.get(table)
            if found:
                module.__dict__[table] = type(found)()
    return trial


def random_in_training(trial: nn.Module, x: torch.Tensor) -> bool:
    """Whether ``trial`` (a copy) computes something else from one call to the next in
    training mode (a dropout applied as a function, ``F.dropout(..., training=...)``,
    which no child module shows)."""
    trial.train()
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            outputs = []
            for seed in (1, 2):
                torch.manual_seed(seed)
                outputs.append(trial(x))
    finally:
        trial.eval()
    first, second = outputs
    return isinstance(first, torch.Tensor) and not torch.equal(first, second)


def relative_difference(expected: object, got: torch.Tensor) -> tuple[float, float] | None:
    """(largest difference over the largest magnitude of ``expected``, share of elements
    that differ at all) of ``got``; ``None`` where the two differ in type, shape or dtype,
    or the difference is not finite: no reading of the module computes that."""
    if not isinstance(expected, torch.Tensor) or not isinstance(got, torch.Tensor):
        return None
    if expected.shape != got.shape or expected.dtype != got.dtype:
        return None
    difference = (expected.float() - got.float()).abs()
    if not math.isfinite(difference.max().item()):
        return None
    scale = expected.float().abs().max().item() + 1e-6
    return difference.max().item() / scale, (difference > 0).float().mean().item()


#: transformers' words for a library a model needs and this machine lacks
_MISSING_LIBRARY = re.compile(r"(\w+) requires the ([\w.-]+) library but it was not found")


def not_built(error: BaseException) -> str:
    """Why a tiny model did not build here, in one sentence: a library it needs and this
    machine lacks by its name (transformers' import errors run over several paragraphs),
    anything else as raised, on one line.

    Example::

        not_built(ImportError("TimmWrapperModel requires the timm library but it was not found ..."))
        # "its tiny model does not build here (TimmWrapperModel needs timm, not installed here)"
    """
    message = str(error)
    missing = _MISSING_LIBRARY.findall(message)
    if missing:
        needs: dict[str, list[str]] = {}
        for owner, library in missing:
            needs.setdefault(owner, []).append(library)
        said = "; ".join(f"{owner} needs {', '.join(libs)}" for owner, libs in needs.items())
        return f"its tiny model does not build here ({said}, not installed here)"
    return (
        f"its tiny model does not build here ({type(error).__name__}: {' '.join(message.split())})"
    )
