"""Checks on tensors going in and out: ``validate_tensors`` and ``nan_guard``."""

from __future__ import annotations

import inspect
import types
import warnings
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from layerswap.decorators._advice import Advice, describe, external_stacklevel, loaded_torch

if TYPE_CHECKING:
    import torch

    from layerswap.decorators._advice import Args, Kwargs, Wrapped

__all__ = ["DimSpec", "ShapeSpec", "nan_guard", "validate_tensors"]

#: One dimension: a name that must agree wherever it is used, a fixed size, or
#: ``None`` for any size.
DimSpec = str | int | None
#: A shape: a tuple of :data:`DimSpec`, with at most one ``...`` standing for any number
#: of dimensions; or ``None`` / ``...`` alone for any shape.
ShapeSpec = tuple[Any, ...] | types.EllipsisType | None

_MISSING: Any = object()


class _ArgumentLocator:
    """Finds named arguments in ``(args, kwargs)`` without ``Signature.bind`` on every call.

    Built once per signature: a name is looked up in ``kwargs`` (when it may be
    passed by keyword), then at its position in ``args``, then its default.
    """

    __slots__ = ("_where", "positional_names")

    def __init__(self, signature: inspect.Signature, names: Iterable[str], label: str) -> None:
        params = list(signature.parameters.values())
        var_keyword = any(p.kind is p.VAR_KEYWORD for p in params)
        self.positional_names: list[str] = []
        for p in params:
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
                self.positional_names.append(p.name)
            elif p.kind is p.VAR_POSITIONAL:
                self.positional_names.append("*" + p.name)
                break
        by_name = {p.name: p for p in params}
        self._where: dict[str, tuple[int, bool, Any]] = {}
        for name in names:
            param = by_name.get(name)
            if param is None and var_keyword:  # may arrive through **kwargs
                self._where[name] = (-1, True, _MISSING)
                continue
            if param is None or param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
                raise TypeError(f"{label}() has no argument {name!r} to validate")
            position = self.positional_names.index(name) if name in self.positional_names else -1
            default = _MISSING if param.default is param.empty else param.default
            self._where[name] = (position, param.kind is not param.POSITIONAL_ONLY, default)

    def get(self, args: tuple[Any, ...], kwargs: dict[str, Any], name: str) -> Any:
        position, by_keyword, default = self._where[name]
        if by_keyword and name in kwargs:
            return kwargs[name]
        if 0 <= position < len(args):
            return args[position]
        return default

    def name_of(self, position: int) -> str:
        """The parameter name an ``args`` position binds to, for messages."""
        names = self.positional_names
        if position < len(names) and not names[position].startswith("*"):
            return names[position]
        if names and names[-1].startswith("*"):
            return f"{names[-1][1:]}[{position - len(names) + 1}]"
        return f"args[{position}]"


class _Locators:
    """One :class:`_ArgumentLocator` per wrapped callable, built on first use and kept.

    The decorator form always sees the same function. Through ``layerswap.wrap`` the
    wrapped callable may be a fresh bound method per call, so it is keyed by the
    function under it (bound and unbound have different signatures: ``self``).
    Other callables (partials) are not cached, because they may be made per call.
    """

    __slots__ = ("_bound", "_names", "_plain")

    def __init__(self, names: Iterable[str]) -> None:
        self._names = tuple(names)
        self._plain: dict[Any, _ArgumentLocator] = {}
        self._bound: dict[Any, _ArgumentLocator] = {}

    def __call__(self, wrapped: Callable[..., Any], instance: Any) -> _ArgumentLocator:
        if type(wrapped) is types.MethodType:
            cache, key = self._bound, wrapped.__func__
        else:
            cache, key = self._plain, wrapped
        locator = cache.get(key)
        if locator is None:
            label = describe(wrapped, instance)
            locator = _ArgumentLocator(inspect.signature(wrapped), self._names, label)
            if type(key) is types.FunctionType:
                cache[key] = locator
        return locator


def _fmt_shape(shape: Iterable[int]) -> str:
    return "(" + ", ".join(str(d) for d in shape) + ("," if len(tuple(shape)) == 1 else "") + ")"


