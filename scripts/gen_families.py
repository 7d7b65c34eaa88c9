"""Write layerswap/families/_inferred.py: the inferred declaration of every verified model type.

Inference imports each modeling module and builds tiny layers (seconds in all), too slow
for every ``import layerswap``; so its result is written out as data, each declaration
with the fields that differ from :class:`~layerswap.family.Family`'s defaults (the tiny
config's beyond what every inferred family shares), and a test
checks it is what inference gives with the installed transformers
(``tests/test_families.py``). The file is the one list of the builtin inferred families
(:data:`~layerswap.families.infer.VERIFIED` reads it). Run after changing the inference,
when that test says the declarations are stale, or to add or drop a model type::

    python scripts/gen_families.py
    python scripts/gen_families.py --add dots1 --drop olmo
"""

from __future__ import annotations

import argparse
import dataclasses
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from layerswap.family import Family

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TARGET = ROOT / "layerswap" / "families" / "_inferred.py"

HEADER = '''"""Model families inferred from transformers' modeling modules (generated: do not edit).

Written by ``python scripts/gen_families.py`` from
:func:`layerswap.inference.infer_family`, the fields that differ from ``Family``'s
defaults (and the tiny config's beyond the one every inferred family shares:
``families._tiny.inferred``); the one list of the builtin inferred families
(``--add TYPE`` adds one).
``tests/test_families.py`` checks that it matches inference with the installed
transformers.
"""

from __future__ import annotations

from layerswap.families._tiny import inferred

INFERRED = (
'''


def _default(field: dataclasses.Field[Any]) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return dataclasses.MISSING


def _written(family: Family) -> dict[str, Any]:
    """The fields ``inferred(...)`` is given for ``family``: those that differ from
    ``Family``'s defaults, the tiny config's beyond ``INFERRED_TINY``; not the description
    it derives."""
    from layerswap.decoder_shape import FLAT, GROUPS
    from layerswap.families._tiny import INFERRED_TINY

    missing = sorted(set(INFERRED_TINY) - set(family.tiny))
    if missing:  # inferred() cannot say a field is absent
        raise SystemExit(f"{family.name}: a tiny config without {missing}: change INFERRED_TINY")
    fields: dict[str, Any] = {}
    for field in dataclasses.fields(family):
        value = getattr(family, field.name)
        if field.name == "tiny":
            value = {k: v for k, v in value.items() if INFERRED_TINY.get(k, _ABSENT) != v}
            if value:
                fields["tiny"] = value
        elif field.name == "description":
            if value != f"inferred from {family.module}":
                raise SystemExit(f"{family.name}: a description inferred() does not derive")
        elif field.name in GROUPS:
            # every group's features written flat at the first group, as declarations give
            # them, in FLAT's order
            if field.name == next(iter(GROUPS)):
                for flat, (group, attr) in FLAT.items():
                    held = getattr(getattr(family, group), attr)
                    if held != getattr(GROUPS[group](), attr):
                        fields[flat] = held
        elif value != _default(field):
            fields[field.name] = value
    return fields


_ABSENT = object()


def render(model_types: list[str]) -> str:
    """The file's content: one ``inferred(...)`` per model type, sorted, with the fields
    that differ from the defaults (:func:`_written`)."""
    from layerswap.inference import infer_family

    parts = [HEADER]
    for model_type in sorted(set(model_types)):
        written = _written(infer_family(model_type, verify=False))
        fields = ",\n".join(f"        {name}={value!r}" for name, value in written.items())
        parts.append(f"    inferred(\n{fields},\n    ),\n")
    parts.append(")\n")
    return "".join(parts)


if __name__ == "__main__":
    from layerswap.families.infer import VERIFIED

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--add", nargs="*", default=[], metavar="TYPE", help="model types to add")
    parser.add_argument("--drop", nargs="*", default=[], metavar="TYPE", help="model types to drop")
    args = parser.parse_args()
    TARGET.write_text(render([t for t in [*VERIFIED, *args.add] if t not in args.drop]))
    # the project's formatter, so the file passes `ruff format --check` as written
    subprocess.run([sys.executable, "-m", "ruff", "format", "-q", str(TARGET)], check=False)
    print(f"wrote {TARGET.relative_to(ROOT)}")
