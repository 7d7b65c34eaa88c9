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


def test_storm_while_a_lazy_patchs_module_is_being_imported(make_module):
    """Starts and stops of shared and separate targets, a concurrent start of one shared
    patch object, and a string target that imports the module a lazy patch waits for:
    no thread hangs (a deadlock shows as a thread still alive after join's timeout),
    and everything is restored."""
    import builtins
    import sys

    started, release = threading.Event(), threading.Event()
    gate = f"_ls_storm_gate_{id(started)}"
    setattr(builtins, gate, (started, release))
    name = make_module(
        "storm_lazy",
        f"import builtins\nstarted, release = builtins.{gate}\nstarted.set()\n"
        "release.wait(10)\n\ndef f():\n    return 'original'\n\nVALUE = 1\n",
    )
    lazy = layerswap.patch(f"{name}:f", lambda: "lazy", lazy=True).start()
    shared = layerswap.patch(Target, "value", "shared")
    errors: list[BaseException] = []
    refused: list[int] = []
    barrier = threading.Barrier(6)

    class Other:
        value = "other"

    def importer() -> None:
        __import__(name)

    def resolver() -> None:
        try:
            barrier.wait()
            with layerswap.patch(f"{name}:VALUE", 2):  # resolution imports the module
                assert sys.modules[name].VALUE == 2
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    def stormer(seed: int) -> None:
        rng = random.Random(seed)
        try:
            barrier.wait()
            for step in range(300):
                owner = Target if rng.random() < 0.5 else Other
                with layerswap.patch(owner, "value", f"s{seed}-{step}"):
                    pass
                try:
                    shared.start()
                except layerswap.errors.PatchStateError:
                    refused.append(seed)
                else:
                    shared.stop()
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=importer, daemon=True)]
    threads[0].start()
    try:
        assert started.wait(10)  # the import is now in progress
        threads += [threading.Thread(target=resolver, daemon=True) for _ in range(2)]
        threads += [threading.Thread(target=stormer, args=(s,), daemon=True) for s in range(4)]
        for t in threads[1:]:
            t.start()
        release.set()
        for t in threads:
            t.join(timeout=60)
        assert not any(t.is_alive() for t in threads), "a thread hung: deadlock"
    finally:
        release.set()
        delattr(builtins, gate)
    assert not errors, errors[0]
    module = sys.modules[name]
    assert module.f() == "lazy" and lazy.is_active
    lazy.stop()
    assert module.f() == "original" and module.VALUE == 1
    assert Target.__dict__["value"] == "original" and Other.value == "other"
    assert not shared.is_active and layerswap.active_patches() == []
