"""What a backend's layer expresses, as data (layerswap.capabilities): one checker for every
backend's table, and the reasons it writes."""

from __future__ import annotations

import dataclasses
import importlib

import pytest

import layerswap
from layerswap.backends import builtin_modules
from layerswap.capabilities import FIELDS, Capability, refusal

TABLE = (
    Capability(
        "parallel",
        expresses=(False,),
        reason="my layer runs attention, then the MLP (this family runs them in parallel)",
    ),
    Capability(
        "rotary",
        expresses=("half",),
        reason="my layer rotates halves (this family's rotary layout is {rotary!r})",
    ),
    Capability("qk_norm", refuses=("across",), reason="my q/k norms are per head ({name})"),
    Capability(
        "qkv_modules",
        test=lambda names: len(names) == 3,
        reason="my layer keeps three projections (this family: {qkv_modules})",
    ),
    Capability("norms", test=lambda norms: len(norms) == 2, reason="norms at {norm_places}"),
)


def _llama(**features: object) -> layerswap.Family:
    llama = layerswap.get_family("llama")
    return dataclasses.replace(llama, name="llama_variant", **features)  # type: ignore[arg-type]


def test_a_family_that_meets_every_row_is_expressed() -> None:
    assert refusal(TABLE, _llama()) is None
    assert refusal((), _llama(parallel=True)) is None


@pytest.mark.parametrize(
    ("features", "reason"),
    [
        (
            {"parallel": True},
            "my layer runs attention, then the MLP (this family runs them in parallel)",
        ),
        (
            {"rotary": "interleaved"},
            "my layer rotates halves (this family's rotary layout is 'interleaved')",
        ),
        ({"qk_norm": "across"}, "my q/k norms are per head (llama_variant)"),
        (
            {"qkv_modules": ("qkv_proj",)},
            "my layer keeps three projections (this family: ('qkv_proj',))",
        ),
        (
            {"norms": (("attn_in", "input_layernorm"), ("attn_out", "a"), ("mlp_in", "b"))},
            "norms at attn_in, attn_out, mlp_in",
        ),
    ],
    ids=["expresses", "expresses-repr", "refuses", "test", "description"],
)
def test_the_first_row_a_family_does_not_meet_gives_the_reason_in_its_values(
    features: dict[str, object], reason: str
) -> None:
    assert refusal(TABLE, _llama(**features)) == reason


def test_rows_are_checked_in_order() -> None:
    assert refusal(TABLE, _llama(rotary="interleaved", parallel=True)) == refusal(
        TABLE, _llama(parallel=True)
    )
    assert refusal(TABLE, _llama(qk_norm=True)) is None  # a value not refused is expressed


@pytest.mark.parametrize(
    ("row", "message"),
    [
        (dict(field="paralel", expresses=(False,), reason="r"), "Family has no field 'paralel'"),
        (dict(field="rotary", expresses=("half",), reason="{rotery}"), "reason names rotery"),
        (dict(field="rotary", reason="r"), "takes one of expresses=, refuses= or test="),
        (dict(field="rotary", expresses=("half",), refuses=("x",), reason="r"), "(given: 2)"),
    ],
    ids=["field", "reason", "none", "two"],
)
def test_a_row_naming_what_a_family_has_not_is_refused_when_written(
    row: dict[str, object], message: str
) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        Capability(**row)  # type: ignore[arg-type]


def _builtin_tables() -> dict[str, tuple[Capability, ...]]:
    tables = {}
    for name in builtin_modules():
        module = importlib.import_module(name)
        for attribute, value in vars(module).items():
            if isinstance(value, Capability):
                value = (value,)
            if isinstance(value, tuple) and value and isinstance(value[0], Capability):
                tables[f"{module.BACKEND.name}.{attribute}"] = value
    return tables


def test_every_builtin_table_names_family_fields_and_expresses_llama() -> None:
    tables = _builtin_tables()
    assert {"liger.EXPRESSES", "te.EXPRESSES"} <= set(tables), sorted(tables)
    llama = layerswap.get_family("llama")
    for name, table in tables.items():
        for row in table:
            assert row.field in FIELDS, (name, row)
            # liger and te both build Llama: a row Llama fails would refuse every family
            assert row.met(llama), (name, row)
