"""The gated MLPs a model's own classes compute, named by running them: what the ``mlp``
slot swaps.

A class's name does not say what it computes: Llama's MLP is
``down(act(gate(x)) * up(x))`` with projections called ``gate_proj``/``up_proj``/
``down_proj``, LFM2's calls them ``w1``/``w3``/``w2`` and applies ``F.silu`` inline,
GraniteMoE-Hybrid packs gate and up into one projection, Falcon-H1 scales the gate's input
and the output by multipliers, Gemma 3n keeps only the top activations on some layers.
:func:`classify` tries every reading of a module's projections (their roles from their
shapes, the activation it holds or a known one), runs a copy against each in float32 (to
rounding) and bfloat16 (to the last bits), and names the one that computes what the class
computes, or says why none does.

Example::

    spec = classify(model.model.layers[0].mlp)
    spec.kind, spec.gate, spec.up, spec.down     # ("silu", "gate_proj", "up_proj", "down_proj")
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from layerswap.trials import (
    one_tensor_input,
    random_copy,
    random_in_training,
    relative_difference,
)

__all__ = [
    "ACTIVATIONS",
    "MLPSpec",
    "candidate_mlp_classes",
    "classify",
    "gated_inputs",
    "is_mlp_class",
]

_MODELING = "transformers.models."
#: words in a class name that mark it as an MLP
_MLP_WORDS = ("mlp", "feedforward")


def _relu2(x: Tensor) -> Tensor:
    return torch.square(F.relu(x))


#: the activations a gated MLP may apply without holding them as a module (LFM2's inline
#: ``F.silu``); their names are also how a module's own activation is named, by running it
ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {
    "silu": F.silu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
    "relu": F.relu,
    "relu2": _relu2,
}


@dataclass(frozen=True)
class MLPSpec:
    """What one gated MLP class computes, and where its parts are.

    ``down(act(gate(x) * gate_scale) * up(x)) * down_scale`` (gate and up clamped to
    ``limit`` first where one is set); ``layout`` ``"separate"``
    (``gate``, ``up`` two projections) or ``"packed"`` (``gate`` one projection whose output
    is ``[gate | up]``; ``up`` is ``""``), ``"packed_up_first"`` (``[up | gate]``).
    """

    #: the activation, a key of :data:`ACTIVATIONS`, or ``"other"`` (its own module)
    kind: str
    layout: str
    gate: str
    up: str
    down: str
    #: the attribute holding the activation module, ``""`` where it applies
    #: ``ACTIVATIONS[kind]`` inline
    act: str = ""
    #: the float attributes scaling the gate's input and the output, ``""`` for none
    gate_scale: str = ""
    down_scale: str = ""
    #: the float attribute bounding the gate from above and up on both sides before the
    #: product (DeepSeek V4's ``swiglu_limit``), ``""`` for none
    limit: str = ""
    #: the up projection runs before the gate (Falcon-H1): called in that order, a random
    #: layer wrapping them (LoRA's dropout) draws as in the original
    up_first: bool = False

    @property
    def label(self) -> str:
        """``"gated silu"``, ``"packed gated gelu_tanh"``, ``"gated silu, scaled"``..."""
        label = ("packed gated " if self.layout != "separate" else "gated ") + self.kind
        label += ", scaled" if self.gate_scale or self.down_scale else ""
        return label + (", clamped" if self.limit else "")


def is_mlp_class(cls: type, module_name: str) -> bool:
    """Whether ``cls`` is named as an MLP and defined in ``module_name`` (a model's modeling
    module) or another of transformers' modeling modules."""
    name = cls.__name__.lower()
    return (cls.__module__ == module_name or cls.__module__.startswith(_MODELING)) and any(
        word in name for word in _MLP_WORDS
    )


def _linears(module: nn.Module) -> dict[str, nn.Linear]:
    return {name: c for name, c in module.named_children() if type(c) is nn.Linear}


def _projections(module: nn.Module) -> dict[str, nn.Module]:
    """The children of ``module`` that project like a linear layer: ``nn.Linear``, and what
    wraps or replaces one (a LoRA or a quantized layer) with ``in_features``/``out_features``."""
    return {
        name: child
        for name, child in module.named_children()
        if isinstance(getattr(child, "in_features", None), int)
        and isinstance(getattr(child, "out_features", None), int)
    }


def candidate_mlp_classes(model: nn.Module, module_name: str) -> dict[type, list[str]]:
    """The MLP classes of ``model`` the ``mlp`` slot considers, with the names of their
    instances: classes named as MLPs (:func:`is_mlp_class`) holding two or three
    projections of their own (``nn.Linear``, or a layer wrapping one: such an MLP is kept,
    with the reason), in the order they first appear."""
    found: dict[type, list[str]] = {}
    for name, module in model.named_modules():
        cls = type(module)
        original = getattr(cls, "_layerswap_original", None)
        cls = original if original is not None else cls
        if is_mlp_class(cls, module_name) and 2 <= len(_projections(module)) <= 3:
            found.setdefault(cls, []).append(name)
    return found


