"""How runs of layer indices are written in messages and reports: ``0-2, 4``.

Example::

    >>> index_spans([0, 1, 2, 4])
    '0-2, 4'
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["index_spans"]


def index_spans(indices: Iterable[int]) -> str:
    """``indices`` (ascending) as runs: consecutive ones joined by a dash, runs by commas.

    Example::

        >>> index_spans([3])
        '3'
        >>> index_spans([0, 1, 2, 5, 6])
        '0-2, 5-6'
    """
    runs: list[list[int]] = []
    for index in indices:
        if runs and index == runs[-1][-1] + 1:
            runs[-1].append(index)
        else:
            runs.append([index])
    return ", ".join(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]) for run in runs)
