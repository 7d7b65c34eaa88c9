"""Prove the ``norm`` slot on every model type ``layerswap list --all`` says it takes (with
``--slot mlp``, ``--slot experts``, ``--slot qkv`` or ``--slot rotary`` that slot; with ``--slot head``, the
``head`` slot on every model type no family covers that it takes), and write what was
swapped, what was kept and the verdict to ``docs/norms.md`` (``docs/mlps.md``,
``docs/experts.md``, ``docs/attentions.md``, ``docs/rotary.md``, ``docs/heads.md``).

Each model type runs in a process of its own (a model type that crashes its process is
recorded as such, not the sweep), two at a time by default::

    python scripts/norm_sweep.py [--jobs 2] [--backend fused] [--slot norm]
    python scripts/norm_sweep.py --update MODEL_TYPE ...   # prove these again, keep the rest

The rows are kept in ``docs/norms.json`` (``docs/heads.json``); the page is written from them.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: where each slot's rows and page go
PAGES = {
    "norm": "norms",
    "mlp": "mlps",
    "experts": "experts",
    "qkv": "attentions",
    "rotary": "rotary",
    "head": "heads",
}
#: the slots that swap classes of a model's own modules (every model type they take)
CLASS_SLOTS = ("norm", "mlp", "experts", "qkv", "rotary")

ONE = r"""
import json, logging, sys, time, warnings
warnings.filterwarnings("ignore")
logging.disable(logging.WARNING)
import torch
torch.set_num_threads(1)
import layerswap
from layerswap.proof import prove, comparing
from layerswap.slots import get_slot

model_type, backend, slot = sys.argv[1], sys.argv[2], sys.argv[3]
row = {"model_type": model_type}
started = time.perf_counter()
try:
    sub = layerswap.get(f"{model_type}.{slot}.{backend}")
    verdict = prove(sub, force=True)
    row.update(passed=verdict.passed, check=verdict.check, detail=verdict.detail)
    family = sub.parts.family
    if slot == "head":
        row["swapped"] = {family.causal_lm: ["head and loss"]}
        raise StopIteration
    with torch.device("meta"), comparing():
        model = family.causal_lm_class()(family.tiny_config())
    chosen = get_slot(slot)
    plan = chosen.plan(model, sub)
    kinds = {}
    for _, _, made in plan.swapped:
        label = chosen.spec_label(made._layerswap_spec)
        kinds.setdefault(made._layerswap_original.__name__, set()).add(label)
    row["swapped"] = {name: sorted(k) for name, k in kinds.items()}
    row["kept"] = {name: reason for name, (_, reason) in plan.kept.items()}
except StopIteration:
    pass
except Exception as exc:
    row.update(passed=False, check="making it", detail=f"{type(exc).__name__}: {exc}")
row["seconds"] = round(time.perf_counter() - started, 1)
print(json.dumps(row))
"""


def _listed(backend: str, slot: str) -> list[str]:
    out = subprocess.run(
        [sys.executable, "-m", "layerswap", "list", "--all", "--json"],
        capture_output=True,
        text=True,
        check=True,
    )
    rows = json.loads(out.stdout)
    return [
        r["model_type"]
        for r in rows
        if backend in (r.get("below_decoder") or {}).get(slot, [])
        and (slot in CLASS_SLOTS or r["reason"] is not None)  # a family's head: its own tests
    ]


def _one(model_type: str, backend: str, slot: str) -> dict[str, object]:
    try:
        done = subprocess.run(
            [sys.executable, "-c", ONE, model_type, backend, slot],
            capture_output=True,
            text=True,
            timeout=600,
        )
        return json.loads(done.stdout.strip().splitlines()[-1])
    except Exception as exc:  # killed (memory), timed out, or printed nothing
        return {
            "model_type": model_type,
            "passed": False,
            "check": "its process",
            "detail": f"{type(exc).__name__}: {exc}",
            "seconds": 0,
        }


def _write(rows: list[dict[str, object]], backend: str, slot: str) -> None:
    import transformers

    passed = sum(bool(r["passed"]) for r in rows)
    which = (
        "every model type it takes" if slot in CLASS_SLOTS else "every model type no family covers"
    )
    lines = [
        f"# The `{slot}` slot, proven on {which}",
        "",
        f"`python scripts/norm_sweep.py --backend {backend} --slot {slot}` on transformers "
        f"{transformers.__version__}, CPU, float32: each model type that `layerswap list --all` "
        f"says the `{backend}` {slot} takes"
        + ("" if slot in CLASS_SLOTS else " (no family covering it)")
        + ", proven on its tiny model (padded forward, prefill and "
        "decode with dynamic and static caches, backward"
        + (")." if slot in CLASS_SLOTS else ": the fused loss and its gradients).")
        + " "
        f"**{passed} of {len(rows)} proven.** A verdict is kept per transformers source; a "
        "user's model is proven again at first use on its own config.",
        "",
        "| model type | swapped (kind) | kept (why) | verdict | seconds |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        swapped = "; ".join(f"{n}: {', '.join(k)}" for n, k in (r.get("swapped") or {}).items())
        kept = "; ".join(f"{n}: {why}" for n, why in (r.get("kept") or {}).items())
        verdict = "proven" if r["passed"] else f"{r.get('check')}: {str(r.get('detail'))[:120]}"
        lines.append(
            f"| {r['model_type']} | {swapped or '-'} | {kept or '-'} | {verdict} | {r['seconds']} |"
        )
    (ROOT / "docs" / f"{PAGES[slot]}.md").write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("model_types", nargs="*")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--backend", default="fused")
    parser.add_argument("--slot", default="norm", choices=sorted(PAGES))
    parser.add_argument("--update", action="store_true", help="merge into docs/<page>.json")
    args = parser.parse_args()
    raw = ROOT / "docs" / f"{PAGES[args.slot]}.json"
    types = args.model_types or _listed(args.backend, args.slot)
    with ThreadPoolExecutor(args.jobs) as pool:
        rows = []
        for row in pool.map(lambda t: _one(t, args.backend, args.slot), types):
            print(json.dumps(row)[:200], flush=True)
            rows.append(row)
    if args.update and raw.exists():
        kept = {r["model_type"]: r for r in json.loads(raw.read_text())}
        for row in rows:
            if str(row["detail"]).startswith("UnknownSubstitutionError"):
                # a model type the slot does not take is no row of the page
                print(f"{row['model_type']}: not taken, left out", flush=True)
                kept.pop(str(row["model_type"]), None)
            else:
                kept[str(row["model_type"])] = row
        rows = [kept[t] for t in sorted(kept)]
    if not args.model_types or args.update:
        raw.write_text(json.dumps(rows, indent=1) + "\n")
        _write(rows, args.backend, args.slot)
    print(f"{sum(bool(r['passed']) for r in rows)} of {len(rows)} proven")


if __name__ == "__main__":
    main()
