"""layerswap.decorators: each decorator as a decorator, on methods, async, and through wrap.

Time, sleep, randomness and memory readings are injected fakes: nothing here sleeps
or reads the wall clock.
"""

from __future__ import annotations

import asyncio
import gc
import inspect
import logging
import os
import runpy
import subprocess
import sys
import threading
import warnings
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers.modeling_outputs import CausalLMOutputWithPast

import layerswap
from layerswap.decorators import (
    Advice,
    CacheInfo,
    MemoryUsage,
    ProfileStats,
    TimingStats,
    device_memory,
    empty_cache,
    empty_device_cache,
    host_memory,
    memory_guard,
    nan_guard,
    profiled,
    profiling,
    retry,
    ttl_cache,
    validate_tensors,
    warn_once,
    warn_once_message,
)

REPO = Path(__file__).resolve().parent.parent


# -- fakes -------------------------------------------------------------------------


class FakeClock:
    """A clock that moves only when told to."""

    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class Sleeper:
    """Records requested delays instead of sleeping."""

    def __init__(self) -> None:
        self.delays: list[float] = []

    def __call__(self, seconds: float) -> None:
        self.delays.append(seconds)

    async def async_sleep(self, seconds: float) -> None:
        self.delays.append(seconds)


def never_sleep(seconds: float) -> None:
    raise AssertionError(f"slept {seconds} s synchronously")


class Flaky:
    """Fails with the given errors in turn, then returns 'ok'."""

    def __init__(self, *errors: BaseException) -> None:
        self.errors = list(errors)
        self.calls = 0

    def __call__(self, x: int) -> str:
        self.calls += 1
        if self.errors:
            raise self.errors.pop(0)
        return f"ok {x}"


@pytest.fixture
def gc_runs() -> Iterator[list[int]]:
    """Full collections that happen during the test (automatic collection switched off)."""
    runs: list[int] = []

    def on_gc(phase: str, info: dict[str, int]) -> None:
        if phase == "start" and info["generation"] == 2:
            runs.append(1)

    was_enabled = gc.isenabled()
    gc.disable()
    gc.callbacks.append(on_gc)
    try:
        yield runs
    finally:
        gc.callbacks.remove(on_gc)
        if was_enabled:
            gc.enable()


@pytest.fixture
def switch_on() -> Iterator[None]:
    before = empty_device_cache.enabled
    empty_device_cache.enable()
    try:
        yield
    finally:
        empty_device_cache.enabled = before


@pytest.fixture(autouse=True)
def _fresh_warn_once() -> Iterator[None]:
    warn_once.reset()
    yield
    warn_once.reset()


def over(fraction: float, total: int = 16 << 30) -> Callable[[], MemoryUsage]:
    return lambda: MemoryUsage(used=int(total * fraction), total=total)


def no_device() -> None:
    return None


# -- what every decorator promises -----------------------------------------------

# name -> a fresh decorator object that lets a plain call with a 2x2 float tensor through
EVERY_DECORATOR: dict[str, Callable[[], Advice]] = {
    "profiled": lambda: profiled(ProfileStats(), clock=FakeClock()),
    "empty_device_cache": lambda: empty_device_cache,
    "warn_once": lambda: warn_once("noted"),
    "retry": lambda: retry(sleep=never_sleep),
    "validate_tensors": lambda: validate_tensors(x=("n", 2)),
    "nan_guard": lambda: nan_guard(check_inputs=True),
    "memory_guard": lambda: memory_guard(host_probe=over(0.1), device_probe=no_device),
    "ttl_cache": lambda: ttl_cache(clock=FakeClock()),
}


def scale(x: torch.Tensor, factor: float = 2.0, *, bias: float = 0.0) -> torch.Tensor:
    """Scale x."""
    return x * factor + bias


@pytest.mark.parametrize("make", EVERY_DECORATOR.values(), ids=EVERY_DECORATOR.keys())
def test_decorated_function_keeps_name_doc_signature_and_result(make: Callable[[], Advice]) -> None:
    wrapped = make()(scale)
    assert wrapped is not scale
    assert wrapped.__name__ == "scale" and wrapped.__doc__ == "Scale x."
    assert getattr(wrapped, "__wrapped__", None) is scale
    assert inspect.signature(wrapped) == inspect.signature(scale)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert torch.equal(wrapped(torch.ones(2, 2), 3.0, bias=1.0), torch.full((2, 2), 4.0))


