"""The human-readable rendering of each command's results (``--json`` skips it)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rich import box
from rich.table import Table
from rich.text import Text

from layerswap.cli.output import Output

if TYPE_CHECKING:
    from layerswap.adapters import AdapterLayout
    from layerswap.bench import BenchReport
    from layerswap.cli.models import Setup
    from layerswap.cli.runs import Patched
    from layerswap.verify import VerificationReport

__all__ = [
    "render_adapter",
    "render_bench",
    "render_checks",
    "render_coverage",
    "render_model_coverage",
    "render_patch",
    "render_environment",
    "render_header",
    "render_substitutions",
    "render_verification",
]


def _table(*columns: str) -> Table:
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False)
    for column in columns:
        table.add_column(column)
    return table


def render_header(console: Output, setup: Setup, what: str, swapped: str | None = None) -> None:
    """What ran: the substitution (and what it swapped), the model, the device."""
    from layerswap.comparison.placement import dtype_name

    info = setup.describe()
    console.print(f"{what}: {setup.substitution.name}" + (f" ({swapped})" if swapped else ""))
    console.print(
        f"model: {info['family']}, {info['source']}: {info['layers']} layers, "
        f"hidden {info['hidden_size']}, heads {info['attention_heads']}/{info['kv_heads']} "
        f"(q/kv), vocab {info['vocab_size']}, {info['parameters'] / 1e6:.2f}M parameters"
    )
    placement = f"device: {setup.device}, {dtype_name(setup.dtype)}"
    if setup.checkpoint_dtype is not None and setup.checkpoint_dtype != setup.dtype:
        placement += (
            f" (--dtype; the checkpoint's weights are {dtype_name(setup.checkpoint_dtype)})"
        )
    console.print(placement)


def _verdict(passed: bool) -> Text:
    return Text("PASS", style="bold green") if passed else Text("FAIL", style="bold red")


def render_verification(console: Output, report: VerificationReport) -> None:
    """One row per decoder layer and the logits, then the extra checks and the verdict."""
    table = _table()
    table.add_column("layer", justify="right")
    table.add_column("module")
    for column in ("max abs error", "max rel error", "cosine"):
        table.add_column(column, justify="right")
    table.add_column("")
    for layer in report.layers:
        mark = _verdict(layer.passed)
        if layer.index == report.first_divergent_layer:
            mark.append("  <- first divergent layer", style="red")
        table.add_row(
            str(layer.index),
            layer.name,
            f"{layer.max_abs_error:.2e}",
            f"{layer.max_rel_error:.2e}",
            f"{layer.cosine:.7f}",
            mark,
        )
    table.add_row(
        "",
        "logits",
        f"{report.max_abs_error:.2e}",
        f"{report.max_rel_error:.2e}",
        f"{report.cosine:.7f}",
        _verdict(report.logits_passed),
    )
    console.emit(table)
    extras = [f"{report.batch}x{report.seq_len} tokens, padding excluded"]
    if report.top1_agreement is not None:
        extras.append(f"top-1 agreement {report.top1_agreement:.1%}")
    if report.kl is not None:
        extras.append(f"KL {report.kl:.2e}")
    console.print("logits: " + ", ".join(extras))
    tol = report.tolerance
    console.print(
        f"tolerance ({report.dtype}): max abs error <= {tol.atol:g} + {tol.rtol:g} x "
        f"max|reference|, cosine >= {tol.min_cosine:g}"
    )
    if report.backward is not None:
        bw = report.backward
        scope = "per layer" if bw.local else "whole model"
        console.print(
            Text.assemble(
                f"backward ({scope}): loss {bw.loss_reference:.6g} vs {bw.loss_candidate:.6g}, "
                f"{len(bw.gradients)} gradients, max rel error {bw.max_rel_error:.2e}, "
                f"min cosine {bw.cosine:.7f}  ",
                _verdict(bw.passed),
                f"  (first divergent: {bw.first_divergent_parameter})"
                if bw.first_divergent_parameter
                else "",
            )
        )
    if report.generation is not None:
        gen = report.generation
        logits = (
            f", logits max abs error {gen.max_abs_error:.2e}"
            if gen.max_abs_error is not None
            else ""
        )
        mismatch = (
            f", first mismatch at {gen.first_mismatch}" if gen.first_mismatch is not None else ""
        )
        console.print(
            Text.assemble(
                f"cached decoding: {gen.new_tokens} greedy tokens with the KV cache, agreement "
                f"{gen.agreement:.0%}{mismatch}{logits}  ",
                _verdict(gen.passed),
            )
        )
    if report.passed:
        console.print(Text.assemble(_verdict(True), ": the swapped model matches the original"))
    else:
        console.print(Text.assemble(_verdict(False), ": ", report.failure_message()))


def render_bench(console: Output, report: BenchReport) -> None:
    """One row per metric: original, swapped, ratio."""
    table = _table("metric")
    for column in ("original", "swapped", "ratio"):
        table.add_column(column, justify="right")
    for row in report.rows():
        table.add_row(*row)
    console.print(
        f"timing: batch {report.batch} x seq {report.seq_len}, median (min-max) of {report.steps} "
        f"interleaved steps after {report.warmup} warm-up (time ratio: original/swapped)"
    )
    console.emit(table)
    for sentence in report.noise():
        console.print(Text(f"warning: {sentence}", style="yellow"))


def render_substitutions(console: Output, rows: list[dict[str, Any]]) -> None:
    """One row per substitution: name, family, backend, and whether it can run here."""
    table = _table("substitution", "family", "backend", "usable here")
    for row in rows:
        usable = Text("yes", style="green") if row["usable"] else Text(f"no: {row['reason']}")
        table.add_row(row["name"], row["family"], row["backend"], usable)
    console.emit(table)


def render_coverage(
    console: Output, rows: list[dict[str, Any]], held_back: str | None = None
) -> None:
    """One row per decoder model type: the family and backends covering it, or why not;
    the other slots that take any model type (``head``, ``norm``) and their backends."""
    table = _table("model type", "family", "backends", "other slots", "why not")
    for row in rows:
        why = row["reason"]
        if why is None:
            why = "; ".join(f"{b}: {reason}" for b, reason in row["not_covered"].items())
        family = row["family"] or "-"
        if row.get("wrapper"):  # a multimodal wrapper: the family of its language model
            family = f"{family} (wrapped)"
            why = "; ".join(part for part in (row["wrapper"], why) if part)
        if row.get("kept"):  # a hybrid: its layers of another kind stay the original's
            why = "; ".join(part for part in (row["kept"], why) if part)
        if row.get("slots_refusal"):  # nothing swapped: what holds the other slots back
            why = "; ".join(part for part in (why, f"other slots: {row['slots_refusal']}") if part)
        below = row.get("below_decoder") or {}
        slots = "; ".join(f"{slot}: {', '.join(names)}" for slot, names in below.items())
        table.add_row(
            row["model_type"],
            family,
            ", ".join(row["backends"]) or "-",
            slots or "-",
            Text(why),
        )
    console.emit(table)
    covered = sum(row["reason"] is None for row in rows)
    wrappers = sum(bool(row.get("wrapper")) for row in rows)
    console.print(
        f"{covered} of {len(rows)} model types covered ({wrappers} of them multimodal wrappers "
        "whose language model is swapped)"
    )
    alone = sum(row["reason"] is not None and bool(row.get("below_decoder")) for row in rows)
    console.print(
        f"{covered + alone} of {len(rows)} model types with something swapped: {alone} more "
        "by another slot alone (their norms, MLPs, experts, attention projections, rotary or "
        "head), proven at first use"
    )
    if held_back is not None:
        console.print(held_back)


def render_model_coverage(console: Output, report: dict[str, Any]) -> None:
    """Per backend and slot: what its substitution replaces and keeps, or why there is none."""
    console.print(f"{report['family']} ({report['source']})")
    table = _table("substitution", "replaces", "keeps the original's", "here")
    for row in report["rows"]:
        if row["unsupported"] is not None:
            table.add_row(row["substitution"], Text(f"none: {row['unsupported']}"), "", "")
            continue
        usable = row["unmet_requirement"]
        table.add_row(
            row["substitution"],
            "\n".join(row["replaces"]),
            "\n".join(row["keeps"]),
            Text("usable", style="green") if usable is None else Text(f"no: {usable}"),
        )
    console.emit(table)


def render_checks(console: Output, rows: list[dict[str, Any]]) -> None:
    """One row per family: proven, failed (and the first difference) or skipped (why)."""
    table = _table("family", "substitution", "verdict", "seconds", "first difference")
    styles = {
        "proven": "green",
        "failed": "bold red",
        "skipped": "yellow",
        "refused": "dim",
        "absent": "dim",
        "unbuildable": "dim",
    }
    for row in rows:
        seconds = f"{row['seconds']:.2f}" if row["seconds"] is not None else ""
        verdict = Text(row["status"], style=styles[row["status"]])
        table.add_row(row["family"], row["substitution"], verdict, seconds, Text(row["detail"]))
    console.emit(table)
    counts = {status: sum(row["status"] == status for row in rows) for status in styles}
    console.print(", ".join(f"{count} {status}" for status, count in counts.items()))


def render_environment(
    console: Output, rows: list[dict[str, str]], backends: dict[str, str | None]
) -> None:
    """What is installed and what it enables, then each backend's usability."""
    table = _table("component", "status", "enables")
    for row in rows:
        table.add_row(row["component"], row["status"], row["enables"])
    console.emit(table)
    for name, reason in sorted(backends.items()):
        console.print(
            f"backend {name}: " + ("usable here" if reason is None else f"not usable: {reason}")
        )


