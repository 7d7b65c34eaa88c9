"""Device memory: ``empty_device_cache`` (a switch) and ``memory_guard`` (a threshold)."""

from __future__ import annotations

import gc
import importlib
import logging
import os
import time
import warnings
from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar, overload

from layerswap.decorators._advice import Advice, describe, external_stacklevel, loaded_torch

if TYPE_CHECKING:
    from layerswap.decorators._advice import Args, Kwargs, Wrapped

__all__ = [
    "EmptyDeviceCache",
    "MemoryUsage",
    "device_memory",
    "empty_cache",
    "empty_device_cache",
    "host_memory",
    "memory_guard",
]

_log = logging.getLogger(__name__)

F = TypeVar("F", bound=Callable[..., Any])

_GIB = float(1 << 30)


def _accelerator_modules(torch: ModuleType) -> list[tuple[str, ModuleType]]:
    """``(name, torch.<name>)`` for each accelerator backend that is present and available.

    Every lookup goes through ``getattr``: ``torch.npu`` exists only once
    ``torch_npu`` is imported, ``torch.xpu``/``torch.mps`` only in some builds, and
    ``is_available`` must not be trusted to exist on all of them.
    """
    found = []
    for name in ("cuda", "xpu", "npu"):
        backend = getattr(torch, name, None)
        is_available = getattr(backend, "is_available", None)
        if backend is not None and callable(is_available) and is_available():
            found.append((name, backend))
    mps_backend = getattr(getattr(torch, "backends", None), "mps", None)
    mps = getattr(torch, "mps", None)
    if mps is not None and mps_backend is not None and mps_backend.is_available():
        found.append(("mps", mps))
    return found


def empty_cache() -> tuple[str, ...]:
    """Run ``gc.collect()``, then empty the caching allocator of every available accelerator.

    Returns the device types emptied (``()`` on a CPU-only machine, where only the
    garbage collection runs). Does not import torch: if nothing imported it, no
    device memory can be cached.

    Example::

        del activations
        empty_cache()   # ('cuda',) on a GPU machine
    """
    # Collect first: tensors kept alive only by reference cycles hold cached blocks.
    gc.collect()
    torch = loaded_torch()
    if torch is None:
        return ()
    emptied = []
    for name, backend in _accelerator_modules(torch):
        empty = getattr(backend, "empty_cache", None)
        if callable(empty):
            empty()
            emptied.append(name)
    return tuple(emptied)


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() not in ("", "0", "false", "no", "off")


class EmptyDeviceCache(Advice):
    """The type of :data:`empty_device_cache`; use that single instance.

    One process-wide switch, off by default (on when the environment variable
    ``LAYERSWAP_EMPTY_DEVICE_CACHE`` is ``1``). When on, every decorated call and
    every ``with`` block ends with :func:`empty_cache` (``gc.collect()`` and the
    accelerator's ``empty_cache``); when off, they cost one attribute check. Emptying
    happens on exit, exceptions included, because that is when the call's temporaries
    have become garbage.

    Emptying the cache trades speed for headroom: the next allocations go back to the
    driver. Turn it on where fragmentation or a neighbouring process needs the memory
    (between evaluation and training phases, around a big one-off step), not in a hot loop.

    Example::

        from layerswap.decorators import empty_device_cache

        empty_device_cache.enable()      # or: empty_device_cache.enabled = True

        @empty_device_cache
        def evaluate(model, batches): ...

        with empty_device_cache:         # also: with empty_device_cache():
            run_generation()

        with layerswap.wrap(model, "generate", empty_device_cache):
            model.generate(input_ids)
    """

    __slots__ = ("enabled",)

    def __init__(self, enabled: bool = False) -> None:
        self.enabled = enabled

    def enable(self) -> None:
        """Turn the switch on for the whole process."""
        self.enabled = True

    def disable(self) -> None:
        """Turn the switch off for the whole process."""
        self.enabled = False

    def _after(self, wrapped: Wrapped, instance: Any, token: None) -> None:
        if self.enabled:
            empty_cache()

    @overload
    def __call__(self) -> EmptyDeviceCache: ...

    @overload
    def __call__(self, func: F) -> F: ...

    def __call__(self, func: Any = None) -> Any:
        """``@empty_device_cache`` decorates; ``empty_device_cache()`` is the switch itself."""
        if func is None:
            return self
        return super().__call__(func)

    def __enter__(self) -> EmptyDeviceCache:
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self.enabled:
            empty_cache()

    def __repr__(self) -> str:
        return f"<empty_device_cache enabled={self.enabled}>"


#: The process-wide switch; see :class:`EmptyDeviceCache`.
empty_device_cache = EmptyDeviceCache(enabled=_env_flag("LAYERSWAP_EMPTY_DEVICE_CACHE"))


class MemoryUsage(NamedTuple):
    """Memory in use and in total, in bytes, of the host or of one device."""

    used: int
    total: int

    @property
    def fraction(self) -> float:
        return self.used / self.total if self.total else 0.0

    def describe(self) -> str:
        return f"{self.fraction:.1%} in use ({self.used / _GIB:.2f} GiB of {self.total / _GIB:.2f} GiB)"


