"""The ``layerswap`` command line: thin, it parses, calls the library and renders.

Commands: ``list``, ``patch``, ``verify``, ``bench``, ``doctor``. Exit codes: 0 passed,
1 verification failed, 2 a usage or environment problem, reported as one line on
stderr without a traceback. ``--json`` puts only JSON on stdout. Progress goes to stderr
and only when stderr is a terminal; output to a pipe has no colours.

Example::

    $ layerswap patch --model llama
    $ layerswap verify --model qwen3 --backward --generate 4 --json | jq .passed
"""

from __future__ import annotations

import contextlib
import difflib
import importlib
import importlib.metadata
import importlib.util
import json
import platform
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn

import typer
from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from layerswap.errors import LayerswapError, VerificationError

if TYPE_CHECKING:
    import torch
    from rich.status import Status

    from layerswap.bench import BenchReport
    from layerswap.substitution import Family, Substitution
    from layerswap.verify import VerificationReport

__all__ = ["app", "main"]

app = typer.Typer(
    name="layerswap",
    help="Swap layers of transformers models for faster ones, and prove they still match.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


class UsageProblem(Exception):
    """A problem with how the command was called or with this machine: exit 2."""


def _one_line(message: object) -> str:
    return " ".join(str(message).split())


@contextlib.contextmanager
def _exit_codes() -> Iterator[None]:
    """Turn usage and environment problems into one line on stderr and exit code 2.

    Library errors other than a failed verification (unknown names, unmet requirements,
    upstream drift, unconvertible weights) are the user's or the machine's to fix, so
    they get a sentence, not a traceback. Anything else is a bug and keeps its traceback.
    """
    try:
        yield
    except (UsageProblem, OSError) as error:
        _fail(error)
    except LayerswapError as error:
        if isinstance(error, VerificationError):
            raise
        _fail(error)


def _fail(error: object) -> NoReturn:
    print(f"layerswap: error: {_one_line(error)}", file=sys.stderr)
    raise typer.Exit(2)


class _Progress:
    """A spinner with a status line on stderr, shown only when stderr is a terminal."""

    def __init__(self, enabled: bool) -> None:
        console = Console(stderr=True)
        self._status: Status | None = (
            console.status("starting") if enabled and console.is_terminal else None
        )

    def __enter__(self) -> _Progress:
        if self._status is not None:
            self._status.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._status is not None:
            self._status.stop()

    def step(self, text: str) -> None:
        if self._status is not None:
            self._status.update(text)


# wide enough that no table row is folded when output goes to a pipe or a file
_PIPE_WIDTH = 200


class _Output(Console):
    """The console for results: no markup parsing ("layerswap[te]" is text, not a style),
    no random highlighting. Piped, it neither folds lines nor pads them: rich assumes 80
    columns and pads table cells with spaces, and greppable output wants neither."""

    def __init__(self) -> None:
        self.piped = not sys.stdout.isatty()
        # piped, COLUMNS (which CI systems often set to 80) must not fold table rows either
        super().__init__(
            highlight=False,
            markup=False,
            soft_wrap=True,
            width=_PIPE_WIDTH if self.piped else None,
        )

    def emit(self, renderable: Any) -> None:
        if not self.piped:
            self.print(renderable)
            return
        with self.capture() as captured:
            self.print(renderable)
        lines = captured.get().splitlines()
        sys.stdout.write("".join(line.rstrip() + "\n" for line in lines))


def _stdout() -> _Output:
    return _Output()


def _print_json(payload: Any) -> None:
    sys.stdout.write(json.dumps(payload, indent=2, default=str) + "\n")


# --------------------------------------------------------------------------- shared options

ModelOption = Annotated[
    str | None,
    typer.Option(
        "--model",
        "-m",
        help="Model family (llama, mistral, qwen2, qwen3, ...).",
        show_default=False,
    ),
]
BackendOption = Annotated[str, typer.Option("--backend", "-b", help="Backend: fused or te.")]
SubstitutionOption = Annotated[
    str | None,
    typer.Option(
        "--substitution",
        "-s",
        help="A substitution by full name (e.g. llama.decoder.fused), instead of --backend.",
        show_default=False,
    ),
]
ConfigOption = Annotated[
    str,
    typer.Option(
        "--config",
        "-c",
        help="'tiny' (embedded config, random weights), a config JSON file, "
        "or a local checkpoint directory.",
    ),
]
DeviceOption = Annotated[str, typer.Option("--device", help="auto, cpu or cuda.")]
DtypeOption = Annotated[str, typer.Option("--dtype", help="float32, bfloat16 or float16.")]
JsonOption = Annotated[bool, typer.Option("--json", help="Print only JSON on stdout.")]
SeedOption = Annotated[int, typer.Option("--seed", help="Seed for random weights and inputs.")]
Fp8Option = Annotated[
    bool, typer.Option("--fp8", help="With --backend te: run the TE layers under FP8 autocast.")
]
Fp8RecipeOption = Annotated[
    str,
    typer.Option(
        "--fp8-recipe",
        help="FP8 scaling recipe: auto, current, delayed, block, mxfp8 or nvfp4.",
    ),
]


@dataclass
class _Setup:
    family: Family
    substitution: Substitution
    model: torch.nn.Module
    source: str
    device: torch.device
    dtype: torch.dtype


def _family(name: str) -> Family:
    from layerswap.substitution import families

    known = families()
    key = name.strip().lower()
    if key not in known:
        close = difflib.get_close_matches(key, list(known), n=3, cutoff=0.5)
        hint = f"; did you mean {' or '.join(close)}?" if close else ""
        raise UsageProblem(
            f"unknown model family {name!r}{hint} (known: {', '.join(sorted(known))})"
        )
    return known[key]


def _choose_substitution(
    model: str | None,
    backend: str,
    substitution: str | None,
    config: str,
    fp8_recipe: str | None = None,
) -> tuple[Family, Substitution]:
    from layerswap.substitution import get, substitutions

    if fp8_recipe is not None:
        if substitution is not None or backend not in ("te", "te_fp8"):
            raise UsageProblem("--fp8 runs TransformerEngine layers: use it with --backend te")
        from layerswap.backends.te import fp8_substitution_for

        family = _family(model if model is not None else _family_of_config(config))
        fp8 = fp8_substitution_for(family, recipe=fp8_recipe)
        if fp8 is None:
            raise UsageProblem(f"TransformerEngine cannot express the {family.name} family")
        return family, fp8
    if substitution is not None:
        sub = get(substitution)
        family = _family(sub.family)
        if model is not None and _family(model).name != family.name:
            raise UsageProblem(
                f"--substitution {sub.name} is for {family.name}, not --model {model}"
            )
        return family, sub
    if model is None:
        model = _family_of_config(config)
    family = _family(model)
    name = f"{family.name}.decoder.{backend}"
    matches = [s for s in substitutions(family=family.name) if s.backend == backend]
    if not matches:
        backends = sorted({s.backend for s in substitutions(family=family.name)})
        raise UsageProblem(
            f"no {backend!r} substitution for {family.name} "
            f"(backends for {family.name}: {', '.join(backends) or 'none'})"
        )
    preferred = [s for s in matches if s.name == name]
    return family, (preferred or matches)[0]


def _family_of_config(config: str) -> str:
    """The family named by a config file's ``model_type``, when --model is left out."""
    path = _config_file(config)
    if path is None:
        raise UsageProblem("--model is required with --config tiny (e.g. --model llama)")
    from layerswap.substitution import families

    model_type = _read_json(path).get("model_type")
    if not isinstance(model_type, str):
        raise UsageProblem(f"{path} has no model_type; pass --model")
    for family in families().values():
        if family.model_type == model_type:
            return family.name
    return model_type  # unknown: _family() reports it with suggestions


def _config_file(config: str) -> Path | None:
    if config == "tiny":
        return None
    path = Path(config)
    if not path.exists():
        raise UsageProblem(f"--config {config}: no such file or directory")
    if path.is_dir():
        path = path / "config.json"
        if not path.is_file():
            raise UsageProblem(f"--config {config}: directory has no config.json")
    return path


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise UsageProblem(f"cannot read {path}: {_one_line(error)}") from error
    if not isinstance(data, dict):
        raise UsageProblem(f"{path} does not hold a JSON object")
    return data


def _placement(device: str, dtype: str) -> tuple[torch.device, torch.dtype]:
    from layerswap.verify import resolve_device, resolve_dtype

    try:
        resolved_dtype = resolve_dtype(dtype)
    except ValueError as error:
        raise UsageProblem(error) from error
    if device.strip().lower() not in ("auto", "cpu", "cuda") and not device.startswith("cuda:"):
        raise UsageProblem(f"unknown device {device!r}; choose auto, cpu or cuda")
    resolved_device = resolve_device(device)
    assert resolved_device is not None and resolved_dtype is not None
    return resolved_device, resolved_dtype


def _setup(
    model: str | None,
    backend: str,
    substitution: str | None,
    config: str,
    device: str,
    dtype: str,
    seed: int,
    progress: _Progress,
    fp8_recipe: str | None = None,
) -> _Setup:
    """Validate everything cheap first, then build the original model."""
    target_device, target_dtype = _placement(device, dtype)
    _quiet_transformers()
    family, sub = _choose_substitution(model, backend, substitution, config, fp8_recipe)
    reason = sub.unmet_requirement()
    if reason is not None:
        raise UsageProblem(f"{sub.name} cannot run here: {reason}")
    if target_device.type != "cuda" and sub.backend.startswith("te"):
        raise UsageProblem(f"{sub.name} needs CUDA; pass --device cuda on a GPU machine")
    config_file = _config_file(config)
    progress.step(f"building {family.name} model")
    built, source = _build_model(family, config, config_file, seed)
    built.to(device=target_device, dtype=target_dtype)
    built.eval()
    return _Setup(family, sub, built, source, target_device, target_dtype)


def _quiet_transformers() -> None:
    """No tqdm bars from transformers: progress is ours (and only on a terminal)."""
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()


def _build_model(
    family: Family, config: str, config_file: Path | None, seed: int
) -> tuple[torch.nn.Module, str]:
    config_class = family.config_type()
    if config_file is not None:
        declared = _read_json(config_file).get("model_type")
        if declared is not None and declared != family.model_type:
            raise UsageProblem(
                f"{config_file} describes a {declared!r} model, not {family.name} "
                f"({family.model_type!r})"
            )
    if config_file is not None and config_file.parent == Path(config):
        # a checkpoint directory: its own weights, loaded the transformers way
        try:
            loaded = family.causal_lm_class().from_pretrained(config, local_files_only=True)
        except (OSError, ValueError) as error:
            raise UsageProblem(f"cannot load checkpoint {config}: {_one_line(error)}") from error
        return loaded, f"checkpoint {config}"
    if config_file is None:
        model_config = family.tiny_config()
        source = "tiny config, random weights"
    else:
        try:
            model_config = config_class.from_json_file(str(config_file))
        except (OSError, ValueError, TypeError) as error:
            raise UsageProblem(f"cannot read config {config_file}: {_one_line(error)}") from error
        source = f"config {config_file}, random weights"
    return family.build(model_config, seed=seed), f"{source} (seed {seed})"


def _describe(setup: _Setup) -> dict[str, Any]:
    from layerswap.verify import _text_config

    config = _text_config(setup.model)
    return {
        "family": setup.family.name,
        "source": setup.source,
        "layers": getattr(config, "num_hidden_layers", None),
        "hidden_size": getattr(config, "hidden_size", None),
        "attention_heads": getattr(config, "num_attention_heads", None),
        "kv_heads": getattr(config, "num_key_value_heads", None),
        "vocab_size": getattr(config, "vocab_size", None),
        "parameters": sum(p.numel() for p in setup.model.parameters()),
    }


def _inputs(setup: _Setup, seed: int) -> dict[str, torch.Tensor]:
    from layerswap.verify import _text_config, default_inputs

    config = _text_config(setup.model)
    pad = getattr(config, "pad_token_id", None)
    return default_inputs(
        config.vocab_size, seed=seed, pad_token_id=pad if isinstance(pad, int) else 0
    )


def _header(console: _Output, setup: _Setup, what: str, swapped: str | None = None) -> None:
    info = _describe(setup)
    console.print(f"{what}: {setup.substitution.name}" + (f" ({swapped})" if swapped else ""))
    console.print(
        f"model: {info['family']}, {info['source']}: {info['layers']} layers, "
        f"hidden {info['hidden_size']}, heads {info['attention_heads']}/{info['kv_heads']} "
        f"(q/kv), vocab {info['vocab_size']}, {info['parameters'] / 1e6:.2f}M parameters"
    )
    console.print(f"device: {setup.device}, {str(setup.dtype).removeprefix('torch.')}")


def _verdict(passed: bool) -> Text:
    return Text("PASS", style="bold green") if passed else Text("FAIL", style="bold red")


def _render_verification(console: _Output, report: VerificationReport) -> None:
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False)
    table.add_column("layer", justify="right")
    table.add_column("module")
    table.add_column("max abs error", justify="right")
    table.add_column("max rel error", justify="right")
    table.add_column("cosine", justify="right")
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
        console.print(
            Text.assemble(
                f"generate: {gen.new_tokens} greedy tokens, agreement {gen.agreement:.0%}"
                + (
                    f", first mismatch at {gen.first_mismatch}"
                    if gen.first_mismatch is not None
                    else ""
                )
                + "  ",
                _verdict(gen.passed),
            )
        )
    if report.passed:
        console.print(Text.assemble(_verdict(True), ": the swapped model matches the original"))
    else:
        console.print(Text.assemble(_verdict(False), ": ", report.failure_message()))


