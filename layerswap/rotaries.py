"""The rotary applications a model's attention classes call, read by running them: what the
``rotary`` slot swaps.

An attention's ``forward`` rotates its queries and keys by calling a function of its
modeling module, ``apply_rotary_pos_emb(q, k, cos, sin)`` (DeepSeek's
``apply_rotary_pos_emb_interleave``, Llama 4's ``apply_rotary_emb``). What that function
computes differs by model type, and its source does not say it plainly: Llama's rotates
every channel by the rotate-half convention, GPT-NeoX's and Phi-3's rotate the leading
``cos.shape[-1]`` channels and pass the rest, ModernBERT's computes in float32 and casts
back, Gemma 3n's takes one tensor, DeepSeek's turns adjacent pairs, GLM's and Cohere's
interleave otherwise. :func:`classify` runs each function a module's class calls on small
random inputs (float32 to rounding, bfloat16 to the last bit, forward and backward) against
each rotation the kernels know, and names what it computes (a :class:`RotarySpec` per
function, a :class:`RotaryCalls` per class), or says why none.

The swapped class calls other functions under other global names
(:func:`rebuilt_forward`: the same code, those names changed, each decorator around it
kept), so the module still runs its own attention, mask, cache and projections.

Example::

    spec = classify(model.model.layers[0].self_attn)
    spec.label         # "rotate-half, q and k"
"""

from __future__ import annotations

import dis
import functools
import inspect
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from layerswap.projections import is_attention_class

__all__ = [
    "ROTARY_FUNCTIONS",
    "RotaryCalls",
    "RotarySpec",
    "calls_conditionally",
    "candidate_rotary_classes",
    "classify",
    "complex_turn",
    "half_rotation",
    "interleaved_rotation",
    "never_rotates",
    "rebuilt_forward",
    "rotary_calls",
]

#: the module-level functions an attention's forward calls to rotate its queries and keys
#: (``apply_rotary_emb``: Llama 4's complex product; ``apply_rotary_pos_emb_interleave``:
#: DeepSeek's interleaved pairs)
ROTARY_FUNCTIONS = ("apply_rotary_pos_emb", "apply_rotary_emb", "apply_rotary_pos_emb_interleave")
#: how many decorators around a forward are rebuilt (``deprecate_kwarg`` is one)
_DEPTH = 8


@dataclass(frozen=True)
class RotarySpec:
    """What one rotary function computes, in the rotate-half convention."""

    #: the global name the attention's forward calls
    function: str
    #: 2: ``(q, k, cos, sin[, position_ids], unsqueeze_dim)``; 1: ``(x, cos, sin,
    #: unsqueeze_dim)``
    operands: int
    #: rotates the leading ``cos.shape[-1]`` channels and passes the others (GPT-NeoX)
    partial: bool
    #: computes in float32 and returns its input's dtype (Cohere, ModernBERT)
    upcast: bool
    #: the parameter names, in order (a call may name them)
    parameters: tuple[str, ...]
    #: ``"half"``: ``x * cos + rotate_half(x) * sin``; ``"interleave"``: adjacent pairs
    #: turned by the first half of cos/sin, written de-interleaved (DeepSeek's
    #: ``apply_rotary_pos_emb_interleave``); ``"complex"``: adjacent pairs times the complex
    #: ``freqs_cis`` (Llama 4's ``apply_rotary_emb``, on bshd states)
    kind: str = "half"

    @property
    def tables(self) -> int:
        """How many position tables follow the operands (cos and sin; ``freqs_cis``)."""
        return 1 if self.kind == "complex" else 2

    @property
    def label(self) -> str:
        turn = {"complex": "complex pairs", "interleave": "interleaved pairs"}.get(
            self.kind, "rotate-half"
        )
        parts = [turn, "q and k" if self.operands == 2 else "one tensor"]
        if self.partial:
            parts.append("leading channels")
        if self.upcast:
            parts.append("in float32")
        return ", ".join(parts)

    @property
    def slug(self) -> str:
        """A short name of what it computes, for the global the swapped forward calls."""
        return (
            f"{self.kind}{self.operands}{'p' if self.partial else 'f'}{'u' if self.upcast else 'i'}"
        )