@pytest.mark.parametrize("make", EVERY_DECORATOR.values(), ids=EVERY_DECORATOR.keys())
def test_decorated_method_binds_to_its_instance(make: Callable[[], Advice]) -> None:
    class Layer:
        def __init__(self, factor: float) -> None:
            self.factor = factor

        @make()
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.factor

    assert getattr(Layer.forward, "__wrapped__", None) is not None  # decorated, not passed by
    assert list(inspect.signature(Layer(1.0).forward).parameters) == ["x"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert torch.equal(Layer(3.0).forward(torch.ones(2, 2)), torch.full((2, 2), 3.0))
        assert torch.equal(Layer(5.0).forward(torch.ones(2, 2)), torch.full((2, 2), 5.0))


@pytest.mark.parametrize("make", EVERY_DECORATOR.values(), ids=EVERY_DECORATOR.keys())
def test_decorated_async_function_stays_a_coroutine_function(make: Callable[[], Advice]) -> None:
    async def double(x: torch.Tensor) -> torch.Tensor:
        await asyncio.sleep(0)
        return x * 2

    wrapped = make()(double)
    assert getattr(wrapped, "__wrapped__", None) is double
    assert inspect.iscoroutinefunction(wrapped)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = asyncio.run(wrapped(torch.ones(2, 2)))
    assert torch.equal(result, torch.full((2, 2), 2.0))


class Affine(torch.nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x)


@pytest.mark.parametrize("make", EVERY_DECORATOR.values(), ids=EVERY_DECORATOR.keys())
def test_wrap_applies_decorator_to_one_module_and_takes_it_off(make: Callable[[], Advice]) -> None:
    torch.manual_seed(0)
    layer, other = Affine(2, 2), Affine(2, 2)
    x = torch.ones(3, 2)
    expected = layer(x)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with layerswap.wrap(layer, "forward", make()):
            assert "forward" in layer.__dict__
            assert "forward" not in other.__dict__
            assert inspect.signature(layer.forward) == inspect.signature(other.forward)
            assert torch.equal(layer(x), expected)
    assert "forward" not in layer.__dict__


@pytest.mark.parametrize("kind", [classmethod, staticmethod])
def test_decorating_above_classmethod_and_staticmethod_keeps_binding(kind: type) -> None:
    stats = ProfileStats()

    class Factory:
        @profiled(stats, clock=FakeClock())
        @kind
        def make(*args: Any) -> int:
            return len(args)

    # a classmethod receives the class, a staticmethod nothing
    assert Factory.make() == (1 if kind is classmethod else 0)
    assert Factory().make() == (1 if kind is classmethod else 0)
    assert stats["Factory.make"].count == 2


@pytest.mark.parametrize(
    "decorator", [nan_guard, retry, ttl_cache, memory_guard], ids=lambda d: d.__name__
)
def test_bare_decorator_is_the_called_form_with_defaults(decorator: Any) -> None:
    bare = decorator(scale)
    called = decorator()(scale)
    x = torch.ones(2)
    assert torch.equal(bare(x), called(x)) and torch.equal(bare(x), scale(x))
    assert bare.__name__ == "scale" and bare.__wrapped__ is scale


def test_bare_warn_once_runs_the_body_once_per_distinct_arguments() -> None:
    # the lru_cache warn-once idiom: the body logs, once per message
    logged: list[Any] = []

    @warn_once
    def warn_fallback(kernel: Any, *, dtype: str = "fp32") -> str:
        logged.append((kernel, dtype))
        return "warned"

    assert warn_fallback("gelu") == "warned"
    assert warn_fallback("gelu") is None  # not run again
    warn_fallback("gelu", dtype="bf16")
    warn_fallback(["unhashable"])  # lru_cache would raise TypeError here
    warn_fallback(["unhashable"])
    assert logged == [("gelu", "fp32"), ("gelu", "bf16"), (["unhashable"], "fp32")]
    warn_once.reset()
    warn_fallback("gelu")
    assert logged[-1] == ("gelu", "fp32") and len(logged) == 4


def test_bare_warn_once_above_classmethod_and_staticmethod_keeps_the_binding() -> None:
    logged: list[Any] = []

    class Kernels:
        @warn_once
        @classmethod
        def fallback(cls, kernel: str) -> str:
            logged.append((cls.__name__, kernel))
            return "warned"

        @warn_once
        @staticmethod
        def note(kernel: str) -> None:
            logged.append(kernel)

    assert Kernels.fallback("gelu") == "warned"
    assert Kernels.fallback("gelu") is None
    Kernels.note("silu")
    Kernels().note("silu")
    assert logged == [("Kernels", "gelu"), "silu"]


def test_bare_warn_once_body_runs_once_when_threads_race() -> None:
    import threading

    runs: list[int] = []
    barrier = threading.Barrier(8)

    @warn_once
    def note(key: str) -> None:
        runs.append(1)

    def call() -> None:
        barrier.wait()
        note("same")

    threads = [threading.Thread(target=call) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert runs == [1]


def test_retry_and_ttl_cache_look_up_the_clock_and_sleep_when_called() -> None:
    import time
    import unittest.mock

    attempts: list[int] = []

    @retry(max_retries=2, exceptions=ValueError)
    def flaky() -> str:
        attempts.append(1)
        if len(attempts) < 3:
            raise ValueError("not yet")
        return "ok"

    with unittest.mock.patch.object(time, "sleep") as sleep:  # patched after decoration
        assert flaky() == "ok"
    assert sleep.call_count == 2

    now = [100.0]

    @ttl_cache(ttl=10.0)
    def load(key: str) -> object:
        return object()

    with unittest.mock.patch.object(time, "monotonic", lambda: now[0]):
        first = load("k")
        assert load("k") is first
        now[0] += 11.0  # past the ttl on the patched clock
        assert load("k") is not first


def test_profiled_needs_its_parentheses_because_a_sink_may_be_a_function() -> None:
    seen: list[tuple[str, float]] = []

    def sink(key: str, seconds: float) -> None:
        seen.append((key, seconds))

    decorated = profiled(sink, clock=FakeClock())(scale)
    decorated(1.0)
    assert [key for key, _ in seen] == ["scale"]


# -- profiled ----------------------------------------------------------------------


def test_profiled_records_each_call_into_stats_with_the_injected_clock() -> None:
    clock, stats = FakeClock(), ProfileStats()

    @profiled(stats, clock=clock)
    def step(seconds: float) -> str:
        clock.advance(seconds)
        return "done"

    assert step(0.25) == "done"
    step(0.75)
    entry = stats["step"]  # the enclosing test function is left out of the key
    assert (entry.count, entry.total, entry.max, entry.min, entry.mean) == (2, 1.0, 0.75, 0.25, 0.5)


def test_profiled_keys_methods_by_class_and_wrap_by_the_instance_class() -> None:
    clock, stats = FakeClock(), ProfileStats()

    class Block:
        @profiled(stats, clock=clock)
        def forward(self) -> None:
            clock.advance(1.0)

        def backward(self) -> None:
            clock.advance(2.0)

    class FusedBlock(Block):
        pass

    FusedBlock().forward()  # decorator form: the qualified name
    block = FusedBlock()
    with layerswap.wrap(block, "backward", profiled(stats, clock=clock)):
        block.backward()  # through wrap: the instance's own class
    assert set(stats) == {
        "Block.forward",
        "FusedBlock.backward",
    }


def test_profiled_name_overrides_the_key() -> None:
    stats = ProfileStats()
    profiled(stats, name="encoder", clock=FakeClock())(scale)(torch.ones(1))
    assert list(stats) == ["encoder"]


def test_profiled_times_calls_that_raise_and_reraises() -> None:
    clock, seen = FakeClock(), []

    @profiled(lambda key, seconds: seen.append((key, seconds)), name="boom", clock=clock)
    def boom() -> None:
        clock.advance(0.5)
        raise KeyError("x")

    with pytest.raises(KeyError):
        boom()
    assert seen == [("boom", 0.5)]


def test_profiled_logs_to_a_logger_at_the_chosen_level(caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock()
    logger = logging.getLogger("test.profiled")

    @profiled(logger, name="embed", level=logging.INFO, clock=clock)
    def embed() -> None:
        clock.advance(0.0125)

    with caplog.at_level(logging.INFO, logger="test.profiled"):
        embed()
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (logging.INFO, "embed took 12.500 ms")
    ]


def test_profiled_fills_a_plain_dict_with_timing_stats() -> None:
    clock, sink = FakeClock(), dict[str, TimingStats]()

    @profiled(sink, name="f", clock=clock)
    def f() -> None:
        clock.advance(2.0)

    f()
    f()
    assert sink == {"f": TimingStats(count=2, total=4.0, max=2.0, min=2.0)}


def test_profiled_async_time_covers_the_awaited_work() -> None:
    clock, stats = FakeClock(), ProfileStats()

    @profiled(stats, name="fetch", clock=clock)
    async def fetch() -> int:
        await asyncio.sleep(0)
        clock.advance(3.0)  # happens only once the coroutine runs
        return 7

    assert asyncio.run(fetch()) == 7
    assert stats["fetch"].total == 3.0


def test_profiled_through_wrap_times_the_awaited_work_of_an_async_method() -> None:
    clock, stats = FakeClock(), ProfileStats()

    class Client:
        async def fetch(self) -> int:
            await asyncio.sleep(0)
            clock.advance(4.0)
            return 1

    client = Client()
    with layerswap.wrap(client, "fetch", profiled(stats, clock=clock)):
        assert asyncio.run(client.fetch()) == 1
    assert (stats["Client.fetch"].count, stats["Client.fetch"].total) == (1, 4.0)


def test_profiled_cuda_sync_still_times_where_cuda_is_absent() -> None:
    clock, stats = FakeClock(), ProfileStats()

    @profiled(stats, name="f", cuda_sync=True, clock=clock)
    def f() -> None:
        clock.advance(1.0)

    f()
    assert stats["f"].count == 1 and stats["f"].total == 1.0


def test_profiled_refuses_a_sink_it_cannot_use() -> None:
    with pytest.raises(TypeError, match="sink must be"):
        profiled(42)  # type: ignore[arg-type]


def test_profiling_context_manager_times_a_block_even_when_it_raises() -> None:
    clock, stats = FakeClock(), ProfileStats()
    with profiling("load", stats, clock=clock):
        clock.advance(1.5)
    with pytest.raises(RuntimeError), profiling("load", stats, clock=clock):
        clock.advance(0.5)
        raise RuntimeError
    assert (stats["load"].count, stats["load"].total) == (2, 2.0)


def test_profile_stats_table_lists_keys_sorted_by_total() -> None:
    stats = ProfileStats()
    stats.record("small", 0.001)
    stats.record("big", 0.010)
    stats.record("big", 0.030)
    lines = stats.table().splitlines()
    assert lines[0].split() == ["key", "calls", "total", "ms", "mean", "ms", "max", "ms"]
    assert lines[2].split() == ["big", "2", "40.000", "20.000", "30.000"]
    assert lines[3].split() == ["small", "1", "1.000", "1.000", "1.000"]
    assert [line.split()[0] for line in stats.table(sort_by=None).splitlines()[2:]] == [
        "small",
        "big",
    ]
    assert str(stats) == stats.table()
    with pytest.raises(ValueError, match="sort_by"):
        stats.table(sort_by="median")


def test_profile_stats_stays_consistent_under_threads() -> None:
    stats = ProfileStats()

    def hammer() -> None:
        for _ in range(2000):
            stats("k", 0.5)

    threads = [threading.Thread(target=hammer) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert (stats["k"].count, stats["k"].total) == (8000, 4000.0)


# -- empty_device_cache --------------------------------------------------------------


def test_empty_device_cache_collects_after_each_call_when_enabled(
    gc_runs: list[int], switch_on: None
) -> None:
    during: list[int] = []

    @empty_device_cache
    def step() -> None:
        during.append(len(gc_runs))

    step()
    step()
    assert during == [0, 1]  # the collection comes after the call, not before
    assert len(gc_runs) == 2


def test_empty_device_cache_does_nothing_when_disabled(gc_runs: list[int]) -> None:
    empty_device_cache.disable()

    @empty_device_cache
    def step() -> int:
        return 1

    assert step() == 1
    with empty_device_cache:
        pass
    assert gc_runs == []


def test_empty_device_cache_context_manager_collects_on_exit_and_on_error(
    gc_runs: list[int], switch_on: None
) -> None:
    with empty_device_cache:
        assert gc_runs == []
    assert len(gc_runs) == 1
    with pytest.raises(ValueError), empty_device_cache():
        raise ValueError
    assert len(gc_runs) == 2


def test_empty_device_cache_frees_reference_cycles_left_by_the_call(switch_on: None) -> None:
    class Node:
        pass

    refs: list[weakref.ref[Node]] = []

    @empty_device_cache
    def leave_cycle() -> None:
        node = Node()
        node.self = node  # type: ignore[attr-defined]
        refs.append(weakref.ref(node))

    gc.disable()
    try:
        leave_cycle()
        assert refs[0]() is None
    finally:
        gc.enable()


def test_empty_device_cache_through_wrap_collects_after_the_forward(
    gc_runs: list[int], switch_on: None
) -> None:
    layer = Affine(2, 2)
    with layerswap.wrap(layer, "forward", empty_device_cache):
        layer(torch.ones(1, 2))
        assert len(gc_runs) == 1
    layer(torch.ones(1, 2))
    assert len(gc_runs) == 1  # unwrapped again


def test_empty_device_cache_switch_is_process_wide() -> None:
    before = empty_device_cache.enabled
    try:
        empty_device_cache.enable()
        assert empty_device_cache().enabled is True  # the call form is the same switch
        empty_device_cache.disable()
        assert empty_device_cache.enabled is False
        empty_device_cache.enabled = True
        assert "enabled=True" in repr(empty_device_cache)
    finally:
        empty_device_cache.enabled = before


def test_empty_device_cache_switch_starts_from_the_environment() -> None:
    code = "from layerswap.decorators import empty_device_cache as e; print(e.enabled)"
    env = {**os.environ, "LAYERSWAP_EMPTY_DEVICE_CACHE": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.stdout.strip() == "True", out.stderr


def test_empty_cache_empties_only_available_accelerators() -> None:
    emptied = empty_cache()
    available = {
        name
        for name in ("cuda", "xpu", "npu")
        if getattr(getattr(torch, name, None), "is_available", lambda: False)()
    }
    if torch.backends.mps.is_available():
        available.add("mps")
    assert set(emptied) == available


# -- warn_once -------------------------------------------------------------------------


def test_warn_once_warns_on_the_first_call_only() -> None:
    @warn_once("{func}() is slow on CPU", category=RuntimeWarning)
    def attend() -> int:
        return 1

    with pytest.warns(RuntimeWarning, match=r"^attend\(\) is slow on CPU$") as record:
        assert attend() == 1
    assert len(record) == 1
    assert record[0].filename == __file__  # points at the caller, not into layerswap
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert attend() == 1


def test_warn_once_default_message_names_the_function() -> None:
    @warn_once()
    def old_api() -> None:
        pass

    with pytest.warns(UserWarning, match=r"old_api\(\) is deprecated"):
        old_api()


def test_warn_once_with_a_key_function_warns_once_per_key() -> None:
    @warn_once("no fused kernel for {key}", key=lambda x: x.dtype)
    def gelu(x: torch.Tensor) -> torch.Tensor:
        return x

    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for dtype in (torch.float16, torch.float16, torch.bfloat16, torch.float16):
            gelu(torch.zeros(1, dtype=dtype))
    assert [str(w.message) for w in record] == [
        "no fused kernel for torch.float16",
        "no fused kernel for torch.bfloat16",
    ]


def test_warn_once_is_shared_between_decorators_and_messages_and_reset_rearms() -> None:
    @warn_once("shared note")
    def a() -> None:
        pass

    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        a()
        assert warn_once_message("shared note") is False  # already emitted by a()
        assert warn_once_message("shared note", key="layer 3") is True
        warn_once.reset()
        a()
    assert [str(w.message) for w in record] == ["shared note"] * 3


def test_warn_once_message_points_at_its_caller_with_stacklevel_one() -> None:
    with pytest.warns(UserWarning) as record:
        warn_once_message("here", stacklevel=1)
    assert record[0].filename == __file__


def test_warn_once_through_wrap_warns_once_per_process() -> None:
    layer = torch.nn.Identity()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        with layerswap.wrap(layer, "forward", warn_once("identity is a no-op")):
            layer(torch.zeros(1))
            layer(torch.zeros(1))
    assert [str(w.message) for w in record] == ["identity is a no-op"]
    assert record[0].filename == __file__


# -- retry -------------------------------------------------------------------------------


def test_retry_retries_listed_errors_with_exponential_backoff() -> None:
    sleeper = Sleeper()
    flaky = Flaky(ConnectionError("a"), ConnectionError("b"))
    fetch = retry(3, 0.5, (ConnectionError,), jitter=0.0, sleep=sleeper)(flaky)
    assert fetch(1) == "ok 1"
    assert flaky.calls == 3
    assert sleeper.delays == [0.5, 1.0]


def test_retry_jitter_comes_from_the_injected_random() -> None:
    sleeper = Sleeper()
    flaky = Flaky(OSError(), OSError())
    # rng 0.75 -> u = +0.5 -> delay * (1 + 0.2 * 0.5)
    retry(backoff_factor=1.0, jitter=0.2, sleep=sleeper, rng=lambda: 0.75)(flaky)(0)
    assert sleeper.delays == pytest.approx([1.1, 2.2])
    assert retry(backoff_factor=1.0, jitter=0.2, rng=lambda: 0.0).delay(0) == pytest.approx(0.8)


def test_retry_caps_the_delay_at_max_delay() -> None:
    policy = retry(10, backoff_factor=1.0, jitter=0.0, max_delay=5.0)
    assert [policy.delay(n) for n in range(5)] == [1.0, 2.0, 4.0, 5.0, 5.0]


def test_retry_lets_unlisted_errors_through_at_once() -> None:
    flaky = Flaky(KeyError("not transient"))
    with pytest.raises(KeyError):
        retry(exceptions=(ConnectionError,), sleep=never_sleep)(flaky)(0)
    assert flaky.calls == 1


def test_retry_reraises_the_last_error_when_exhausted(caplog: pytest.LogCaptureFixture) -> None:
    errors = [TimeoutError(f"try {i}") for i in range(3)]
    sleeper = Flaky(*errors)
    delays = Sleeper()
    with (
        caplog.at_level(logging.WARNING, logger="layerswap.decorators.retry"),
        pytest.raises(TimeoutError) as excinfo,
    ):
        retry(2, exceptions=TimeoutError, sleep=delays, jitter=0.0)(sleeper)(0)
    assert excinfo.value is errors[-1]
    assert sleeper.calls == 3 and len(delays.delays) == 2
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2
    assert "raised TimeoutError: try 0; retry 1 of 2 in 0.50 s" in messages[0]


def test_retry_logs_to_the_given_logger(caplog: pytest.LogCaptureFixture) -> None:
    logger = logging.getLogger("test.retry")
    with caplog.at_level(logging.WARNING, logger="test.retry"):
        retry(logger=logger, sleep=Sleeper())(Flaky(ValueError("x")))(0)
    assert [r.name for r in caplog.records] == ["test.retry"]


def test_retry_async_uses_the_async_sleep() -> None:
    sleeper = Sleeper()
    flaky = Flaky(ConnectionError(), ConnectionError())

    @retry(jitter=0.0, sleep=never_sleep, async_sleep=sleeper.async_sleep)
    async def fetch(x: int) -> str:
        await asyncio.sleep(0)
        return flaky(x)

    assert asyncio.run(fetch(2)) == "ok 2"
    assert sleeper.delays == [0.5, 1.0]


def test_retry_through_wrap_retries_a_module_forward() -> None:
    layer = torch.nn.Identity()
    flaky = Flaky(RuntimeError("CUDA error: launch failure"))

    def forward(x: torch.Tensor) -> torch.Tensor:
        flaky(0)
        return x

    layer.forward = forward  # type: ignore[method-assign,assignment]
    with layerswap.wrap(layer, "forward", retry(sleep=Sleeper())):
        assert torch.equal(layer(torch.ones(1)), torch.ones(1))
    assert flaky.calls == 2


def test_retry_refuses_nonsense() -> None:
    with pytest.raises(TypeError, match="exception types"):
        retry(exceptions=("ValueError",))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="jitter"):
        retry(jitter=2.0)
    with pytest.raises(TypeError, match="max_retries"):
        retry(-1)


# -- validate_tensors ----------------------------------------------------------------------


@validate_tensors(x=("batch", "dim"), mask=("batch",))
def masked_sum(x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    return x.sum(-1) if mask is None else x.sum(-1) * mask


def test_validate_tensors_accepts_agreeing_shapes_and_skips_none() -> None:
    assert masked_sum(torch.ones(2, 3), torch.ones(2)).tolist() == [3.0, 3.0]
    assert masked_sum(torch.ones(4, 3)).tolist() == [3.0] * 4
    assert masked_sum(torch.ones(4, 3), mask=None).tolist() == [3.0] * 4


def test_validate_tensors_names_the_disagreeing_dimension() -> None:
    with pytest.raises(ValueError) as excinfo:
        masked_sum(torch.ones(2, 3), torch.ones(3))
    assert (
        str(excinfo.value)
        == "masked_sum(): argument 'mask' dim 0 ('batch') is 3, but 'x' set batch=2"
    )
    with pytest.raises(ValueError, match="'mask' dim 0"):
        masked_sum(x=torch.ones(2, 3), mask=torch.ones(3))  # by keyword too


def test_validate_tensors_checks_rank_fixed_sizes_and_repeated_names() -> None:
    @validate_tensors(w=("n", "n"), b=(4,), h=(None, 8))
    def f(w: torch.Tensor, b: torch.Tensor, h: torch.Tensor) -> None:
        pass

    f(torch.zeros(3, 3), torch.zeros(4), torch.zeros(5, 8))
    with pytest.raises(ValueError, match=r"'w' has 3 dims \(shape \(3, 3, 3\)\), expected 2"):
        f(torch.zeros(3, 3, 3), torch.zeros(4), torch.zeros(5, 8))
    with pytest.raises(ValueError, match=r"'w' dim 1 \('n'\) is 2, but itself set n=3"):
        f(torch.zeros(3, 2), torch.zeros(4), torch.zeros(5, 8))
    with pytest.raises(ValueError, match=r"'b' dim 0 is 5, expected 4 \(shape \(5,\)\)"):
        f(torch.zeros(3, 3), torch.zeros(5), torch.zeros(5, 8))
    with pytest.raises(ValueError, match=r"'h' dim 1 is 7, expected 8"):
        f(torch.zeros(3, 3), torch.zeros(4), torch.zeros(5, 7))


def test_validate_tensors_ellipsis_matches_any_number_of_leading_dims() -> None:
    @validate_tensors(x=(..., "hidden"), w=("out", "hidden"))
    def project(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x @ w.T

    assert project(torch.ones(8), torch.ones(2, 8)).shape == (2,)
    assert project(torch.ones(2, 3, 8), torch.ones(2, 8)).shape == (2, 3, 2)
    with pytest.raises(ValueError, match=r"'w' dim 1 \('hidden'\) is 4, but 'x' set hidden=8"):
        project(torch.ones(2, 3, 8), torch.ones(2, 4))
    with pytest.raises(ValueError, match="expected at least 1"):
        project(torch.tensor(1.0), torch.ones(2, 1))


def test_validate_tensors_checks_dtype_device_and_type() -> None:
    @validate_tensors(x=None, dtype=(torch.float32, torch.bfloat16), device="cpu")
    def f(x: Any) -> None:
        pass

    f(torch.zeros(2))
    f(torch.zeros(2, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match=r"'x' has dtype torch.int64, expected torch.float32 or"):
        f(torch.zeros(2, dtype=torch.int64))
    with pytest.raises(ValueError, match="'x' is on meta, expected cpu"):
        f(torch.zeros(2, device="meta"))
    with pytest.raises(TypeError, match=r"'x' must be a torch\.Tensor, got list"):
        f([1.0, 2.0])


def test_validate_tensors_on_a_method_skips_self() -> None:
    class Attention:
        @validate_tensors(q=("b", "d"), k=("b", "d"))
        def forward(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
            return q * k

    Attention().forward(torch.ones(2, 3), k=torch.ones(2, 3))
    with pytest.raises(ValueError, match=r"Attention\.forward\(\): argument 'k' dim 1"):
        Attention().forward(torch.ones(2, 3), torch.ones(2, 4))


def test_validate_tensors_through_wrap_on_a_live_module() -> None:
    layer = torch.nn.Linear(4, 2)
    with layerswap.wrap(layer, "forward", validate_tensors(input=("batch", 4))):
        assert layer(torch.ones(3, 4)).shape == (3, 2)
        with pytest.raises(ValueError, match=r"Linear\.forward\(\): argument 'input' dim 1 is 5"):
            layer(torch.ones(3, 5))
    assert "forward" not in layer.__dict__


def test_validate_tensors_finds_arguments_passed_through_kwargs() -> None:
    @validate_tensors(mask=("n",))
    def f(**kwargs: Any) -> int:
        return len(kwargs)

    assert f(mask=torch.ones(3)) == 1
    with pytest.raises(ValueError, match="'mask' has 2 dims"):
        f(mask=torch.ones(3, 1))


def test_validate_tensors_rejects_bad_specs_when_decorating() -> None:
    with pytest.raises(TypeError, match=r"has no argument 'y'"):
        validate_tensors(y=("n",))(scale)
    with pytest.raises(TypeError, match="not a name, a size"):
        validate_tensors(x=("n", -1))
    with pytest.raises(ValueError, match=r"more than one \.\.\."):
        validate_tensors(x=(..., "n", ...))
    with pytest.raises(TypeError, match="at least one"):
        validate_tensors()


# -- nan_guard ------------------------------------------------------------------------------


def test_nan_guard_raises_naming_the_function() -> None:
    @nan_guard()
    def normalize(x: torch.Tensor) -> torch.Tensor:
        return x / x.sum()

    assert torch.equal(normalize(torch.ones(2)), torch.full((2,), 0.5))
    with pytest.raises(
        FloatingPointError, match=r"normalize\(\) returned non-finite values: 2 NaN"
    ):
        normalize(torch.zeros(2))


def test_nan_guard_names_the_bad_field_of_a_model_output() -> None:
    @nan_guard()
    def head() -> CausalLMOutputWithPast:
        logits = torch.zeros(1, 2, 4)
        logits[0, 1, 3] = float("inf")
        return CausalLMOutputWithPast(
            loss=torch.tensor(1.0), logits=logits, hidden_states=(torch.zeros(2), torch.zeros(2))
        )

    with pytest.raises(FloatingPointError) as excinfo:
        head()
    assert "'logits': 0 NaN and 1 inf of 8 values (shape (1, 2, 4), torch.float32)" in str(
        excinfo.value
    )
    assert "loss" not in str(excinfo.value)


def test_nan_guard_paths_into_nested_tuples_and_dicts() -> None:
    bad = torch.tensor([float("nan")])

    @nan_guard()
    def nested() -> Any:
        return {"hidden_states": (torch.ones(1), bad), "extra": {"scale": bad}}

    @nan_guard()
    def pair() -> tuple[torch.Tensor, torch.Tensor]:
        return torch.ones(1), bad

    with pytest.raises(FloatingPointError) as excinfo:
        nested()
    assert "'hidden_states[1]'" in str(excinfo.value)
    assert "'extra.scale'" in str(excinfo.value)
    with pytest.raises(FloatingPointError, match=r"'output\[1\]'"):
        pair()


def test_nan_guard_no_false_alarm_when_the_sum_overflows() -> None:
    big = torch.full((4,), 3e38)  # finite, but the sum overflows float32
    half = torch.full((4,), 60000.0, dtype=torch.float16)
    assert nan_guard()(lambda: (big, half))() is not None


def test_nan_guard_ignores_integer_tensors_and_other_objects() -> None:
    @nan_guard()
    def f() -> Any:
        return {"ids": torch.tensor([1, 2]), "cache": object(), "n": 3}

    assert f()["n"] == 3


def test_nan_guard_warn_returns_the_value() -> None:
    result = torch.tensor([float("nan")])

    def compute() -> torch.Tensor:
        return result

    guarded = nan_guard(action="warn")(compute)
    with pytest.warns(RuntimeWarning, match="returned non-finite values") as record:
        assert guarded() is result
    assert record[0].filename == __file__


def test_nan_guard_checks_inputs_only_when_asked() -> None:
    def first(x: torch.Tensor, *rest: torch.Tensor, scale: Any = None) -> torch.Tensor:
        return torch.zeros(1)

    nan = torch.tensor([float("nan")])
    assert nan_guard()(first)(nan) is not None
    with pytest.raises(FloatingPointError, match=r"first\(\) received non-finite values: 'x'"):
        nan_guard(check_inputs=True)(first)(nan)
    with pytest.raises(FloatingPointError, match=r"'rest\[1\]'"):
        nan_guard(check_inputs=True)(first)(torch.ones(1), torch.ones(1), nan)
    with pytest.raises(FloatingPointError, match=r"'scale\[0\]'"):
        nan_guard(check_inputs=True)(first)(torch.ones(1), scale=[nan])


def test_nan_guard_through_wrap_finds_the_broken_layer() -> None:
    torch.manual_seed(0)
    first, second = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    model = torch.nn.Sequential(first, second)
    with torch.no_grad():
        second.weight[0, 0] = float("nan")
    guards = [layerswap.wrap(layer, "forward", nan_guard()) for layer in model]
    with layerswap.patches(*guards), pytest.raises(FloatingPointError) as excinfo:
        model(torch.ones(1, 2))
    assert "Linear.forward() returned non-finite values: 1 NaN" in str(excinfo.value)
    assert all("forward" not in layer.__dict__ for layer in model)


# -- memory_guard ------------------------------------------------------------------------------


def test_memory_guard_raises_with_the_numbers_and_skips_the_call() -> None:
    calls = []

    @memory_guard(0.85, action="raise", host_probe=over(0.9), device_probe=no_device)
    def load() -> None:
        calls.append(1)

    with pytest.raises(MemoryError) as excinfo:
        load()
    message = str(excinfo.value)
    assert "load(): host memory 90.0% in use (14.40 GiB of 16.00 GiB)" in message
    assert "85% threshold" in message
    assert calls == []


def test_memory_guard_checks_the_device_probe_too() -> None:
    guard = memory_guard(
        0.5, action="raise", host_probe=over(0.1), device_probe=over(0.75, 8 << 30)
    )
    with pytest.raises(MemoryError, match=r"device memory 75.0% in use \(6.00 GiB of 8.00 GiB\)"):
        guard(scale)(torch.ones(1))


def test_memory_guard_warn_warns_and_runs_the_call() -> None:
    guarded = memory_guard(action="warn", host_probe=over(0.95), device_probe=no_device)(scale)
    with pytest.warns(RuntimeWarning, match="host memory 95.0%") as record:
        assert torch.equal(guarded(torch.ones(1)), torch.full((1,), 2.0))
    assert record[0].filename == __file__


def test_memory_guard_gc_collects_then_runs_and_logs_if_still_over(
    gc_runs: list[int], caplog: pytest.LogCaptureFixture
) -> None:
    guarded = memory_guard(host_probe=over(0.9), device_probe=no_device)(scale)
    with caplog.at_level(logging.INFO, logger="layerswap.decorators.memory"):
        assert torch.equal(guarded(torch.ones(1)), torch.full((1,), 2.0))
    assert len(gc_runs) == 1
    assert [r.levelno for r in caplog.records] == [logging.INFO, logging.WARNING]
    assert "still over the 85% threshold after gc" in caplog.records[1].getMessage()


def test_memory_guard_gc_is_quiet_when_collection_helps(
    gc_runs: list[int], caplog: pytest.LogCaptureFixture
) -> None:
    readings = iter([0.9, 0.5])
    guarded = memory_guard(host_probe=lambda: over(next(readings))(), device_probe=no_device)(scale)
    with caplog.at_level(logging.WARNING, logger="layerswap.decorators.memory"):
        guarded(torch.ones(1))
    assert len(gc_runs) == 1 and caplog.records == []


def test_memory_guard_under_threshold_does_nothing(gc_runs: list[int]) -> None:
    guarded = memory_guard(0.85, action="raise", host_probe=over(0.84), device_probe=no_device)
    assert torch.equal(guarded(scale)(torch.ones(1)), torch.full((1,), 2.0))
    assert gc_runs == []


def test_memory_guard_interval_limits_how_often_it_probes() -> None:
    clock, probes = FakeClock(), []

    def probe() -> MemoryUsage:
        probes.append(clock())
        return MemoryUsage(1, 10)

    guarded = memory_guard(host_probe=probe, device_probe=no_device, interval=5.0, clock=clock)(
        scale
    )
    for _ in range(4):  # at 100, 102, 104, 106
        guarded(torch.ones(1))
        clock.advance(2.0)
    assert probes == [100.0, 106.0]


def test_memory_guard_through_wrap_stops_a_forward_over_the_threshold() -> None:
    layer = Affine(2, 2)
    guard = memory_guard(0.9, action="raise", host_probe=over(0.1), device_probe=over(0.95))
    with (
        layerswap.wrap(layer, "forward", guard),
        pytest.raises(MemoryError, match=r"Affine\.forward"),
    ):
        layer(torch.ones(1, 2))
    assert layer(torch.ones(1, 2)).shape == (1, 2)


def test_memory_guard_threshold_must_be_a_fraction() -> None:
    with pytest.raises(ValueError, match=r"did you mean 0\.85"):
        memory_guard(85)
    with pytest.raises(ValueError, match="action"):
        memory_guard(action="panic")


def test_default_memory_probes_read_this_machine() -> None:
    host = host_memory()
    assert host.total > 0 and 0.0 < host.fraction < 1.0
    assert device_memory("cpu") is None
    if not torch.cuda.is_available():
        assert device_memory() is None


# -- ttl_cache ------------------------------------------------------------------------------


def counted(func: Callable[..., Any]) -> tuple[Callable[..., Any], list[Any]]:
    """``func`` that appends each call's first argument to a list (tensors: their repr)."""
    calls: list[Any] = []

    def counting(*args: Any, **kwargs: Any) -> Any:
        first = args[0] if args else None
        calls.append(repr(first) if isinstance(first, torch.Tensor) else first)
        return func(*args, **kwargs)

    return counting, calls


def test_ttl_cache_hits_until_the_entry_expires() -> None:
    clock = FakeClock()
    square, calls = counted(lambda n: [n * n])
    cached = ttl_cache(ttl=10.0, clock=clock)(square)
    first = cached(3)
    clock.advance(9.9)
    assert cached(3) is first
    clock.advance(0.1)
    assert cached(3) == [9] and cached(3) is not first
    assert len(calls) == 2
    assert cached.cache_info() == CacheInfo(hits=2, misses=2, maxsize=128, currsize=1, ttl=10.0)


def test_ttl_cache_evicts_the_least_recently_used() -> None:
    square, calls = counted(lambda n: n * n)
    cached = ttl_cache(maxsize=2, clock=FakeClock())(square)
    cached(1)
    cached(2)
    cached(1)  # 2 is now the least recently used
    cached(3)
    cached(1)
    cached(2)
    assert calls == [1, 2, 3, 2]
    assert cached.cache_info().currsize == 2


def test_ttl_cache_keys_keyword_and_positional_separately_and_clears() -> None:
    f, calls = counted(lambda a, b=0: a + b)
    cached = ttl_cache(clock=FakeClock())(f)
    cached(1, 2)
    cached(1, b=2)
    cached(1, b=2)
    assert len(calls) == 2
    cached.cache_clear()
    assert cached.cache_info() == CacheInfo(0, 0, 128, 0, 60.0)
    cached(1, 2)
    assert len(calls) == 3


def test_ttl_cache_same_tensor_hits_and_in_place_change_misses() -> None:
    total, calls = counted(lambda t: float(t.sum()))
    cached = ttl_cache(clock=FakeClock())(total)
    x = torch.ones(3)
    assert cached(x) == 3.0
    assert cached(x) == 3.0
    x.add_(1)  # bumps the version counter
    assert cached(x) == 6.0
    assert cached(torch.full((3,), 2.0)) == 6.0  # equal but a different tensor: computed
    assert len(calls) == 3


def test_ttl_cache_holds_keyed_tensors_so_their_id_cannot_be_reused() -> None:
    cached = ttl_cache(clock=FakeClock())(lambda t: t.shape)
    x = torch.ones(2)
    alive = weakref.ref(x)
    cached(x)
    del x
    gc.collect()
    assert alive() is not None  # the entry keeps it: no new tensor can get its id
    cached.cache_clear()
    gc.collect()
    assert alive() is None


def test_ttl_cache_content_keys_share_equal_tensors_and_hold_nothing() -> None:
    total, calls = counted(lambda t: float(t.sum()))
    cached = ttl_cache(clock=FakeClock(), tensors="content")(total)
    x = torch.ones(3)
    alive = weakref.ref(x)
    cached(x)
    cached(torch.ones(3))
    cached(torch.ones(3, dtype=torch.float64))  # same values, other dtype: another key
    x.add_(1)
    cached(x)
    assert len(calls) == 3
    del x
    gc.collect()
    assert alive() is None


def test_ttl_cache_keys_inference_tensors_by_content() -> None:
    total, calls = counted(lambda t: float(t.sum()))
    cached = ttl_cache(clock=FakeClock())(total)
    with torch.inference_mode():
        x = torch.ones(3)
        assert cached(x) == 3.0
        assert cached(x) == 3.0
        x.add_(1)  # no version counter here, but the content changed
        assert cached(x) == 6.0
    assert len(calls) == 2


def test_ttl_cache_tensors_inside_tuples_and_lists_are_keyed_too() -> None:
    total, calls = counted(lambda ts: sum(float(t.sum()) for t in ts))
    cached = ttl_cache(clock=FakeClock())(total)
    x = torch.ones(2)
    assert cached([x, x]) == 4.0
    assert cached([x, x]) == 4.0
    x.mul_(2)
    assert cached([x, x]) == 8.0
    assert len(calls) == 2


def test_ttl_cache_refuses_unhashable_arguments_clearly() -> None:
    cached = ttl_cache()(lambda s: s)
    with pytest.raises(TypeError, match=r"unhashable argument"):
        cached({1, 2})


def test_ttl_cache_separates_instances_of_a_method() -> None:
    class Rotary:
        def __init__(self, base: float) -> None:
            self.base = base
            self.calls = 0

        @ttl_cache(clock=FakeClock())
        def freqs(self, n: int) -> float:
            self.calls += 1
            return self.base * n

    a, b = Rotary(1.0), Rotary(10.0)
    assert (a.freqs(2), b.freqs(2), a.freqs(2)) == (2.0, 20.0, 2.0)
    assert (a.calls, b.calls) == (1, 1)


def test_ttl_cache_through_wrap_keeps_instances_apart() -> None:
    clock = FakeClock()
    cache = ttl_cache(clock=clock)
    torch.manual_seed(0)
    first, second = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    x = torch.ones(1, 2)
    with layerswap.wrap(first, "forward", cache), layerswap.wrap(second, "forward", cache):
        a1, b1 = first(x), second(x)
        assert first(x) is a1 and second(x) is b1
        assert not torch.equal(a1, b1)
    assert cache.cache_info().hits == 2 and cache.cache_info().misses == 2


def test_ttl_cache_async_caches_the_awaited_value() -> None:
    calls = []

    @ttl_cache(clock=FakeClock())
    async def lookup(n: int) -> int:
        calls.append(n)
        await asyncio.sleep(0)
        return n + 1

    async def main() -> list[int]:
        return [await lookup(1), await lookup(1), await lookup(2)]

    assert asyncio.run(main()) == [2, 2, 3]
    assert calls == [1, 2]


def test_ttl_cache_maxsize_zero_caches_nothing() -> None:
    f, calls = counted(lambda n: n)
    cached = ttl_cache(maxsize=0)(f)
    cached(1)
    cached(1)
    assert len(calls) == 2


def test_ttl_cache_stays_consistent_under_threads() -> None:
    cached = ttl_cache(maxsize=8, clock=FakeClock())(lambda n: n * 2)
    errors: list[BaseException] = []

    def hammer(offset: int) -> None:
        try:
            for i in range(500):
                assert cached((i + offset) % 16) == ((i + offset) % 16) * 2
        except BaseException as error:  # surfaced below
            errors.append(error)

    threads = [threading.Thread(target=hammer, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    info = cached.cache_info()
    assert errors == []
    assert info.hits + info.misses == 2000
    assert info.currsize <= 8


# -- the example ---------------------------------------------------------------------------


def test_profile_layers_example_runs_and_restores_the_model(
    capsys: pytest.CaptureFixture[str],
) -> None:
    runpy.run_path(str(REPO / "examples" / "profile_layers.py"), run_name="__main__")
    out = capsys.readouterr().out
    assert [line.split()[:2] for line in out.splitlines()[2:]] == [
        [f"model.layers.{i}", "1"] for i in range(4)
    ]


# --- the Advice base: hooks make both faces --------------------------------------------


def test_advice_subclass_hooks_run_around_sync_and_async_calls_and_through_wrap():
    import asyncio
    import types

    from layerswap.decorators import Advice

    events: list[str] = []

    class traced(Advice):
        def _before(self, wrapped, instance, args, kwargs):
            events.append(f"before {args}")
            return "token"

        def _after(self, wrapped, instance, token):
            events.append(f"after {token}")

    @traced()
    def add(a, b):
        events.append("call")
        return a + b

    @traced()
    async def slow_add(a, b):
        return a + b

    assert add(1, 2) == 3
    assert asyncio.run(slow_add(3, 4)) == 7
    module = types.ModuleType("advice_target")
    module.add = lambda a, b: a * b
    with layerswap.wrap(module, "add", traced()):
        assert module.add(2, 5) == 10
    assert events == [
        "before (1, 2)", "call", "after token",
        "before (3, 4)", "after token",
        "before (2, 5)", "after token",
    ]  # fmt: skip


def test_advice_subclass_with_an_unsupported_set_of_hooks_is_refused_at_definition():
    from layerswap.decorators import Advice

    with pytest.raises(TypeError, match="no advice has that shape"):

        class broken(Advice):
            def _returned(self, wrapped, instance, token, result):
                pass


@pytest.mark.parametrize("decorator", [ttl_cache, retry], ids=lambda d: d.__name__)
def test_a_generator_function_is_refused_where_the_advice_would_do_nothing(decorator: Any) -> None:
    """A generator function's call returns the generator before any of its code runs: a
    cache would hand later callers an exhausted one, a retry would never see it raise."""

    def numbers() -> Iterator[int]:
        yield 1

    async def streamed() -> Any:
        yield 1

    with pytest.raises(TypeError, match=r"numbers, a generator function: "):
        decorator(numbers)
    with pytest.raises(TypeError, match=r"streamed, a generator function: "):
        decorator()(streamed)


def test_ttl_cache_sees_a_tensor_changed_in_place_inside_a_namedtuple() -> None:
    from collections import namedtuple

    Pair = namedtuple("Pair", "a b")
    cached = ttl_cache(clock=FakeClock())(lambda pair: float(pair.a.sum() + pair.b.sum()))
    pair = Pair(torch.ones(2), torch.ones(1))
    assert cached(pair) == 3.0
    pair.a.add_(1)
    assert cached(pair) == 5.0  # recomputed: the tensor's version is in the key
    assert cached(Pair(torch.ones(2), torch.ones(1))) == 3.0


def test_memory_guard_keeps_refusing_until_it_probes_again() -> None:
    """With an interval, the calls between two probes are judged by the last one: a call
    refused for memory is not let through by the next, unprobed one."""
    clock, usage = FakeClock(), [0.9]
    guarded = memory_guard(
        0.5,
        action="raise",
        host_probe=lambda: MemoryUsage(int(usage[0] * 100), 100),
        device_probe=no_device,
        interval=5.0,
        clock=clock,
    )(scale)
    for _ in range(2):
        with pytest.raises(MemoryError, match="50% threshold"):
            guarded(torch.ones(1))
        clock.advance(1.0)
    usage[0] = 0.1
    clock.advance(5.0)  # probed again: under the threshold now
    assert torch.equal(guarded(torch.ones(1)), torch.full((1,), 2.0))


def test_a_decorated_generator_function_stays_one() -> None:
    """``inspect.isgeneratorfunction`` (pytest fixtures, FastAPI dependencies) still
    answers for the decorated function; values, ``send`` and ``close`` go through."""
    closed: list[str] = []

    @nan_guard
    def numbers(n: int) -> Iterator[torch.Tensor]:
        try:
            for i in range(n):
                got = yield torch.full((1,), float(i))
                if got is not None:
                    yield got
        finally:
            closed.append("closed")

    @nan_guard
    async def streamed(n: int) -> Any:
        for i in range(n):
            yield i

    assert inspect.isgeneratorfunction(numbers) and inspect.isasyncgenfunction(streamed)
    assert [float(t) for t in numbers(3)] == [0.0, 1.0, 2.0]
    running = numbers(3)
    next(running)
    assert float(running.send(torch.full((1,), 7.0))) == 7.0
    running.close()
    assert closed == ["closed", "closed"]

    async def collect() -> list[int]:
        return [i async for i in streamed(3)]

    assert asyncio.run(collect()) == [0, 1, 2]
