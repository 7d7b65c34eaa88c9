from __future__ import annotations

import itertools
import os
import sys
import tempfile
import textwrap
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

_counter = itertools.count()

# one thread per process: the suite's models are tiny, and xdist runs a worker per core;
# torch's default (a thread per core in every worker, and in every interpreter a test
# starts) oversubscribes the cores and makes the suite several times slower
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

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
