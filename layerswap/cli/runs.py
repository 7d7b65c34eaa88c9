"""What the commands run of the library: ``patch``'s model built, verified against the
original, timed, swapped and saved (:func:`patch_model`, and its ``--json`` document), and
the benchmark ``patch --bench`` and ``bench`` share (:func:`run_bench`)."""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any

from layerswap.cli.models import Setup, build
from layerswap.cli.options import ModelChoice
from layerswap.cli.output import Progress
from layerswap.cli.problems import UsageProblem

if TYPE_CHECKING:
    import torch

    from layerswap.bench import BenchReport
    from layerswap.cli.saving import SaveTarget
    from layerswap.comparison.report import VerificationReport

__all__ = ["Patched", "patch_json", "patch_model", "run_bench"]


def run_bench(
    setup: Setup,
    progress: Progress,
    *,
    batch: int,
    seq: int,
    steps: int,
    warmup: int,
    backward: bool,
    seed: int,
) -> BenchReport:
    """:func:`layerswap.bench` of the command's model, each step shown as progress."""
    from layerswap.bench import bench

    def on_step(done: int, total: int) -> None:
        progress.step(f"benchmarking: step {done}/{total}")

    return bench(
        setup.model,
        setup.substitution,
        batch=batch,
        seq=seq,
        steps=steps,
        warmup=warmup,
        backward=backward,
        seed=seed,
        on_step=on_step,
    )


@dataclasses.dataclass(frozen=True)
class Patched:
    """What ``layerswap patch`` did: the model it built, its verification and bench reports
    (``None`` where not asked for), the layers it swapped (module, original class,
    replacement class) and where it saves the swapped model, in which dtype."""

    setup: Setup
    report: VerificationReport | None
    bench_report: BenchReport | None
    swapped: list[tuple[str, str, str]]
    target: SaveTarget | None
    saved_dtype: torch.dtype

    @property
    def passed(self) -> bool:
        return self.report is None or self.report.passed

    @property
    def saved_to(self) -> Path | None:
        """Where the swapped model was written: ``None`` unless ``--save`` was given and
        verification passed."""
        return self.target.path if self.target is not None and self.passed else None


def patch_model(
    choice: ModelChoice,
    progress: Progress,
    *,
    verify: bool,
    bench: bool,
    save: Path | None,
    overwrite: bool,
) -> Patched:
    """Build the model, verify and time it if asked, swap it, and save it if it passed."""
    from layerswap.cli.saving import save_target

    if overwrite and save is None:
        raise UsageProblem("--overwrite applies to --save: pass --save DIR")
    target = save_target(save, overwrite) if save is not None else None
    setup = build(choice, progress)
    from layerswap.comparison.inputs import inputs_for
    from layerswap.proof import comparing
    from layerswap.swap import swap
    from layerswap.verify import verify as run_verification

    report = None
    if verify:
        progress.step("verifying against the original")
        inputs = inputs_for(setup.model, seed=choice.seed)
        report = run_verification(setup.model, setup.substitution, inputs)
    bench_report = None
    if bench:
        bench_report = run_bench(
            setup, progress, batch=2, seq=64, steps=5, warmup=2, backward=True, seed=choice.seed
        )
    progress.step("swapping")
    # verified: the report is the verdict (a failed one exits 1 below); else the
    # behaviour proof runs in swap and refuses a substitution that does not hold
    with comparing() if report is not None else contextlib.nullcontext():
        handle = swap(setup.model, setup.substitution)
    swapped = [(name, old.__name__, new.__name__) for name, old, new in handle.swapped]
    patched = Patched(
        setup, report, bench_report, swapped, target, setup.checkpoint_dtype or setup.dtype
    )
    if target is not None and patched.passed:
        progress.step(f"saving to {target.path}")
        target.write(setup.model, patched.saved_dtype)
    return patched


def patch_json(patched: Patched) -> dict[str, Any]:
    """``layerswap patch --json``'s document."""
    from layerswap.comparison.placement import dtype_name

    setup, report, bench_report = patched.setup, patched.report, patched.bench_report
    return {
        "command": "patch",
        "passed": patched.passed,
        "substitution": setup.substitution.name,
        "device": str(setup.device),
        "dtype": dtype_name(setup.dtype),
        "model": setup.describe(),
        "swapped": [
            {"module": name, "original": old, "replacement": new}
            for name, old, new in patched.swapped
        ],
        "verification": report.to_dict() if report is not None else None,
        "bench": bench_report.to_dict() if bench_report is not None else None,
        "saved": str(patched.saved_to) if patched.saved_to is not None else None,
        "saved_dtype": dtype_name(patched.saved_dtype) if patched.saved_to is not None else None,
    }
