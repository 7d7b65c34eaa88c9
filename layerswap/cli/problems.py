"""Usage and environment problems: one line on stderr and exit code 2, no traceback."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import NoReturn

import typer

from layerswap.errors import LayerswapError, VerificationError

__all__ = ["UsageProblem", "exit_codes", "fail", "one_line"]


class UsageProblem(Exception):
    """A problem with how the command was called or with this machine: exit 2."""


def one_line(message: object) -> str:
    """``message`` with every run of whitespace (newlines too) made one space."""
    return " ".join(str(message).split())


@contextlib.contextmanager
def exit_codes() -> Iterator[None]:
    """Turn usage and environment problems into one line on stderr and exit code 2.

    Library errors other than a failed verification (unknown names, unmet requirements,
    upstream drift, unconvertible weights) are the user's or the machine's to fix, so
    they get a sentence, not a traceback. Anything else is a bug and keeps its traceback.
    """
    try:
        yield
    except (UsageProblem, OSError) as error:
        fail(error)
    except LayerswapError as error:
        if isinstance(error, VerificationError):
            raise
        fail(error)
    except Exception as error:
        if not _invalid_config(error):
            raise
        fail(f"invalid config: {error}")


def _invalid_config(error: BaseException) -> bool:
    """Whether ``error`` is a config refused by its own validation (huggingface_hub's
    strict dataclasses: ``num_attention_heads`` not dividing ``hidden_size``), told by
    its class's name, not imported here."""
    return any(
        cls.__name__ == "StrictDataclassError" and cls.__module__.startswith("huggingface_hub")
        for cls in type(error).__mro__
    )


def fail(error: object) -> NoReturn:
    """Report ``error`` as one line on stderr and exit with code 2."""
    print(f"layerswap: error: {one_line(error)}", file=sys.stderr)
    raise typer.Exit(2)
