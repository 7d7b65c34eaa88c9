"""Write layerswap/families/_inferred.py: the inferred declaration of every verified model type.

Inference imports each modeling module and builds tiny layers (seconds in all), too slow
for every ``import layerswap``; so its result is written out as data and a test checks it
is what inference gives with the installed transformers
(``tests/test_families.py``). Run after changing ``VERIFIED`` or the inference, or when
that test says the declarations are stale::

    python scripts/gen_families.py
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TARGET = ROOT / "layerswap" / "families" / "_inferred.py"

HEADER = '''"""Model families inferred from transformers' modeling modules (generated: do not edit).

Written by ``python scripts/gen_families.py`` from
:func:`layerswap.families.infer.infer_family` for every model type in
:data:`~layerswap.families.infer.VERIFIED`; ``tests/test_families.py`` checks that it
matches inference with the installed transformers.
"""

from __future__ import annotations

from layerswap.family import Family

INFERRED = (
'''


def render() -> str:
    """The file's content: one ``Family(...)`` per verified model type, in order."""
    from layerswap.families.infer import VERIFIED, infer_family

    parts = [HEADER]
    for model_type in VERIFIED:
        family = infer_family(model_type, verify=False)
        fields = ",\n".join(
            f"        {field.name}={getattr(family, field.name)!r}"
            for field in dataclasses.fields(family)
        )
        parts.append(f"    Family(\n{fields},\n    ),\n")
    parts.append(")\n")
    return "".join(parts)


if __name__ == "__main__":
    TARGET.write_text(render())
    # the project's formatter, so the file passes `ruff format --check` as written
    subprocess.run([sys.executable, "-m", "ruff", "format", "-q", str(TARGET)], check=False)
    print(f"wrote {TARGET.relative_to(ROOT)}")