def _render_bench(console: _Output, report: BenchReport) -> None:
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False)
    table.add_column("metric")
    table.add_column("original", justify="right")
    table.add_column("swapped", justify="right")
    table.add_column("ratio", justify="right")
    for row in report.rows():
        table.add_row(*row)
    console.print(
        f"timing: batch {report.batch} x seq {report.seq_len}, median of {report.steps} "
        f"interleaved steps after {report.warmup} warm-up (time ratio: original/swapped)"
    )
    console.emit(table)


def _run_bench(
    setup: _Setup,
    progress: _Progress,
    *,
    batch: int,
    seq: int,
    steps: int,
    warmup: int,
    backward: bool,
    seed: int,
) -> BenchReport:
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


# --------------------------------------------------------------------------- commands


@app.command("list")
def list_command(
    family: Annotated[
        str | None, typer.Option("--family", help="Only this family.", show_default=False)
    ] = None,
    backend: Annotated[
        str | None, typer.Option("--backend", help="Only this backend.", show_default=False)
    ] = None,
    json_output: JsonOption = False,
) -> None:
    """Every registered substitution: family, backend, and whether it can run here."""
    with _exit_codes():
        from layerswap.substitution import substitutions

        if family is not None:
            family = _family(family).name
        rows: list[dict[str, Any]] = []
        for sub in substitutions(family=family, backend=backend):
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
        _print_json(rows)
        return
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False)
    for column in ("substitution", "family", "backend", "usable here"):
        table.add_column(column)
    for row in rows:
        usable = Text("yes", style="green") if row["usable"] else Text(f"no: {row['reason']}")
        table.add_row(row["name"], row["family"], row["backend"], usable)
    _stdout().emit(table)


