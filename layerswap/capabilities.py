"""What a backend's layer expresses, as data: one row per family field it reads, checked once.

A backend's layer computes some of a :class:`~layerswap.family.Family`'s features one way
only: Liger's RoPE kernel rotates halves of each head, TransformerEngine fuses one norm
before attention and one before the MLP. It declares that as a table of
:class:`Capability` rows (the field, the values it expresses or refuses, and why not), and
:func:`refusal` walks any table against any family: the first row the family does not
meet gives the reason, written from the family's own values. Imports neither torch nor
transformers.

Example::

    TABLE = (
        Capability("parallel", expresses=(False,),
                   reason="my layer runs attention, then the MLP (this family runs them in parallel)"),
        Capability("rotary", expresses=("half",),
                   reason="my layer rotates halves of each head (this family's rotary layout is {rotary})"),
    )
    refusal(TABLE, layerswap.get_family("cohere"))
    # "my layer runs attention, then the MLP (this family runs them in parallel)"
"""

from __future__ import annotations

import dataclasses
import string
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from layerswap.decoder_shape import FLAT, GROUPS
from layerswap.family import Family

__all__ = ["DESCRIPTIONS", "FIELDS", "Capability", "refusal"]

_NORM_KINDS = {
    "rms": "an RMSNorm",
    "layer": "a LayerNorm",
    "layer_nobias": "a LayerNorm without a bias",
}

#: what a reason may name besides a family's fields: its values described in words
DESCRIPTIONS: dict[str, Callable[[Family], str]] = {
    # "attn_out, mlp_out"
    "norm_places": lambda family: ", ".join(place for place, _ in family.normalization.places),
    # "query_layernorm/key_layernorm, after it"
    "qk_norms": lambda family: (
        "/".join(family.attention.qk_norm_modules)
        + (", after it" if family.attention.qk_norm_after_rotary else "")
    ),
    # "a LayerNorm without a bias"
    "norm_kind": lambda family: _NORM_KINDS.get(
        family.normalization.kind, family.normalization.kind
    ),
    # "q_proj, k_proj, v_proj, gate_proj, up_proj, down_proj"
    "projections": lambda family: ", ".join(
        (*family.attention.qkv_modules, *family.feed_forward.modules)
    ),
}

#: what a row may name: a Family field (a group: ``rope``), a feature by its flat name
#: (``rotary``) or by its place in a group (``rope.layout``)
FIELDS = frozenset(
    (
        *(field.name for field in dataclasses.fields(Family)),
        *FLAT,
        *(
            f"{group}.{field.name}"
            for group, cls in GROUPS.items()
            for field in dataclasses.fields(cls)
        ),
    )
)


def _value(family: Family, name: str) -> Any:
    """``family``'s value of the field or feature ``name`` (see :data:`FIELDS`)."""
    if name in FLAT:
        name = ".".join(FLAT[name])
    value: Any = family
    for part in name.split("."):
        value = getattr(value, part)
    return value


@dataclass(frozen=True)
class Capability:
    """One row of what a backend's layer expresses: the family's ``field`` and the values
    the layer computes, given one way of three:

    - ``expresses``: the only values it computes (``rotary`` ``("half",)``);
    - ``refuses``: the values it does not compute, every other it does (``qk_norm``
      ``("head_weights",)``);
    - ``test``: whether it computes a value (``lambda names: len(names) in (1, 3)``).

    ``reason`` is why not, a :meth:`str.format` template of the family's fields and
    :data:`DESCRIPTIONS`: ``"this family's rotary layout is {rotary}"``. A field or a name
    in the reason that a family does not have is an error here, when the table is written.
    """

    #: a :class:`Family` field, a feature's flat name (``"rotary"``, as declared) or its
    #: place in a group (``"rope.layout"``)
    field: str
    reason: str
    expresses: tuple[Any, ...] | None = None
    refuses: tuple[Any, ...] | None = None
    test: Callable[[Any], bool] | None = None

    def __post_init__(self) -> None:
        if self.field not in FIELDS:
            raise ValueError(f"Family has no field {self.field!r} (its fields: {sorted(FIELDS)})")
        given = [self.expresses is not None, self.refuses is not None, self.test is not None]
        if sum(given) != 1:
            raise ValueError(
                f"Capability({self.field!r}) takes one of expresses=, refuses= or test= "
                f"(given: {sum(given)})"
            )
        unknown = sorted(set(_named(self.reason)) - FIELDS - set(DESCRIPTIONS))
        if unknown:
            raise ValueError(
                f"Capability({self.field!r})'s reason names {', '.join(unknown)}, neither a "
                f"Family field nor one of {sorted(DESCRIPTIONS)}"
            )

    def met(self, family: Family) -> bool:
        """Whether the layer computes ``family``'s value of :attr:`field`."""
        value = _value(family, self.field)
        if self.expresses is not None:
            return value in self.expresses
        if self.refuses is not None:
            return value not in self.refuses
        return self.test is None or bool(self.test(value))

    def why_not(self, family: Family) -> str:
        """:attr:`reason`, written with ``family``'s values."""
        return self.reason.format_map(_Facts(family))


def refusal(table: Sequence[Capability], family: Family) -> str | None:
    """The reason of the first row of ``table`` that ``family`` does not meet, or ``None``
    when the backend's layer expresses every one.

    Example::

        refusal(liger.declaration.EXPRESSES, layerswap.get_family("cohere"))
        # "the liger layer uses Liger's RMSNorm kernel (this family's norm is a LayerNorm)"
    """
    for row in table:
        if not row.met(family):
            return row.why_not(family)
    return None


def _named(template: str) -> Iterator[str]:
    """The names a format template reads (``{normalization.switch[0]}`` reads
    ``normalization.switch``)."""
    for _, name, _, _ in string.Formatter().parse(template):
        if name:
            yield name.split("[", 1)[0]


class _Facts(Mapping[str, Any]):
    """A family's fields and :data:`DESCRIPTIONS`, as a reason template reads them."""

    def __init__(self, family: Family) -> None:
        self._family = family

    def __getitem__(self, name: str) -> Any:
        if name in DESCRIPTIONS:
            return DESCRIPTIONS[name](self._family)
        if name in FIELDS:
            return _value(self._family, name)
        raise KeyError(name)

    def __iter__(self) -> Iterator[str]:
        return iter((*FIELDS, *DESCRIPTIONS))

    def __len__(self) -> int:
        return len(FIELDS) + len(DESCRIPTIONS)
