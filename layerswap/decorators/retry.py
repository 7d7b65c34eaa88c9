"""``retry``: call again after listed exceptions, with exponential backoff and jitter."""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from layerswap.decorators._advice import Advice, describe

if TYPE_CHECKING:
    from layerswap.decorators._advice import Args, Kwargs, Wrapped

__all__ = ["retry"]

_log = logging.getLogger(__name__)


class retry(Advice):
    """Retry a call up to ``max_retries`` times when it raises one of ``exceptions``.

    The delay before retry ``n`` (0-based) is
    ``backoff_factor * 2**n * (1 + jitter * u)``, ``u`` uniform in ``[-1, 1)`` drawn
    from ``rng``, capped at ``max_delay``: jitter keeps many workers that failed
    together from retrying together. Other exceptions propagate at once; when the
    retries are used up the last error is re-raised with its traceback. Each retry
    is logged at WARNING on ``logger``. Async functions sleep with ``async_sleep``.
    ``sleep``, ``async_sleep`` and ``rng`` are injectable (tests never really sleep);
    by default ``time.sleep`` / ``asyncio.sleep`` are looked up at each retry, so a
    test that patches them works. Bare ``@retry`` uses the defaults.

    Retry only what is safe to repeat: a call that raised half-way through mutating
    state runs again from the start.

    Example::

        @retry(max_retries=5, exceptions=(ConnectionError, TimeoutError))
        def fetch_shard(url): ...

        @retry(exceptions=(torch.cuda.OutOfMemoryError,), backoff_factor=2.0)
        async def serve(request): ...
    """

    refuses_generators = (
        "its code runs, and raises, only as it is iterated, after the call retry watches "
        "has returned; retry the code that iterates it instead"
    )

    __slots__ = (
        "_async_sleep",
        "_backoff",
        "_exceptions",
        "_jitter",
        "_logger",
        "_max_delay",
        "_max_retries",
        "_rng",
        "_sleep",
    )

    def __init__(
        self,
        max_retries: int = 3,
        backoff_factor: float = 0.5,
        exceptions: type[BaseException] | tuple[type[BaseException], ...] = (Exception,),
        *,
        jitter: float = 0.1,
        max_delay: float = 30.0,
        sleep: Callable[[float], object] | None = None,
        async_sleep: Callable[[float], Awaitable[object]] | None = None,
        rng: Callable[[], float] = random.random,
        logger: logging.Logger | None = None,
    ) -> None:
        if not isinstance(max_retries, int) or isinstance(max_retries, bool) or max_retries < 0:
            raise TypeError(f"max_retries must be an int >= 0, got {max_retries!r}")
        if isinstance(exceptions, type):
            exceptions = (exceptions,)
        if not all(isinstance(e, type) and issubclass(e, BaseException) for e in exceptions):
            raise TypeError(f"exceptions must be exception types, got {exceptions!r}")
        if backoff_factor < 0 or max_delay < 0 or not 0 <= jitter <= 1:
            raise ValueError(
                "need backoff_factor >= 0, max_delay >= 0 and 0 <= jitter <= 1, got "
                f"backoff_factor={backoff_factor}, max_delay={max_delay}, jitter={jitter}"
            )
        self._max_retries = max_retries
        self._backoff = backoff_factor
        self._exceptions = tuple(exceptions)
        self._jitter = jitter
        self._max_delay = max_delay
        self._sleep = sleep
        self._async_sleep = async_sleep
        self._rng = rng
        self._logger = logger or _log

    def delay(self, retry_number: int) -> float:
        """Seconds to wait before retry ``retry_number`` (0 for the first retry)."""
        base = self._backoff * 2.0**retry_number
        if self._jitter:
            base *= 1.0 + self._jitter * (2.0 * self._rng() - 1.0)
        return min(self._max_delay, max(0.0, base))

    def _schedule_retry(
        self, wrapped: Wrapped, instance: Any, retry_number: int, error: BaseException
    ) -> float:
        """The delay before retry ``retry_number``, logged with the error that asks for it."""
        delay = self.delay(retry_number)
        self._logger.warning(
            "%s() raised %s: %s; retry %d of %d in %.2f s",
            describe(wrapped, instance),
            type(error).__name__,
            error,
            retry_number + 1,
            self._max_retries,
            delay,
        )
        return delay

    # Written out, not made from hooks: this advice calls the function again, and the
    # sync and the async form sleep differently.

    def _advice(self, wrapped: Wrapped, instance: Any, args: Args, kwargs: Kwargs) -> Any:
        retry_number = 0
        while True:
            try:
                return wrapped(*args, **kwargs)
            except self._exceptions as error:
                if retry_number >= self._max_retries:
                    raise
                delay = self._schedule_retry(wrapped, instance, retry_number, error)
            # Sleep outside the except block, so a failure while sleeping (Ctrl-C)
            # is not reported as raised "during handling" of the retried error.
            (self._sleep or time.sleep)(delay)
            retry_number += 1

    async def _async_advice(
        self, wrapped: Wrapped, instance: Any, args: Args, kwargs: Kwargs
    ) -> Any:
        retry_number = 0
        while True:
            try:
                return await wrapped(*args, **kwargs)
            except self._exceptions as error:
                if retry_number >= self._max_retries:
                    raise
                delay = self._schedule_retry(wrapped, instance, retry_number, error)
            await (self._async_sleep or asyncio.sleep)(delay)
            retry_number += 1
