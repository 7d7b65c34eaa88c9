"""What every backend's ``qkv`` replacement shares: an attention module of the model's own
class whose projections from one input are one matrix product.

The ``qkv`` slot (:mod:`layerswap.slots.qkv`) gives each attention module it swaps a class
made by :meth:`~layerswap.backends.class_swap.ClassReplacement.subclass_for` whose
``forward`` is the original's, untouched (the attention core, MLA's latent path, a gated
query stay exactly as they are); what changes is each group of projections its forward
calls on one input (:mod:`layerswap.projections`):

- their weights (and biases) are moved into one tensor, each projection's ``Parameter``
  a slice of it: the very same ``Parameter`` objects under the same names, so
  ``state_dict``, ``save_pretrained``, PEFT targets and optimizers see what they saw;
- each projection becomes a :class:`PackedLinear`: the first of a group called on a
  tensor computes the whole group's product in one GEMM and hands the others their
  slices when they are called on that very tensor (the same object, unchanged since); a
  projection called on anything else computes its own product, as the original did.
  In training one custom autograd step gives each projection its slice of the weight's
  gradient.

The packing is checked at each call, never assumed: weights moved since (``model.to``,
``half()``, a checkpoint loaded into new tensors, a deep copy) are packed again on the next
call, outside ``torch.inference_mode``; weights another library owns the storage of (ZeRO-3,
FSDP, tensor-parallel ``DTensor``\\ s) are left to it, and the projections compute their own
products, as do calls traced by ``torch.compile``. Undo gives each projection its class and
a storage of its own back.
"""

from __future__ import annotations

import threading
import warnings
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from layerswap.backends.class_swap import ClassReplacement
from layerswap.errors import SwapWarning
from layerswap.patching.undo import UndoLog
from layerswap.projections import ProjectionSpec

__all__ = ["PackedGroup", "PackedLinear", "ProjectionsReplacement", "is_packed"]


class _Sliced(torch.autograd.Function):
    """The packed weight (or bias) of a group's projections, from their ``Parameter``\\ s
    that are its slices: no copy forward; the gradient split into their slices backward."""

    @staticmethod
    def forward(ctx: Any, sizes: tuple[int, ...], *parts: Tensor) -> Tensor:
        ctx.sizes = sizes
        return _whole(parts, sizes)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Any, ...]:
        return (None, *torch.split(grad, ctx.sizes, 0))


def _whole(parts: tuple[Tensor, ...] | list[Tensor], sizes: tuple[int, ...]) -> Tensor:
    first = parts[0]
    shape = (sum(sizes), *first.shape[1:])
    return first.detach().as_strided(shape, first.stride(), first.storage_offset())


def _packed(parts: list[Tensor], sizes: tuple[int, ...], tracked: bool) -> Tensor:
    """The one tensor ``parts`` are slices of; where a gradient flows, through :class:`_Sliced`."""
    if not tracked:
        return _whole(parts, sizes)
    whole: Tensor = _Sliced.apply(sizes, *parts)  # type: ignore[no-untyped-call]
    return whole


def _is_slice_chain(parts: list[Tensor]) -> bool:
    """Whether ``parts`` lie one after another in one storage, alike in dtype and device."""
    first = parts[0]
    if not first.is_contiguous():
        return False
    pointer = first.data_ptr()
    for part in parts:
        if (
            part.data_ptr() != pointer
            or part.dtype != first.dtype
            or part.device != first.device
            or not part.is_contiguous()
            or part.shape[1:] != first.shape[1:]
        ):
            return False
        pointer += part.numel() * part.element_size()
    return True


def _own_storage(part: Tensor, shape: tuple[int, ...]) -> bool:
    """Whether ``part`` is a plain tensor of ``shape`` holding its whole storage (so packing
    it takes nothing from another library: ZeRO-3 and FSDP hold views of their own flat
    buffers, tensor parallelism ``DTensor``\\ s)."""
    return (
        type(part) in (nn.Parameter, Tensor)
        and tuple(part.shape) == shape
        and not part.is_meta
        and part.is_contiguous()
        and part.storage_offset() == 0
        and part.untyped_storage().nbytes() == part.numel() * part.element_size()
    )


def _version(x: Tensor) -> int:
    """``x``'s version counter (an inference tensor has none: -1)."""
    return -1 if x.is_inference() else x._version


