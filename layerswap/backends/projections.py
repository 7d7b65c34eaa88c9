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
- each projection becomes a :class:`PackedLinear`. Inside one call of the attention's
  ``forward``, the first of a group called on a tensor computes the whole group's product
  in one GEMM and hands the others their slices when they are called on that very tensor
  (the same object, unchanged since, in the same grad and autocast modes); nothing is kept
  once the call returns. A projection called on anything else, or outside the attention's
  forward, computes its own product, as the original did. In training one custom autograd
  step gives each projection its slice of the weight's gradient.

The packing is checked at each call, never assumed: weights moved since (``model.to``,
``half()``, a checkpoint loaded into new tensors, a deep copy) are packed again on the next
call (outside ``torch.inference_mode``, so the model still trains); weights another library
owns the storage of (ZeRO-3, FSDP, tensor-parallel ``DTensor`` objects) are left to it,
with a warning. The projections compute their own products, as the original does, under
``torch.compile`` and ``torch.func`` transforms, where a projection's weight is made when
it is called (pruning's pre-hooks, a parametrization), and for a projection module two
attentions share. An attention whose projections have a ``forward`` set on the instance
(accelerate's hooks, set before the swap) is kept, with the reason. Undo
gives each projection its class and a storage of its own back.
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
        # kept (not copied) so that autograd says so when one is changed in place before
        # the backward pass, as it does for the original's separate products
        ctx.save_for_backward(*parts)
        return _whole(parts, sizes)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Any, ...]:
        ctx.saved_tensors  # noqa: B018 - raises where a part changed since forward
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
    """Whether ``parts`` lie one after another in one storage, alike in dtype and device
    (tensors of storages of their own that happen to lie side by side are not)."""
    first = parts[0]
    if not first.is_contiguous():
        return False
    storage = first.untyped_storage()
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
    return bool(
        parts[-1].untyped_storage().data_ptr() == storage.data_ptr()
        and pointer <= storage.data_ptr() + storage.nbytes()
    )


def _own_storage(part: Tensor, shape: tuple[int, ...], made: set[int]) -> bool:
    """Whether ``part`` is a projection's own ``Parameter`` of ``shape`` holding its whole
    storage, or a slice of a tensor its group made (``made``: their storages' addresses),
    so that packing it takes nothing from another library (ZeRO-3 and FSDP hold views of
    their own flat buffers, tensor parallelism ``DTensor`` objects)."""
    if type(part) is not nn.Parameter or tuple(part.shape) != shape or part.is_meta:
        return False
    storage = part.untyped_storage()
    if storage.data_ptr() in made:
        return True
    return (
        part.is_contiguous()
        and part.storage_offset() == 0
        and storage.nbytes() == part.numel() * part.element_size()
    )


def _traced(x: Tensor) -> bool:
    """Whether ``x`` is a tensor of a ``torch.func`` transform (``vmap``, ``grad``), which
    has no storage to pack against."""
    wrapped = getattr(torch._C._functorch, "is_functorch_wrapped_tensor", None)
    return bool(wrapped is not None and wrapped(x))


def _version(x: Tensor) -> int:
    """``x``'s version counter (an inference tensor has none: -1)."""
    return -1 if x.is_inference() else x._version


def _modes(x: Tensor) -> tuple[Any, ...]:
    """What decides a product besides its input and weights: grad mode and autocast."""
    device = x.device.type
    autocast = torch.is_autocast_enabled(device)
    return (torch.is_grad_enabled(), autocast and torch.get_autocast_dtype(device))


class PackedGroup:
    """Projections an attention's forward calls on one input, computed as one product.

    A product is handed from one projection to the next only inside one call of the
    attention's ``forward`` (:meth:`opened`), in the thread that made it, for the very
    tensor it was made from, unchanged since (its version), in the same grad and autocast
    modes.
    """

    def __init__(
        self, members: list[nn.Linear], names: tuple[str, ...], bias: bool, substitution: str
    ) -> None:
        self.members = members
        self.names = names
        self.substitution = substitution
        self.bias = bias
        self.sizes = tuple(member.out_features for member in members)
        self._starts = [sum(self.sizes[:i]) for i in range(len(self.sizes))]
        self._made: set[int] = set()
        self._local = threading.local()
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        del state["_local"], state["_lock"]
        state["_made"] = set()
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
        """Move the weights (and biases) into one tensor each, where every one is a
        projection's own tensor (see :func:`_own_storage`); why not, else ``None``."""
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
                if not all(
                    _own_storage(p, shape, self._made)
                    for p, shape in zip(parts, shapes, strict=True)
                ):
                    return (
                        "their weights are not tensors of their own (views of a buffer another "
                        "library holds: ZeRO-3, FSDP, tensor parallelism; or tensors "
                        "torch.func.functional_call or a parametrization put in their place)"
                    )
                if len({(p.dtype, p.device) for p in parts}) != 1:
                    return "their weights differ in dtype or device"
            made = set()
            # a tensor made under inference_mode could never be saved for a backward later
            with torch.inference_mode(False):
                for name in names:
                    parts = self._parts(name)
                    whole = torch.cat([part.detach() for part in parts])
                    made.add(whole.untyped_storage().data_ptr())
                    for part, start in zip(parts, self._starts, strict=True):
                        part.data = whole.narrow(0, start, part.shape[0])
            self._made = made
            return None if self.packed() else "their weights could not be packed"

    def _unpacked(self, reason: str) -> None:
        """Say once per group why its projections compute their own products."""
        if getattr(self, "_told", None) == reason:
            return
        self._told = reason
        warnings.warn(
            f"{self.substitution}: {'+'.join(self.names)} are not packed, {reason}; each "
            "computes its own product, as the original does",
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
            self._made = set()

    def opened(self) -> None:
        """The attention's forward starts: products may be handed over until it ends."""
        self._local.open = True
        self._local.pending = None

    def closed(self) -> None:
        """The attention's forward ends: nothing made in it is kept or handed over."""
        self._local.open = False
        self._local.pending = None

    def _computable(self, member: nn.Linear, x: Tensor) -> bool:
        """Whether the group may compute ``member``'s product with the others' now."""
        if not getattr(self._local, "open", False) or _traced(x):
            return False
        if not any(m is member for m in self.members):  # a replica (DataParallel)
            return False
        # a projection whose weight is made when it is called (pruning's and other
        # pre-hooks, a parametrization) computes its own, from what its hooks make
        return all("weight" in m._parameters and not m._forward_pre_hooks for m in self.members)

    def output(self, member: nn.Linear, x: Tensor) -> Tensor | None:
        """``member``'s product of ``x``: handed over when the group computed it from this
        very ``x`` in this call, or the whole group's computed now; ``None`` where
        ``member`` computes its own (see :class:`PackedGroup`)."""
        pending = getattr(self._local, "pending", None)
        if pending is not None:
            source, version, modes, outputs = pending
            if source is x and version == _version(x) and modes == _modes(x):
                out: Tensor | None = outputs.pop(id(member), None)
                if out is not None:
                    if not outputs:
                        self._local.pending = None
                    return out
        if not self._computable(member, x):
            return None
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
        product = F.linear(x, weight, bias)
        # one view per projection (not split's views of one call: each may be changed in
        # place, as the original's separate products may)
        outputs = {
            id(m): product.narrow(-1, start, size)
            for m, start, size in zip(self.members, self._starts, self.sizes, strict=True)
        }
        mine: Tensor = outputs.pop(id(member))
        self._local.pending = (x, _version(x), _modes(x), outputs)
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
    _layerswap_groups: tuple[PackedGroup, ...]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            return super().forward(*args, **kwargs)
        groups = self.__dict__.get("_layerswap_groups", ())
        for group in groups:
            group.opened()
        try:
            return super().forward(*args, **kwargs)
        finally:
            for group in groups:
                group.closed()

    def _layerswap_attach(self, changes: UndoLog) -> None:
        spec = self._layerswap_spec
        groups = []
        for names, bias in zip(spec.groups, spec.biases, strict=True):
            members: list[Any] = [getattr(self, name) for name in names]
            group = PackedGroup(members, names, bias, self._layerswap_swapped_by)
            if any(isinstance(member, PackedLinear) for member in members):
                # one projection module in two attentions: packed for one, it would be
                # packed again for the other at every call
                group._unpacked("one of them is another attention's too")
                continue
            reason = group.pack()
            if reason is not None:
                group._unpacked(reason)
            changes.record(group.unpack)
            for member in members:
                changes.set_attribute(member, "_layerswap_group", group)
                changes.set_class(member, PackedLinear)
            groups.append(group)
        changes.set_attribute(self, "_layerswap_groups", tuple(groups))

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
        self.__dict__.pop("_layerswap_groups", None)

    def extra_repr(self) -> str:
        return f"{self._layerswap_spec.label} packed ({self.backend})"


def is_packed(module: nn.Module) -> bool:
    """Whether ``module`` is an attention the ``qkv`` slot swapped."""
    return isinstance(module, ProjectionsReplacement)
