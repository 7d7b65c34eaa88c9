"""The docs stay true to the code: the API reference is current, links resolve, and every
```python block runs (blocks that cannot run here are marked ```python fragment)."""

from __future__ import annotations

import json
import os
import re
import runpy
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # runs every page's code and commands

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


# --- python blocks: runnable (```python) or fragments (```python fragment) ---------------

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RUNNABLE, FRAGMENT = "python", "python fragment"
FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})(?P<info>.*)$")


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # of the first line of code (the line after the opening fence)
    info: str
    source: str

    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def code_blocks(page: Path) -> list[Block]:
    """The fenced code blocks of a markdown page, dedented by their fence's indent."""
    blocks: list[Block] = []
    lines = page.read_text().splitlines()
    i = 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        i += 1
        if opening is None:
            continue
        fence, indent = opening["fence"], len(opening["indent"])
        start, body = i, []
        closing = re.compile(rf"^[ \t]*{re.escape(fence[0])}{{{len(fence)},}}[ \t]*$")
        while i < len(lines) and not closing.match(lines[i]):
            body.append(lines[i][indent:] if lines[i][:indent].strip() == "" else lines[i])
            i += 1
        i += 1  # the closing fence
        blocks.append(Block(page, start + 1, opening["info"].strip(), "\n".join(body) + "\n"))
    return blocks


def is_python(info: str) -> bool:
    word = info.split(maxsplit=1)[0].lower() if info else ""
    return word in {"py", "py3", "pycon", "ipython"} or word.startswith("python")


def runnable_blocks(page: Path) -> list[Block]:
    return [block for block in code_blocks(page) if block.info == RUNNABLE]


# pages without a runnable block have nothing to run (the API reference: signatures only)
RUNNABLE_PAGES = [page for page in PAGES if runnable_blocks(page)]


def test_python_blocks_are_runnable_or_marked_as_fragments():
    """```python runs (test_python_blocks_run); ```python fragment is shown, not run."""
    odd = [
        f"{block.where()}: ```{block.info}"
        for page in PAGES
        for block in code_blocks(page)
        if is_python(block.info) and block.info not in (RUNNABLE, FRAGMENT)
    ]
    assert not odd, f"python blocks open with ```{RUNNABLE} or ```{FRAGMENT} only: {odd}"
    assert ROOT / "README.md" in RUNNABLE_PAGES, "the README's example is run, and found"


# Runs the blocks given as JSON in one namespace, in order, like a notebook. Each block is
# compiled under its page's path with its own line numbers, so a traceback points at the
# page's line; a failure names the block and shows it.
RUNNER = """
import json, sys, traceback
namespace = {"__name__": "__main__"}
for block in json.load(open(sys.argv[1])):
    code = "\\n" * (block["line"] - 1) + block["source"]
    try:
        exec(compile(code, block["path"], "exec"), namespace)
    except BaseException:
        sys.stdout.flush()
        traceback.print_exc()
        print(f"\\nthe python block at {block['where']} failed:\\n\\n{block['source']}",
              file=sys.stderr)
        sys.exit(1)
"""


@pytest.mark.parametrize(
    "page", RUNNABLE_PAGES, ids=[str(page.relative_to(ROOT)) for page in RUNNABLE_PAGES]
)
def test_python_blocks_run(page: Path, tmp_path: Path) -> None:
    """A page's ```python blocks run in order in one namespace, in a fresh interpreter
    whose working directory is a temporary one (files they write land there)."""
    blocks = [
        {"path": str(b.page), "line": b.line, "where": b.where(), "source": b.source}
        for b in runnable_blocks(page)
    ]
    (tmp_path / "blocks.json").write_text(json.dumps(blocks))
    env = {
        **os.environ,
        # nothing is downloaded: a block that tries fails here
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        # tiny models gain nothing from intra-op threads, and on a machine busy with the
        # other test workers spinning OpenMP threads make them ten times slower
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
    }
    result = subprocess.run(
        [sys.executable, "-c", RUNNER, "blocks.json"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]


# --- command-line output: generated by scripts/gen_cli_docs.py ---------------------------


def _environment_differs() -> str | None:
    """Why this machine prints other ``list``/``doctor`` output than the docs show."""
    import importlib.util

    import torch

    if torch.cuda.is_available():
        return "CUDA is available here: list and doctor show usable GPU backends"
    for module in ("transformer_engine", "liger_kernel"):
        if importlib.util.find_spec(module) is not None:
            return f"{module} is installed here"
    return None


@pytest.mark.slow
@pytest.mark.xdist_group("coverage")  # list --all: after test_families' run, from its store
def test_command_line_output_in_docs_is_what_the_commands_print():
    """Every ``<!-- cli: ... -->`` block of docs/cli.md and README.md is a fresh run;
    ``cli volatile`` blocks (timings, versions) up to their numbers."""
    differs = _environment_differs()
    if differs is not None:
        pytest.skip(f"the docs show a CPU machine without TE or Liger; {differs}")
    generator = runpy.run_path(str(ROOT / "scripts" / "gen_cli_docs.py"))
    stale = generator["stale"](generator["render"]())
    assert not stale, f"stale command-line output: run python scripts/gen_cli_docs.py: {stale}"
