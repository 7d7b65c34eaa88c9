"""``layerswap check`` and doctor's proofs row: which families are proven on these versions.

A family is proven when its substitution passed the behaviour proof
(:mod:`layerswap.proof`) on the installed transformers, torch and layerswap. ``check``
proves on demand (the family's tiny config); the proof also runs by itself at first use.
A substitution named with ``--substitution`` is checked as its slot checks it before a
swap (an adopted patch function's: proven on the family's tiny model).
"""

from __future__ import annotations

import functools
import time
from typing import TYPE_CHECKING, Any

from layerswap.errors import LayerswapError

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    import torch

    from layerswap.substitution import Substitution

__all__ = ["check_rows", "proofs_row"]


def _row(family: str, name: str, **fields: Any) -> dict[str, Any]:
    return {"family": family, "substitution": name, "seconds": None, "detail": "", **fields}


def check_one(
    family: str, backend: str, again: bool, dtype: torch.dtype | None = None
) -> dict[str, Any]:
    """The check of one family: its static contract, then the behaviour proof."""
    from layerswap.registry import get, get_backend, get_family

    name = f"{family}.decoder.{backend}"
    # asked first: a backend reading the family's source, or making the substitution,
    # would find it missing
    absent = _absent(family, name)
    if absent is not None:
        return absent
    refused = get_backend(backend).unsupported(get_family(family))
    if refused is not None:
        return _row(family, name, status="refused", detail=f"the backend refuses it: {refused}")
    return _check(get(name), again, dtype)


def check_named(name: str, again: bool, dtype: torch.dtype | None = None) -> dict[str, Any]:
    """The check of one substitution by name (one registered by hand: an adopted patch
    function's, :func:`layerswap.adoption.patch_substitution`, too)."""
    from layerswap.registry import get

    sub = get(name)
    absent = _absent(sub.family, sub.name)
    return absent if absent is not None else _check(sub, again, dtype)


def _absent(family: str, name: str) -> dict[str, Any] | None:
    from layerswap.registry import get_family
    from layerswap.versions import transformers_version

    if get_family(family).absence() is None:
        return None
    version = transformers_version()
    return _row(family, name, status="absent", detail=f"not in transformers {version}")


def _check(sub: Substitution, again: bool, dtype: torch.dtype | None = None) -> dict[str, Any]:
    """Its requirement, then the slot's checks on the family's tiny config: for the decoder
    slot the stored behaviour proof (in ``dtype`` too where it is bfloat16 or float16), for
    another slot what it checks before a swap (the patch slot: the patch function adopted
    and proven on a tiny model)."""
    from layerswap.placement import Placement
    from layerswap.proof import changed_here, prove

    family, name = sub.family, sub.name
    reason = sub.unmet_requirement()
    if reason is not None:
        return _row(family, name, status="skipped", detail=f"cannot run here: {reason}")
    try:
        # the config as a model sets it (its attention implementation chosen)
        config = sub.parts.family.build().config
    except Exception as error:  # not layerswap's to prove: the original fails here too
        detail = f"the original cannot be built here: {type(error).__name__}: {error}"
        return _row(family, name, status="unbuildable", detail=detail)
    # a verdict on these versions whose transformers source has changed since vouches for
    # nothing: said so, and proven again
    changed = changed_here().get(name)
    since = (
        "changed since proven: transformers' source differs from the one proven; "
        if changed
        else ""
    )
    started = time.perf_counter()
    try:
        if not sub.parts.slot.proves(sub):
            sub.parts.slot.prepare(sub, config, Placement(dtype))
            seconds = round(time.perf_counter() - started, 3)
            return _row(family, name, status="proven", seconds=seconds)
        sub.check_upstream(config)
        verdict = prove(sub, None, force=again, dtype=dtype)
    except LayerswapError as error:
        return _row(family, name, status="failed", detail=since + str(error))
    except Exception as error:  # the original itself cannot be built here: say so
        detail = f"{since}{type(error).__name__}: {error}"
        return _row(family, name, status="failed", detail=detail)
    status = "proven" if verdict.passed else "failed"
    if verdict.passed:
        detail = f"{since}proven again now" if changed else ""
    else:
        detail = f"{since}{verdict.check}: {verdict.detail}"
    return _row(family, name, status=status, seconds=verdict.seconds, detail=detail)


def check_rows(
    families: list[str],
    backend: str,
    again: bool,
    on_step: Callable[[int, int, str], None] | None = None,
    substitutions: Sequence[str] = (),
    dtype: torch.dtype | None = None,
) -> list[dict[str, Any]]:
    """One row per family (its ``<family>.decoder.<backend>``), then per substitution
    named: ``proven``, ``failed`` (with the first difference), ``skipped`` (cannot run
    here), ``refused`` (the backend does not express the family, and says why),
    ``absent`` (not in the installed transformers) or ``unbuildable`` (the original itself
    fails to build on it: nothing to prove). ``dtype``: bfloat16 or float16 is proven too."""
    steps: list[tuple[str, Callable[[], dict[str, Any]]]] = [
        (family, functools.partial(check_one, family, backend, again, dtype)) for family in families
    ]
    steps += [(name, functools.partial(check_named, name, again, dtype)) for name in substitutions]
    rows = []
    for done, (label, step) in enumerate(steps):
        if on_step is not None:
            on_step(done, len(steps), label)
        rows.append(step())
    if on_step is not None:
        on_step(len(steps), len(steps), "")
    return rows


def proofs_row() -> dict[str, str]:
    """Doctor's row: how many of the families the installed transformers has are proven
    here, failed, changed since proven, or not proven yet; and which it lacks."""
    from layerswap.proof import changed_here, proven_here
    from layerswap.registry import families
    from layerswap.versions import transformers_version

    verdicts = proven_here()
    changed = changed_here()
    known = families()
    absent = sorted(name for name, family in known.items() if family.absence() is not None)
    names = sorted(set(known) - set(absent))
    proven, failed, stale, pending = [], [], [], []
    for family in names:
        found = [v for name, v in verdicts.items() if name.startswith(f"{family}.decoder.")]
        if any(not v.passed for v in found):
            failed.append(family)
        elif found:
            proven.append(family)
        elif any(name.startswith(f"{family}.decoder.") for name in changed):
            stale.append(family)
        else:
            pending.append(family)
    status = f"{len(proven)} of {len(names)} families proven on these versions"
    if stale:
        status += f", {len(stale)} changed since proven"
    parts = []
    if failed:
        parts.append("FAILED: " + ", ".join(failed))
    if stale:
        parts.append(
            "changed since proven (transformers' source differs from the one proven; "
            "proven again at first use, or now by `layerswap check`): " + ", ".join(stale)
        )
    if pending:
        parts.append(
            "not proven yet (proven at first use, or now by `layerswap check --all`): "
            + ", ".join(pending)
        )
    if absent:
        parts.append(f"not in transformers {transformers_version()}: " + ", ".join(absent))
    return {
        "component": "proofs",
        "status": status + (f", {len(failed)} failed" if failed else ""),
        "enables": "; ".join(parts) or "every family",
    }
