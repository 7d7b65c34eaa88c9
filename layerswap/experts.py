"""What the experts of a mixture-of-experts block compute, read by running their gate.

transformers 5 keeps a block's experts as one module of 3-D weights (``Qwen3MoeExperts``:
``gate_up_proj`` of ``experts x 2·intermediate x hidden``), its class decorated by
``use_experts_implementation`` (:mod:`layerswap.hf_internals.experts`): the grouped and
batched implementations compute each expert's ``act(gate) * up`` through the module's
``_apply_gate``. The ``experts`` slot (:mod:`layerswap.slots.experts`) reads, per module:

- the decorator's flags (weights transposed, gate/up concatenated or interleaved, biases,
  a norm after each expert);
- what ``_apply_gate`` computes, by running it on a copy at two scales: ``act(gate) * up``
  of a known activation (:data:`~layerswap.mlps.ACTIVATIONS`), else ``"own"`` (gpt-oss's
  clamped, interleaved gate). A gate that gives two answers for one input (a dropout) is
  kept: a backward pass that runs it again would not see what the forward saw.

Example::

    spec = classify(model.model.layers[0].mlp.experts)
    spec.label        # 'gated silu experts'
"""

from __future__ import annotations

import copy
import dataclasses
import importlib
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from layerswap import hf_internals
from layerswap.mlps import ACTIVATIONS
from layerswap.trials import random_copy, relative_difference, without_hooks
from layerswap.zero3 import is_partitioned

__all__ = ["ExpertsSpec", "candidate_experts_classes", "classify", "is_experts_module"]

#: the scales the gate is read at: a bound it holds (a clamp) shows at the larger one
_SCALES = (1.0, 10.0)
#: how far (relative to the output's magnitude) a reading may be from the gate in float32
_TOLERANCE = 1e-5


@dataclass(frozen=True)
class ExpertsSpec:
    """What one experts class computes, per the decorator's flags and by running its gate."""

    #: the gate: a key of :data:`~layerswap.mlps.ACTIVATIONS` (``act(gate) * up``, gate
    #: first), or ``"own"`` (a gate of the class's own, run as it is)
    kind: str
    transposed: bool = False
    concatenated: bool = True
    bias: bool = False
    post_norm: bool = False
    #: the implementation the model runs the experts with (its config's
    #: ``experts_implementation``): ``"grouped_mm"``, ``"eager"`` ...
    implementation: str | None = None
    #: running the experts in that implementation reaches ``_apply_gate`` (read by running
    #: a copy): transformers' grouped and batched implementations do, a class's own eager
    #: loop computes the product inline and does not
    gate_called: bool = True

    @property
    def label(self) -> str:
        """``"gated silu experts"``, with what else the experts hold."""
        gate = "experts with a gate of their own" if self.kind == "own" else "experts"
        head = gate if self.kind == "own" else f"gated {self.kind} {gate}"
        extras = [
            word
            for flag, word in (
                (self.transposed, "transposed"),
                (not self.concatenated, "interleaved"),
                (self.bias, "biased"),
                (self.post_norm, "post-normed"),
            )
            if flag
        ]
        return f"{head} ({', '.join(extras)})" if extras else head


def is_experts_module(module: nn.Module) -> bool:
    """Whether ``module`` is an experts module transformers' decorator made."""
    return hf_internals.experts_flags(module) is not None


def candidate_experts_classes(model: nn.Module, module_name: str) -> dict[type, list[str]]:
    """The experts classes of ``model`` that the modeling module ``module_name`` holds (its
    own or imported), with the names of their instances, in the order they first appear."""
    namespace = vars(importlib.import_module(module_name))
    found: dict[type, list[str]] = {}
    for name, module in model.named_modules():
        cls = type(module)
        cls = getattr(cls, "_layerswap_original", cls)
        if namespace.get(cls.__name__) is cls and is_experts_module(module):
            found.setdefault(cls, []).append(name)
    return found


def _gate_width(module: nn.Module, spec: ExpertsSpec) -> int | None:
    weight = getattr(module, "gate_up_proj", None)
    if not isinstance(weight, Tensor) or weight.dim() != 3:
        return None
    return int(weight.shape[1] if not spec.transposed else weight.shape[2])


def _read_gate(trial: nn.Module, width: int) -> str | None:
    """The activation ``trial._apply_gate`` applies as ``act(gate) * up``; ``"own"`` for
    another deterministic gate; ``None`` for a gate that is not deterministic."""
    gate_of: Any = trial._apply_gate
    generator = torch.Generator().manual_seed(0)
    readings = set(ACTIVATIONS)
    for scale in _SCALES:
        x = torch.randn(6, width, generator=generator) * scale
        with torch.no_grad():
            first = gate_of(x)
            again = gate_of(x)
        if not isinstance(first, Tensor) or not torch.equal(first, again):
            return None
        gate, up = x.chunk(2, dim=-1)
        for kind in list(readings):
            off = relative_difference(ACTIVATIONS[kind](gate) * up, first)
            if off is None or off[0] > _TOLERANCE:
                readings.discard(kind)
    return next((kind for kind in ACTIVATIONS if kind in readings), "own")


