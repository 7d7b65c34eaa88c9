"""Write ``constraints.txt``: the exact version of everything ``layerswap[dev,integrations]``
installs.

CI and the README's test command install with ``-c constraints.txt``, so a new release of
torch, transformers, peft or anything else they pull in cannot change what the tests run
against without a commit here. Run it in an environment where the tests pass, after
``pip install -U``-ing what should move:

    python scripts/update_constraints.py            # rewrites constraints.txt
    python scripts/update_constraints.py --check    # exit 1 if it would change

Newer transformers releases are covered at run time by the behaviour proof, and the
release sweep (``scripts/compat_sweep.py``) proves the range; this file only pins CI.
"""

from __future__ import annotations

import argparse
import importlib.metadata as metadata
import sys
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent
TARGET = ROOT / "constraints.txt"
HEADER = """\
# Exact versions of everything `pip install -e ".[dev,integrations]"` installs, for CI and the README's
# test command (pip install -c constraints.txt ...). Regenerate with
# `python scripts/update_constraints.py` in an environment where the tests pass.
"""


def _closure(root: str, extras: tuple[str, ...]) -> dict[str, str]:
    """Installed name -> version for ``root[extras]`` and everything it requires."""
    found: dict[str, str] = {}
    pending: list[tuple[str, tuple[str, ...]]] = [(root, extras)]
    while pending:
        name, wanted = pending.pop()
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        key = canonicalize_name(dist.metadata["Name"])
        first_visit = key not in found
        found[key] = dist.version
        for line in dist.requires or []:
            requirement = Requirement(line)
            active = requirement.marker is None or any(
                requirement.marker.evaluate({**default_environment(), "extra": extra})
                for extra in ("", *wanted)
            )
            if active and (first_visit or requirement.extras):
                pending.append((requirement.name, tuple(requirement.extras)))
    found.pop(canonicalize_name(root), None)
    return found


def render() -> str:
    pins = _closure("layerswap", ("dev", "integrations"))
    # torch's local label (+cpu) is left out: `==2.13.0` matches the CPU build too
    lines = [f"{name}=={version.split('+')[0]}" for name, version in sorted(pins.items())]
    return HEADER + "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the file is stale")
    args = parser.parse_args()
    text = render()
    if args.check:
        current = TARGET.read_text(encoding="utf-8") if TARGET.exists() else ""
        if current != text:
            print(f"{TARGET.name} is stale: run python scripts/update_constraints.py")
            return 1
        return 0
    TARGET.write_text(text, encoding="utf-8")
    print(f"wrote {TARGET.name}: {text.count(chr(10)) - HEADER.count(chr(10))} pins")
    return 0


if __name__ == "__main__":
    sys.exit(main())
