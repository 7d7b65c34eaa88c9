"""Thread storm: many threads start and stop nested patches of one target in random order."""

from __future__ import annotations

import random
import threading

import layerswap


class Target:
    value = "original"


def test_thread_storm_keeps_the_stack_consistent():
    original = Target.__dict__["value"]
    errors: list[BaseException] = []
    barrier = threading.Barrier(8)

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        live = []
        try:
            barrier.wait()
            for step in range(1500):
                if live and (rng.random() < 0.5 or len(live) > 6):
                    live.pop(rng.randrange(len(live))).stop()  # any order, not LIFO
                else:
                    live.append(layerswap.patch(Target, "value", f"t{seed}-{step}").start())
                seen = Target.value
                # A reader sees a complete value: the original or some thread's patch.
                assert seen == "original" or seen.startswith("t"), seen
            for p in reversed(live):
                p.stop()
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]
    assert Target.__dict__["value"] is original
    assert layerswap.active_patches() == []


def test_thread_storm_with_context_managers_and_exceptions():
    original = Target.__dict__["value"]

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        for step in range(500):
            try:
                with layerswap.patch(Target, "value", f"w{seed}-{step}"):
                    if rng.random() < 0.3:
                        raise ValueError
            except ValueError:
                pass

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert Target.__dict__["value"] is original
