"""The norms a model's own classes compute, named by running them: what the ``norm`` slot
swaps.

A class's name does not say what it computes (an ``RMSNorm`` may multiply by ``1 + w``, cast
before or after the weight, or take a gate); :func:`classify` runs one instance of a norm
class against every :data:`KINDS` entry, in float32 (to rounding) and in bfloat16 (where
the order of casts shows, to the last bit on almost every element), and names the kind
whose fused function computes what the class computes, or why none does. A kind is a
fused function of ``(x, weight, bias, eps)``: PyTorch's one-kernel ``F.rms_norm`` /
``F.layer_norm`` in the casts the original makes.

Example::

    spec = classify(model.model.layers[0].input_layernorm)
    spec.kind          # "rms" (Llama: normalised in float32, cast, then scaled)
    spec.eps_name      # "variance_epsilon"
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from layerswap.trials import one_tensor_input, random_copy, relative_difference
from layerswap.zero3 import full_shape

__all__ = [
    "GROUPED_KINDS",
    "KINDS",
    "NormSpec",
    "candidate_norm_classes",
    "classify",
    "fused_norm",
    "is_norm_class",
]

Tensor = torch.Tensor
NormFunction = Callable[[Tensor, Tensor | None, Tensor | None, float], Tensor]


def _shape(x: Tensor) -> tuple[int]:
    return (x.shape[-1],)


def _rms(x: Tensor, w: Tensor | None, b: Tensor | None, eps: float) -> Tensor:
    # Llama: normalised in float32, cast back, then scaled by the weight in its own dtype
    normed = F.rms_norm(x.float(), _shape(x), eps=eps).to(x.dtype)
    return normed if w is None else w * normed


def _rms_float(x: Tensor, w: Tensor | None, b: Tensor | None, eps: float) -> Tensor:
    # normalised and scaled in float32, then cast (Qwen3-Next, OLMo 2)
    weight = None if w is None else w.float()
    return F.rms_norm(x.float(), _shape(x), weight, eps=eps).to(x.dtype)


def _rms_offset(x: Tensor, w: Tensor | None, b: Tensor | None, eps: float) -> Tensor:
    # Gemma: scaled by (1 + w) in float32, then cast
    weight = None if w is None else 1.0 + w.float()
    return F.rms_norm(x.float(), _shape(x), weight, eps=eps).to(x.dtype)


def _rms_offset_cast(x: Tensor, w: Tensor | None, b: Tensor | None, eps: float) -> Tensor:
    # normalised in float32, cast, then scaled by (1 + w)
    normed = F.rms_norm(x.float(), _shape(x), eps=eps).to(x.dtype)
    return normed if w is None else normed * (1.0 + w)


def _rms_native(x: Tensor, w: Tensor | None, b: Tensor | None, eps: float) -> Tensor:
    # everything in the input's dtype
    return F.rms_norm(x, _shape(x), w, eps=eps)


def _layer_float(x: Tensor, w: Tensor | None, b: Tensor | None, eps: float) -> Tensor:
    # mean-centred in float32 (Cohere's LayerNorm), then cast
    weight = None if w is None else w.float()
    bias = None if b is None else b.float()
    return F.layer_norm(x.float(), _shape(x), weight, bias, eps).to(x.dtype)


def _layer_native(x: Tensor, w: Tensor | None, b: Tensor | None, eps: float) -> Tensor:
    return F.layer_norm(x, _shape(x), w, b, eps)


def _layer_offset(x: Tensor, w: Tensor | None, b: Tensor | None, eps: float) -> Tensor:
    # Nemotron's LayerNorm1P: scaled by (1 + w), in the input's dtype
    return F.layer_norm(x, _shape(x), None if w is None else w + 1.0, b, eps)


#: every kind the ``norm`` slot's fused functions compute, in the order :func:`classify`
#: prefers them on a tie
KINDS: dict[str, NormFunction] = {
    "rms": _rms,
    "rms_float": _rms_float,
    "rms_offset": _rms_offset,
    "rms_offset_cast": _rms_offset_cast,
    "rms_native": _rms_native,
    "layer_float": _layer_float,
    "layer_native": _layer_native,
    "layer_offset": _layer_offset,
}


def _grouped(x: Tensor, eps: float, group: int) -> Tensor:
    # normalised in float32 over each run of ``group`` channels (Qwen4-Exp's hyper-connections)
    wide = x.float()
    grouped = wide.reshape(*wide.shape[:-1], -1, group)
    return F.rms_norm(grouped, (group,), eps=eps).flatten(-2)


def _rms_grouped(x: Tensor, w: Tensor | None, b: Tensor | None, eps: float, group: int) -> Tensor:
    normed = _grouped(x, eps, group).to(x.dtype)
    return normed if w is None else w * normed


def _rms_float_grouped(
    x: Tensor, w: Tensor | None, b: Tensor | None, eps: float, group: int
) -> Tensor:
    normed = _grouped(x, eps, group)
    return (normed if w is None else normed * w.float()).to(x.dtype)


def _rms_offset_grouped(
    x: Tensor, w: Tensor | None, b: Tensor | None, eps: float, group: int
) -> Tensor:
    normed = _grouped(x, eps, group)
    return (normed if w is None else normed * (1.0 + w.float())).to(x.dtype)


#: the kinds that normalise each group of ``group`` channels on its own, the weight over
#: every channel: functions of ``(x, weight, bias, eps, group)``, the group size read from
#: the norm (:attr:`NormSpec.group_name`)
GROUPED_KINDS: dict[str, Callable[..., Tensor]] = {
    "rms_grouped": _rms_grouped,
    "rms_float_grouped": _rms_float_grouped,
    "rms_offset_grouped": _rms_offset_grouped,
}

_MODELING = "transformers.models."
#: names of a norm's group size (channels normalised together)
_GROUP_NAMES = ("group_size",)
#: names a norm's epsilon goes by
_EPS_NAMES = ("variance_epsilon", "eps", "epsilon", "layer_norm_eps", "rms_norm_eps")
#: torch's own norm modules: one kernel already, nothing faster to put there
_TORCH_NORMS = (nn.LayerNorm, nn.RMSNorm, nn.GroupNorm)


@dataclass(frozen=True)
class NormSpec:
    """What one norm class computes: the :data:`KINDS` key and where its epsilon is."""

    kind: str
    eps_name: str
    #: the largest difference from the original, in float32 and in bfloat16 (relative)
    float32_error: float = 0.0
    bfloat16_error: float = 0.0
    #: the attribute holding the group size of a grouped kind (:data:`GROUPED_KINDS`)
    group_name: str = ""


def fused_norm(spec: NormSpec) -> NormFunction:
    """The fused function of ``spec``'s kind."""
    return KINDS[spec.kind]


