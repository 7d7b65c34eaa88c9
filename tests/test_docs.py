"""The docs stay true to the code: the API reference is current and links resolve."""

from __future__ import annotations

import re
import runpy
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_api_reference_is_generated_from_the_current_code():
    generator = runpy.run_path(str(ROOT / "scripts" / "gen_api_docs.py"))
    expected = generator["render"]()
    assert (ROOT / "docs" / "api.md").read_text() == expected, (
        "docs/api.md is stale: run python scripts/gen_api_docs.py"
    )


def test_relative_links_in_docs_point_at_existing_files():
    broken = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" in target:
                continue
            if not (page.parent / target).exists():
                broken.append(f"{page.relative_to(ROOT)} -> {target}")
    assert not broken, broken


def test_family_tables_are_generated_from_the_registry():
    generator = runpy.run_path(str(ROOT / "scripts" / "gen_family_table.py"))
    for path, expected in generator["render"]().items():
        assert path.read_text() == expected, (
            f"{path.name}'s family table is stale: run python scripts/gen_family_table.py"
        )
