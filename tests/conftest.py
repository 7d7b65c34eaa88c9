from __future__ import annotations

import gc
import itertools
import os
import sys
import tempfile
import textwrap
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

_counter = itertools.count()

# one thread per process: the suite's models are tiny, and xdist runs a worker per core;
# torch's default (a thread per core in every worker, and in every interpreter a test
# starts) oversubscribes the cores and makes the suite several times slower
# (torch reads these when imported; the xdist controller, which runs no test, never
# imports it)
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
if "torch" in sys.modules:  # imported before this file: told directly
    sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

# behaviour proofs (layerswap.proof) are stored per test run, shared by its xdist workers,
# never in the user's cache directory
_RUN = os.environ.get("PYTEST_XDIST_TESTRUNUID") or uuid.uuid4().hex
os.environ["LAYERSWAP_CACHE"] = str(Path(tempfile.gettempdir()) / f"layerswap-proofs-{_RUN}")


@pytest.fixture
def make_module(tmp_path: Path) -> Iterator[Callable[[str, str], str]]:
    """Write a uniquely named module into tmp_path; return its import name.

    The module is not imported: tests decide when (lazy resolution, lazy hooks).
    """
    sys.path.insert(0, str(tmp_path))
    created: list[str] = []

    def make(stem: str, source: str) -> str:
        name = f"ls_{stem}_{next(_counter)}"
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
        created.append(name)
        return name

    yield make
    sys.path.remove(str(tmp_path))
    for name in created:
        sys.modules.pop(name, None)


# --- the fast lane ---------------------------------------------------------------------------
# `pytest` runs the unit tests and the per-family tests on the representative families
# (tests/models.py: REPRESENTATIVES, every structural choice covered); `pytest --full`
# (what .ci/run runs) adds the tests marked `slow` and the family matrix (`matrix`).

_SKIPPED_LANES = ("slow", "matrix")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--full",
        action="store_true",
        help="run the whole suite: the tests marked slow and every family (what CI runs)",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    from models import FAMILIES, REPRESENTATIVES

    others = set(FAMILIES) - set(REPRESENTATIVES)
    for item in items:
        callspec = getattr(item, "callspec", None)
        # the fast lane runs a test marked one_family (the plumbing every family shares)
        # on llama alone, any other per-family test on the representatives
        beyond = set(FAMILIES) - {"llama"} if item.get_closest_marker("one_family") else others
        # a family's name, or a substitution of it ("solar_open.head.fused")
        if callspec is not None and any(
            isinstance(value, str) and value.split(".")[0] in beyond
            for value in callspec.params.values()
        ):
            item.add_marker(pytest.mark.matrix)
    if config.getoption("--full") or config.getoption("-m"):
        return  # everything, or what the -m expression chose
    kept, dropped = [], []
    for item in items:
        lane = any(item.get_closest_marker(name) for name in _SKIPPED_LANES)
        (dropped if lane else kept).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


def pytest_collection_finish(session: pytest.Session) -> None:
    # what collection left alive (torch, transformers, their modules) stays alive: kept out
    # of every later garbage collection, each of which then takes a few milliseconds, not
    # a quarter second (the tests that collect to check a finalizer, and pytest's own
    # collections at the end of the session)
    gc.collect()
    gc.freeze()


def pytest_report_header(config: pytest.Config) -> str | None:
    if config.getoption("--full") or config.getoption("-m"):
        return None
    return (
        "fast lane: tests marked slow and the family matrix are deselected "
        "(pytest --full runs the whole suite, as CI does)"
    )
