"""Where output goes: results on stdout (plain when piped), progress on stderr."""

from __future__ import annotations

import contextlib
import io
import json
import logging
import sys
import warnings
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.live import Live
from rich.text import Text

if TYPE_CHECKING:
    from rich.status import Status

__all__ = ["Chatter", "Output", "Progress", "print_json", "quiet_import_chatter"]

# wide enough that no table row is folded when output goes to a pipe or a file
_PIPE_WIDTH = 200


class Progress:
    """A spinner with a status line on stderr, shown only when stderr is a terminal.

    ``spinner=False``: the line alone, drawn when it changes, with no thread to animate it
    (a command that forks worker processes needs to be running one thread).
    """

    def __init__(self, enabled: bool, *, spinner: bool = True) -> None:
        # bound to this stderr: output captured later (see Chatter) leaves the spinner be
        console = Console(file=sys.stderr)
        self._live: Status | Live | None = None
        if enabled and console.is_terminal:
            self._live = (
                console.status("starting")
                if spinner
                else Live(Text("starting"), console=console, auto_refresh=False, transient=True)
            )

    def __enter__(self) -> Progress:
        if self._live is not None:
            self._live.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._live is not None:
            self._live.stop()

    def step(self, text: str) -> None:
        """Show ``text`` as what is being done now."""
        if isinstance(self._live, Live):
            self._live.update(Text(text), refresh=True)
        elif self._live is not None:
            self._live.update(text)

    def count(self, done: int, total: int, text: str) -> None:
        """Show a bar of ``done`` out of ``total``, then ``text``."""
        width = 24
        filled = width * done // max(total, 1)
        self.step(f"[{'#' * filled}{'.' * (width - filled)}] {done}/{total} {text}")


#: loggers of packages transformers imports while it loads (torchao, when installed, for
#: its quantizer) whose warnings are about their own install, not the user's command
_IMPORT_CHATTER = ("torchao", "torch.utils._pytree")


def quiet_import_chatter() -> None:
    """Only errors from :data:`_IMPORT_CHATTER`'s loggers: a command's refusal is one line
    of its own on stderr, not torchao's note that its CUDA kernels cannot load on a CPU
    machine. Imports nothing (the loggers are set before their packages load)."""
    for name in _IMPORT_CHATTER:
        logging.getLogger(name).setLevel(logging.ERROR)


class Chatter:
    """What third-party code prints while a command works, held back and counted.

    Inferring a family builds tiny models from transformers' modeling modules, which
    print config dumps, deprecation notes and install hints. Inside ``with chatter:``
    stdout, stderr, Python warnings and transformers' log messages are captured;
    :meth:`summary` says how much was held back.
    """

    def __init__(self) -> None:
        self.lines = 0
        self.warnings = 0
        self.records = 0
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> Chatter:
        from transformers.utils import logging as transformers_logging

        buffer = io.StringIO()
        self._stack.callback(lambda: setattr(self, "lines", self.lines + _line_count(buffer)))
        self._stack.enter_context(contextlib.redirect_stdout(buffer))
        self._stack.enter_context(contextlib.redirect_stderr(buffer))
        caught = self._stack.enter_context(warnings.catch_warnings(record=True))
        self._stack.callback(lambda: setattr(self, "warnings", self.warnings + len(caught)))
        # transformers' handler writes to the stderr it was created with: swap the
        # handlers of its logger for one that counts (warnings and errors alike)
        logger = logging.getLogger(transformers_logging.__name__.split(".")[0])
        counter = _Counting()
        saved, logger.handlers = logger.handlers, [counter]
        self._stack.callback(setattr, logger, "handlers", saved)
        self._stack.callback(lambda: setattr(self, "records", self.records + counter.count))
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def summary(self) -> str | None:
        """One line on what was held back, or ``None`` when nothing was."""
        if not self.lines and not self.warnings and not self.records:
            return None
        return (
            f"held back while inferring: {self.lines} lines of output, {self.warnings} "
            f"warnings and {self.records} log messages from transformers"
        )


class _Counting(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.count += 1


def _line_count(buffer: io.StringIO) -> int:
    return len([line for line in buffer.getvalue().splitlines() if line.strip()])


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
