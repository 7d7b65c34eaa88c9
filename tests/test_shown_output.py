"""The docs' freshness check (scripts/shown_output.py): a figure another machine's BLAS
rounds differently is the same output; a changed word, count, or a figure that crosses
its tolerance is not (issue 38, item 6: a fresh machine's ``pytest --full`` failed)."""

from __future__ import annotations

import runpy
from collections.abc import Callable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
same_output: Callable[[str, str], bool] = runpy.run_path(str(ROOT / "scripts" / "shown_output.py"))[
    "same_output"
]

SHOWN = """\
$ layerswap verify --model qwen3 --backward
layer   module           max abs error   max rel error      cosine
─────────────────────────────────────────────────────────────────────────
    0   model.layers.0        0.00e+00        0.00e+00   1.0000000   PASS
        logits                0.00e+00        0.00e+00   1.0000000   PASS
logits: 2x16 tokens, padding excluded, top-1 agreement 100.0%, KL 0.00e+00
tolerance (float32): max abs error <= 1e-05 + 0.0001 x max|reference|, cosine >= 0.99999
backward (whole model): loss 6.23131 vs 6.23131, 47 gradients, max rel error 9.93e-07, \
min cosine 1.0000000  PASS
cached decoding: 4 greedy tokens with the KV cache, agreement 100%, logits max abs error \
2.09e-07  PASS
PASS: the swapped model matches the original
"""

BROKEN = """\
    2   model.layers.2        1.37e-03        5.27e-03   0.9999848   FAIL
tolerance (float32): max abs error <= 1e-05 + 0.0001 x max|reference|, cosine >= 0.99999
FAIL: first divergent layer: 2 (model.layers.2): max abs error 0.00137
"""

BFLOAT16 = """\
    0   model.layers.0        1.46e-03        1.01e-02   0.9999814   PASS
tolerance (bfloat16): max abs error <= 0.01 + 0.05 x max|reference|, cosine >= 0.995
"""

BFLOAT16_BACKWARD = """\
tolerance (bfloat16): max abs error <= 0.01 + 0.05 x max|reference|, cosine >= 0.995
backward (whole model): loss 6.35638 vs 6.35683, 39 gradients, max rel error 2.76e-02, \
min cosine 0.9996874  PASS
"""


def edited(text: str, old: str, new: str) -> str:
    assert text.count(old) >= 1, f"{old!r} is not in the sample"
    return text.replace(old, new)


@pytest.mark.parametrize(
    ("text", "old", "new"),
    [
        # the figures a second machine of the same kind printed (issue 38, item 6)
        (SHOWN, "error 2.09e-07", "error 1.79e-07"),
        (SHOWN, "error 9.93e-07", "error 6.12e-07"),
        # bitwise here, a rounding apart there
        (SHOWN, "0.00e+00        0.00e+00   1.0000000", "1.19e-07        2.38e-07   0.9999999"),
        (SHOWN, "KL 0.00e+00", "KL 3.10e-09"),
        (SHOWN, "loss 6.23131 vs 6.23131", "loss 6.23132 vs 6.23131"),
        # above the floor (a real fault's figure): rounding moves it by far less than 2x
        (BROKEN, "1.37e-03", "1.38e-03"),
        (BROKEN, "0.9999848", "0.9999843"),
        # bfloat16 rounds at 1e-3: below its own tolerance's floor
        (BFLOAT16, "1.46e-03", "1.95e-03"),
        (BFLOAT16, "0.9999814", "0.9999517"),
        # what this machine printed for the bfloat16 backward the docs show
        (
            BFLOAT16_BACKWARD,
            "6.35683, 39 gradients, max rel error 2.76e-02, min cosine 0.9996874",
            "6.35684, 39 gradients, max rel error 2.67e-02, min cosine 0.9996892",
        ),
    ],
    ids=[
        "logits-error",
        "gradient-error",
        "zero-to-rounding",
        "kl",
        "loss",
        "fault-figure-rounded",
        "fault-cosine-rounded",
        "bfloat16-error",
        "bfloat16-cosine",
        "bfloat16-backward",
    ],
)
def test_a_figure_rounded_otherwise_is_the_same_output(text: str, old: str, new: str) -> None:
    assert same_output(text, edited(text, old, new))


@pytest.mark.parametrize(
    ("text", "old", "new"),
    [
        # a figure that crosses the tolerance's floor (atol 1e-5, or 1 - min cosine)
        (SHOWN, "error 2.09e-07", "error 2.09e-05"),
        (SHOWN, "1.0000000   PASS\n        logits", "0.9999800   PASS\n        logits"),
        (BFLOAT16, "1.46e-03", "1.46e-02"),
        # a fault's figure that more than doubles or halves
        (BROKEN, "1.37e-03", "3.00e-03"),
        (BROKEN, "5.27e-03", "1.27e-03"),
        # words, verdicts, counts, shapes and the other numbers: exactly
        (SHOWN, "error 2.09e-07  PASS", "error 2.09e-07  FAIL"),
        (SHOWN, "47 gradients", "46 gradients"),
        (SHOWN, "4 greedy tokens", "5 greedy tokens"),
        (SHOWN, "2x16 tokens", "2x15 tokens"),
        (SHOWN, "agreement 100.0%", "agreement 99.9%"),
        (SHOWN, "loss 6.23131 vs 6.23131", "loss 6.23131 vs 6.24131"),
        (SHOWN, "<= 1e-05 +", "<= 1e-04 +"),
        (BROKEN, "max abs error 0.00137", "max abs error 0.00138"),
        (SHOWN, "matches the original", "matches the orignal"),
    ],
    ids=[
        "error-crosses-atol",
        "cosine-crosses-min",
        "bfloat16-crosses-atol",
        "fault-doubles",
        "fault-shrinks",
        "verdict",
        "gradient-count",
        "token-count",
        "shape",
        "agreement",
        "loss",
        "tolerance",
        "failure-message",
        "word",
    ],
)
def test_a_changed_word_count_or_figure_beyond_rounding_is_stale(
    text: str, old: str, new: str
) -> None:
    assert not same_output(text, edited(text, old, new))


def test_figures_without_a_tolerance_line_are_compared_exactly() -> None:
    # no tolerance printed: nothing to tell rounding by
    assert not same_output("error 0.00e+00\n", "error 1.19e-07\n")
    assert same_output("error 1.19e-07\n", "error 1.19e-07\n")


def test_an_extra_or_missing_line_is_stale() -> None:
    assert not same_output(SHOWN, SHOWN + "warning: noisy\n")
    assert not same_output(
        SHOWN, SHOWN.replace("PASS: the swapped model matches the original\n", "")
    )
