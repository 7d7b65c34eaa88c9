"""Write docs/api.md from the public API's signatures and docstrings.

Run: ``python scripts/gen_api_docs.py`` (the test suite checks the file is current).
"""

from __future__ import annotations

import inspect
import re
import sys
from pathlib import Path

# this checkout's package, whatever copy of layerswap is installed
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import layerswap

OUT = Path(__file__).resolve().parent.parent / "docs" / "api.md"

HEADER = """# API reference

Generated from the code by `python scripts/gen_api_docs.py`; every name below is
importable from `layerswap`. The guides in [index.md](index.md) explain how the
pieces fit together.
"""


def summary(obj: object) -> str:
    doc = inspect.getdoc(obj) or ""
    paragraph = doc.split("\n\n", 1)[0]
    return " ".join(line.strip() for line in paragraph.splitlines())


def signature(name: str, obj: object) -> str:
    try:
        text = f"{name}{inspect.signature(obj)}"  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return name
    # default values that are functions print with their address: keep the name only
    return re.sub(r"<function (\S+) at 0x[0-9a-f]+>", r"\1", text)


def render() -> str:
    # signatures are shown, not run: "```python fragment" (tests/test_docs.py runs the
    # blocks opened with a bare "```python")
    parts = [HEADER]
    for name in sorted(n for n in layerswap.__all__ if not n.startswith("_") and n != "errors"):
        obj = getattr(layerswap, name)
        if not callable(obj):  # a constant: its value, sorted when it is a set
            value = sorted(obj) if isinstance(obj, (set, frozenset)) else obj
            module = layerswap._EXPORTS[name]
            parts.append(f"\n## `{name}`\n\nconstant in `{module}`\n")
            parts.append(f"```python fragment\n{name} = {value!r}\n```\n")
            continue
        kind = "class" if inspect.isclass(obj) else "function"
        parts.append(f"\n## `{name}`\n\n{kind} in `{obj.__module__}`\n")
        parts.append(f"```python fragment\n{signature(name, obj)}\n```\n")
        text = summary(obj)
        if text:
            parts.append(f"\n{text}\n")
    parts.append("\n## `errors`\n\nThe exception and warning types, in `layerswap.errors`:\n\n")
    from layerswap import errors

    for name in errors.__all__:
        error = getattr(errors, name)
        bases = ", ".join(b.__name__ for b in error.__bases__)
        parts.append(f"- `{name}({bases})`: {summary(error)}\n")
    return "".join(parts)


def main() -> int:
    OUT.write_text(render())
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
