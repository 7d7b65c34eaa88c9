"""Running ``layerswap`` in process, as the command-line tests do.

Example::

    from command_line import run

    code, out, err = run(capsys, "patch", "--model", "llama")
"""

from __future__ import annotations

import pytest

from layerswap.cli import main


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """``layerswap ARGS`` in process: (exit code, stdout, stderr) of the command alone.

    What the test printed before (a ``save_pretrained`` progress bar, shown or not
    depending on what ran earlier in the same worker) is read and dropped first.
    """
    capsys.readouterr()
    with pytest.raises(SystemExit) as exited:
        main(list(args))
    out, err = capsys.readouterr()
    code = exited.value.code
    return (code if isinstance(code, int) else 0), out, err
