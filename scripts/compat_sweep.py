"""Prove layerswap on every transformers release: the sweep behind docs/compatibility.md.

For each release (by default the newest patch of every 5.x minor the package index
serves, from ``--lowest`` up), a virtual environment that shares this one's packages
(torch included, ``--system-site-packages``) gets that transformers and what it requires;
in it, ``layerswap check --all --json`` runs the contract check of every family (the
static call check and the behaviour proof), then a focused test subset (swapped
generation, default verification, loading and saving). Results go to
``docs/compatibility.json`` (merged with earlier runs, by version) and the generated
``docs/compatibility.md``; the lowest release from which every later one passes is the
lower bound to declare in pyproject.toml. The exact packages of that release's
environment are written to ``constraints-lowest.txt``, which CI installs to check it.

    python scripts/compat_sweep.py                       # every minor from 5.0
    python scripts/compat_sweep.py --versions 5.4.0,5.24.0
    python scripts/compat_sweep.py --render               # docs from the JSON only

Takes one to three minutes per release on a laptop CPU; the environments are kept in
``--workdir`` for reuse.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "compatibility.json"
PAGE = ROOT / "docs" / "compatibility.md"
LOWEST_CONSTRAINTS = ROOT / "constraints-lowest.txt"
#: the focused subset each release runs: swapped generation, default verification,
#: loading and saving through use() (what the contract check cannot see)
TESTS = (
    "tests/test_contract.py::test_swapped_generation_equals_the_original",
    "tests/test_contract.py::test_default_verification_passes_and_reports_decoding_for_fused",
    "tests/test_contract.py::test_the_proof_inside_from_pretrained_builds_on_a_real_device",
    *(
        f"tests/test_pretrained.py::{test}[{family}]"
        for test in (
            "test_from_pretrained_inside_use_loads_an_original_checkpoint",
            "test_a_swapped_model_saves_the_original_layout",
        )
        for family in ("llama", "qwen3", "gemma2", "mixtral")
    ),
    "tests/test_pretrained.py::test_a_loaded_model_saves_the_original_layout_after_use_ends",
    "tests/test_pretrained.py::test_nested_use_of_one_substitution_converts_once",
)


def released(lowest: str) -> list[str]:
    """The newest patch of every minor release from ``lowest`` on, as the index lists them."""
    listing = subprocess.run(
        [sys.executable, "-m", "pip", "index", "versions", "transformers"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    line = next(row for row in listing.splitlines() if row.startswith("Available versions:"))
    versions = [Version(v.strip()) for v in line.split(":", 1)[1].split(",")]
    newest: dict[tuple[int, int], Version] = {}
    for version in versions:
        if version.is_prerelease or version < Version(lowest):
            continue
        key = (version.major, version.minor)
        newest[key] = max(newest.get(key, version), version)
    return [str(newest[key]) for key in sorted(newest)]


def _environment(workdir: Path, version: str) -> Path:
    venv = workdir / f"transformers-{version}"
    python = venv / "bin" / "python"
    if not python.exists():
        subprocess.run(
            [sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True
        )
        subprocess.run(
            [str(python), "-m", "pip", "install", "-q", f"transformers=={version}"], check=True
        )
    return python


def _local_packages(python: Path) -> list[str]:
    frozen = subprocess.run(
        [str(python), "-m", "pip", "freeze", "--local"], capture_output=True, text=True
    ).stdout
    return sorted(line for line in frozen.splitlines() if "==" in line)


def sweep_one(workdir: Path, version: str) -> dict[str, Any]:
    """Contract check and test subset of one release, in its own environment."""
    started = time.perf_counter()
    python = _environment(workdir, version)
    env = {
        **os.environ,
        "LAYERSWAP_CACHE": tempfile.mkdtemp(prefix=f"proofs-{version}-"),
        # releases below the declared lowest are proven too: that is how it is found
        "LAYERSWAP_SWEEP": "1",
    }
    checked = subprocess.run(
        [str(python), "-m", "layerswap", "check", "--all", "--json"],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
    )
    try:
        families = json.loads(checked.stdout)
    except ValueError:
        families = []
    tests = subprocess.run(
        [str(python), "-m", "pytest", "--full", "-q", "-p", "no:cacheprovider", "-x", *TESTS],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
    )
    summary = (tests.stdout.strip().splitlines() or [""])[-1]
    return {
        "version": version,
        "families": families,
        "check_error": None if families else (checked.stderr.strip().splitlines() or [""])[-1],
        "tests_passed": tests.returncode == 0,
        "tests": summary,
        "packages": _local_packages(python),
        "seconds": round(time.perf_counter() - started, 1),
    }


def verdict(result: dict[str, Any]) -> bool:
    """Whether a release passes: every family it ships proven, and the tests pass."""
    rows = result["families"]
    return bool(rows) and result["tests_passed"] and all(row["status"] != "failed" for row in rows)


def lowest_passing(results: dict[str, dict[str, Any]]) -> str | None:
    """The lowest release from which every minor release, down from the newest swept,
    was swept and passes (a minor not swept ends the range: it is not known to pass)."""
    lowest: str | None = None
    for version in sorted(results, key=Version, reverse=True):
        current = Version(version)
        if lowest is not None:
            above = Version(lowest)
            if (current.major, current.minor + 1) != (above.major, above.minor):
                break
        if not verdict(results[version]):
            break
        lowest = version
    return lowest


def render(results: dict[str, dict[str, Any]]) -> str:
    """docs/compatibility.md from the sweep's results."""
    lowest = lowest_passing(results)
    lines = [
        "# Compatibility with transformers releases",
        "",
        "<!-- generated by scripts/compat_sweep.py from docs/compatibility.json: do not edit -->",
        "",
        "Every release below was swept: in its own environment, `layerswap check --all` ran the",
        "contract check of every family (the static call check, then the behaviour proof:",
        "padded forward, decoding with dynamic and static caches, backward; fused backend, CPU,",
        "float32), then a focused test subset (swapped generation, default verification,",
        "loading and saving). A release newer than the last one swept is proven family by",
        "family at first use (the behaviour proof, stored per versions); a family that fails",
        "there is refused with the first check that differs, before the model is touched.",
        "",
        f"**Lowest supported release: {lowest or 'none passes'}** (pyproject.toml's lower bound).",
        "",
        "| transformers | verdict | proven | not in the release | original fails to build | failed (first difference) | tests |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for version in sorted(results, key=Version, reverse=True):
        result = results[version]
        rows = result["families"]
        proven = [r["family"] for r in rows if r["status"] == "proven"]
        absent = [r["family"] for r in rows if r["status"] == "absent"]
        broken = [
            f"{r['family']} ({_short(r['detail'], 70)})"
            for r in rows
            if r["status"] == "unbuildable"
        ]
        failed = [f"{r['family']} ({_short(r['detail'])})" for r in rows if r["status"] == "failed"]
        if not rows:
            failed = [f"the check did not run: {result['check_error']}"]
        mark = "pass" if verdict(result) else "**fail**"
        lines.append(
            f"| {version} | {mark} | {len(proven)} | {', '.join(absent) or '-'} | "
            f"{'; '.join(broken) or '-'} | {'; '.join(failed) or '-'} | {result['tests']} |"
        )
    lines += [
        "",
        "Re-run with `python scripts/compat_sweep.py` (all releases) or",
        "`--versions A,B` (some); `--render` regenerates this page from the JSON.",
        "",
    ]
    return "\n".join(lines)


def _short(detail: str, width: int = 110) -> str:
    detail = detail.replace("|", "/").replace("\n", " ")
    return detail if len(detail) <= width else detail[: width - 1] + "…"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lowest", default="5.0", help="the first release to sweep")
    parser.add_argument("--versions", help="comma-separated releases (default: every minor)")
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "sweep")
    parser.add_argument("--render", action="store_true", help="only regenerate the docs")
    args = parser.parse_args()
    results: dict[str, dict[str, Any]] = (
        json.loads(RESULTS.read_text(encoding="utf-8")) if RESULTS.exists() else {}
    )
    if not args.render:
        versions = args.versions.split(",") if args.versions else released(args.lowest)
        args.workdir.mkdir(parents=True, exist_ok=True)
        for version in versions:
            result = sweep_one(args.workdir, version)
            results[version] = result
            print(
                f"{version}: {'pass' if verdict(result) else 'FAIL'} ({result['seconds']} s; "
                f"tests: {result['tests']})",
                flush=True,
            )
            RESULTS.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
    PAGE.write_text(render(results), encoding="utf-8")
    lowest = lowest_passing(results)
    if lowest is not None:
        packages = results[lowest]["packages"]
        LOWEST_CONSTRAINTS.write_text(
            f"# the lowest supported transformers ({lowest}) and what it requires beyond\n"
            "# constraints.txt: CI checks it (generated by scripts/compat_sweep.py)\n"
            + "\n".join(packages)
            + "\n",
            encoding="utf-8",
        )
    print(f"lowest release from which all pass: {lowest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
