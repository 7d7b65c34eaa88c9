"""Whether command-line output shown in the docs is still what the command prints.

A verification report prints figures measured on this machine's CPU: ``max abs error
2.09e-07`` on one machine is ``1.79e-07`` on another of the same kind whose BLAS rounds
in another order. So a block is the same when its text is, except for the figures its
own tolerance line (``tolerance (float32): max abs error <= 1e-05 + 0.0001 x ...,
cosine >= 0.99999``) cannot tell apart::

    same_output(shown, fresh)   # words, counts, shapes, PASS/FAIL: exactly;
                                # errors, cosines and losses: up to rounding

- an error (``1.37e-03``) or a cosine's shortfall from 1 (``0.9999848``): both at most
  the floor (``atol``; ``1 - min cosine``), or both above it and within a factor of
  ``SPREAD``. One that crosses the floor, or moves further, is a change.
- a loss (``loss 6.23131 vs 6.23131``): within ``rtol`` of each other.

A block without a tolerance line is compared exactly; ``volatile`` blocks (timings,
versions) with every number masked (``masked``).
"""

from __future__ import annotations

import re

NUMBER = re.compile(r"\d+(?:[.,]\d+)*(?:e[-+]\d+)?x?")
# how a report prints what it measured, by kind
FIGURE = re.compile(
    r"(?<![\w.])(?P<error>\d\.\d\de[-+]\d\d)(?![\w.])"
    r"|(?<![\w.])(?P<cosine>[01]\.\d{7})(?![\w.])"
    r"|(?:(?<=loss )|(?<=\d vs ))(?P<loss>\d+(?:\.\d+)?(?:e[-+]\d+)?)(?![\w.])"
)
TOLERANCE = re.compile(
    r"tolerance \(\w+\): max abs error <= (\S+) \+ (\S+) x max\|reference\|, "
    r"cosine >= (\S+)"
)
# rounding moves an error above the floor (a real fault's, or bfloat16's) by far less;
# a fault that grows or shrinks more than this is a change the docs should show
SPREAD = 2.0


def masked(text: str) -> str:
    """``text`` with every number one placeholder, runs of spaces one space, and no
    ``warning:`` lines (a timing's noise warning comes and goes with the machine)."""
    kept = "".join(line for line in text.splitlines(True) if not line.startswith("warning:"))
    return re.sub(r"[ ─]+", " ", NUMBER.sub("#", kept))


def same_output(shown: str, fresh: str) -> bool:
    """``shown`` and ``fresh`` are the same text but for figures their tolerance cannot
    tell apart.

    >>> tolerance = "tolerance (float32): max abs error <= 1e-05 + 0.0001 x max|reference|"
    >>> same_output(f"{tolerance}, cosine >= 0.99999\\nerror 2.09e-07  PASS",
    ...             f"{tolerance}, cosine >= 0.99999\\nerror 1.79e-07  PASS")
    True
    """
    shown_words, shown_figures = _pieces(shown)
    fresh_words, fresh_figures = _pieces(fresh)
    if shown_words != fresh_words:
        return False  # the words and the other numbers, exactly
    tolerance = _tolerance(fresh)
    if tolerance is None:
        return shown == fresh
    atol, rtol, shortfall = tolerance
    for (kind, old), (other, new) in zip(shown_figures, fresh_figures, strict=True):
        if kind != other:
            return False
        if kind == "error" and not _errors_agree(old, new, atol):
            return False
        if kind == "cosine" and not _errors_agree(1 - old, 1 - new, shortfall):
            return False
        if kind == "loss" and abs(old - new) > rtol * max(abs(old), abs(new)):
            return False
    return True


def _pieces(text: str) -> tuple[list[str], list[tuple[str, float]]]:
    """The text between figures, and each figure as (kind, value)."""
    words, figures, at = [], [], 0
    for found in FIGURE.finditer(text):
        kind = found.lastgroup or ""
        words.append(text[at : found.start()])
        figures.append((kind, float(found.group(kind))))
        at = found.end()
    words.append(text[at:])
    return words, figures


def _tolerance(text: str) -> tuple[float, float, float] | None:
    """The strictest atol, rtol and 1 - min cosine of the block's tolerance lines, or
    ``None`` when it prints none (nothing to tell rounding by)."""
    found = TOLERANCE.findall(text)
    if not found:
        return None
    return (
        min(float(atol) for atol, _, _ in found),
        min(float(rtol) for _, rtol, _ in found),
        min(1 - float(cosine) for _, _, cosine in found),
    )


def _errors_agree(old: float, new: float, floor: float) -> bool:
    """Both at most the floor, or both above it and within a factor of SPREAD."""
    if old <= floor and new <= floor:
        return True
    if old <= floor or new <= floor:
        return False
    return max(old, new) <= SPREAD * min(old, new)