@dataclass(frozen=True)
class RotaryCalls:
    """What each rotary function an attention's forward calls computes, in the order its
    names are listed in :data:`ROTARY_FUNCTIONS` (DeepSeek V3's attention calls two, one
    per setting of ``rope_interleave``)."""

    calls: tuple[RotarySpec, ...]

    @property
    def label(self) -> str:
        if len(self.calls) == 1:
            return self.calls[0].label
        return "; ".join(f"{call.function}: {call.label}" for call in self.calls)


def half_rotation(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """The rotate-half rotation of the leading ``cos.shape[-1]`` channels of ``x``, the
    others passed; ``cos``/``sin`` already broadcast against ``x`` (the reference the
    kernels are read against, in transformers' order of operations)."""
    width = cos.shape[-1]
    rotated, passed = x[..., :width], x[..., width:]
    half = width // 2
    turned = torch.cat((-rotated[..., half:], rotated[..., :half]), dim=-1)
    out = rotated * cos + turned * sin
    return torch.cat((out, passed), dim=-1) if passed.shape[-1] else out


def _unwrapped(function: Any) -> Any:
    for _ in range(_DEPTH):
        inner = getattr(function, "__wrapped__", None)
        if inner is None:
            return function
        function = inner
    return function


def interleaved_rotation(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """DeepSeek's rotation of adjacent channel pairs by the first half of ``cos``/``sin``
    (already broadcast against ``x``), the pairs' first elements written first, in
    transformers' order of operations."""
    half = cos.shape[-1] // 2
    cos, sin = cos[..., :half], sin[..., :half]
    first, second = x[..., 0::2], x[..., 1::2]
    return torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1)


def _global_reads(code: types.CodeType, name: str) -> set[str]:
    """How ``code`` (and the code it defines) reads ``name``: the opcodes naming it."""
    found = {i.opname for i in dis.get_instructions(code) if i.argval == name}
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            found |= _global_reads(const, name)
    return found


def rotary_calls(cls: type) -> list[tuple[str, Any]] | str:
    """``(name, function)`` of each rotary function ``cls.forward`` calls as a global of its
    module, or why none can be swapped."""
    forward = getattr(cls, "forward", None)
    inner: Any = _unwrapped(forward)
    code = getattr(inner, "__code__", None)
    if code is None:
        return "its forward is no Python function"
    wrapper = forward
    while wrapper is not inner:
        held = getattr(wrapper, "__wrapped__", None)
        if not _holds(wrapper, held):
            return (
                f"its forward is wrapped by {getattr(wrapper, '__qualname__', wrapper)}, "
                "which does not hold the function it wraps in its closure"
            )
        wrapper = held
    namespace: dict[str, Any] = getattr(inner, "__globals__", {})
    found: list[tuple[str, Any]] = []
    reasons: list[str] = []
    for name in ROTARY_FUNCTIONS:
        if name not in code.co_names:
            continue
        reads = _global_reads(code, name)
        function = namespace.get(name)
        if reads != {"LOAD_GLOBAL"}:
            reasons.append(
                f"its forward reads {name} otherwise than as a global ({', '.join(sorted(reads))})"
            )
        elif function is None:
            reasons.append(f"{name} is not a global of {namespace.get('__name__')}")
        else:
            found.append((name, function))
    if found:
        return found
    return "; ".join(reasons) or "its forward calls no rotary function of its module"


def _holds(wrapper: Any, inner: Any) -> bool:
    cells = getattr(wrapper, "__closure__", None) or ()
    return isinstance(wrapper, types.FunctionType) and any(_content(c) is inner for c in cells)


def _content(cell: Any) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell
        return None


def rebuilt_forward(forward: Any, renamed: dict[str, str]) -> Any:
    """``forward`` with each global ``name`` of ``renamed`` read as ``renamed[name]``: the
    same code and defaults, each decorator around it rebuilt around the new function
    (:func:`rotary_calls` checked that it can be)."""
    inner = getattr(forward, "__wrapped__", None)
    if inner is None:
        names = tuple(renamed.get(n, n) for n in forward.__code__.co_names)
        made = types.FunctionType(
            forward.__code__.replace(co_names=names),
            forward.__globals__,
            forward.__name__,
            forward.__defaults__,
            forward.__closure__,
        )
    else:
        rebuilt = rebuilt_forward(inner, renamed)
        cells = tuple(
            types.CellType(rebuilt) if _content(cell) is inner else cell
            for cell in forward.__closure__
        )
        made = types.FunctionType(
            forward.__code__, forward.__globals__, forward.__name__, forward.__defaults__, cells
        )
    made.__kwdefaults__ = forward.__kwdefaults__
    made.__dict__.update(forward.__dict__)
    if inner is not None:
        made.__wrapped__ = rebuilt  # type: ignore[attr-defined]
    made.__qualname__ = forward.__qualname__
    made.__doc__ = forward.__doc__
    made.__module__ = forward.__module__
    made.__annotations__ = dict(getattr(forward, "__annotations__", {}))
    return made


def _forward_tree(cls: type) -> Any:
    import ast
    import textwrap

    try:
        return ast.parse(
            textwrap.dedent(inspect.getsource(_unwrapped(getattr(cls, "forward", None))))
        )
    except (OSError, TypeError, SyntaxError):
        return None


def _call_sites(tree: Any) -> Iterator[tuple[Any, list[tuple[Any, bool]]]]:
    """Each call of a rotary function in ``tree``, with the branches it stands in: ``(node,
    True/False)`` for an ``if``'s body or ``else``, ``(node, None)`` for any other branch."""
    import ast

    branches = (ast.If, ast.IfExp, ast.For, ast.While, ast.Try, ast.BoolOp, ast.Match)

    def walk(node: Any, inside: list[tuple[Any, bool | None]]) -> Iterator[Any]:
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) in ROTARY_FUNCTIONS:
            yield node, inside
            return
        for field, child in ast.iter_fields(node):
            children = child if isinstance(child, list) else [child]
            for item in children:
                if not isinstance(item, ast.AST):
                    continue
                if isinstance(node, ast.If) and field in ("body", "orelse"):
                    yield from walk(item, [*inside, (node, field == "body")])
                elif isinstance(node, branches) and not (
                    isinstance(node, ast.If) and field == "test"
                ):
                    yield from walk(item, [*inside, (node, None)])
                else:
                    yield from walk(item, inside)

    yield from walk(tree, [])


