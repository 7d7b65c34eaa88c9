"""Where a warning points: at the first line outside layerswap.

A warning raised deep inside layerswap (a wrapped ``forward``, a swap's rollback) is
about the user's call, so it should name the user's line. The depth between the two
changes with the path taken (``swap`` or ``use``, a context manager's exit or not), so
it is counted when the warning is raised rather than written as a number.

Example::

    warnings.warn(message, SwapWarning, stacklevel=external_stacklevel())
"""

from __future__ import annotations

import os
import sys

__all__ = ["external_stacklevel"]

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
#: frames between the user's line and layerswap's that help nobody: ``nn.Module.__call__``
#: (between ``layer(x)`` and a wrapped ``forward``), contextlib's ``__exit__`` (between a
#: ``with`` block and a generator context manager of layerswap's) and torch's decorator
#: context managers (``torch.no_grad`` on a function of layerswap's)
_PASSED_OVER = (
    os.path.join("torch", "nn", "modules", "module.py"),
    os.sep + "contextlib.py",
    os.path.join("torch", "utils", "_contextlib.py"),
)


def external_stacklevel() -> int:
    """The ``stacklevel`` that makes a warning point at the first frame outside layerswap.

    Counted from the caller of this function, so pass the result straight to
    ``warnings.warn`` from that caller. Used only when a warning is emitted, so the
    frame walk costs nothing on the hot path.
    """
    frame = sys._getframe(1)
    level = 1
    while frame is not None and _is_plumbing(frame.f_code.co_filename):
        frame = frame.f_back  # type: ignore[assignment]
        level += 1
    return level


def _is_plumbing(filename: str) -> bool:
    return filename.startswith(_PACKAGE_DIR) or filename.endswith(_PASSED_OVER)
