"""Decorators from production ML practice, each usable for good or for a while.

Every decorator here is an object built once from its arguments. Applied to a
function (``@profiled()``) it returns a plain function made with
:func:`layerswap.safe_wraps`: sync or async, bound as a method like any other,
with ``inspect.signature`` intact. Given to :func:`layerswap.wrap` it is
around-advice on a live model, and comes off again when the patch stops::

    from layerswap.decorators import ProfileStats, profiled

    stats = ProfileStats()
    with layerswap.wrap(model.model.layers[3], "forward", profiled(stats, name="layer 3")):
        model(input_ids)
    print(stats.table())

None of them imports torch until it needs it.
"""

from __future__ import annotations

from layerswap.decorators._advice import Advice
from layerswap.decorators.caching import CachedFunction, CacheInfo, ttl_cache
from layerswap.decorators.memory import (
    EmptyDeviceCache,
    MemoryUsage,
    device_memory,
    empty_cache,
    empty_device_cache,
    host_memory,
    memory_guard,
)
from layerswap.decorators.profiling import (
    ProfileSink,
    ProfileStats,
    TimingStats,
    profiled,
    profiling,
)
from layerswap.decorators.retry import retry
from layerswap.decorators.tensors import nan_guard, validate_tensors
from layerswap.decorators.warn import warn_once, warn_once_message

__all__ = [
    "Advice",
    "CacheInfo",
    "CachedFunction",
    "EmptyDeviceCache",
    "MemoryUsage",
    "ProfileSink",
    "ProfileStats",
    "TimingStats",
    "device_memory",
    "empty_cache",
    "empty_device_cache",
    "host_memory",
    "memory_guard",
    "nan_guard",
    "profiled",
    "profiling",
    "retry",
    "ttl_cache",
    "validate_tensors",
    "warn_once",
    "warn_once_message",
]