def render_adapter(console: Output, directory: str, family: str, found: AdapterLayout) -> None:
    """The adapter's layout, and what plain transformers + PEFT would do with it."""
    adapted = ", ".join(found.adapted) or "nothing"
    console.print(f"adapter {directory} ({family}): {found.layout} layout, adapts {adapted}")
    if found.plain_model_misses:
        kept = [leaf for leaf in found.adapted if leaf not in found.fused]
        console.print(
            Text(
                f"a plain {family} model has no {', '.join(found.fused)}: transformers + PEFT "
                f"would apply only {', '.join(kept) or 'nothing'} and skip the rest without a "
                "word",
                style="bold red",
            )
        )
        console.print(
            "convert it once, on a swapped model: layerswap.adapters.save_adapter("
            f'layerswap.adapters.load_adapter(swapped_model, "{directory}"), "OUT")'
        )
    else:
        console.print(
            "plain transformers + PEFT load it whole; on a swapped model "
            "PeftModel.from_pretrained converts it"
        )


def _swapped_word(patched: Patched) -> str:
    """What the rows of a swap are: decoder ``layers``, or what a slot that swaps modules
    of its own kind calls them (the ``norm`` slot's ``norms``, the ``mlp`` slot's ``MLPs``)."""
    from layerswap.slots import get_slot

    plural = getattr(get_slot(patched.setup.substitution.slot), "plural", "")
    return plural or "layers"


def render_patch(console: Output, patched: Patched) -> None:
    """``layerswap patch``'s report for a reader: what was swapped, verified, timed, saved."""
    from layerswap.comparison.placement import dtype_name

    kinds = sorted({(old, new) for _, old, new in patched.swapped})
    render_header(
        console,
        patched.setup,
        "patch",
        f"{len(patched.swapped)} {_swapped_word(patched)} swapped: "
        + ", ".join(f"{old} -> {new}" for old, new in kinds),
    )
    if patched.report is not None:
        render_verification(console, patched.report)
    if patched.bench_report is not None:
        render_bench(console, patched.bench_report)
    if patched.saved_to is not None:
        console.print(
            f"saved the swapped model in the original layout to {patched.saved_to} "
            f"({dtype_name(patched.saved_dtype)})"
        )
    elif patched.target is not None:
        console.print(f"not saved to {patched.target.path}: verification failed")
