"""What a causal LM's ``forward`` does with its logits, read from transformers' source:
the head slot's contract (:mod:`layerswap.backends.head`).

The statements of the original ``*ForCausalLM.forward`` from the projection onto the
vocabulary (``logits = self.lm_head(...)``, under whatever names it has) to its
``return`` are parsed: a soft-cap, a division or a multiplication of the logits is read
with the attribute holding its value, a router's loss added to the loss with its
coefficient; anything else is refused with :class:`~layerswap.errors.UpstreamDriftError`
naming the statement.

Example::

    head_contract(Gemma2ForCausalLM).steps    # (("softcap", "config.final_logit_softcapping"),)
"""

from __future__ import annotations

import ast
import inspect
import re
import textwrap
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from layerswap.errors import UpstreamDriftError
from layerswap.ops.linear_cross_entropy import LogitTransform
from layerswap.versions import transformers_version

__all__ = ["HeadContract", "head_contract", "read_path"]


_TRANSFORMS: tuple[tuple[re.Pattern[str], str], ...] = (
    (
        re.compile(
            r"if self\.(?P<path>[\w.]+) is not None:\n"
            r"    logits = logits / self\.(?P=path)\n"
            r"    logits = torch\.tanh\(logits\)\n"
            r"    logits = logits \* self\.(?P=path)"
        ),
        "softcap",
    ),
    (
        # the same, its value named first (Gemma 4's multimodal model: its text config's)
        re.compile(
            r"if \((?P<name>\w+) := self\.(?P<path>[\w.]+(?:\(\)\.[\w.]+)?)\) is not None:\n"
            r"    logits = logits / (?P=name)\n"
            r"    logits = torch\.tanh\(logits\)\n"
            r"    logits = logits \* (?P=name)"
        ),
        "softcap",
    ),
    (re.compile(r"logits = logits / self\.(?P<path>[\w.]+)"), "div"),
    (re.compile(r"logits = logits \* self\.(?P<path>[\w.]+)"), "mul"),
)
#: the name of the logits in the return (``lm_logits``: Falcon)
_RETURNED_LOGITS = re.compile(
    r"return \w+\(loss=loss, (?:aux_loss=aux_loss, )?logits=(?P<name>\w+), "
)
_LOSS_CALL = re.compile(
    r"if labels is not None:\n    loss = self\.loss_function\("
    r"(logits=logits, labels=labels, |logits, labels, )[^\n]*\*\*kwargs\)"
)
#: a mixture-of-experts causal LM's router loss, added to the loss after it
_AUX_LOSS = re.compile(
    r"if output_router_logits:\n    aux_loss = load_balancing_loss_func\(.*\)\n"
    r"    if labels is not None:\n"
    r"        loss \+= self\.(?P<coef>[\w.]+) \* aux_loss\.to\(loss\.device\)"
)
#: the tuple a forward called with ``return_dict=False`` returns (the head always calls it
#: with ``True``, and gives ``to_tuple()`` where the caller asked for a tuple)
_TUPLE_RETURN = re.compile(
    r"if not return_dict:\n    output = \(logits,\) \+ \w+\[1:\]\n"
    r"    return \(loss,\) \+ output if loss is not None else output"
)


def read_path(model: nn.Module, path: str) -> Any:
    """``model.<path>``, a call on the way where a part ends ``()``
    (``"config.get_text_config().final_logit_softcapping"``)."""
    value: Any = model
    for part in path.split("."):
        value = getattr(value, part.removesuffix("()"))
        if part.endswith("()"):
            value = value()
    return value


@dataclass(frozen=True)
class HeadContract:
    """What the original ``forward`` does to the logits: ``(kind, "config.attr")`` steps;
    ``aux_coef``: the attribute scaling the router loss it adds to the loss, if it does;
    ``head``: the ``nn.Linear`` projecting onto the vocabulary (``lm_head``; GPT-NeoX
    Japanese's ``embed_out``, RWKV's ``head``, BioGPT's ``output_projection``)."""

    steps: tuple[tuple[str, str], ...] = ()
    aux_coef: str | None = None
    head: str = "lm_head"

    def transforms(self, model: nn.Module) -> tuple[LogitTransform, ...]:
        """The steps with their values read from ``model`` (an unset soft-cap is skipped)."""
        found = []
        for kind, path in self.steps:
            value = read_path(model, path)
            if value is None and kind == "softcap":
                continue
            if isinstance(value, torch.Tensor):
                value = value.item()
            found.append(LogitTransform(kind, float(value)))  # type: ignore[arg-type]
        return tuple(found)


