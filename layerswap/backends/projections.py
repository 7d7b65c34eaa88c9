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
from collections.abc import Callable
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd import forward_ad
from torch.multiprocessing.reductions import StorageWeakRef

from layerswap import sliced_saves
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


def _unchanged(names: tuple[str, ...], weights: list[Tensor]) -> Callable[[Tensor], None]:
    """A gradient hook raising, as autograd does for a tensor it saved, where one of the
    frozen ``weights`` a product was computed from has changed in place since."""
    versions = [weight._version for weight in weights]

    def check(_: Tensor) -> None:
        for name, weight, version in zip(names, weights, versions, strict=True):
            if weight._version != version:
                raise RuntimeError(
                    "one of the variables needed for gradient computation has been modified "
                    f"by an inplace operation: the weight of {name} is at version "
                    f"{weight._version}; expected version {version} instead (it was changed "
                    "in place after the forward pass that used it)"
                )

    return check


def _storage_address(tensor: Tensor) -> int | None:
    """Where ``tensor``'s storage starts, or ``None`` for a tensor with none of its own (a
    quantizer's wrapper subclass: torchao's ``Int8Tensor``), which no packing made."""
    try:
        return int(tensor.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):
        return None


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


def _own_storage(part: Tensor, shape: tuple[int, ...], made: dict[int, Any]) -> bool:
    """Whether ``part`` is a projection's own ``Parameter`` of ``shape`` holding its whole
    storage, or a slice of a tensor its group made (``made``: their storages' addresses and
    weak references; an address is the group's only while its storage lives),
    so that packing it takes nothing from another library (ZeRO-3 and FSDP hold views of
    their own flat buffers, tensor parallelism ``DTensor`` objects)."""
    if type(part) is not nn.Parameter or tuple(part.shape) != shape or part.is_meta:
        return False
    storage = part.untyped_storage()
    ours = made.get(storage.data_ptr())
    if ours is not None and not ours.expired():
        return True
    return (
        part.is_contiguous()
        and part.storage_offset() == 0
        and storage.nbytes() == part.numel() * part.element_size()
    )


def _weak(storage: torch.UntypedStorage) -> Any:
    """A weak reference to ``storage`` (``expired()`` once it is freed)."""
    return StorageWeakRef(storage)  # type: ignore[no-untyped-call]


_WRAPPED = getattr(torch._C._functorch, "is_functorch_wrapped_tensor", None)
#: ``torch.split_with_sizes_copy`` (typed as its ``out=`` form, which returns nothing)
_split_copies: Any = torch.split_with_sizes_copy


