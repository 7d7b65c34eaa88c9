"""Every example in examples/ runs as a user would run it (each asserts its own claims)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # each example in a fresh interpreter

EXAMPLES = sorted((Path(__file__).resolve().parent.parent / "examples").glob("*.py"))


def test_there_are_examples():
    assert {p.name for p in EXAMPLES} >= {"quickstart.py", "custom_substitution.py"}


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_runs(path: Path) -> None:
    result = subprocess.run(
        [sys.executable, str(path)], capture_output=True, text=True, timeout=300, check=False
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