def gated_inputs(module: nn.Module, spec: MLPSpec, x: Tensor) -> tuple[Tensor, Tensor]:
    """``(gate, up)`` of ``module`` for ``x``: its projections' outputs, the gate scaled."""
    if spec.layout == "separate" and spec.up_first:
        up = getattr(module, spec.up)(x)
        gate = getattr(module, spec.gate)(x)
    elif spec.layout == "separate":
        gate = getattr(module, spec.gate)(x)
        up = getattr(module, spec.up)(x)
    else:
        first, second = getattr(module, spec.gate)(x).chunk(2, dim=-1)
        gate, up = (first, second) if spec.layout == "packed" else (second, first)
    if spec.gate_scale:
        gate = gate * getattr(module, spec.gate_scale)
    if spec.limit:
        bound = getattr(module, spec.limit)
        gate, up = gate.clamp(max=bound), up.clamp(min=-bound, max=bound)
    return gate, up


def activation_of(module: nn.Module, spec: MLPSpec) -> Callable[[Tensor], Tensor]:
    """The activation ``module`` applies: its own module, or the known one it applies inline."""
    act: Callable[[Tensor], Tensor] = (
        getattr(module, spec.act) if spec.act else ACTIVATIONS[spec.kind]
    )
    return act


def _reference(module: nn.Module, spec: MLPSpec, x: Tensor) -> Tensor:
    gate, up = gated_inputs(module, spec, x)
    out: Tensor = getattr(module, spec.down)(activation_of(module, spec)(gate) * up)
    return out * getattr(module, spec.down_scale) if spec.down_scale else out