def _traced(x: Tensor) -> bool:
    """Whether ``x`` is a tensor of a ``torch.func`` transform (``vmap``, ``grad``), which
    has no storage to pack against."""
    return bool(_WRAPPED is not None and _WRAPPED(x))


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
        self._resized(tuple(member.out_features for member in members))
        self._made: dict[int, Any] = {}
        self._fresh()

    def _fresh(self) -> None:
        self._local = threading.local()
        self._lock = threading.Lock()
        #: (the packed storages, weakly; the members' weight and bias addresses) as last
        #: checked: while those storages live, addresses in them are slices of them
        self._verified: tuple[list[Any], list[int]] | None = None

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        for name in ("_local", "_lock", "_verified"):
            del state[name]
        state["_made"] = {}
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._fresh()
        # a copy (deepcopy, or unpickled in another process) may hold packed slices already
        sliced_saves.arm()

    def _parts(self, name: str) -> list[Tensor]:
        return [getattr(member, name) for member in self.members]

    def packed(self) -> bool:
        """Whether the group's weights (and biases) are slices of one tensor each."""
        return _is_slice_chain(self._parts("weight")) and (
            not self.bias or _is_slice_chain(self._parts("bias"))
        )

    def pack(self) -> str | None:
        """Move the weights (and biases) into one tensor each, where every one is a
        projection's own tensor (see :func:`_own_storage`); why not, else ``None``.

        The group's sizes are read off the weights as they are now (heads pruned since the
        swap change them); nothing changes unless every tensor can be packed."""
        with self._lock:
            if self.packed():
                return None
            names = ("weight", "bias") if self.bias else ("weight",)
            weights = self._parts("weight")
            if (
                any(w is None or w.dim() != 2 for w in weights)
                or len({w.shape[1] for w in weights}) != 1
            ):
                return "their weights are no longer matrices of one input width"
            sizes = tuple(int(w.shape[0]) for w in weights)
            if self.bias and any(
                b is None or tuple(b.shape) != (n,)
                for b, n in zip(self._parts("bias"), sizes, strict=True)
            ):
                return "their biases no longer match their weights"
            if sizes != self.sizes:
                self._resized(sizes)
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
            made: dict[int, Any] = {}
            # a tensor made under inference_mode could never be saved for a backward later
            with torch.inference_mode(False):
                for name in names:
                    parts = self._parts(name)
                    whole = torch.cat([part.detach() for part in parts])
                    storage = whole.untyped_storage()
                    made[storage.data_ptr()] = _weak(storage)
                    for part, start in zip(parts, self._starts, strict=True):
                        part.data = whole.narrow(0, start, part.shape[0])
            self._made = made
            # savers that deduplicate by storage: every slice whole, while these live
            sliced_saves.arm(
                [self.members[0].weight.untyped_storage()]
                + ([self.members[0].bias.untyped_storage()] if self.bias else [])
            )
            return None if self.packed() else "their weights could not be packed"

    def _resized(self, sizes: tuple[int, ...]) -> None:
        self.sizes = sizes
        self._starts = [sum(sizes[:i]) for i in range(len(sizes))]
        self._split = list(sizes)

    def _addresses(self) -> list[int]:
        names = ("weight", "bias") if self.bias else ("weight",)
        return [m._parameters[name].data_ptr() for name in names for m in self.members]  # type: ignore[union-attr]

    def _still_packed(self) -> bool:
        """Whether the group is packed: the addresses it last found packed, in storages
        that still live, answer at once; anything else is checked (and packed) again."""
        verified = self._verified
        if (
            verified is not None
            and not any(ref.expired() for ref in verified[0])
            and self._addresses() == verified[1]
        ):
            return True
        self._verified = None
        if not self.packed():
            reason = self.pack()
            if reason is not None:
                self._unpacked(reason)
                return False
        names = ("weight", "bias") if self.bias else ("weight",)
        self._verified = (
            [_weak(getattr(self.members[0], n).untyped_storage()) for n in names],
            self._addresses(),
        )
        return True

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
        """Give each projection a storage of its own (the same values); a tensor set or
        taken since the packing (a bias removed) is left as it is."""
        with self._lock:
            for name in ("weight", "bias") if self.bias else ("weight",):
                parts = self._parts(name)
                present = [part for part in parts if isinstance(part, Tensor)]
                whole = len(present) == len(parts) and _is_slice_chain(parts)
                for part in present:
                    if whole or (self._made and _storage_address(part) in self._made):
                        part.data = part.detach().clone()
            self._made = {}
            self._verified = None

    def product(self, x: Tensor, weights: list[Any], tracked: bool) -> Tensor:
        """The whole group's product of ``x``, the group packed (``weights``: its members'
        weights; ``tracked``: whether a gradient flows to them): one ``F.linear`` over the
        packed weight. A backend computing it with a GEMM of its own overrides this."""
        grad = torch.is_grad_enabled()
        weight = _packed(weights, self.sizes, tracked)
        bias = None
        if self.bias:
            biases: list[Any] = [m._parameters["bias"] for m in self.members]
            bias = _packed(biases, self.sizes, grad and any(b.requires_grad for b in biases))
        return F.linear(x, weight, bias)

    def opened(self) -> None:
        """The attention's forward starts: products may be handed over until it ends."""
        self._local.open = True
        self._local.pending = None

    def closed(self) -> None:
        """The attention's forward ends: nothing made in it is kept or handed over."""
        self._local.open = False
        self._local.pending = None

    def output(self, member: nn.Linear, x: Tensor) -> Tensor | None:
        """``member``'s product of ``x``: handed over when the group computed it from this
        very ``x`` in this call, or the whole group's computed now; ``None`` where
        ``member`` computes its own (see :class:`PackedGroup`)."""
        local = self._local
        index = member.__dict__.get("_layerswap_index", -1)
        pending = getattr(local, "pending", None)
        if pending is not None and pending[0] is x:
            _, version, modes, handed = pending
            out: Tensor | None = handed[index]
            if out is not None and version == _version(x) and modes == _modes(x):
                handed[index] = None
                return out
        if (
            not getattr(local, "open", False)
            or self.members[index] is not member  # a replica (DataParallel)
            or _traced(x)
        ):
            return None
        if forward_ad._current_level >= 0:
            # forward-mode AD: dual weights' tangents would not reach the packed product
            return None
        for m in self.members:
            # a projection whose weight is made when it is called (pruning's and other
            # pre-hooks, a parametrization) computes its own, from what its hooks make
            if m._forward_pre_hooks or "weight" not in m._parameters:
                return None
            if (m._parameters.get("bias") is not None) != self.bias:
                # a bias given or taken since the swap: the group's product has it not
                self._unpacked("a bias was given to or taken from one of them since the swap")
                return None
        if not self._still_packed():
            return None
        grad = torch.is_grad_enabled()
        weights: list[Any] = [m._parameters["weight"] for m in self.members]
        tracked = grad and any(w.requires_grad for w in weights)
        product = self.product(x, weights, tracked)
        if grad and not tracked and x.requires_grad:
            # frozen weights: x's gradient is computed from them, so one changed in place
            # before the backward pass is refused, as the original's products refuse it
            product.register_hook(_unchanged(self.names, weights))  # type: ignore[no-untyped-call]
        outputs: list[Tensor | None]
        if grad:
            # a tensor of its own per projection, made in one op: each may be changed in
            # place (a PEFT layer's ``result +=``, a forward hook), with a tensor that
            # requires grad too, without touching what autograd saved of the others, as
            # the original's separate products may (views of one product may not)
            outputs = list(_split_copies(product, self._split, -1))
        else:
            outputs = list(product.split_with_sizes(self._split, -1))
        mine: Tensor | None = outputs[index]
        outputs[index] = None
        local.pending = (x, _version(x), _modes(x), outputs)
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

    def _layerswap_detach(self) -> None:
        """Back to ``nn.Linear`` with tensors of its own: a copy made since the swap (PEFT's
        ``modules_to_save``), which the swap's undo does not reach through its group."""
        for name in ("weight", "bias"):
            tensor = self._parameters.get(name)
            if tensor is not None and tensor.untyped_storage().nbytes() != (
                tensor.numel() * tensor.element_size()
            ):
                tensor.data = tensor.detach().clone()
        self.__dict__.pop("_layerswap_group", None)
        self.__dict__.pop("_layerswap_index", None)
        restored: Any = self
        restored.__class__ = nn.Linear