@app.command()
def patch(
    model: ModelOption = None,
    backend: BackendOption = "fused",
    substitution: SubstitutionOption = None,
    config: ConfigOption = "tiny",
    device: DeviceOption = "auto",
    dtype: DtypeOption = "float32",
    verify: Annotated[
        bool, typer.Option("--verify/--no-verify", help="Compare with the original model.")
    ] = True,
    bench: Annotated[bool, typer.Option("--bench", help="Also time original vs swapped.")] = False,
    json_output: JsonOption = False,
    save: Annotated[
        Path | None,
        typer.Option(
            "--save",
            help="Write the swapped model here, in the original layout (save_pretrained).",
            show_default=False,
        ),
    ] = None,
    seed: SeedOption = 0,
    fp8: Fp8Option = False,
    fp8_recipe: Fp8RecipeOption = "auto",
) -> None:
    """Build a model, swap its decoder layers, verify against the original, report."""
    with _exit_codes(), _Progress(not json_output) as progress:
        from layerswap.swap import swap
        from layerswap.verify import verify as run_verification

        setup = _setup(
            model,
            backend,
            substitution,
            config,
            device,
            dtype,
            seed,
            progress,
            fp8_recipe if fp8 else None,
        )
        report = None
        if verify:
            progress.step("verifying against the original")
            report = run_verification(setup.model, setup.substitution, _inputs(setup, seed))
        bench_report = None
        if bench:
            bench_report = _run_bench(
                setup, progress, batch=2, seq=64, steps=5, warmup=2, backward=True, seed=seed
            )
        progress.step("swapping")
        handle = swap(setup.model, setup.substitution)
        swapped = [(name, old.__name__, new.__name__) for name, old, new in handle.swapped]
        if save is not None:
            progress.step(f"saving to {save}")
            save.mkdir(parents=True, exist_ok=True)
            model_to_save: Any = setup.model
            model_to_save.save_pretrained(save)
    passed = report is None or report.passed
    if json_output:
        _print_json(
            {
                "command": "patch",
                "passed": passed,
                "substitution": setup.substitution.name,
                "device": str(setup.device),
                "dtype": str(setup.dtype).removeprefix("torch."),
                "model": _describe(setup),
                "swapped": [
                    {"module": name, "original": old, "replacement": new}
                    for name, old, new in swapped
                ],
                "verification": report.to_dict() if report is not None else None,
                "bench": bench_report.to_dict() if bench_report is not None else None,
                "saved": str(save) if save is not None else None,
            }
        )
    else:
        console = _stdout()
        kinds = sorted({(old, new) for _, old, new in swapped})
        _header(
            console,
            setup,
            "patch",
            f"{len(swapped)} layers swapped: " + ", ".join(f"{old} -> {new}" for old, new in kinds),
        )
        if report is not None:
            _render_verification(console, report)
        if bench_report is not None:
            _render_bench(console, bench_report)
        if save is not None:
            console.print(f"saved the swapped model in the original layout to {save}")
    if not passed:
        raise typer.Exit(1)


