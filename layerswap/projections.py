"""The attention projections a model's own classes compute from one input: what the ``qkv``
slot packs into one product.

An attention module projects its input several times before its core: Llama's
``q_proj(hidden_states)``, ``k_proj(hidden_states)`` and ``v_proj(hidden_states)``,
Qwen3-Next's gated ``q_proj`` (query and gate) with ``k_proj``/``v_proj``, DeepSeek's
multi-head latent attention ``q_a_proj(hidden_states)`` with
``kv_a_proj_with_mqa(hidden_states)``. :func:`classify` reads the class's ``forward``
(transformers' source, as the installed release has it): the ``nn.Linear`` children it
calls on one and the same variable, with nothing assigned to that variable between the
calls, form a group. What a group computes is not assumed from the reading: each call
still checks, when it runs, that it is given the very tensor its group was computed from
(:mod:`layerswap.backends.projections`), so a reading that groups too much costs time,
never numbers.

Example::

    classify(model.model.layers[0].self_attn).groups   # (("q_proj", "k_proj", "v_proj"),)
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap
from dataclasses import dataclass
from typing import Any

from torch import nn

__all__ = ["ProjectionSpec", "candidate_attention_classes", "classify", "is_attention_class"]

_MODELING = "transformers.models."


@dataclass(frozen=True)
class ProjectionSpec:
    """The groups of projections an attention class computes from one input each."""

    #: per group, the names of its ``nn.Linear`` children in the order forward calls them
    groups: tuple[tuple[str, ...], ...]
    #: whether the group's projections have biases (all of a group alike: projections of
    #: one input with and without a bias are two groups)
    biases: tuple[bool, ...]
    kind: str = "packed"

    @property
    def label(self) -> str:
        """``"q_proj+k_proj+v_proj"``; groups joined by ``", "``."""
        return ", ".join("+".join(group) for group in self.groups)


def is_attention_class(cls: type, module_name: str) -> bool:
    """Whether ``cls`` is named as an attention and defined in ``module_name`` (a model's
    modeling module) or another of transformers' modeling modules."""
    return (
        cls.__module__ == module_name or cls.__module__.startswith(_MODELING)
    ) and "attention" in cls.__name__.lower()


def _linears(module: nn.Module) -> dict[str, nn.Module]:
    """The children of ``module`` that project like a linear layer (``nn.Linear``, or a
    layer wrapping or replacing one: an adapter, a quantized layer)."""
    return {
        name: child
        for name, child in module.named_children()
        if isinstance(getattr(child, "in_features", None), int)
        and isinstance(getattr(child, "out_features", None), int)
    }


def candidate_attention_classes(model: nn.Module, module_name: str) -> dict[type, list[str]]:
    """The attention classes of ``model`` the ``qkv`` slot considers, with the names of their
    instances: classes named as attentions (:func:`is_attention_class`) holding two or more
    projections of their own, in the order they first appear."""
    found: dict[type, list[str]] = {}
    for name, module in model.named_modules():
        cls = type(module)
        original = getattr(cls, "_layerswap_original", None)
        cls = original if original is not None else cls
        if is_attention_class(cls, module_name) and len(_linears(module)) >= 2:
            found.setdefault(cls, []).append(name)
    return found


def classify(module: nn.Module) -> ProjectionSpec | str:
    """The groups of ``module``'s projections its class's ``forward`` calls on one input, as
    a :class:`ProjectionSpec`, or why the slot packs none. Reads the source; touches nothing
    of the module (a module on the meta device is read alike)."""
    cls: type = getattr(type(module), "_layerswap_original", type(module))
    read = _calls_on_one_input(cls)
    if isinstance(read, str):
        return read
    linears = _linears(module)
    groups: list[tuple[str, ...]] = []
    biases: list[bool] = []
    reasons: list[str] = []
    for names in read:
        members = [name for name in names if name in linears]
        if len(members) < 2:
            continue
        children = [linears[name] for name in members]
        if any(type(child) is not nn.Linear for child in children):
            wrapped = next(
                n for n, c in zip(members, children, strict=True) if type(c) is not nn.Linear
            )
            reasons.append(
                f"{wrapped} is a {type(linears[wrapped]).__name__}, not an nn.Linear (swap "
                "before an adapter or a quantization wraps the projections)"
            )
            continue
        if len({child.in_features for child in children}) != 1:
            continue
        # one product per kind: with biases, and without (Whisper's k_proj has none)
        found = False
        for bias in (True, False):
            alike = tuple(
                n for n, c in zip(members, children, strict=True) if (c.bias is not None) is bias
            )
            if len(alike) >= 2:
                groups.append(alike)
                biases.append(bias)
                found = True
        if not found:
            reasons.append(f"of {'+'.join(members)} some have a bias and some none")
    if groups:
        return ProjectionSpec(tuple(groups), tuple(biases))
    if reasons:
        return "; ".join(reasons)
    return "its forward calls no two of its projections on one input"


@functools.lru_cache(maxsize=256)
def _calls_on_one_input(cls: type) -> tuple[tuple[str, ...], ...] | str:
    """Per variable, the ``self.<child>(variable)`` calls of ``cls.forward`` between two
    assignments of that variable (or in-place changes: ``variable.mul_(...)``), in source
    order; or why the source cannot be read."""
    try:
        forward: Any = getattr(cls, "forward", None)
        source = textwrap.dedent(inspect.getsource(forward))
        tree = ast.parse(source)
    except (OSError, TypeError, SyntaxError) as exc:
        return f"its forward's source cannot be read ({type(exc).__name__})"
    events: list[tuple[int, int, str, str]] = []  # (line, column, variable, child or "=")
    for statement in ast.walk(tree):
        if not isinstance(statement, ast.stmt):
            continue
        # its own expressions and targets; the statements in its body are visited in turn
        own = [n for n in ast.iter_child_nodes(statement) if not isinstance(n, ast.stmt)]
        for node in (inner for part in own for inner in ast.walk(part)):
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                # assigned once the statement has run: its right side reads the old value
                end = statement.end_lineno or statement.lineno
                events.append((end, 1 << 30, node.id, "="))
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Name)
                and node.func.value.id != "self"
                and node.func.attr.endswith("_")
                and not node.func.attr.startswith("_")
            ):
                # changed in place (x.mul_(...)): what follows reads another value
                events.append((node.lineno, node.col_offset, node.func.value.id, "="))
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Name)
                and node.func.value.id == "self"
                and len(node.args) == 1
                and not node.keywords
                and isinstance(node.args[0], ast.Name)
            ):
                events.append((node.lineno, node.col_offset, node.args[0].id, node.func.attr))
    groups: dict[tuple[str, int], list[str]] = {}
    assigned: dict[str, int] = {}
    for _, _, variable, what in sorted(events):
        if what == "=":
            assigned[variable] = assigned.get(variable, 0) + 1
            continue
        calls = groups.setdefault((variable, assigned.get(variable, 0)), [])
        if what not in calls:
            calls.append(what)
    return tuple(tuple(calls) for calls in groups.values() if len(calls) >= 2)