class _TensorSpec:
    """A parsed shape spec: dims before and after the ``...`` (if any)."""

    __slots__ = ("any_shape", "head", "tail", "text", "variadic")

    def __init__(self, argument: str, spec: Any) -> None:
        self.any_shape = spec is None or spec is Ellipsis
        if self.any_shape:
            spec = ()
        if isinstance(spec, (str, int)):
            spec = (spec,)
        if not isinstance(spec, (tuple, list)):
            raise TypeError(
                f"validate_tensors: the spec of {argument!r} must be a tuple of dims "
                f"(names, ints, None, ...), got {spec!r}"
            )
        for dim in spec:
            ok = dim is None or dim is Ellipsis or isinstance(dim, str)
            ok = ok or (isinstance(dim, int) and not isinstance(dim, bool) and dim >= 0)
            if not ok:
                raise TypeError(
                    f"validate_tensors: dim {dim!r} in the spec of {argument!r} is not a "
                    "name, a size >= 0, None or ..."
                )
        if sum(dim is Ellipsis for dim in spec) > 1:
            raise ValueError(f"validate_tensors: the spec of {argument!r} has more than one ...")
        self.variadic = Ellipsis in spec
        if self.variadic:
            cut = list(spec).index(Ellipsis)
            self.head, self.tail = tuple(spec[:cut]), tuple(spec[cut + 1 :])
        else:
            self.head, self.tail = tuple(spec), ()
        self.text = "(" + ", ".join("..." if d is Ellipsis else repr(d) for d in spec) + ")"


def _dims_with_positions(spec: _TensorSpec, ndim: int) -> Iterable[tuple[int, DimSpec]]:
    yield from enumerate(spec.head)
    offset = ndim - len(spec.tail)
    for i, dim in enumerate(spec.tail):
        yield offset + i, dim


def _device_matches(actual: torch.device, expected: torch.device) -> bool:
    if actual.type != expected.type:
        return False
    return expected.index is None or actual.index == expected.index