@app.command("verify")
def verify_command(
    model: ModelOption = None,
    backend: BackendOption = "fused",
    substitution: SubstitutionOption = None,
    config: ConfigOption = "tiny",
    device: DeviceOption = "auto",
    dtype: DtypeOption = "float32",
    backward: Annotated[
        bool, typer.Option("--backward", help="Also compare the loss and every gradient.")
    ] = False,
    generate: Annotated[
        int, typer.Option("--generate", help="Also compare N greedily generated tokens.", min=0)
    ] = 0,
    streaming: Annotated[
        bool,
        typer.Option("--streaming", help="Layer by layer: memory near one model plus a layer."),
    ] = False,
    tolerance: Annotated[
        float | None,
        typer.Option(
            "--tolerance", help="atol and rtol (default: by dtype).", min=0, show_default=False
        ),
    ] = None,
    json_output: JsonOption = False,
    seed: SeedOption = 0,
    fp8: Fp8Option = False,
    fp8_recipe: Fp8RecipeOption = "auto",
) -> None:
    """Verify a substitution against the original model, layer by layer."""
    with _exit_codes(), _Progress(not json_output) as progress:
        from layerswap.verify import verify as run_verification

        setup = _setup(
            model,
            backend,
            substitution,
            config,
            device,
            dtype,
            seed,
            progress,
            fp8_recipe if fp8 else None,
        )
        progress.step("verifying against the original")
        try:
            report = run_verification(
                setup.model,
                setup.substitution,
                _inputs(setup, seed),
                backward=backward,
                generate=generate,
                tolerance=tolerance,
                streaming=streaming,
            )
        except ValueError as error:
            raise UsageProblem(error) from error
    if json_output:
        _print_json(report.to_dict())
    else:
        console = _stdout()
        _header(console, setup, "verify")
        _render_verification(console, report)
    if not report.passed:
        raise typer.Exit(1)