@functools.lru_cache(maxsize=512)
def _rotary_sites(cls: type) -> tuple[tuple[tuple[Any, bool | None], ...], ...] | None:
    """The branches each rotary call of ``cls.forward`` stands in (:func:`_call_sites`),
    read once per class; ``None`` where the source cannot be read."""
    tree = _forward_tree(cls)
    if tree is None:
        return None
    return tuple(tuple(inside) for _, inside in _call_sites(tree))


def calls_conditionally(cls: type) -> bool:
    """Whether ``cls.forward`` calls its rotary function only under a condition (a config
    switch, NoPE layers: DeepSeek V3's ``rope_interleave``, GraniteMoeHybrid's
    ``position_embedding_type``), read from its source; ``True`` where the source cannot
    be read. Whether it runs is then asked of a run."""
    sites = _rotary_sites(cls)
    return sites is None or any(sites)


def _gates(cls: type) -> tuple[tuple[tuple[Any, bool], ...], ...] | None:
    """Each rotary call site of ``cls.forward`` with the ``if`` tests it stands under,
    ``(test, whether it must hold)``; ``None`` where one stands under another branch (a
    loop, a conditional expression) or the source cannot be read."""
    sites = _rotary_sites(cls)
    if sites is None or any(body is None for site in sites for _, body in site):
        return None
    return tuple(tuple((node.test, bool(body)) for node, body in site) for site in sites)


