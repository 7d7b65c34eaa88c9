"""The options of ``patch``, ``verify`` and ``bench``, declared once.

Typer reads a command's options from its signature. :class:`ModelChoice` declares the
nine options that choose, build and place the model; :func:`model_options` gives them
to a command as one ``ModelChoice`` argument.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any

import typer

__all__ = [
    "AdoptOption",
    "BackwardOption",
    "GenerateOption",
    "JsonOption",
    "ModelChoice",
    "StreamingOption",
    "ToleranceOption",
    "model_options",
]

ModelOption = Annotated[
    str | None,
    typer.Option(
        "--model",
        "-m",
        metavar="FAMILY",
        help="Model family (llama, mistral, qwen2, qwen3, ...).",
        show_default=False,
    ),
]
BackendOption = Annotated[
    str,
    typer.Option(
        "--backend",
        "-b",
        metavar="BACKEND",
        help="Backend name, or <backend>_<variant> (layerswap list shows which run here).",
    ),
]
SubstitutionOption = Annotated[
    str | None,
    typer.Option(
        "--substitution",
        "-s",
        metavar="NAME",
        help="A substitution by full name (e.g. llama.decoder.fused), instead of --backend.",
        show_default=False,
    ),
]
ConfigOption = Annotated[
    str,
    typer.Option(
        "--config",
        "-c",
        metavar="tiny|FILE|DIR",
        help="'tiny' (embedded config, random weights), a config JSON file, "
        "or a local checkpoint directory.",
    ),
]
DeviceOption = Annotated[str, typer.Option("--device", metavar="DEVICE", help="auto, cpu or cuda.")]
DtypeOption = Annotated[
    str, typer.Option("--dtype", metavar="DTYPE", help="float32, bfloat16 or float16.")
]
JsonOption = Annotated[bool, typer.Option("--json", help="Print only JSON on stdout.")]
SeedOption = Annotated[
    int, typer.Option("--seed", metavar="INT", help="Seed for random weights and inputs.")
]
# verify's own
BackwardOption = Annotated[
    bool, typer.Option("--backward", help="Also compare the loss and every gradient.")
]
GenerateOption = Annotated[
    int | None,
    typer.Option(
        "--generate",
        metavar="N",
        help="Greedy tokens decoded with the KV cache and compared (default: 4 for a "
        "causal LM; 0 skips).",
        min=0,
        show_default=False,
    ),
]
StreamingOption = Annotated[
    bool,
    typer.Option("--streaming", help="Layer by layer: memory near one model plus a layer."),
]
ToleranceOption = Annotated[
    float | None,
    typer.Option(
        "--tolerance",
        metavar="TOL",
        help="atol and rtol (default: by dtype).",
        min=0,
        show_default=False,
    ),
]
AdoptOption = Annotated[
    str | None,
    typer.Option(
        "--adopt",
        metavar="MODULE:FUNCTION",
        help="Prove a patch function (Liger's apply_liger_kernel_to_*, your own) on a "
        "tiny model of --model, then undo it; the substitution options are not used.",
        show_default=False,
    ),
]
Fp8Option = Annotated[
    bool,
    typer.Option("--fp8", help="Run the chosen backend's fp8 variant (its layers in FP8 GEMMs)."),
]
Fp8RecipeOption = Annotated[
    str,
    typer.Option(
        "--fp8-recipe",
        metavar="RECIPE",
        help="The fp8 variant's scaling recipe: auto, current, delayed, block, mxfp8 or nvfp4.",
    ),
]


@dataclass(frozen=True)
class ModelChoice:
    """Which model to build, which substitution to apply, and where it runs.

    Each field is a command-line option (its type says which); ``--help`` lists
    ``seed``, ``fp8`` and ``fp8_recipe`` after the command's own options.
    """

    model: ModelOption = None
    backend: BackendOption = "fused"
    substitution: SubstitutionOption = None
    config: ConfigOption = "tiny"
    device: DeviceOption = "auto"
    dtype: DtypeOption = "float32"
    seed: SeedOption = 0
    fp8: Fp8Option = False
    fp8_recipe: Fp8RecipeOption = "auto"


_LISTED_LAST = ("seed", "fp8", "fp8_recipe")


def _choice_parameters() -> tuple[list[inspect.Parameter], list[inspect.Parameter]]:
    """The fields of :class:`ModelChoice` as keyword parameters: (listed first, last)."""
    hints = typing.get_type_hints(ModelChoice, include_extras=True)
    first: list[inspect.Parameter] = []
    last: list[inspect.Parameter] = []
    for field in dataclasses.fields(ModelChoice):
        parameter = inspect.Parameter(
            field.name,
            inspect.Parameter.KEYWORD_ONLY,
            default=field.default,
            annotation=hints[field.name],
        )
        (last if field.name in _LISTED_LAST else first).append(parameter)
    return first, last


def model_options(command: Callable[..., None]) -> Callable[..., None]:
    """Declare :class:`ModelChoice`'s options on ``command``, which gets them as one value.

    ``command(choice, **own_options)`` becomes a function of every option, whose
    signature (what Typer reads) has the model options around the command's own.

    Example::

        @app.command("verify")
        @model_options
        def verify_command(choice: ModelChoice, json_output: JsonOption = False) -> None: ...
    """
    first, last = _choice_parameters()
    own = list(inspect.signature(command, eval_str=True).parameters.values())[1:]
    keyword_only = inspect.Parameter.KEYWORD_ONLY
    parameters = [*first, *(p.replace(kind=keyword_only) for p in own), *last]
    names = [field.name for field in dataclasses.fields(ModelChoice)]

    @functools.wraps(command)
    def with_choice(**options: Any) -> None:
        choice = ModelChoice(**{name: options.pop(name) for name in names})
        command(choice, **options)

    with_choice.__signature__ = inspect.Signature(parameters)  # type: ignore[attr-defined]
    with_choice.__annotations__ = {p.name: p.annotation for p in parameters} | {"return": None}
    return with_choice