def _structure(module: nn.Module) -> str | None:
    """Why ``module`` is no MLP the slot reads (``None`` if it may be one)."""
    linears = _linears(module)
    wrapped = {
        n: f"{type(c).__module__}.{type(c).__qualname__}"
        for n, c in _projections(module).items()
        if n not in linears
    }
    if wrapped:
        named = ", ".join(f"{n} ({cls})" for n, cls in wrapped.items())
        return (
            f"its projections are not plain nn.Linear: {named}; where an adapter or "
            "quantization wrapped them, swap the mlp slot before (they run as they are then)"
        )
    for name, child in module.named_children():
        if name in linears:
            continue
        if isinstance(child, nn.Dropout):
            return f"it holds a dropout ({name})"
        if next(child.parameters(), None) is not None or next(child.buffers(), None) is not None:
            return f"it holds {name}, a {type(child).__name__} with parameters of its own"
    own = [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
    if own:
        return "it holds parameters or buffers besides its projections"
    return one_tensor_input(module)


def _activations(module: nn.Module) -> Iterator[tuple[str, str]]:
    """(attribute, kind) of every activation ``module`` may apply: the parameter-free
    modules it holds (their kind named by running them), then the known ones inline."""
    for name, child in module.named_children():
        if type(child) is nn.Linear or isinstance(child, nn.Dropout):
            continue
        yield name, _kind_of(child)
    for kind in ACTIVATIONS:
        yield "", kind


def _kind_of(act: nn.Module) -> str:
    sample = torch.linspace(-6.0, 6.0, 401)
    try:
        with torch.no_grad():
            out = act(sample)
    except Exception:
        return "other"
    for kind, fn in ACTIVATIONS.items():
        if isinstance(out, Tensor) and torch.allclose(out, fn(sample), rtol=1e-6, atol=1e-6):
            return kind
    return "other"


def _scales(module: nn.Module, part: str) -> list[str]:
    names = [
        key
        for key, value in vars(module).items()
        if part in key and "multiplier" in key and isinstance(value, (int, float))
    ]
    return ["", *names]


def _limits(module: nn.Module) -> list[str]:
    names = [
        key
        for key, value in vars(module).items()
        if "limit" in key and isinstance(value, (int, float)) and not isinstance(value, bool)
    ]
    return ["", *names]


def _readings(module: nn.Module) -> Iterator[MLPSpec]:
    """Every way ``module``'s projections and activation could make a gated MLP that their
    shapes allow, the conventional names first."""
    linears = _linears(module)
    acts = list(_activations(module))
    shapes = {name: (lin.in_features, lin.out_features) for name, lin in linears.items()}
    layouts: list[tuple[str, str, str, str]] = []
    if len(linears) == 3:
        for gate, up, down in itertools.permutations(linears, 3):
            (g_in, g_out), (u_in, u_out), (d_in, d_out) = shapes[gate], shapes[up], shapes[down]
            if g_in == u_in == d_out and g_out == u_out == d_in:
                layouts.append(("separate", gate, up, down))
    else:
        for packed, down in itertools.permutations(linears, 2):
            (p_in, p_out), (d_in, d_out) = shapes[packed], shapes[down]
            if p_in == d_out and p_out == 2 * d_in:
                layouts += [("packed", packed, "", down), ("packed_up_first", packed, "", down)]
    for (layout, gate, up, down), (act, kind) in itertools.product(layouts, acts):
        for gate_scale, down_scale, limit in itertools.product(
            _scales(module, "gate"), _scales(module, "down"), _limits(module)
        ):
            yield MLPSpec(kind, layout, gate, up, down, act, gate_scale, down_scale, limit)


def classify(module: nn.Module) -> MLPSpec | str:
    """What ``module``'s class computes, as an :class:`MLPSpec`, or why the slot reads no
    gated MLP in it.

    Runs a copy (the module itself is not touched; one on the meta device is copied with
    empty storage): random weights, one input in float32 and bfloat16, half of its tokens
    ten times the scale of the rest (so that a bound the MLP puts on its gate acts). A
    reading matches
    when it agrees to rounding in float32 and, in bfloat16, differs by at most two units in
    the last place on at most 2% of the elements; the first reading that matches is it.
    """
    reason = _structure(module)
    if reason is not None:
        return reason
    width = next(iter(_linears(module).values())).in_features
    with torch.device("cpu"):
        generator = torch.Generator().manual_seed(1)
        # at the usual scale, and ten times it: a bound on the gate (DeepSeek V4's
        # swiglu_limit) acts on the second, so a reading without it does not match
        x = (
            torch.randn(2, 6, width, generator=generator)
            * torch.tensor([1.0, 10.0]).repeat_interleave(3)[:, None]
        )
        trials = {dtype: random_copy(module, dtype) for dtype in (torch.float32, torch.bfloat16)}
        expected = {}
        for dtype, trial in trials.items():
            try:
                with torch.no_grad():
                    expected[dtype] = trial(x.to(dtype))
            except Exception as exc:
                return f"it does not run on one tensor ({type(exc).__name__}: {exc})"
        if random_in_training(trials[torch.float32], x):
            # Seed-OSS: F.dropout(down_proj(...), residual_dropout, training=self.training)
            return (
                "it computes something random in training (a dropout applied as a "
                "function), which a replacement computing down(act(gate(x)) * up(x)) drops"
            )
        for spec in _readings(module):
            if _matches(spec, trials, expected, x):
                return _in_call_order(spec, trials[torch.float32], x)
        if len(_linears(module)) == 2 and _plain(trials[torch.float32], x, expected):
            return "it is a plain MLP, down(act(up(x))): nothing to fuse"
    return "it computes no gated MLP, down(act(gate(x)) * up(x)), the slot reads"


def _in_call_order(spec: MLPSpec, trial: nn.Module, x: Tensor) -> MLPSpec:
    """``spec``, saying whether ``trial`` (a copy) calls its up projection first."""
    if spec.layout != "separate":
        return spec
    order: list[str] = []
    hooks = [
        getattr(trial, name).register_forward_pre_hook(
            lambda module, args, name=name: order.append(name)
        )
        for name in (spec.gate, spec.up)
    ]
    try:
        with torch.no_grad():
            trial(x)
    finally:
        for hook in hooks:
            hook.remove()
    return dataclasses.replace(spec, up_first=order[:1] == [spec.up])


def _matches(
    spec: MLPSpec,
    trials: dict[torch.dtype, nn.Module],
    expected: dict[torch.dtype, Tensor],
    x: Tensor,
) -> bool:
    bounds = {torch.float32: (1e-5, 1.0), torch.bfloat16: (2.0**-6, 0.02)}
    for dtype, trial in trials.items():
        try:
            with torch.no_grad():
                got = _reference(trial, spec, x.to(dtype))
        except Exception:
            return False
        found = relative_difference(expected[dtype], got)
        largest, share = bounds[dtype]
        if found is None or found[0] > largest or found[1] > share:
            return False
    return True


def _plain(trial: nn.Module, x: Tensor, expected: dict[torch.dtype, Tensor]) -> bool:
    linears = _linears(trial)
    for (up, down), (act, kind) in itertools.product(
        itertools.permutations(linears, 2), _activations(trial)
    ):
        fn = getattr(trial, act) if act else ACTIVATIONS[kind]
        try:
            with torch.no_grad():
                got = linears[down](fn(linears[up](x)))
        except Exception:
            continue
        found = relative_difference(expected[torch.float32], got)
        if found is not None and found[0] <= 1e-5:
            return True
    return False
