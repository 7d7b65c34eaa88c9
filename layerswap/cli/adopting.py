"""``layerswap verify --adopt MODULE:FUNCTION``: a patch function adopted, proven, undone.

The function is imported (a module in the current directory too, as ``python -m`` finds
it), adopted with :func:`layerswap.adopt` on the family's tiny config (or the ``--config``
given, its sizes shrunk) and undone. Exit codes as ``verify``'s: 0 proven, 1 the patch
changes the numbers (the first divergent layer named), 2 it cannot be imported or run here.

Example::

    $ layerswap verify --adopt my_patches:fast_rms_norm --model llama
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable
from typing import Any

import typer

from layerswap.cli.models import find_family
from layerswap.cli.options import ModelChoice
from layerswap.cli.output import Output, Progress, print_json
from layerswap.cli.problems import UsageProblem, exit_codes, one_line
from layerswap.errors import LayerswapError, PatchDivergenceError
from layerswap.suggestions import did_you_mean

__all__ = ["load_patch_function", "verify_adopted"]


def load_patch_function(target: str) -> Callable[..., Any]:
    """The function ``target`` (``"package.module:function"``) names; a usage problem,
    with close names, where it does not."""
    module_name, _, qualname = target.partition(":")
    if not module_name or not qualname:
        raise UsageProblem(
            f"--adopt takes MODULE:FUNCTION (e.g. my_patches:apply_fast_norm), not {target!r}"
        )
    here = os.getcwd()
    added = here not in sys.path
    if added:
        sys.path.insert(0, here)
    try:
        found: Any = importlib.import_module(module_name)
    except Exception as error:  # a missing module, or one that fails as it runs
        raise UsageProblem(
            f"--adopt: cannot import {module_name!r}: {type(error).__name__}: {error}"
        ) from error
    finally:
        if added:
            sys.path.remove(here)
    for part in qualname.split("."):
        if not hasattr(found, part):
            names = [name for name in dir(found) if not name.startswith("_")]
            hint = did_you_mean(part, names)
            raise UsageProblem(
                f"--adopt: {module_name} has no {qualname!r}{'; ' + hint if hint else ''}"
            )
        found = getattr(found, part)
    if not callable(found):
        raise UsageProblem(f"--adopt: {target} is a {type(found).__name__}, not a function")
    return found  # type: ignore[no-any-return]


def _config(choice: ModelChoice) -> Any:
    if choice.model is None and choice.config == "tiny":
        raise UsageProblem("--adopt needs the family to prove it on: --model FAMILY")
    if choice.config == "tiny":
        return find_family(choice.model or "").tiny_config()
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(choice.config)
    except Exception as error:  # unreadable, or refused by the config's own validation
        raise UsageProblem(f"--config {choice.config}: {error}") from error
    if choice.model is not None:
        family = find_family(choice.model)
        if config.model_type != family.model_type:
            raise UsageProblem(
                f"--config {choice.config} describes a {config.model_type!r} model, not "
                f"{family.name} ({family.model_type!r})"
            )
    return config


def verify_adopted(target: str, choice: ModelChoice, *, json_output: bool) -> None:
    """Adopt ``target`` proven on ``choice``'s family, print the verdict, undo; exit 1 when
    the patch changes the numbers."""
    import layerswap

    with exit_codes(), Progress(not json_output) as progress:
        function = load_patch_function(target)
        config = _config(choice)
        progress.step(f"adopting {target} and proving it on a tiny model")
        try:
            adoption = layerswap.adopt(function, config=config, prove=True)
        except PatchDivergenceError as error:
            _show(target, json_output, passed=False, detail=str(error), layer=error.layer)
            raise typer.Exit(1) from None
        except LayerswapError:
            raise  # exit 2 with its sentence (exit_codes)
        except Exception as error:  # the patch function's own: it cannot run here
            raise UsageProblem(
                f"--adopt: {target} raised {type(error).__name__}: {error} (its changes were "
                "taken back)"
            ) from error
        adoption.undo()
    _show(
        target,
        json_output,
        passed=True,
        detail=f"proven equal to the original on a tiny {adoption.proven} model",
        changes=adoption.changes,
        family=adoption.proven,
        checks=adoption.checks,
    )


def _show(
    target: str,
    json_output: bool,
    *,
    passed: bool,
    detail: str,
    layer: str | None = None,
    changes: list[str] | None = None,
    family: str | None = None,
    checks: tuple[str, ...] = (),
) -> None:
    if json_output:
        payload = {"adopted": target, "passed": passed, "family": family, "layer": layer}
        print_json({**payload, "checks": list(checks), "changes": changes or [], "detail": detail})
        return
    console = Output()
    if not passed:
        console.print(f"FAILED  {one_line(detail)}")
        return
    console.print(f"PASSED  {target}: {detail}")
    console.print(f"checks: {', '.join(checks)}")
    console.print(f"changed ({len(changes or [])}), then undone:")
    for line in changes or []:
        console.print(f"  {line}")
