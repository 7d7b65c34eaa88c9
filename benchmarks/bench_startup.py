"""How long the command line and the registry take to answer, against importing a model.

Each command runs in a fresh interpreter, the commands interleaved round by round (so a
busy spell of the machine touches all of them), and the median of the rounds is
compared with the reference: ``python -c "import torch,
transformers.models.llama.modeling_llama"``, what any use of a Llama costs anyway.

Targets: ``layerswap list`` and an unknown-family error at most 0.5x the reference;
``layerswap.get("llama.decoder.fused")`` imports no other family's modeling module;
``layerswap list --all`` at most 15 s cold. The commands run once before the rounds, so
what the registry keeps per transformers release (the backends' answers,
:func:`layerswap.verdicts.remembered`) is there, as after a user's first command; the cold
``list --all`` runs with an empty cache directory each time (the first run on a
transformers release: every model type inferred, in one process per CPU). Run:
``python benchmarks/bench_startup.py [rounds]``.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time

PYTHON = sys.executable
REFERENCE = "import torch, transformers.models.llama.modeling_llama"
COLD = "layerswap list --all (cold: empty cache)"
COMMANDS = {
    "reference: import torch + llama modeling": [PYTHON, "-c", REFERENCE],
    "import layerswap": [PYTHON, "-c", "import layerswap"],
    "layerswap.get('llama.decoder.fused')": [
        PYTHON,
        "-c",
        "import layerswap; layerswap.get('llama.decoder.fused')",
    ],
    "layerswap list": [PYTHON, "-m", "layerswap", "list"],
    "layerswap patch --model lama (unknown family)": [
        PYTHON,
        "-m",
        "layerswap",
        "patch",
        "--model",
        "lama",
    ],
    "layerswap list --all (answers kept)": [PYTHON, "-m", "layerswap", "list", "--all"],
    COLD: [PYTHON, "-m", "layerswap", "list", "--all"],
}
MODELING = (
    "import sys, layerswap; layerswap.get('llama.decoder.fused'); "
    "print(sorted(m for m in sys.modules if m.startswith('transformers.models.') "
    "and '.modeling_' in m) or 'none')"
)


def _time(command: list[str], cold: bool = False) -> float:
    with tempfile.TemporaryDirectory() as empty:
        env = {**os.environ, "LAYERSWAP_CACHE": empty} if cold else None
        start = time.perf_counter()
        subprocess.run(command, capture_output=True, check=False, env=env)
        return time.perf_counter() - start


def main(rounds: int = 5) -> None:
    for label, command in COMMANDS.items():  # the answers a first command keeps
        if label != COLD:
            _time(command)
    times: dict[str, list[float]] = {label: [] for label in COMMANDS}
    for _ in range(rounds):
        for label, command in COMMANDS.items():
            times[label].append(_time(command, cold=label == COLD))
    reference = statistics.median(times[next(iter(COMMANDS))])
    print(f"python {sys.version.split()[0]}, {rounds} rounds, median seconds (min-max)")
    for label, seconds in times.items():
        median = statistics.median(seconds)
        print(
            f"{label:48s} {median:6.2f} ({min(seconds):.2f}-{max(seconds):.2f})"
            f"  {median / reference:5.2f}x"
        )
    imported = subprocess.run(
        [PYTHON, "-c", MODELING], capture_output=True, text=True, check=False
    ).stdout.strip()
    print(f"modeling modules imported by layerswap.get('llama.decoder.fused'): {imported}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 5)