class validate_tensors(Advice):
    """Check the shapes, dtype and device of tensor arguments before each call.

    Each keyword names an argument and gives its shape: a tuple whose entries are
    a dimension name (a str: every use of the name, in this and the other
    arguments, must have the same size), a fixed size (an int), ``None`` (any size)
    or one ``...`` (any number of dimensions). ``dtype`` (one dtype, or a tuple of
    allowed dtypes) and ``device`` (``"cuda"`` matches any CUDA device, ``"cuda:1"``
    only that one) apply to every named argument. Arguments are found by
    ``inspect.signature`` (positionally or by keyword, methods included); an
    argument that is ``None`` or not passed is skipped, so optional masks work.

    A wrong type or dtype raises :class:`TypeError`, a wrong shape or device
    :class:`ValueError`, each naming the function, the argument, what was expected
    and what came.

    Example::

        @validate_tensors(x=("batch", "seq", "hidden"), mask=("batch", "seq"), dtype=torch.float32)
        def attend(x, mask=None): ...

        attend(torch.zeros(2, 5, 64), mask=torch.ones(3, 5))
        # ValueError: attend(): argument 'mask' dim 0 ('batch') is 3, but 'x' set batch=2
    """

    __slots__ = ("_device", "_dtypes", "_locators", "_named", "_specs", "_tensor")

    def __init__(
        self,
        *,
        dtype: torch.dtype | tuple[torch.dtype, ...] | None = None,
        device: str | torch.device | None = None,
        **specs: Any,
    ) -> None:
        import torch

        if not specs:
            raise TypeError("validate_tensors() needs at least one argument spec, e.g. x=('n', 4)")
        self._specs = tuple((name, _TensorSpec(name, spec)) for name, spec in specs.items())
        self._named = any(
            isinstance(dim, str) for _, spec in self._specs for dim in spec.head + spec.tail
        )
        if dtype is None:
            self._dtypes: tuple[torch.dtype, ...] | None = None
        else:
            self._dtypes = tuple(dtype) if isinstance(dtype, (tuple, list, set)) else (dtype,)
            if not all(isinstance(d, torch.dtype) for d in self._dtypes):
                raise TypeError(f"dtype must be a torch.dtype or a tuple of them, got {dtype!r}")
        self._device = None if device is None else torch.device(device)
        self._locators = _Locators(specs)
        self._tensor = torch.Tensor

    def _before(self, wrapped: Wrapped, instance: Any, args: Args, kwargs: Kwargs) -> None:
        locator = self._locators(wrapped, instance)
        # dimension name -> (size, argument that set it); per call, as calls may overlap
        bound: dict[str, tuple[int, str]] | None = {} if self._named else None
        for name, spec in self._specs:
            value = locator.get(args, kwargs, name)
            if value is _MISSING or value is None:
                continue
            if not isinstance(value, self._tensor):
                self._fail(
                    TypeError,
                    wrapped,
                    instance,
                    name,
                    f"must be a torch.Tensor, got {type(value).__name__}",
                )
            if self._dtypes is not None and value.dtype not in self._dtypes:
                expected = " or ".join(str(d) for d in self._dtypes)
                self._fail(
                    TypeError,
                    wrapped,
                    instance,
                    name,
                    f"has dtype {value.dtype}, expected {expected}",
                )
            if self._device is not None and not _device_matches(value.device, self._device):
                self._fail(
                    ValueError,
                    wrapped,
                    instance,
                    name,
                    f"is on {value.device}, expected {self._device}",
                )
            if not spec.any_shape:
                self._check_shape(wrapped, instance, name, spec, value.shape, bound)

    def _check_shape(
        self,
        wrapped: Callable[..., Any],
        instance: Any,
        name: str,
        spec: _TensorSpec,
        shape: torch.Size,
        bound: dict[str, tuple[int, str]] | None,
    ) -> None:
        ndim = len(shape)
        fixed = len(spec.head) + len(spec.tail)
        if ndim != fixed and not (spec.variadic and ndim >= fixed):
            expected = f"at least {fixed}" if spec.variadic else str(fixed)
            self._fail(
                ValueError,
                wrapped,
                instance,
                name,
                f"has {ndim} dims (shape {_fmt_shape(shape)}), expected {expected} {spec.text}",
            )
        for position, dim in _dims_with_positions(spec, ndim):
            size = shape[position]
            if dim is None:
                continue
            if isinstance(dim, int):
                if size != dim:
                    self._fail(
                        ValueError,
                        wrapped,
                        instance,
                        name,
                        f"dim {position} is {size}, expected {dim} (shape {_fmt_shape(shape)})",
                    )
                continue
            assert bound is not None
            seen = bound.get(dim)
            if seen is None:
                bound[dim] = (size, name)
            elif seen[0] != size:
                setter = "itself" if seen[1] == name else repr(seen[1])
                self._fail(
                    ValueError,
                    wrapped,
                    instance,
                    name,
                    f"dim {position} ({dim!r}) is {size}, but {setter} set {dim}={seen[0]}",
                )

    @staticmethod
    def _fail(
        error: type[Exception],
        wrapped: Callable[..., Any],
        instance: Any,
        name: str,
        what: str,
    ) -> None:
        __tracebackhide__ = True
        raise error(f"{describe(wrapped, instance)}(): argument {name!r} {what}")

    def _decorated(self, wrapper: Callable[..., Any]) -> None:
        # Decorator form: a spec naming no argument fails now, not at the first call.
        self._locators(wrapper.__wrapped__, None)  # type: ignore[attr-defined]


_MAX_DEPTH = 16


def _all_finite(torch: Any, tensor: torch.Tensor) -> bool:
    tensor = tensor.detach()
    if tensor.numel() == 0:
        return True
    if not tensor.is_complex():
        # One reduction, no full-size bool tensor: a finite sum proves every element
        # finite (NaN and inf propagate). A non-finite sum may be overflow, so it
        # only sends us to the exact check below.
        accumulate = torch.float64 if tensor.dtype == torch.float64 else torch.float32
        if bool(torch.isfinite(tensor.sum(dtype=accumulate))):
            return True
        if tensor.dtype not in (torch.float32, torch.float64):
            tensor = tensor.to(torch.float32)  # exact, and isfinite has no float8 kernel
    return bool(torch.isfinite(tensor).all())