class _Unknown(Exception):
    """A condition that is not the module's own switches alone."""


def _switch_value(test: Any, held: dict[str, Any]) -> Any:
    """``test`` evaluated on a module's own attributes ``held``: ``self.x``, ``None``,
    ``not``, ``is (not) None``, ``and``/``or``; anything else is :class:`_Unknown`."""
    import ast

    if isinstance(test, ast.Attribute) and isinstance(test.value, ast.Name):
        if test.value.id != "self" or test.attr not in held:
            raise _Unknown
        return held[test.attr]
    if isinstance(test, ast.Constant) and test.value is None:
        return None
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        return not _switch_value(test.operand, held)
    if isinstance(test, ast.BoolOp):
        values = [bool(_switch_value(value, held)) for value in test.values]
        return all(values) if isinstance(test.op, ast.And) else any(values)
    if isinstance(test, ast.Compare) and len(test.ops) == 1:
        left, right = _switch_value(test.left, held), _switch_value(test.comparators[0], held)
        if isinstance(test.ops[0], ast.Is):
            return left is right
        if isinstance(test.ops[0], ast.IsNot):
            return left is not right
    raise _Unknown


def never_rotates(module: nn.Module) -> str | None:
    """Why ``module`` never calls its rotary function: every call stands under ``if`` tests
    of the module's own attributes (``self.use_rope``, ``self.sliding_window is not None``)
    that it fails, as a NoPE layer does (SmolLM3's, Llama 4's, Cohere 2's global layers);
    ``None`` where a call may run, or its conditions are not the module's own switches."""
    import ast

    cls: type = getattr(type(module), "_layerswap_original", type(module))
    sites = _gates(cls)
    if not sites:
        return None
    held = vars(module)
    try:
        if any(all(bool(_switch_value(t, held)) == want for t, want in site) for site in sites):
            return None
    except Exception:  # a switch that is not a plain value, or not the module's own
        return None
    tests = sorted({ast.unparse(test) for site in sites for test, _ in site})
    return f"a NoPE layer: {' / '.join(tests)} fails here, so it applies no rotary embedding"


def candidate_rotary_classes(model: nn.Module, module_name: str) -> dict[type, list[str]]:
    """The attention classes of ``model`` whose forward calls a rotary function of its
    module, with the names of their instances, in the order they first appear."""
    found: dict[type, list[str]] = {}
    for name, module in model.named_modules():
        cls: type = getattr(type(module), "_layerswap_original", type(module))
        if is_attention_class(cls, module_name) and _calls_rotary(cls):
            found.setdefault(cls, []).append(name)
    return found


@functools.lru_cache(maxsize=512)
def _calls_rotary(cls: type) -> bool:
    code = getattr(_unwrapped(getattr(cls, "forward", None)), "__code__", None)
    return code is not None and any(name in code.co_names for name in ROTARY_FUNCTIONS)


def classify(module: nn.Module) -> RotaryCalls | str:
    """What the rotary functions ``module``'s class calls compute (those that compute a
    rotation the kernels know), or why none does. Runs the functions, never the module (a
    module on the meta device is read alike)."""
    cls: type = getattr(type(module), "_layerswap_original", type(module))
    found = rotary_calls(cls)
    if isinstance(found, str):
        return found
    read = [_read(name, function) for name, function in found]
    specs = tuple(spec for spec in read if isinstance(spec, RotarySpec))
    if specs:
        return RotaryCalls(specs)
    return "; ".join(str(reason) for reason in read)


