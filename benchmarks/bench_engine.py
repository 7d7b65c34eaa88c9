"""Patching engine cost, measured side by side in one run.

1. A patch enter+exit cycle: layerswap.patch against unittest.mock.patch.object,
   unittest.mock.patch (string form) and pytest's MonkeyPatch.
2. Per-call overhead of a layerswap.wrap-ped function against a functools.wraps
   closure doing the same pass-through.

Goals: a cycle at most mock's time in both forms (stretch: half); wrap overhead
at most 1.5x the closure's. Run: ``python benchmarks/bench_engine.py``.
"""

from __future__ import annotations

import functools
import statistics
import sys
import timeit
import types
import unittest.mock

import pytest

import layerswap

target = types.ModuleType("layerswap_bench_target")
target.VALUE = 1
sys.modules[target.__name__] = target


def plain(x: int) -> int:
    return x


target.plain = plain
REPEAT = 7


def best_per_op(stmt: object, number: int) -> float:
    """Median over REPEAT runs of the time per operation, in nanoseconds."""
    timer = timeit.Timer(stmt)  # type: ignore[arg-type]
    return statistics.median(t / number * 1e9 for t in timer.repeat(REPEAT, number))


def cycles(number: int) -> dict[str, float]:
    new = object()

    def layerswap_object() -> None:
        with layerswap.patch(target, "VALUE", new):
            pass

    def layerswap_string() -> None:
        with layerswap.patch("layerswap_bench_target:VALUE", new):
            pass

    def mock_object() -> None:
        with unittest.mock.patch.object(target, "VALUE", new):
            pass

    def mock_string() -> None:
        with unittest.mock.patch("layerswap_bench_target.VALUE", new):
            pass

    def monkeypatch() -> None:
        mp = pytest.MonkeyPatch()
        mp.setattr(target, "VALUE", new)
        mp.undo()

    fns = {
        "layerswap.patch(obj, attr)": layerswap_object,
        "layerswap.patch('mod:attr')": layerswap_string,
        "mock.patch.object": mock_object,
        "mock.patch('mod.attr')": mock_string,
        "pytest MonkeyPatch": monkeypatch,
    }
    results: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(3):  # interleave the contenders
        for name, fn in fns.items():
            results[name].append(best_per_op(fn, number))
    return {k: statistics.median(v) for k, v in results.items()}


def call_overhead(number: int) -> dict[str, float]:
    def advice(wrapped, instance, args, kwargs):  # type: ignore[no-untyped-def]
        return wrapped(*args, **kwargs)

    @functools.wraps(plain)
    def closure(*args, **kwargs):  # type: ignore[no-untyped-def]
        return plain(*args, **kwargs)

    import wrapt

    wrapt_wrapper = wrapt.FunctionWrapper(plain, advice)
    with layerswap.wrap(target, "plain", advice):
        wrapped = target.plain
    fns = {
        "bare call": lambda: plain(1),
        "functools.wraps closure": lambda: closure(1),
        "layerswap.wrap": lambda: wrapped(1),
        "wrapt.FunctionWrapper": lambda: wrapt_wrapper(1),
    }
    results: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(3):
        for name, fn in fns.items():
            results[name].append(best_per_op(fn, number))
    return {k: statistics.median(v) for k, v in results.items()}


def main() -> None:
    print(f"python {sys.version.split()[0]}, layerswap {layerswap.__version__}")
    c = cycles(20_000)
    print("\npatch enter+exit cycle (ns, median)")
    for name, ns in c.items():
        print(f"  {name:32s} {ns:9.0f}")
    r_obj = c["layerswap.patch(obj, attr)"] / c["mock.patch.object"]
    r_str = c["layerswap.patch('mod:attr')"] / c["mock.patch('mod.attr')"]
    r_mp = c["layerswap.patch(obj, attr)"] / c["pytest MonkeyPatch"]
    print(f"  ratio layerswap/mock, object form : {r_obj:.2f}  (goal <= 1.00, stretch 0.50)")
    print(f"  ratio layerswap/mock, string form : {r_str:.2f}  (goal <= 1.00, stretch 0.50)")
    print(f"  ratio layerswap/MonkeyPatch       : {r_mp:.2f}")

    o = call_overhead(500_000)
    bare = o["bare call"]
    print("\nper-call cost (ns, median; overhead = minus the bare call)")
    for name, ns in o.items():
        extra = "" if name == "bare call" else f"   overhead {ns - bare:6.0f}"
        print(f"  {name:32s} {ns:9.0f}{extra}")
    ratio = (o["layerswap.wrap"] - bare) / (o["functools.wraps closure"] - bare)
    print(f"  wrap overhead / closure overhead  : {ratio:.2f}  (goal <= 1.50)")


if __name__ == "__main__":
    main()
