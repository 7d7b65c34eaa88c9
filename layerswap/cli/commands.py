"""The commands: each parses its options, calls the library and renders the result."""

from __future__ import annotations

import dataclasses
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer

from layerswap.cli.adopting import verify_adopted
from layerswap.cli.doctor import backend_problems, environment
from layerswap.cli.models import build, coverage_target, find_family
from layerswap.cli.options import (
    AdoptOption,
    BackwardOption,
    GenerateOption,
    JsonOption,
    ModelChoice,
    StreamingOption,
    ToleranceOption,
    model_options,
)
from layerswap.cli.output import Chatter, Output, Progress, print_json, quiet_import_chatter
from layerswap.cli.problems import UsageProblem, exit_codes, one_line
from layerswap.cli.render import (
    render_adapter,
    render_bench,
    render_checks,
    render_coverage,
    render_environment,
    render_header,
    render_model_coverage,
    render_patch,
    render_substitutions,
    render_verification,
)
from layerswap.cli.runs import patch_json, patch_model, run_bench

__all__ = ["app", "main"]

app = typer.Typer(
    name="layerswap",
    help="Swap layers of transformers models for faster ones, and prove they still match.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)


@app.command("list")
def list_command(
    family: Annotated[
        str | None,
        typer.Option("--family", metavar="FAMILY", help="Only this family.", show_default=False),
    ] = None,
    backend: Annotated[
        str | None,
        typer.Option("--backend", metavar="BACKEND", help="Only this backend.", show_default=False),
    ] = None,
    all_families: Annotated[
        bool,
        typer.Option(
            "--all",
            help="Every decoder family the installed transformers ships: covered, or why not "
            "(infers and verifies each one, the first time on a transformers release: about "
            "20 s on one core, split across --jobs processes; kept after).",
        ),
    ] = False,
    jobs: Annotated[
        int | None,
        typer.Option(
            "--jobs",
            min=1,
            metavar="N",
            help="With --all: processes inferring the model types not yet answered "
            "(default: one per CPU).",
            show_default=False,
        ),
    ] = None,
    json_output: JsonOption = False,
) -> None:
    """Every registered substitution: family, backend, and whether it can run here."""
    if all_families:
        _list_coverage(json_output, jobs)
        return
    with exit_codes(), Progress(not json_output) as progress:
        from layerswap.registry import offers

        if jobs is not None:
            raise UsageProblem("--jobs goes with --all (the processes that infer model types)")
        if family is not None:
            family = find_family(family).name
        if backend is not None:
            known = sorted({sub.backend for sub in offers()})
            if backend not in known:
                from layerswap.suggestions import did_you_mean

                hint = did_you_mean(backend, known)
                raise UsageProblem(
                    f"no backend named {backend!r}{'; ' + hint if hint else ''} "
                    f"(known: {', '.join(known)})"
                )
        # instant once answered; the first list on a transformers release reads each
        # family's causal LM and builds the tiny layers liger and te judge
        progress.step("reading the backends' answers for this transformers release")
        rows: list[dict[str, Any]] = []
        for sub in offers(family=family, backend=backend):
            reason = sub.unmet_requirement()
            rows.append(
                {
                    "name": sub.name,
                    "family": sub.family,
                    "backend": sub.backend,
                    "usable": reason is None,
                    "reason": reason,
                    "description": sub.description,
                }
            )
    if json_output:
        print_json(rows)
        return
    render_substitutions(Output(), rows)


def _list_coverage(json_output: bool, jobs: int | None) -> None:
    chatter = Chatter()
    # no spinner thread: the model types not yet answered are inferred in forked processes
    with exit_codes(), Progress(not json_output, spinner=False) as progress:
        progress.step("reading transformers' model types")
        from layerswap.coverage import coverage
        from layerswap.registry import offers

        with chatter:
            report = coverage(
                on_step=lambda d, t, m: progress.count(d, t, f"inferring {m}"), jobs=jobs
            )
        rows = []
        for model_type, found in report.items():
            name = found.family
            # the backends whose decoder layers cover it (the slots below are "other slots"),
            # read without making a substitution (no backend's layers imported)
            decoders = offers(family=name, slot="decoder") if name else []
            backends = sorted({offer.backend for offer in decoders})
            rows.append(
                {
                    "model_type": model_type,
                    "family": name,
                    "backends": backends,
                    "reason": found.reason,
                    "wrapper": found.wrapper,
                    "kept": found.kept,
                    # the slots below the decoder layer swapping some of its modules
                    "below_decoder": found.below_decoder,
                    "slots_refusal": found.slots_refusal,
                    "not_covered": {
                        backend: why for backend, why in found.backends.items() if why is not None
                    }
                    if name
                    else {},
                }
            )
    if json_output:
        print_json(rows)
        return
    render_coverage(Output(), rows, chatter.summary())


@app.command("coverage")
def coverage_command(
    target: Annotated[
        str,
        typer.Argument(
            metavar="TARGET",
            help="A family name or a transformers model type (its tiny config), a config "
            "JSON file or a checkpoint directory.",
            show_default=False,
        ),
    ],
    json_output: JsonOption = False,
) -> None:
    """Which modules of a model each substitution replaces, and which stay the original's."""
    with exit_codes():
        from layerswap.coverage import model_coverage

        if not Path(target).exists():
            target = coverage_target(target)
        report = model_coverage(target)
    if json_output:
        print_json(report.as_dict())
        return
    render_model_coverage(Output(), report.as_dict())


def _refuse_with_adopt(choice: ModelChoice, **verification: Any) -> None:
    """``--adopt`` proves the patch on a tiny float32 model on its own terms: an option it
    would not use is refused by name, not ignored."""
    defaults = ModelChoice()
    unused = [
        f"--{name.replace('_', '-')}"
        for name in ("backend", "substitution", "device", "dtype", "seed", "fp8", "fp8_recipe")
        if getattr(choice, name) != getattr(defaults, name)
    ]
    unused += [f"--{name}" for name, value in verification.items() if value not in (None, False)]
    if unused:
        raise UsageProblem(
            f"--adopt proves the patch on a tiny float32 model of --model (or --config) "
            f"with its own checks; it does not use {', '.join(unused)}"
        )


@app.command()
@model_options
def patch(
    choice: ModelChoice,
    verify: Annotated[
        bool, typer.Option("--verify/--no-verify", help="Compare with the original model.")
    ] = True,
    bench: Annotated[bool, typer.Option("--bench", help="Also time original vs swapped.")] = False,
    json_output: JsonOption = False,
    save: Annotated[
        Path | None,
        typer.Option(
            "--save",
            metavar="DIR",
            help="Write the swapped model here, in the original layout (save_pretrained) and "
            "the checkpoint's own dtype; only when verification passes.",
            show_default=False,
        ),
    ] = None,
    overwrite: Annotated[
        bool,
        typer.Option("--overwrite", help="Let --save replace a model saved there before."),
    ] = False,
) -> None:
    """Build a model, swap its decoder layers, verify against the original, report."""
    with exit_codes(), Progress(not json_output) as progress:
        patched = patch_model(
            choice, progress, verify=verify, bench=bench, save=save, overwrite=overwrite
        )
    if json_output:
        print_json(patch_json(patched))
    else:
        render_patch(Output(), patched)
    if not patched.passed:
        raise typer.Exit(1)


@app.command("verify")
@model_options
def verify_command(
    choice: ModelChoice,
    backward: BackwardOption = False,
    generate: GenerateOption = None,
    streaming: StreamingOption = False,
    tolerance: ToleranceOption = None,
    adopt: AdoptOption = None,
    json_output: JsonOption = False,
) -> None:
    """Verify a substitution against the original model, layer by layer."""
    if tolerance is not None and not math.isfinite(tolerance):
        with exit_codes():
            raise UsageProblem(f"--tolerance takes a finite number, not {tolerance}")
    if adopt is not None:
        with exit_codes():
            _refuse_with_adopt(
                choice,
                backward=backward,
                generate=generate,
                streaming=streaming,
                tolerance=tolerance,
            )
        verify_adopted(adopt, choice, json_output=json_output)
        return
    with exit_codes(), Progress(not json_output) as progress:
        setup = build(choice, progress)
        from layerswap.comparison.inputs import inputs_for
        from layerswap.verify import verify as run_verification

        progress.step("verifying against the original")
        try:
            report = run_verification(
                setup.model,
                setup.substitution,
                inputs_for(setup.model, seed=choice.seed),
                backward=backward,
                generate=generate,
                tolerance=tolerance,
                streaming=streaming,
            )
        except ValueError as error:
            raise UsageProblem(error) from error
    if json_output:
        print_json(report.to_dict())
    else:
        console = Output()
        render_header(console, setup, "verify")
        render_verification(console, report)
    if not report.passed:
        raise typer.Exit(1)


@app.command("bench")
@model_options
def bench_command(
    choice: ModelChoice,
    batch: Annotated[
        int, typer.Option("--batch", metavar="N", min=1, help="Sequences per step.")
    ] = 4,
    seq: Annotated[
        int, typer.Option("--seq", metavar="N", min=1, help="Tokens per sequence.")
    ] = 128,
    steps: Annotated[int, typer.Option("--steps", metavar="N", min=1, help="Measured steps.")] = 10,
    warmup: Annotated[
        int, typer.Option("--warmup", metavar="N", min=0, help="Unmeasured steps.")
    ] = 3,
    backward: Annotated[
        bool, typer.Option("--backward/--no-backward", help="Also time forward+backward.")
    ] = True,
    json_output: JsonOption = False,
) -> None:
    """Time the original and the swapped model (interleaved runs, medians, ratios)."""
    with exit_codes(), Progress(not json_output) as progress:
        setup = build(choice, progress)
        report = run_bench(
            setup,
            progress,
            batch=batch,
            seq=seq,
            steps=steps,
            warmup=warmup,
            backward=backward,
            seed=choice.seed,
        )
    if json_output:
        print_json(report.to_dict())
        return
    console = Output()
    render_header(console, setup, "bench")
    render_bench(console, report)


@app.command("check")
def check_command(
    family_names: Annotated[
        list[str] | None,
        typer.Argument(metavar="FAMILY...", help="Families to prove.", show_default=False),
    ] = None,
    all_families: Annotated[bool, typer.Option("--all", help="Every registered family.")] = False,
    backend: Annotated[
        str, typer.Option("--backend", "-b", metavar="BACKEND", help="The backend proven.")
    ] = "fused",
    again: Annotated[
        bool, typer.Option("--again", help="Prove again, whatever is stored.")
    ] = False,
    substitution_names: Annotated[
        list[str] | None,
        typer.Option(
            "--substitution",
            "-s",
            metavar="NAME",
            help="Also prove a substitution by full name (repeatable), e.g. one registered "
            "from a patch function.",
            show_default=False,
        ),
    ] = None,
    dtype: Annotated[
        str,
        typer.Option(
            "--dtype",
            metavar="DTYPE",
            help="The dtype your models compute in: bfloat16 or float16 is proven too, "
            "as at first use of a model in it.",
        ),
    ] = "float32",
    json_output: JsonOption = False,
) -> None:
    """Prove substitutions equal to the original on the installed transformers and torch.

    Each family's tiny model runs with original and replacement layers: a left-padded
    forward, one long sequence alone, decoding with a dynamic and a static cache, a
    backward pass (in training mode), and with --dtype bfloat16 or float16 the forward in that dtype. Verdicts are
    stored (LAYERSWAP_CACHE), as at first use. A substitution named with --substitution
    is proven as its slot proves it before a swap. Exit 1 when one fails.
    """
    with exit_codes(), Progress(not json_output) as progress:
        from layerswap.cli.proving import check_rows
        from layerswap.comparison.placement import resolve_dtype
        from layerswap.registry import families, get, get_backend

        try:
            proven_dtype = resolve_dtype(dtype)
        except ValueError as error:
            raise UsageProblem(error) from error
        get_backend(backend)  # an unknown backend is a usage error, with close names
        named = [get(name).name for name in substitution_names or []]  # unknown: exit 2
        if all_families and family_names:
            raise UsageProblem("name the families to prove, or give --all, not both")
        if not (all_families or family_names or named):
            raise UsageProblem("name the families to prove, give --all, or --substitution")
        names = (
            sorted(families())
            if all_families
            else [find_family(n).name for n in family_names or []]
        )
        rows = check_rows(
            names,
            backend,
            again,
            lambda d, t, f: progress.count(d, t, f),
            substitutions=named,
            dtype=proven_dtype,
        )
    if json_output:
        print_json(rows)
    else:
        render_checks(Output(), rows)
    if any(row["status"] == "failed" for row in rows):
        raise typer.Exit(1)


@app.command("adapter")
def adapter_command(
    directory: Annotated[
        Path,
        typer.Argument(metavar="DIR", help="A PEFT adapter directory.", show_default=False),
    ],
    model: Annotated[
        str | None,
        typer.Option(
            "--model",
            "-m",
            metavar="FAMILY",
            help="The base model's family (default: from the adapter's base model, when "
            "that is a local checkpoint).",
            show_default=False,
        ),
    ] = None,
    json_output: JsonOption = False,
) -> None:
    """Which layout a LoRA adapter is in, and whether a plain model would miss parts of it.

    Exit 1 when plain transformers + PEFT would skip some of its modules (an adapter saved
    with the swapped layers' fused names).
    """
    with exit_codes():
        from layerswap.adapters import adapter_layout
        from layerswap.cli.models import family_of_adapter
        from layerswap.registry import get

        if not (directory / "adapter_config.json").is_file():
            raise UsageProblem(f"{directory}: no adapter_config.json (not a PEFT adapter)")
        family = find_family(model).name if model is not None else family_of_adapter(directory)
        found = adapter_layout(directory, get(f"{family}.decoder.fused"))
    if json_output:
        print_json({"adapter": str(directory), "family": family, **dataclasses.asdict(found)})
    else:
        render_adapter(Output(), str(directory), family, found)
    if found.plain_model_misses:
        raise typer.Exit(1)


@app.command()
def doctor(json_output: JsonOption = False) -> None:
    """What is installed here and what it enables."""
    with exit_codes():
        from layerswap.cli.proving import proofs_row

        rows = [*environment(), proofs_row()]
        problems = backend_problems()
    if json_output:
        print_json(
            {
                "environment": rows,
                "backends": {
                    name: {"usable": reason is None, "reason": reason}
                    for name, reason in problems.items()
                },
            }
        )
        return
    render_environment(Output(), rows, problems)


def _click_class(name: str) -> type[Exception]:
    """A click exception class, found through typer (which may vendor its own click)."""
    for klass in typer.BadParameter.__mro__:
        if klass.__name__ == name:
            return klass
    raise LookupError(name)  # pragma: no cover - every click has these


def _plain_arguments(group: Any) -> None:
    """Arguments in help as click writes them: ``TARGET``, not typer's ``{TARGET} <str>``."""
    for command in getattr(group, "commands", {}).values():
        for param in command.params:
            if param.param_type_name != "argument" or not hasattr(param, "_usage_display_name"):
                continue
            name = param.metavar or param.name.upper()
            usage = name if param.required else f"[{name}]"
            param._usage_display_name = lambda usage=usage: usage
            param.display_type_rich = lambda ctx: None


def main(argv: Sequence[str] | None = None) -> NoReturn:
    """Run the command line (``layerswap`` and ``python -m layerswap``); exits.

    Usage errors found while parsing (an unknown option, a bad number) are reported as
    one line with exit code 2, like every other usage problem; a bare ``layerswap``
    prints the help.
    """
    quiet_import_chatter()
    usage_error, click_exception = _click_class("UsageError"), _click_class("ClickException")
    command = typer.main.get_command(app)
    _plain_arguments(command)
    try:
        code = command.main(
            args=list(argv) if argv is not None else None,
            prog_name="layerswap",
            standalone_mode=False,
        )
    except usage_error as error:
        ctx = getattr(error, "ctx", None)
        if type(error).__name__ == "NoArgsIsHelpError" and ctx is not None:
            sys.stdout.write(ctx.get_help() + "\n")
            sys.exit(0)
        message = one_line(getattr(error, "format_message", error.__str__)())
        hint = f" (see: {ctx.command_path} --help)" if ctx is not None else ""
        print(f"layerswap: error: {message}{hint}", file=sys.stderr)
        sys.exit(2)
    except click_exception as error:
        print(f"layerswap: error: {one_line(error)}", file=sys.stderr)
        sys.exit(getattr(error, "exit_code", 1))
    except typer.Abort:
        print("layerswap: aborted", file=sys.stderr)
        sys.exit(130)
    sys.exit(code if isinstance(code, int) else 0)