@functools.lru_cache(maxsize=256)
def _read(name: str, function: Callable[..., Any]) -> RotarySpec | str:
    # on the CPU whatever the default device (transformers builds a model under
    # torch.device("meta"); a user may set a CUDA default), with autograd on, inside
    # torch.inference_mode too: what is read (and kept) never depends on the caller's state
    with torch.device("cpu"), torch.inference_mode(False), torch.enable_grad():
        return _read_here(name, function)


def _read_here(name: str, function: Callable[..., Any]) -> RotarySpec | str:
    try:
        parameters = tuple(inspect.signature(function).parameters)
    except (TypeError, ValueError):
        return f"{name} has no signature to read"
    generator = torch.Generator().manual_seed(0)

    def draw(*shape: int, dtype: torch.dtype = torch.float32) -> Tensor:
        return torch.randn(*shape, generator=generator).to(dtype)

    if len(parameters) == 3:  # (xq, xk, freqs_cis): Llama 4's complex product
        return _read_complex(name, function, parameters, draw)
    for operands in (2, 1):
        tail = parameters[operands + 2 :]
        if tail not in (("unsqueeze_dim",), ("position_ids", "unsqueeze_dim")):
            continue
        q, k = draw(2, 3, 5, 8), draw(2, 1, 5, 8)
        cos, sin = draw(2, 5, 8), draw(2, 5, 8)
        if not _rotates(function, operands, (q, k), cos, sin, torch.float32):
            if _rotates(function, operands, (q, k), cos, sin, torch.float32, interleave=True):
                low = [t.to(torch.bfloat16) for t in (q, k, cos, sin)]
                if not _bitwise(function, operands, low, upcast=False, interleave=True):
                    return f"{name} rounds bfloat16 otherwise than in its inputs' dtype"
                return RotarySpec(name, operands, False, False, parameters, kind="interleave")
            other = _layout(function, operands, (q, k), cos, sin)
            return f"{name} does not compute the rotate-half rotation" + (
                f" (it computes the {other!r} layout)" if other else ""
            )
        partial = _rotates(function, operands, (q, k), cos[..., :4], sin[..., :4], torch.float32)
        low = [t.to(torch.bfloat16) for t in (q, k, cos, sin)]
        upcast = _bitwise(function, operands, low, upcast=True)
        if not upcast and not _bitwise(function, operands, low, upcast=False):
            return f"{name} rounds bfloat16 otherwise than in its inputs' dtype or in float32"
        return RotarySpec(name, operands, partial, upcast, parameters)
    return f"{name} takes ({', '.join(parameters)}), not (q, k, cos, sin, unsqueeze_dim)"


def _read_complex(
    name: str, function: Callable[..., Any], parameters: tuple[str, ...], draw: Any
) -> RotarySpec | str:
    """What a ``(xq, xk, freqs_cis)`` function computes: Llama 4's product of adjacent
    pairs with the complex ``freqs_cis`` (batch, seq, pairs), broadcast over the heads of
    bshd states, in float32 and cast back; bfloat16 compared to the last bit."""
    q, k = draw(2, 5, 3, 8), draw(2, 5, 1, 8)
    freqs = torch.polar(torch.ones(2, 5, 4), draw(2, 5, 4))
    for dtype in (torch.float32, torch.bfloat16):
        x, y = q.to(dtype), k.to(dtype)
        got = _outputs(_call(function, 2, (x, y), freqs, None), 2)
        want = [complex_turn(t, freqs) for t in (x, y)]
        if not all(
            isinstance(out, Tensor) and out.dtype == dtype and torch.equal(out, w)
            for out, w in zip(got, want, strict=True)
        ):
            return f"{name} does not compute Llama 4's product of adjacent pairs with freqs_cis"
    return RotarySpec(name, 2, False, True, parameters, kind="complex")


def complex_turn(x: Tensor, freqs: Tensor) -> Tensor:
    """Llama 4's rotation of bshd ``x``: adjacent channel pairs as complex numbers times
    ``freqs`` (batch, seq, pairs), in float32, cast back to ``x``'s dtype."""
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(pairs * freqs[:, :, None, :]).flatten(3).type_as(x)