def is_norm_class(cls: type, module_name: str) -> bool:
    """Whether ``cls`` is named as a norm and defined in ``module_name`` (a model's modeling
    module) or another of transformers' modeling modules (a model built of another's
    parts: Gemma 4's assistant). What it computes is asked by running it."""
    return (cls.__module__ == module_name or cls.__module__.startswith(_MODELING)) and (
        "Norm" in cls.__name__
    )


def candidate_norm_classes(model: nn.Module, module_name: str) -> dict[type, list[str]]:
    """The norm classes of ``model`` the ``norm`` slot considers, with the names of their
    instances: classes defined in ``module_name`` (the model's modeling module) or another
    of transformers' modeling modules (a model built of another's parts: Gemma 4's
    assistant) whose name has ``Norm`` in it and that hold no modules, in the order they
    first appear."""
    found: dict[type, list[str]] = {}
    for name, module in model.named_modules():
        cls = type(module)
        original = getattr(cls, "_layerswap_original", None)
        cls = original if original is not None else cls
        # a module holding others is a block named after its norm, not one
        if is_norm_class(cls, module_name) and not any(True for _ in module.children()):
            found.setdefault(cls, []).append(name)
    return found


def _structure(module: nn.Module) -> tuple[str | None, int | None]:
    """Why ``module`` is not a plain norm (``None`` if it may be), and its width."""
    if isinstance(module, _TORCH_NORMS) and type(module).forward in (
        nn.LayerNorm.forward,
        nn.RMSNorm.forward,
        nn.GroupNorm.forward,
    ):
        return "it runs torch's own one-kernel norm already", None
    if any(True for _ in module.children()):
        return "it holds modules of its own", None
    params = dict(module.named_parameters())
    if set(params) - {"weight", "bias"}:
        others = ", ".join(sorted(set(params) - {"weight", "bias"}))
        return f"it holds parameters other than weight and bias ({others})", None
    weight = params.get("weight")
    shape = None if weight is None else full_shape(weight)  # ZeRO-3's whole shape
    if shape is not None and len(shape) != 1:
        return f"its weight has shape {tuple(shape)}, not one value per channel", None
    if dict(module.named_buffers()):
        return "it holds buffers", None
    reason = one_tensor_input(module)
    if reason is not None:
        return reason, None
    width = shape[0] if shape is not None else None
    return None, width


