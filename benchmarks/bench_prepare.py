"""What preparing a proven substitution costs: what every swap, every model ``use()``
builds, and every re-prepare after a cast pays once the verdict is stored; and what the
placement guard's probe costs each forward pass of a swapped model.

``slot.prepare`` runs the call contract and structure checks, then looks the verdict up
by its key (``proof_key``: the versions, and a digest of the code the original runs,
read from what this process binds). The key's live digest is read again only where a
namespace or a class dict holds other objects than when it was last read; the
"read afresh" rows clear that memory before each call, as every call read before.
Each figure is the minimum over ``--repeats`` rounds of ``--calls`` calls, the rows
interleaved round by round::

    python benchmarks/bench_prepare.py
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import transformers

import layerswap
from layerswap import placement_guard, proof, sources
from layerswap.placement import Placement
from layerswap.proof_key import proof_key


def _per_call(action: Callable[[], object], calls: int) -> float:
    started = time.perf_counter()
    for _ in range(calls):
        action()
    return (time.perf_counter() - started) / calls


def _afresh(action: Callable[[], object]) -> Callable[[], object]:
    def run() -> object:
        sources._NAMESPACES.clear()
        sources._CLASSES.clear()
        return action()

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--substitution", default="llama.decoder.fused")
    parser.add_argument("--calls", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()

    sub = layerswap.get(args.substitution)
    config = sub.parts.family.tiny_config()
    cpu = torch.device("cpu")
    placement = Placement(torch.float32, cpu)
    assert proof.prove(sub, config).passed  # stored: what follows is the lookup alone
    model = sub.parts.family.causal_lm_class()(config)
    watched = placement_guard._Guard(model.register_forward_pre_hook(lambda *_: None))
    rows: dict[str, Callable[[], object]] = {
        "placement guard's probe (each forward)": lambda: placement_guard._probe(model, watched),
        "proof_key": lambda: proof_key(sub, config, cpu),
        "proof_key, live digest read afresh": _afresh(lambda: proof_key(sub, config, cpu)),
        "contract and structure": lambda: sub.check_upstream(config),
        "slot.prepare": lambda: sub.parts.slot.prepare(sub, config, placement),
        "slot.prepare, live digest read afresh": _afresh(
            lambda: sub.parts.slot.prepare(sub, config, placement)
        ),
    }
    for action in rows.values():
        action()  # warm: imports, caches of the files' digests
    best = dict.fromkeys(rows, float("inf"))
    for _ in range(args.repeats):
        for name, action in rows.items():
            best[name] = min(best[name], _per_call(action, args.calls))
    print(
        f"{sub.name}, transformers {transformers.__version__}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} CPU threads; min of {args.repeats} x {args.calls} calls"
    )
    for name, seconds in best.items():
        print(f"{name:<40} {seconds * 1e3:8.4f} ms")
    print(
        f"proof_key: {best['proof_key, live digest read afresh'] / best['proof_key']:.1f}x "
        "faster than read afresh; slot.prepare: "
        f"{best['slot.prepare, live digest read afresh'] / best['slot.prepare']:.1f}x"
    )


if __name__ == "__main__":
    main()