@app.command("bench")
def bench_command(
    model: ModelOption = None,
    backend: BackendOption = "fused",
    substitution: SubstitutionOption = None,
    config: ConfigOption = "tiny",
    device: DeviceOption = "auto",
    dtype: DtypeOption = "float32",
    batch: Annotated[int, typer.Option("--batch", min=1, help="Sequences per step.")] = 4,
    seq: Annotated[int, typer.Option("--seq", min=1, help="Tokens per sequence.")] = 128,
    steps: Annotated[int, typer.Option("--steps", min=1, help="Measured steps.")] = 10,
    warmup: Annotated[int, typer.Option("--warmup", min=0, help="Unmeasured steps.")] = 3,
    backward: Annotated[
        bool, typer.Option("--backward/--no-backward", help="Also time forward+backward.")
    ] = True,
    json_output: JsonOption = False,
    seed: SeedOption = 0,
    fp8: Fp8Option = False,
    fp8_recipe: Fp8RecipeOption = "auto",
) -> None:
    """Time the original and the swapped model (interleaved runs, medians, ratios)."""
    with _exit_codes(), _Progress(not json_output) as progress:
        setup = _setup(
            model,
            backend,
            substitution,
            config,
            device,
            dtype,
            seed,
            progress,
            fp8_recipe if fp8 else None,
        )
        report = _run_bench(
            setup,
            progress,
            batch=batch,
            seq=seq,
            steps=steps,
            warmup=warmup,
            backward=backward,
            seed=seed,
        )
    if json_output:
        _print_json(report.to_dict())
        return
    console = _stdout()
    _header(console, setup, "bench")
    _render_bench(console, report)


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _environment() -> list[dict[str, str]]:
    import torch
    import transformers

    import layerswap
    from layerswap.substitution import families

    rows = [
        {"component": "python", "status": platform.python_version(), "enables": ""},
        {"component": "layerswap", "status": layerswap.__version__, "enables": ""},
    ]
    cuda = torch.cuda.is_available()
    if cuda:
        name = torch.cuda.get_device_name(0)
        major, minor = torch.cuda.get_device_capability(0)
        cuda_status = f"available: {name} (compute capability {major}.{minor})"
        cuda_enables = "--device cuda; bfloat16 at full speed; the te backend"
        if major < 8:
            cuda_enables = "--device cuda (bfloat16 needs compute capability 8.0+ to be fast)"
    else:
        build = "CPU-only build" if torch.version.cuda is None else "no GPU visible"
        cuda_status = f"not available ({build})"
        cuda_enables = "CPU only: the te backend needs CUDA"
    rows.append({"component": "torch", "status": torch.__version__, "enables": "the fused backend"})
    rows.append({"component": "CUDA", "status": cuda_status, "enables": cuda_enables})
    major_version = int(transformers.__version__.split(".")[0])
    supported = "supported" if major_version == 5 else "NOT supported (need >=5,<6)"
    rows.append(
        {
            "component": "transformers",
            "status": f"{transformers.__version__} ({supported})",
            "enables": "families: " + ", ".join(sorted(families())),
        }
    )
    te_version = _version("transformer_engine") or _version("transformer-engine")
    te_found = importlib.util.find_spec("transformer_engine") is not None
    if te_found:
        rows.append(
            {
                "component": "TransformerEngine",
                "status": te_version or "installed",
                "enables": "te backend (bfloat16, FP8)"
                if cuda
                else "te backend once CUDA is there",
            }
        )
    else:
        rows.append(
            {
                "component": "TransformerEngine",
                "status": "not installed",
                "enables": "te backend: pip install 'layerswap[te]' on a CUDA machine",
            }
        )
    return rows