def _layout(
    function: Callable[..., Any], operands: int, tensors: Any, cos: Tensor, sin: Tensor
) -> str | None:
    """Which other layout of :data:`~layerswap.rotary.ROTARY_LAYOUTS` ``function`` computes
    (GLM's, Cohere's interleaved pairs; nanochat's reversed halves), to say so."""
    from layerswap.rotary import ROTARY_LAYOUTS, rotate

    got = _outputs(_call(function, operands, tensors, cos, sin), operands)
    for layout in ROTARY_LAYOUTS[1:]:
        try:
            want = [rotate(x, cos, sin, layout) for x in tensors[:operands]]
        except RuntimeError:
            continue
        if all(
            isinstance(out, Tensor) and out.shape == w.shape and torch.allclose(out, w, atol=1e-5)
            for out, w in zip(got, want, strict=True)
        ):
            return layout
    return None


def _call(
    function: Callable[..., Any], operands: int, tensors: Any, cos: Tensor, sin: Tensor | None
) -> Any:
    tables = (cos,) if sin is None else (cos, sin)
    try:
        return function(*tensors[:operands], *tables)
    except Exception:
        return None


def _expected(
    x: Tensor, cos: Tensor, sin: Tensor, upcast: bool, interleave: bool = False
) -> Tensor:
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    if interleave:
        return interleaved_rotation(x, cos, sin)
    if upcast:
        # each term casts the states (so each term's gradient is rounded to their dtype
        # before the two are summed), the result cast back
        width, half = cos.shape[-1], cos.shape[-1] // 2
        first, second = x.float()[..., :width], x.float()[..., :width]
        turned = torch.cat((-second[..., half:], second[..., :half]), dim=-1)
        out = first * cos.float() + turned * sin.float()
        if width < x.shape[-1]:
            out = torch.cat((out, x.float()[..., width:]), dim=-1)
        return out.to(x.dtype)
    return half_rotation(x, cos, sin)


def _outputs(got: Any, operands: int) -> list[Any]:
    if operands == 1:
        return [got]
    return list(got) if isinstance(got, tuple) and len(got) == 2 else [None, None]


def _rotates(
    function: Callable[..., Any],
    operands: int,
    tensors: Any,
    cos: Tensor,
    sin: Tensor,
    dtype: torch.dtype,
    *,
    interleave: bool = False,
) -> bool:
    got = _outputs(_call(function, operands, tensors, cos, sin), operands)
    for out, x in zip(got, tensors[:operands], strict=True):
        want = _expected(x.double(), cos.double(), sin.double(), False, interleave)
        if not isinstance(out, Tensor) or out.shape != x.shape or out.dtype != dtype:
            return False
        if not torch.allclose(out.double(), want, rtol=1e-5, atol=1e-5):
            return False
    return True


def _bitwise(
    function: Callable[..., Any],
    operands: int,
    low: list[Tensor],
    *,
    upcast: bool,
    interleave: bool = False,
) -> bool:
    """Whether ``function`` rounds as the rotation does in ``low``'s dtype (or in float32
    and cast back), its outputs and its inputs' gradients to the last bit."""
    q, k, cos, sin = (t.detach().requires_grad_(i < 2) for i, t in enumerate(low))
    got = _outputs(_call(function, operands, (q, k), cos, sin), operands)
    for out, x in zip(got, (q, k)[:operands], strict=True):
        want = _expected(x, cos, sin, upcast, interleave)
        if not (isinstance(out, Tensor) and out.dtype == x.dtype and torch.equal(out, want)):
            return False
        if not out.requires_grad:
            return False
        grad = torch.ones_like(out).mul_(0.375)  # exact in bfloat16
        grad[..., ::3] = -1.5
        (mine,) = torch.autograd.grad(want, x, grad)
        (theirs,) = torch.autograd.grad(out, x, grad)
        if not torch.equal(mine, theirs):
            return False
    return True
