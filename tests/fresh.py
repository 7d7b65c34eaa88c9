"""Running Python code in a fresh interpreter, as the tests of what a new process does.

Example::

    from fresh import run_json

    found = run_json("import json, sys; print(json.dumps('torch' in sys.modules))", tmp_path)

    # another transformers first on the path (tests/edited_transformers.py)
    found = run_json("import json, transformers; print(json.dumps(transformers.__file__))",
                     tmp_path, path=[edited_transformers(tmp_path, edits)])
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def run_json(code: str, cache: Path, *, path: Sequence[Path] = ()) -> Any:
    """``code`` (dedented) in a fresh interpreter whose verdicts and answers are kept under
    ``cache``, with ``path`` first on ``PYTHONPATH``: the JSON its last line of output holds.
    A failure raises with the interpreter's stderr."""
    python_path = [*map(str, path), os.environ.get("PYTHONPATH", "")]
    env = {
        **os.environ,
        "LAYERSWAP_CACHE": str(cache),
        "PYTHONPATH": os.pathsep.join(p for p in python_path if p),
    }
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    if done.returncode != 0:
        raise AssertionError(f"the fresh interpreter failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])