@app.command()
def doctor(json_output: JsonOption = False) -> None:
    """What is installed here and what it enables."""
    with _exit_codes():
        rows = _environment()
        from layerswap.substitution import substitutions

        backends: dict[str, list[str]] = {}
        for sub in substitutions():
            reason = sub.unmet_requirement()
            backends.setdefault(sub.backend, []).append(reason or "")
        usable = {
            name: next((r for r in reasons if r), None)
            if not all(r == "" for r in reasons)
            else None
            for name, reasons in backends.items()
        }
    if json_output:
        _print_json(
            {
                "environment": rows,
                "backends": {
                    name: {"usable": reason is None, "reason": reason}
                    for name, reason in usable.items()
                },
            }
        )
        return
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False)
    for column in ("component", "status", "enables"):
        table.add_column(column)
    for row in rows:
        table.add_row(row["component"], row["status"], row["enables"])
    console = _stdout()
    console.emit(table)
    for name, reason in sorted(usable.items()):
        console.print(
            f"backend {name}: " + ("usable here" if reason is None else f"not usable: {reason}")
        )


# --------------------------------------------------------------------------- entry point


def _click_class(name: str) -> type[Exception]:
    """A click exception class, found through typer (which may vendor its own click)."""
    for klass in typer.BadParameter.__mro__:
        if klass.__name__ == name:
            return klass
    raise LookupError(name)  # pragma: no cover - every click has these


def main(argv: Sequence[str] | None = None) -> NoReturn:
    """Run the command line (``layerswap`` and ``python -m layerswap``); exits.

    Usage errors found while parsing (an unknown option, a bad number) are reported as
    one line with exit code 2, like every other usage problem; a bare ``layerswap``
    prints the help.
    """
    usage_error, click_exception = _click_class("UsageError"), _click_class("ClickException")
    command = typer.main.get_command(app)
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
        message = _one_line(getattr(error, "format_message", error.__str__)())
        hint = f" (see: {ctx.command_path} --help)" if ctx is not None else ""
        print(f"layerswap: error: {message}{hint}", file=sys.stderr)
        sys.exit(2)
    except click_exception as error:
        print(f"layerswap: error: {_one_line(error)}", file=sys.stderr)
        sys.exit(getattr(error, "exit_code", 1))
    except typer.Abort:
        print("layerswap: aborted", file=sys.stderr)
        sys.exit(130)
    sys.exit(code if isinstance(code, int) else 0)
