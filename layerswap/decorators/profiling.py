"""``profiled`` and ``profiling``: per-call wall time into a pluggable sink."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from layerswap.decorators._advice import Advice, describe

if TYPE_CHECKING:
    from layerswap.decorators._advice import Args, Kwargs, Wrapped

__all__ = ["ProfileSink", "ProfileStats", "TimingStats", "profiled", "profiling"]

_log = logging.getLogger(__name__)


@dataclass(slots=True)
class TimingStats:
    """Running statistics of one key: count, total, mean, min and max in seconds."""

    count: int = 0
    total: float = 0.0
    max: float = 0.0
    min: float = float("inf")

    @property
    def mean(self) -> float:
        return self.total / self.count if self.count else 0.0

    def add(self, seconds: float) -> None:
        self.count += 1
        self.total += seconds
        if seconds > self.max:
            self.max = seconds
        if seconds < self.min:
            self.min = seconds


class ProfileStats(dict[str, TimingStats]):
    """A dict of :class:`TimingStats` per key, filled by :func:`profiled`; ``str()`` is a table.

    Example::

        stats = ProfileStats()

        @profiled(stats)
        def step(): ...

        step(); step()
        stats["step"].count   # 2
        print(stats)          # key, calls, total/mean/max in milliseconds
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # the three updates of one record must not interleave between threads
        self._lock = threading.Lock()

    def record(self, key: str, seconds: float) -> None:
        """Add one timing under ``key``; also what ``stats(key, seconds)`` does."""
        with self._lock:
            entry = self.get(key)
            if entry is None:
                entry = self[key] = TimingStats()
            # TimingStats.add inlined: this runs on every profiled call
            entry.count += 1
            entry.total += seconds
            if seconds > entry.max:
                entry.max = seconds
            if seconds < entry.min:
                entry.min = seconds

    __call__ = record

    def table(self, *, sort_by: str | None = "total") -> str:
        """The stats as an aligned text table in milliseconds.

        ``sort_by`` is ``"total"``, ``"mean"``, ``"max"`` or ``"count"`` (descending),
        or ``None`` for first-recorded order.
        """
        rows = list(self.items())
        if sort_by is not None:
            if sort_by not in ("total", "mean", "max", "count"):
                raise ValueError(
                    f"sort_by must be total, mean, max, count or None, not {sort_by!r}"
                )
            rows.sort(key=lambda row: getattr(row[1], sort_by), reverse=True)
        header = ("key", "calls", "total ms", "mean ms", "max ms")
        body = [
            (key, str(s.count), f"{s.total * 1e3:.3f}", f"{s.mean * 1e3:.3f}", f"{s.max * 1e3:.3f}")
            for key, s in rows
        ]
        widths = [max(len(row[i]) for row in [header, *body]) for i in range(len(header))]
        lines = [
            "  ".join(
                cell.ljust(width) if i == 0 else cell.rjust(width)
                for i, (cell, width) in enumerate(zip(row, widths, strict=True))
            )
            for row in [header, *body]
        ]
        lines.insert(1, "  ".join("-" * width for width in widths))
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


#: Where timings go: a logger, a dict of running stats (a :class:`ProfileStats` or a
#: plain ``dict``), or any callable taking ``(key, seconds)``, e.g. a metrics logger's method.
ProfileSink = logging.Logger | dict[str, TimingStats] | Callable[[str, float], object]


def _recorder(sink: ProfileSink | None, level: int) -> Callable[[str, float], object]:
    """Turn a sink into one ``(key, seconds)`` callable, so each call does no dispatch."""
    if sink is None:
        sink = _log
    if isinstance(sink, logging.Logger):
        logger = sink

        def log(key: str, seconds: float) -> None:
            if logger.isEnabledFor(level):
                logger.log(level, "%s took %.3f ms", key, seconds * 1e3)

        return log
    if isinstance(sink, ProfileStats):
        return sink.record
    if isinstance(sink, dict):
        stats = sink

        def accumulate(key: str, seconds: float) -> None:
            entry = stats.get(key)
            if entry is None:
                entry = stats[key] = TimingStats()
            entry.add(seconds)

        return accumulate
    if callable(sink):
        return sink
    raise TypeError(
        "sink must be a logging.Logger, a dict such as ProfileStats, or a callable "
        f"(key, seconds); got {type(sink).__name__}"
    )


def _cuda_synchronizer() -> Callable[[], None] | None:
    import torch  # the user asked for CUDA timing, so torch is wanted

    if torch.cuda.is_available():
        return torch.cuda.synchronize  # type: ignore[no-any-return]
    return None


class profiled(Advice):
    """Time each call with ``time.perf_counter`` and send ``(key, seconds)`` to ``sink``.

    Always written with parentheses, ``@profiled()``: a sink may itself be a plain
    function, so ``profiled(f)`` cannot tell a sink from a function to decorate.

    The key is ``name`` if given, else ``Class.method`` for methods (the qualified
    name; through :func:`layerswap.wrap`, the class of the instance) or the
    function's qualified name. Calls that raise are timed too. With
    ``cuda_sync=True`` and CUDA available, the device is synchronised before each
    clock read, so the time covers the kernels the call queued, not just their
    launch. ``clock`` is injectable (tests pass a fake).

    Sinks: a :class:`logging.Logger` (one record per call at ``level``, DEBUG by
    default), a :class:`ProfileStats` or plain ``dict`` (running stats per key), or
    any callable ``(key, seconds)``.

    Example::

        stats = ProfileStats()

        @profiled(stats)
        def tokenize(batch): ...

        # temporarily, on one layer of a live model:
        with layerswap.wrap(model.model.layers[3], "forward", profiled(stats, name="layer 3")):
            model(input_ids)
        print(stats.table())
    """

    __slots__ = ("_clock", "_name", "_record", "_sync")

    _bare = False

    def __init__(
        self,
        sink: ProfileSink | None = None,
        *,
        name: str | None = None,
        cuda_sync: bool = False,
        level: int = logging.DEBUG,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self._record = _recorder(sink, level)
        self._name = name
        self._clock = clock  # None: time.perf_counter, looked up at each call
        self._sync = _cuda_synchronizer() if cuda_sync else None

    def _before(self, wrapped: Wrapped, instance: Any, args: Args, kwargs: Kwargs) -> float:
        if self._sync is not None:
            self._sync()  # do not bill this call for work queued before it
        return (self._clock or time.perf_counter)()

    def _after(self, wrapped: Wrapped, instance: Any, start: float) -> None:
        if self._sync is not None:
            self._sync()
        elapsed = (self._clock or time.perf_counter)() - start
        self._record(self._name or describe(wrapped, instance), elapsed)


@contextmanager
def profiling(
    name: str,
    sink: ProfileSink | None = None,
    *,
    cuda_sync: bool = False,
    level: int = logging.DEBUG,
    clock: Callable[[], float] | None = None,
) -> Iterator[None]:
    """Time a block and send ``(name, seconds)`` to ``sink``, like :class:`profiled`.

    Example::

        stats = ProfileStats()
        with profiling("generate", stats):
            model.generate(input_ids, max_new_tokens=8)
        stats["generate"].total
    """
    record = _recorder(sink, level)
    sync = _cuda_synchronizer() if cuda_sync else None
    if sync is not None:
        sync()
    clock = clock or time.perf_counter  # looked up now, so a patched clock is used
    start = clock()
    try:
        yield
    finally:
        if sync is not None:
            sync()
        record(name, clock() - start)