def classify(module: nn.Module) -> ExpertsSpec | str:
    """What ``module`` computes, or why the ``experts`` slot keeps it."""
    flags = hf_internals.experts_flags(module)
    if flags is None:
        return "it is not an experts module transformers' use_experts_implementation made"
    if not flags["has_gate"]:
        return "its experts are not gated (act(up(x))): there is no product to fuse"
    if any(isinstance(child, nn.Dropout) for child in module.modules()):
        return "it holds a dropout"
    if any(is_partitioned(param) for param in module.parameters()):
        # its gate is read off its own weights, which this rank holds a slice of
        return (
            "its weights are partitioned by DeepSpeed ZeRO-3 (this rank holds a slice): "
            "swap inside layerswap.use() while the model loads"
        )
    spec = ExpertsSpec(
        kind="own",
        transposed=flags["is_transposed"],
        concatenated=flags["is_concatenated"],
        bias=flags["has_bias"],
        post_norm=flags["has_post_expert_norm"],
        implementation=hf_internals.experts_implementation(module),
    )
    width = _gate_width(module, spec)
    if width is None or width % 2:
        return "it holds no 3-D gate_up_proj to read its gate off"
    try:
        # on the CPU even inside from_pretrained, which builds under torch.device("meta")
        with torch.device("cpu"):
            trial = random_copy(_few_experts(module), torch.float32).train()
            kind = _read_gate(trial, width)
            called = _calls_gate(trial, spec)
    except torch.OutOfMemoryError:
        raise
    except Exception as exc:  # a gate that does not run on a copy alone
        return f"its gate does not run on its own ({type(exc).__name__}: {exc})"
    if kind is None:
        return "its gate gives two answers for one input (it draws random numbers)"
    if kind != "own" and not spec.concatenated:
        kind = "own"  # gate and up interleaved: the class's own gate splits them
    return dataclasses.replace(spec, kind=kind, gate_called=called)


#: the experts a reading copy keeps: enough for tokens routed to more than one
_READ_EXPERTS = 2
#: the attributes an experts class counts its experts in
_EXPERT_COUNTS = ("num_experts", "num_local_experts", "n_routed_experts")


def _few_experts(module: nn.Module) -> nn.Module:
    """A copy of ``module`` holding its first :data:`_READ_EXPERTS` experts only, in float32
    on the CPU (or the meta device): what the gate and the implementation compute does not
    depend on how many there are, and a real model's experts module holds gigabytes
    (DeepSeek-V3: 22 GB a layer in bfloat16), which reading must not copy."""
    experts = int(module.get_parameter("gate_up_proj").shape[0])
    keep = min(_READ_EXPERTS, experts)
    memo: dict[int, Any] = {}
    for tensor in (*module.parameters(), *module.buffers()):
        small = tensor.detach()
        if small.dim() >= 1 and small.shape[0] == experts:
            small = small[:keep]
        small = small.clone() if small.is_meta else small.to("cpu", torch.float32, copy=True)
        if isinstance(tensor, nn.Parameter):
            small = nn.Parameter(small, requires_grad=tensor.requires_grad)
        memo[id(tensor)] = small
    trial = without_hooks(copy.deepcopy(module, memo))
    for count in _EXPERT_COUNTS:
        if isinstance(getattr(trial, count, None), int):
            setattr(trial, count, keep)
    return trial


def _calls_gate(trial: nn.Module, spec: ExpertsSpec) -> bool:
    """Whether running ``trial`` (a copy) on a few routed tokens reaches its
    ``_apply_gate``: the one place a backend's gate takes effect."""
    weight: Tensor = trial.get_parameter("gate_up_proj")
    experts = int(weight.shape[0])
    hidden = int(weight.shape[2] if not spec.transposed else weight.shape[1])
    calls: list[int] = []
    gate_of: Any = trial._apply_gate

    def counted(gate_up: Tensor) -> Tensor:
        calls.append(1)
        out: Tensor = gate_of(gate_up)
        return out

    generator = torch.Generator().manual_seed(0)
    tokens = torch.randn(4, hidden, generator=generator)
    chosen = torch.arange(4).remainder(experts).unsqueeze(-1)
    trial.__dict__["_apply_gate"] = counted  # this copy's alone
    try:
        with torch.no_grad():
            trial(tokens, chosen, torch.ones(4, 1))
    finally:
        del trial.__dict__["_apply_gate"]
    return bool(calls)