def _find_non_finite(
    torch: Any, value: Any, path: str, root: str, found: list[tuple[str, Any]], depth: int = 0
) -> None:
    if isinstance(value, torch.Tensor):
        if (value.is_floating_point() or value.is_complex()) and not _all_finite(torch, value):
            found.append((path, value))
        return
    if depth >= _MAX_DEPTH:
        return
    if isinstance(value, dict):  # includes transformers' ModelOutput
        for key, item in value.items():
            if isinstance(key, str):
                item_path = f"{path}.{key}" if path else key
            else:
                item_path = f"{path or root}[{key!r}]"
            _find_non_finite(torch, item, item_path, root, found, depth + 1)
    elif isinstance(value, (list, tuple)):
        fields = getattr(value, "_fields", None)  # a namedtuple: use its field names
        for i, item in enumerate(value):
            if fields is not None:
                item_path = f"{path}.{fields[i]}" if path else fields[i]
            else:
                item_path = f"{path or root}[{i}]"
            _find_non_finite(torch, item, item_path, root, found, depth + 1)


def _describe_non_finite(torch: Any, path: str, tensor: torch.Tensor) -> str:
    tensor = tensor.detach()
    nan = int(torch.isnan(tensor).sum())
    inf = int(torch.isinf(tensor).sum())
    where = f"{path!r}: " if path else ""
    return (
        f"{where}{nan} NaN and {inf} inf of {tensor.numel()} values "
        f"(shape {_fmt_shape(tensor.shape)}, {tensor.dtype})"
    )


class nan_guard(Advice):
    """Raise (or warn) when a call returns a tensor holding NaN or inf.

    Looks through the returned value: a tensor, or tensors nested in tuples, lists,
    named tuples and dicts — transformers' ``ModelOutput`` is a dict — and names
    the path of each bad one (``logits``, ``hidden_states[2]``). With
    ``check_inputs=True`` the tensor arguments are checked before the call too.
    ``action="raise"`` raises :class:`FloatingPointError`; ``"warn"`` warns with
    :class:`RuntimeWarning` and returns the value. Integer tensors are skipped.

    Each check reads a result back from the device (one sync per floating tensor);
    use it while hunting a divergence, or on a few layers via ``layerswap.wrap``.

    Example::

        @nan_guard()
        def loss_fn(logits, labels): ...

        # find the first layer that produces NaN in a live model:
        guards = [layerswap.wrap(layer, "forward", nan_guard()) for layer in model.model.layers]
        with layerswap.patches(*guards):
            model(input_ids)   # FloatingPointError: LlamaDecoderLayer.forward() returned ...
    """

    __slots__ = ("_action", "_check_inputs", "_locators")

    def __init__(self, *, action: str = "raise", check_inputs: bool = False) -> None:
        if action not in ("raise", "warn"):
            raise ValueError(f"action must be 'raise' or 'warn', got {action!r}")
        self._action = action
        self._check_inputs = check_inputs
        self._locators = _Locators(())

    def _report(
        self,
        torch: Any,
        wrapped: Callable[..., Any],
        instance: Any,
        verb: str,
        found: list[tuple[str, Any]],
    ) -> None:
        details = "; ".join(_describe_non_finite(torch, path, t) for path, t in found)
        message = f"{describe(wrapped, instance)}() {verb} non-finite values: {details}"
        if self._action == "raise":
            raise FloatingPointError(message)
        warnings.warn(message, RuntimeWarning, stacklevel=external_stacklevel())

    def _before(self, wrapped: Wrapped, instance: Any, args: Args, kwargs: Kwargs) -> None:
        if not self._check_inputs:
            return
        torch = loaded_torch()
        if torch is None:
            return
        found: list[tuple[str, Any]] = []
        if args:
            locator = self._locators(wrapped, instance)
            for i, value in enumerate(args):
                name = locator.name_of(i)
                _find_non_finite(torch, value, name, name, found)
        for name, value in kwargs.items():
            _find_non_finite(torch, value, name, name, found)
        if found:
            self._report(torch, wrapped, instance, "received", found)

    def _returned(self, wrapped: Wrapped, instance: Any, token: None, result: Any) -> None:
        torch = loaded_torch()
        if torch is None:
            return
        found: list[tuple[str, Any]] = []
        _find_non_finite(torch, result, "", "output", found)
        if found:
            self._report(torch, wrapped, instance, "returned", found)
