"""Write layerswap/families/_inferred.py: the inferred declaration of every verified model type.

Inference imports each modeling module and builds tiny layers (seconds in all), too slow
for every ``import layerswap``; so its result is written out as data, each declaration
with the fields that differ from :class:`~layerswap.family.Family`'s defaults, and a test
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
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TARGET = ROOT / "layerswap" / "families" / "_inferred.py"

HEADER = '''"""Model families inferred from transformers' modeling modules (generated: do not edit).

Written by ``python scripts/gen_families.py`` from
:func:`layerswap.inference.infer_family`, the fields that differ from ``Family``'s
defaults; the one list of the builtin inferred families (``--add TYPE`` adds one).
``tests/test_families.py`` checks that it matches inference with the installed
transformers.
"""

from __future__ import annotations

from layerswap.family import Family

INFERRED = (
'''


def _default(field: dataclasses.Field[Any]) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return dataclasses.MISSING


def render(model_types: list[str]) -> str:
    """The file's content: one ``Family(...)`` per model type, sorted, with the fields that
    differ from the defaults."""
    from layerswap.inference import infer_family

    parts = [HEADER]
    for model_type in sorted(set(model_types)):
        family = infer_family(model_type, verify=False)
        fields = ",\n".join(
            f"        {field.name}={getattr(family, field.name)!r}"
            for field in dataclasses.fields(family)
            if getattr(family, field.name) != _default(field)
        )
        parts.append(f"    Family(\n{fields},\n    ),\n")
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
