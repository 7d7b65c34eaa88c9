"""Running Python code in a fresh interpreter, as the tests of what a new process does.

Example::

    from fresh import run_json

    found = run_json("import json, sys; print(json.dumps('torch' in sys.modules))", tmp_path)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any


def run_json(code: str, cache: Path) -> Any:
    """``code`` (dedented) in a fresh interpreter whose verdicts and answers are kept under
    ``cache``: the JSON its last line of output holds."""
    env = {**os.environ, "LAYERSWAP_CACHE": str(cache)}
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])