def host_memory() -> MemoryUsage:
    """Host memory from ``psutil.virtual_memory()``; ``used`` is total minus available.

    That is the figure behind ``psutil``'s ``percent``: page cache the kernel can
    drop counts as available, not as used.
    """
    import psutil

    vm = psutil.virtual_memory()
    return MemoryUsage(used=int(vm.total - vm.available), total=int(vm.total))


def device_memory(device: Any = None) -> MemoryUsage | None:
    """Memory of an accelerator from its ``mem_get_info``; ``None`` when there is none to ask.

    ``device`` is anything ``torch.device`` accepts, or ``None`` for the current CUDA
    device when CUDA is available. CPU devices, and backends without
    ``mem_get_info``, give ``None``.
    """
    torch: Any = loaded_torch()
    if torch is None:
        if device is None:
            return None
        torch = importlib.import_module("torch")
    if device is None:
        if not torch.cuda.is_available():
            return None
        device = torch.device("cuda", torch.cuda.current_device())
    device = torch.device(device)
    backend = getattr(torch, device.type, None)
    mem_get_info = getattr(backend, "mem_get_info", None)
    is_available = getattr(backend, "is_available", None)
    if mem_get_info is None or not callable(is_available) or not is_available():
        return None
    free, total = mem_get_info(device)
    return MemoryUsage(used=int(total - free), total=int(total))


class memory_guard(Advice):
    """Before each call, check host and device memory against ``threshold``.

    Host memory is ``psutil.virtual_memory()``; device memory is the accelerator's
    ``mem_get_info`` for ``device`` (default: the current CUDA device, if any). When
    either is at or over ``threshold`` (a fraction, 0.85 = 85 %):

    * ``action="gc"`` runs :func:`empty_cache` (``gc.collect()`` and the device's
      cache), checks again and logs a warning if it is still over;
    * ``action="raise"`` raises :class:`MemoryError` with the numbers, and the call
      does not run;
    * ``action="warn"`` warns (:class:`RuntimeWarning`) and runs the call.

    ``host_probe`` and ``device_probe`` replace the measurements (tests, or other
    sources); ``interval`` skips probing if the last probe is younger than that many
    seconds of ``clock``, for functions called in a tight loop (with ``action="raise"``,
    the last probe's refusal holds until the next probe).

    Example::

        @memory_guard(0.9, action="raise")
        def load_shard(path): ...

        with layerswap.wrap(model, "generate", memory_guard(0.8)):
            model.generate(input_ids)
    """

    __slots__ = (
        "_action",
        "_clock",
        "_device_probe",
        "_host_probe",
        "_interval",
        "_next_check",
        "_refused",
        "threshold",
    )

    def __init__(
        self,
        threshold: float = 0.85,
        action: str = "gc",
        device: Any = None,
        *,
        host_probe: Callable[[], MemoryUsage] = host_memory,
        device_probe: Callable[[], MemoryUsage | None] | None = None,
        interval: float = 0.0,
        clock: Callable[[], float] | None = None,
    ) -> None:
        if not 0.0 < threshold <= 1.0:
            hint = f"; did you mean {threshold / 100:g}?" if 1.0 < threshold <= 100.0 else ""
            raise ValueError(f"threshold is a fraction in (0, 1], got {threshold!r}{hint}")
        if action not in ("gc", "raise", "warn"):
            raise ValueError(f"action must be 'gc', 'raise' or 'warn', got {action!r}")
        self.threshold = threshold
        self._action = action
        self._host_probe = host_probe
        self._device_probe = device_probe or (lambda: device_memory(device))
        self._interval = interval
        self._clock = clock  # None: time.monotonic, looked up at each call
        self._next_check = float("-inf")
        # action="raise": the refusal of the last probe, kept until the next one
        self._refused: str | None = None

    def _over(self) -> list[tuple[str, MemoryUsage]]:
        over = []
        for where, probe in (("host", self._host_probe), ("device", self._device_probe)):
            usage = probe()
            if usage is not None and usage.fraction >= self.threshold:
                over.append((where, usage))
        return over

    def _before(self, wrapped: Wrapped, instance: Any, args: Args, kwargs: Kwargs) -> None:
        if self._interval > 0.0:
            now = (self._clock or time.monotonic)()
            if now < self._next_check:
                # not probed again yet: a call the last probe refused is refused still
                if self._refused is not None:
                    raise MemoryError(self._refused)
                return
            self._next_check = now + self._interval
        self._refused = None
        over = self._over()
        if not over:
            return
        what = "; ".join(f"{where} memory {usage.describe()}" for where, usage in over)
        message = (
            f"{describe(wrapped, instance)}(): {what}, "
            f"at or over the {self.threshold:.0%} threshold of memory_guard"
        )
        if self._action == "raise":
            self._refused = message
            raise MemoryError(message)
        if self._action == "warn":
            warnings.warn(message, RuntimeWarning, stacklevel=external_stacklevel())
            return
        _log.info("%s; running gc and emptying the device cache", message)
        empty_cache()
        still = self._over()
        if still:
            _log.warning(
                "%s(): still over the %.0f%% threshold after gc: %s",
                describe(wrapped, instance),
                self.threshold * 100,
                "; ".join(f"{where} memory {usage.describe()}" for where, usage in still),
            )