class ProjectionsReplacement(ClassReplacement):
    """The base of a backend's ``qkv`` replacement: the attention's own ``forward``, its
    projections packed when the swap attaches them."""

    _layerswap_spec: ClassVar[ProjectionSpec]
    _layerswap_groups: tuple[PackedGroup, ...]
    #: the group each set of projections becomes (its :meth:`PackedGroup.product` is the
    #: backend's GEMM)
    group_class: ClassVar[type[PackedGroup]] = PackedGroup

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
            group = self.group_class(members, names, bias, self._layerswap_swapped_by)
            if any(isinstance(member, PackedLinear) for member in members):
                # one projection module in two attentions: packed for one, it would be
                # packed again for the other at every call
                group._unpacked("one of them is another attention's too")
                continue
            # on the meta device (a model from_pretrained builds before it loads) there is
            # nothing to pack yet: the first forward packs what was loaded
            if not any(member.weight.is_meta for member in members):
                reason = group.pack()
                if reason is not None:
                    group._unpacked(reason)
            changes.record(group.unpack)
            for index, member in enumerate(members):
                changes.set_attribute(member, "_layerswap_group", group)
                changes.set_attribute(member, "_layerswap_index", index)
                changes.set_class(member, PackedLinear)
            groups.append(group)
        changes.set_attribute(self, "_layerswap_groups", tuple(groups))

    def _layerswap_members(self) -> dict[str, tuple[nn.Module, type]]:
        return {
            name: (member, PackedLinear)
            for group in self.__dict__.get("_layerswap_groups", ())
            for name, member in zip(group.names, group.members, strict=True)
        }

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
                member.__dict__.pop("_layerswap_index", None)
        self.__dict__.pop("_layerswap_groups", None)

    def extra_repr(self) -> str:
        return f"{self._layerswap_spec.label} packed ({self.backend})"


def is_packed(module: nn.Module) -> bool:
    """Whether ``module`` is an attention the ``qkv`` slot swapped."""
    return isinstance(module, ProjectionsReplacement)