def head_contract(causal_lm: type) -> HeadContract:
    """Read what ``causal_lm.forward`` does after ``self.lm_head(...)``.

    Raises :class:`UpstreamDriftError` naming the statement layerswap does not know, or
    saying that the source cannot be read.
    """
    version = transformers_version()
    where = f"{causal_lm.__name__}.forward in transformers {version}"
    try:
        source = textwrap.dedent(inspect.getsource(causal_lm.forward))  # type: ignore[attr-defined]
    except (OSError, TypeError) as exc:
        raise UpstreamDriftError(f"{where}: its source cannot be read ({exc})") from exc
    function = ast.parse(source).body[0]
    if not isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef):
        raise UpstreamDriftError(f"{where}: not a plain function")
    statements = [ast.unparse(statement) for statement in function.body]
    returned = _RETURNED_LOGITS.match(statements[-1]) if statements else None
    name = "logits" if returned is None else returned["name"]
    if name != "logits":  # read under the one name the patterns know
        if any(isinstance(node, ast.Name) and node.id == "logits" for node in ast.walk(function)):
            raise UpstreamDriftError(
                f"{where} returns {name} as its logits and names another value logits; "
                "the head substitution cannot tell which one its loss reads"
            )
        statements = [re.sub(rf"\b{name}\b", "logits", text) for text in statements]
    projection = [(i, found) for i, text in enumerate(statements) if (found := _projection(text))]
    if len(projection) != 1:
        raise UpstreamDriftError(
            f"{where} does not compute its logits in one `{name} = self.<head>(...)` "
            "statement; the head substitution needs that structure"
        )
    rest = statements[projection[0][0] + 1 :]
    head, scale = projection[0][1]  # Falcon-H1: `self.lm_head(h) * self.model.multiplier`
    steps: list[tuple[str, str]] = [] if scale is None else [("mul", scale)]
    while rest and rest[0] != "loss = None":
        for pattern, kind in _TRANSFORMS:
            match = pattern.fullmatch(rest[0])
            if match:
                steps.append((kind, match["path"]))
                break
        else:
            raise UpstreamDriftError(
                f"{where} transforms its logits in a way the head substitution does not "
                f"reproduce: `{_first_line(rest[0])}`"
            )
        rest = rest[1:]
    expected = ("loss = None", "the loss statement", "the return")
    # between the loss and the return: a router loss added to it, a tuple for return_dict
    middle, aux = rest[2:-1], None
    if middle[:1] == ["aux_loss = None"] and len(middle) > 1:
        added = _AUX_LOSS.fullmatch(middle[1])
        if added:
            middle, aux = middle[2:], added["coef"]
    if middle and _TUPLE_RETURN.fullmatch(middle[0]):
        middle = middle[1:]
    if (
        len(rest) < 3
        or rest[0] != "loss = None"
        or not _LOSS_CALL.fullmatch(rest[1])
        or not re.fullmatch(
            r"return \w+\(loss=loss, (aux_loss=aux_loss, )?logits=logits, .*\)", rest[-1]
        )
        or middle
    ):
        extra = next(
            (text for text in [*rest[1:2], *middle] if not _LOSS_CALL.fullmatch(text)),
            rest[-1] if rest else "",
        )
        raise UpstreamDriftError(
            f"{where} does more with the loss than the head substitution reproduces "
            f"(expected {', '.join(expected)}; found `{_first_line(extra)}`)"
        )
    return HeadContract(tuple(steps), aux, head)


#: what may follow the projection's call in its statement: ``.float()`` (Mamba, Mllama),
#: ``.contiguous()`` (OPT)
_HARMLESS_TAILS = frozenset({"float", "contiguous"})


def _projection(text: str) -> tuple[str, str | None] | None:
    """``(head, scale)`` of a statement ``logits = self.<head>(...)``, maybe times
    ``self.<scale>`` (Falcon-H1); ``None`` for any other statement (a projection whose
    result is reshaped or sliced in the same statement included)."""
    statement = ast.parse(text).body[0]
    if not (
        isinstance(statement, ast.Assign)
        and len(statement.targets) == 1
        and isinstance(statement.targets[0], ast.Name)
        and statement.targets[0].id == "logits"
    ):
        return None
    value, scale = statement.value, None
    if isinstance(value, ast.BinOp) and isinstance(value.op, ast.Mult):
        path = ast.unparse(value.right)
        if not re.fullmatch(r"self\.[\w.]+", path):
            return None
        value, scale = value.left, path.removeprefix("self.")
    # a cast the fused loss makes anyway (it computes in float32), or a copy into one block
    while (
        isinstance(value, ast.Call)
        and not value.args
        and not value.keywords
        and isinstance(value.func, ast.Attribute)
        and value.func.attr in _HARMLESS_TAILS
    ):
        value = value.func.value
    if not (
        isinstance(value, ast.Call)
        and isinstance(value.func, ast.Attribute)
        and isinstance(value.func.value, ast.Name)
        and value.func.value.id == "self"
    ):
        return None
    if any(isinstance(node, ast.Name) and node.id == "logits" for node in ast.walk(value)):
        return None  # a step on the logits (a soft-cap module), not the projection
    return value.func.attr, scale


def _first_line(text: str) -> str:
    line = text.splitlines()[0] if text else ""
    return line if len(line) < 100 else line[:97] + "..."