def _eps_name(module: nn.Module) -> str | None:
    for name in _EPS_NAMES:
        value = module.__dict__.get(name)
        if isinstance(value, float) and 0.0 < value < 0.1:
            return name
    return None


def _trial_copy(module: nn.Module, dtype: torch.dtype, eps_name: str, eps: float) -> nn.Module:
    """A copy of ``module`` on the CPU in ``dtype``, random weights, epsilon ``eps``."""
    trial = random_copy(module, dtype)
    setattr(trial, eps_name, eps)
    return trial


def _errors(
    module: nn.Module, fn: NormFunction, dtype: torch.dtype, eps_name: str, x: Tensor
) -> tuple[float, float] | None:
    """(largest relative difference, share of elements differing) of ``fn`` against the
    original in ``dtype``; ``None`` where either fails to run."""
    # a large epsilon, so that a function reading another attribute shows
    trial = _trial_copy(module, dtype, eps_name, 0.05)
    weight = getattr(trial, "weight", None)
    bias = getattr(trial, "bias", None)
    inputs = x.to(dtype)
    try:
        with torch.no_grad():
            expected = trial(inputs)
            got = fn(inputs, weight, bias, 0.05)
    except Exception:
        return None
    return relative_difference(expected, got)


def classify(module: nn.Module) -> NormSpec | str:
    """What ``module``'s class computes, as a :class:`NormSpec`, or why no kind matches.

    Runs a copy (the module itself is not touched; a module on the meta device is copied
    with empty storage): random weights, a large epsilon, one input in float32 and
    bfloat16. A kind matches when its fused function agrees to rounding in float32 and,
    in bfloat16, differs by at most two units in the last place on at most 2% of the
    elements; of those, the one closest in bfloat16.
    """
    reason, width = _structure(module)
    if reason is not None:
        return reason
    eps_name = _eps_name(module)
    if eps_name is None:
        return "it keeps no epsilon under a name a norm uses"
    # on the CPU even inside from_pretrained, which builds under torch.device("meta")
    with torch.device("cpu"):
        return _closest(module, eps_name, width)


def _candidate_kinds(module: nn.Module) -> list[tuple[str, NormFunction, str]]:
    """(kind, its function of ``(x, w, b, eps)``, the group size's attribute) of every kind
    ``module`` may compute: the grouped ones where it holds a group size."""
    found: list[tuple[str, NormFunction, str]] = [(k, fn, "") for k, fn in KINDS.items()]
    for name in _GROUP_NAMES:
        group = module.__dict__.get(name)
        if isinstance(group, int) and not isinstance(group, bool) and group > 0:
            found += [
                (kind, functools.partial(fn, group=group), name)
                for kind, fn in GROUPED_KINDS.items()
            ]
    return found


def _closest(module: nn.Module, eps_name: str, width: int | None) -> NormSpec | str:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, width or 16, generator=generator) * 3.0 + 0.5
    best: NormSpec | None = None
    best_share = 1.0
    for kind, fn, group_name in _candidate_kinds(module):
        exact = _errors(module, fn, torch.float32, eps_name, x)
        if exact is None or exact[0] > 1e-5:
            continue
        rounded = _errors(module, fn, torch.bfloat16, eps_name, x)
        if rounded is None or rounded[0] > 2.0**-6 or rounded[1] > 0.02:
            continue
        if best is None or rounded[1] < best_share:
            best = NormSpec(kind, eps_name, exact[0], rounded[0], group_name)
            best_share = rounded[1]
    if best is None:
        return "it computes none of the norms the fused functions compute"
    return best
