"""Where output goes: results on stdout (plain when piped), progress on stderr."""

from __future__ import annotations

import json
import sys
from typing import TYPE_CHECKING, Any

from rich.console import Console

if TYPE_CHECKING:
    from rich.status import Status

__all__ = ["Output", "Progress", "print_json"]

# wide enough that no table row is folded when output goes to a pipe or a file
_PIPE_WIDTH = 200


class Progress:
    """A spinner with a status line on stderr, shown only when stderr is a terminal."""

    def __init__(self, enabled: bool) -> None:
        console = Console(stderr=True)
        self._status: Status | None = (
            console.status("starting") if enabled and console.is_terminal else None
        )

    def __enter__(self) -> Progress:
        if self._status is not None:
            self._status.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._status is not None:
            self._status.stop()

    def step(self, text: str) -> None:
        """Show ``text`` as what is being done now."""
        if self._status is not None:
            self._status.update(text)

    def count(self, done: int, total: int, text: str) -> None:
        """Show a bar of ``done`` out of ``total``, then ``text``."""
        width = 24
        filled = width * done // max(total, 1)
        self.step(f"[{'#' * filled}{'.' * (width - filled)}] {done}/{total} {text}")


class Output(Console):
    """The console for results: no markup parsing ("layerswap[te]" is text, not a style),
    no random highlighting. Piped, it neither folds lines nor pads them: rich assumes 80
    columns and pads table cells with spaces, and greppable output wants neither."""

    def __init__(self) -> None:
        self.piped = not sys.stdout.isatty()
        # piped, COLUMNS (which CI systems often set to 80) must not fold table rows either
        super().__init__(
            highlight=False,
            markup=False,
            soft_wrap=True,
            width=_PIPE_WIDTH if self.piped else None,
        )

    def emit(self, renderable: Any) -> None:
        """Print a table (or any renderable): as is on a terminal, right-trimmed piped."""
        if not self.piped:
            self.print(renderable)
            return
        with self.capture() as captured:
            self.print(renderable)
        lines = captured.get().splitlines()
        sys.stdout.write("".join(line.rstrip() + "\n" for line in lines))


def print_json(payload: Any) -> None:
    """``payload`` as indented JSON, the only thing on stdout."""
    sys.stdout.write(json.dumps(payload, indent=2, default=str) + "\n")