class PackedGroup:
    """Projections an attention's forward calls on one input, computed as one product."""

    def __init__(
        self, members: list[nn.Linear], names: tuple[str, ...], bias: bool, substitution: str
    ) -> None:
        self.members = members
        self.names = names
        self.substitution = substitution
        self.bias = bias
        self.sizes = tuple(member.out_features for member in members)
        self._split = list(self.sizes)
        self._local = threading.local()
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        del state["_local"], state["_lock"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._local = threading.local()
        self._lock = threading.Lock()

    def _parts(self, name: str) -> list[Tensor]:
        return [getattr(member, name) for member in self.members]

    def packed(self) -> bool:
        """Whether the group's weights (and biases) are slices of one tensor each."""
        return _is_slice_chain(self._parts("weight")) and (
            not self.bias or _is_slice_chain(self._parts("bias"))
        )

    def pack(self) -> str | None:
        """Move the weights (and biases) into one tensor each, where every one is a plain
        tensor of its own (see :func:`_own_storage`); why not, else ``None``."""
        with self._lock:
            if self.packed():
                return None
            names = ("weight", "bias") if self.bias else ("weight",)
            for name in names:
                parts = self._parts(name)
                shapes = [
                    (m.out_features, m.in_features) if name == "weight" else (m.out_features,)
                    for m in self.members
                ]
                if not all(map(_own_storage, parts, shapes)):
                    return (
                        "their weights are not plain tensors of their own (held by ZeRO-3, "
                        "FSDP or tensor parallelism, or on the meta device)"
                    )
                if len({(p.dtype, p.device) for p in parts}) != 1:
                    return "their weights differ in dtype or device"
            # a tensor made under inference_mode could never be saved for a backward later
            with torch.inference_mode(False):
                for name in names:
                    parts = self._parts(name)
                    whole = torch.cat([part.detach() for part in parts])
                    for part, piece in zip(parts, torch.split(whole, self._split), strict=True):
                        part.data = piece
            return None

    def _unpacked(self, reason: str) -> None:
        """Say once per group why its projections compute their own products."""
        if getattr(self, "_told", None) == reason:
            return
        self._told = reason
        names = "+".join(self.names)
        warnings.warn(
            f"{self.substitution}: {names} are not packed, {reason}; each computes its own "
            "product, as the original does",
            SwapWarning,
            stacklevel=4,
        )

    def unpack(self) -> None:
        """Give each projection a storage of its own (the same values)."""
        with self._lock:
            for name in ("weight", "bias") if self.bias else ("weight",):
                parts = self._parts(name)
                if _is_slice_chain(parts):
                    for part in parts:
                        part.data = part.detach().clone()

    def output(self, member: nn.Linear, x: Tensor) -> Tensor | None:
        """``member``'s product of ``x``: handed over when the group computed it from this
        very ``x``, or the whole group's computed now; ``None`` where ``member`` must compute
        its own (the group is not packed and cannot be)."""
        pending = getattr(self._local, "pending", None)
        if pending is not None:
            source, version, outputs = pending
            if source is x and version == _version(x):
                out: Tensor | None = outputs.pop(id(member), None)
                if out is not None:
                    if not outputs:
                        self._local.pending = None
                    return out
        if not self.packed():
            reason = self.pack()
            if reason is not None:
                self._unpacked(reason)
                return None
        weights = self._parts("weight")
        tracked = torch.is_grad_enabled() and any(w.requires_grad for w in weights)
        weight = _packed(weights, self.sizes, tracked)
        bias = None
        if self.bias:
            biases = self._parts("bias")
            tracked = torch.is_grad_enabled() and any(b.requires_grad for b in biases)
            bias = _packed(biases, self.sizes, tracked)
        products = torch.split(F.linear(x, weight, bias), self._split, -1)
        outputs = {id(m): p for m, p in zip(self.members, products, strict=True)}
        mine: Tensor = outputs.pop(id(member))
        self._local.pending = (x, _version(x), outputs)
        return mine


class PackedLinear(nn.Linear):
    """A projection of a packed group (:class:`PackedGroup`): its product is the group's
    slice where the group computed it from the same input, its own otherwise."""

    _layerswap_group: PackedGroup

    def forward(self, input: Tensor) -> Tensor:
        if not torch.compiler.is_compiling():
            out = self._layerswap_group.output(self, input)
            if out is not None:
                return out
        return F.linear(input, self.weight, self.bias)


class ProjectionsReplacement(ClassReplacement):
    """The base of a backend's ``qkv`` replacement: the attention's own ``forward``, its
    projections packed when the swap attaches them."""

    _layerswap_spec: ClassVar[ProjectionSpec]

    def _layerswap_attach(self, changes: UndoLog) -> None:
        spec = self._layerswap_spec
        for names, bias in zip(spec.groups, spec.biases, strict=True):
            members: list[Any] = [getattr(self, name) for name in names]
            group = PackedGroup(members, names, bias, self._layerswap_swapped_by)
            reason = group.pack()
            if reason is not None:
                group._unpacked(reason)
            changes.record(group.unpack)
            for member in members:
                changes.set_attribute(member, "_layerswap_group", group)
                changes.set_class(member, PackedLinear)

    def _layerswap_detach(self) -> None:
        for names in self._layerswap_spec.groups:
            members = [getattr(self, name) for name in names]
            group = getattr(members[0], "_layerswap_group", None)
            if group is not None:
                group.unpack()
            for member in members:
                if type(member) is PackedLinear:
                    restored: Any = member
                    restored.__class__ = nn.Linear
                member.__dict__.pop("_layerswap_group", None)

    def extra_repr(self) -> str:
        return f"{self._layerswap_spec.label} packed ({self.backend})"


def is_packed(module: nn.Module) -> bool:
    """Whether ``module`` is an attention the ``qkv`` slot swapped."""
    return isinstance(module, ProjectionsReplacement)
