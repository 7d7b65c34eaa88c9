"""Swapped models under ``torch.distributed``, and substitutions in DataLoader workers.

A swapped model is an ordinary ``nn.Module``: DDP, FSDP and ``accelerate`` wrap it
like any other, as long as **every rank applies the same substitution** before it
builds or loads the model (ranks whose parameters differ in name or shape cannot
synchronise). :func:`check_ranks_agree` checks that at run time.

Class-level swaps (:func:`layerswap.use`) are patches of the running process. A
DataLoader worker started with ``spawn`` or ``forkserver`` is a fresh interpreter
that does not have them; :func:`reapply` makes a ``worker_init_fn`` that applies
them again there. See docs/distributed.md.

Example::

    from layerswap.distributed import reapply

    with layerswap.use("llama.decoder.fused"):
        model = LlamaForCausalLM(config)
        loader = DataLoader(dataset, num_workers=4, multiprocessing_context="spawn",
                            worker_init_fn=reapply())
"""

from __future__ import annotations

import functools
import pickle
import warnings
from collections import Counter
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from layerswap.errors import SubstitutionError, SwapWarning
from layerswap.patching import PatchGroup

if TYPE_CHECKING:
    from torch import nn

    from layerswap.substitution import Substitution

__all__ = [
    "ENVIRONMENT",
    "Propagation",
    "Reapply",
    "WithSubstitutions",
    "applied_substitutions",
    "apply_from_environment",
    "check_ranks_agree",
    "propagate",
    "reapply",
]

# Groups started by Reapply in a worker: they last as long as the worker process.
_WORKER_GROUPS: list[PatchGroup] = []


def applied_substitutions() -> tuple[Substitution, ...]:
    """The registered substitutions whose class-level swap is live here, oldest first.

    A substitution counts as applied while the group that :func:`layerswap.use` (or
    :func:`layerswap.replace_decoder`) started is active (see
    :func:`layerswap.use.applied`).

    Example::

        with layerswap.use("llama.decoder.fused"):
            [s.name for s in applied_substitutions()]   # ["llama.decoder.fused"]
    """
    from layerswap.use import applied

    return applied()


class Reapply:
    """A picklable ``worker_init_fn`` that applies substitutions in the worker process.

    Made by :func:`reapply`. In the worker it applies each substitution with
    :func:`layerswap.use` for the rest of the worker's life, skipping those the
    worker already has (a ``fork``-started worker inherits the parent's patches),
    then calls ``then(worker_id)`` if given.
    """

    def __init__(
        self,
        substitutions: Iterable[str | Substitution],
        then: Callable[[int], Any] | None = None,
    ) -> None:
        from layerswap.registry import get

        self.substitutions: tuple[Substitution, ...] = tuple(get(s) for s in substitutions)
        self.then = then

    @property
    def names(self) -> tuple[str, ...]:
        """The names of the substitutions applied in each worker, in order."""
        return tuple(sub.name for sub in self.substitutions)

    def __call__(self, worker_id: int = 0) -> None:
        from layerswap.use import use

        present = {sub.name for sub in applied_substitutions()}
        for sub in self.substitutions:
            if sub.name in present:
                continue
            group = use(sub)
            group.start()
            _WORKER_GROUPS.append(group)
        if self.then is not None:
            self.then(worker_id)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (tuple(_portable(sub) for sub in self.substitutions), self.then))

    def __repr__(self) -> str:
        then = f", then={self.then!r}" if self.then is not None else ""
        return f"Reapply({list(self.names)!r}{then})"


class WithSubstitutions:
    """A picklable callable that applies substitutions in its process, then calls ``fn``.

    What the pytest plugin hands ``torch.multiprocessing.start_processes`` in a
    ``--layerswap`` run, so a rank started with ``spawn`` builds the same layers as the
    test that started it. Example::

        torch.multiprocessing.spawn(WithSubstitutions(run_rank, ["llama.decoder.fused"]))
    """

    def __init__(self, fn: Callable[..., Any], substitutions: Iterable[str | Substitution]):
        self.fn = fn
        self.reapply = Reapply(substitutions)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.reapply()
        return self.fn(*args, **kwargs)

    def __repr__(self) -> str:
        return f"WithSubstitutions({self.fn!r}, {list(self.reapply.names)!r})"


def _portable(sub: Substitution) -> Substitution | str:
    """``sub`` itself when it pickles, else its registered name (looked up in the worker)."""
    from layerswap.registry import get

    try:
        pickle.dumps(sub)
    except Exception as exc:
        try:
            if get(sub.name) is sub:
                return sub.name
        except LookupError:
            pass
        raise SubstitutionError(
            f"cannot send substitution {sub.name!r} to a worker process: it does not pickle "
            f"({exc}) and is not registered under its name; define its replacement class and "
            "converter at module level, or register it in a module the worker imports"
        ) from exc
    return sub


def _rebuild(items: tuple[Substitution | str, ...], then: Callable[[int], Any] | None) -> Reapply:
    from layerswap.registry import get

    local = []
    for item in items:
        if isinstance(item, str):
            local.append(get(item))
            continue
        try:
            registered = get(item.name)
        except LookupError:
            registered = None
        # the worker's registered object, when it is the same substitution, so that
        # layers built in the worker are marked with it (swap/save_pretrained find it)
        local.append(registered if registered == item else item)
    return Reapply(local, then)


def reapply(
    substitutions: Iterable[str | Substitution] | None = None,
    *,
    then: Callable[[int], Any] | None = None,
) -> Reapply:
    """A ``worker_init_fn`` that re-applies substitutions in DataLoader worker processes.

    With ``substitutions=None`` it captures those applied here and now
    (:func:`applied_substitutions`), so create it inside the ``use(...)`` block. The
    result pickles (``spawn``/``forkserver`` workers receive a copy): a registered
    substitution whose parts do not pickle is sent by name. ``then`` is your own
    ``worker_init_fn``, called afterwards with the worker id.

    Example::

        with layerswap.use("llama.decoder.fused"):
            loader = DataLoader(dataset, num_workers=2, multiprocessing_context="spawn",
                                worker_init_fn=reapply(then=seed_worker))
    """
    if substitutions is None:
        captured: Iterable[str | Substitution] = applied_substitutions()
        if not captured:
            warnings.warn(
                "reapply(): no layerswap substitution is applied here, so workers will build "
                "original layers; create it inside the use(...) block, or name the "
                "substitutions: reapply(['llama.decoder.fused'])",
                SwapWarning,
                stacklevel=2,
            )
    else:
        captured = [substitutions] if isinstance(substitutions, str) else substitutions
    return Reapply(captured, then)


def _fingerprint(model: nn.Module | None) -> dict[str, Any]:
    applied = sorted(sub.name for sub in applied_substitutions())
    layers: dict[str, int] = {}
    if model is not None:
        from layerswap.model import decoder_layers, unwrap

        counts = Counter(
            f"{type(layer).__module__}.{type(layer).__qualname__}"
            for _, layer in decoder_layers(unwrap(model))
        )
        layers = dict(sorted(counts.items()))
    return {"applied": applied, "decoder_layers": layers}


def check_ranks_agree(model: nn.Module | None = None, *, group: Any = None) -> None:
    """Raise :class:`SubstitutionError` unless every rank applied the same substitutions.

    Compares, across the ranks of ``group`` (default: the whole world), the
    substitutions applied in the process and, when ``model`` is given (plain or
    wrapped by DDP/FSDP), the classes of its decoder layers. Every rank must call
    it (it is a collective). Without an initialised process group it does nothing.

    Example::

        with layerswap.use("llama.decoder.fused"):
            model = LlamaForCausalLM(config)
        check_ranks_agree(model)
        model = DistributedDataParallel(model)
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    mine = _fingerprint(model)
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    if all(other == everyone[0] for other in everyone):
        return
    lines = [f"  rank {rank}: {state}" for rank, state in enumerate(everyone)]
    raise SubstitutionError(
        "ranks disagree on layerswap substitutions (every rank must apply the same ones "
        "before building or loading the model):\n" + "\n".join(lines)
    )


# --- processes the user's code starts: an environment variable read at import ------------

#: the environment variable naming the substitutions a process applies when it imports
#: layerswap: ``"llama.decoder.fused@transformers.models.llama.modeling_llama,..."``
#: (each registered name, with the module its original class lives in)
ENVIRONMENT = "LAYERSWAP_SUBSTITUTIONS"

# substitutions armed or applied in this process from the environment, by name
_FROM_ENVIRONMENT: dict[str, PatchGroup | None] = {}


class Propagation:
    """Substitutions carried to processes started from here, through :data:`ENVIRONMENT`.

    Made by :func:`propagate`. ``stop()`` (or leaving the ``with`` block) puts the
    variable back as it was; processes started meanwhile keep what they got.
    """

    def __init__(self, names: tuple[str, ...], value: str, previous: str | None) -> None:
        self.names = names
        self.value = value
        self._previous = previous
        self._active = True

    def stop(self) -> None:
        """Stop carrying them: :data:`ENVIRONMENT` is restored (removed if it was unset)."""
        import os

        if not self._active:
            return
        self._active = False
        if self._previous is None:
            os.environ.pop(ENVIRONMENT, None)
        else:
            os.environ[ENVIRONMENT] = self._previous

    def __enter__(self) -> Propagation:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "active" if self._active else "stopped"
        return f"Propagation({list(self.names)!r}, {state})"


def propagate(substitutions: Iterable[str | Substitution] | None = None) -> Propagation:
    """Make processes started from here apply ``substitutions`` (default: those applied now).

    Sets :data:`ENVIRONMENT`, which child processes inherit. A process that imports
    layerswap with it set applies each substitution (:func:`layerswap.use`, for the
    rest of its life) as soon as the original's modeling module is imported, before
    any model is built, and says so on stderr. That covers ``multiprocessing`` with
    ``spawn`` and ``forkserver`` and ``torch.multiprocessing.spawn`` (the child
    re-imports the script that called this), and ``torchrun`` (each rank runs the
    script). A forked child inherits the patches themselves and applies nothing twice.
    Only registered substitutions travel by name; others raise
    :class:`SubstitutionError`. Off unless called.

    Example::

        with layerswap.use("llama.decoder.fused"):
            propagate()                    # every process started from here on
        torch.multiprocessing.spawn(train, nprocs=2)
    """
    import os

    from layerswap.registry import get

    if substitutions is None:
        chosen: list[Substitution] = list(applied_substitutions())
        if not chosen:
            raise SubstitutionError(
                "propagate(): no layerswap substitution is applied here; call it inside the "
                "use(...) block, or name them: propagate(['llama.decoder.fused'])"
            )
    else:
        items = [substitutions] if isinstance(substitutions, str) else list(substitutions)
        chosen = [get(item) for item in items]
    entries = []
    for sub in chosen:
        try:
            registered = get(sub.name)
        except LookupError:
            registered = None
        if registered != sub:
            raise SubstitutionError(
                f"propagate(): {sub.name!r} is not the registered substitution of that name, "
                "so another process cannot look it up; register it, or hand it to the "
                "process yourself (WithSubstitutions)"
            )
        module = sub.original.partition(":")[0]
        entries.append(f"{sub.name}@{module}")
    previous = os.environ.get(ENVIRONMENT)
    kept = [entry for entry in (previous or "").split(",") if entry and entry not in entries]
    value = ",".join([*kept, *entries])
    os.environ[ENVIRONMENT] = value
    return Propagation(tuple(sub.name for sub in chosen), value, previous)


def apply_from_environment(value: str | None = None) -> list[str]:
    """Arm the substitutions :data:`ENVIRONMENT` (or ``value``) names in this process.

    Run when layerswap is imported with the variable set. Each substitution is applied
    when its original's modeling module is imported (now, if it already is), skipping
    those this process already has; returns the names armed. A name this process
    cannot resolve raises :class:`SubstitutionError` at that import, never silently.
    """
    import os

    import wrapt

    text = os.environ.get(ENVIRONMENT, "") if value is None else value
    armed = []
    for entry in filter(None, (part.strip() for part in text.split(","))):
        name, _, module = entry.partition("@")
        if not name or not module:
            raise SubstitutionError(
                f"{ENVIRONMENT}={text!r}: entries are NAME@MODULE "
                "(set by layerswap.distributed.propagate)"
            )
        if name in _FROM_ENVIRONMENT:
            continue
        _FROM_ENVIRONMENT[name] = None
        armed.append(name)
        wrapt.register_post_import_hook(functools.partial(_apply_named, name), module)
    return armed


def _apply_named(name: str, _module: Any = None) -> None:
    import os
    import sys

    from layerswap.use import use

    if _FROM_ENVIRONMENT.get(name) is not None:
        return
    if name in {sub.name for sub in applied_substitutions()}:
        return  # a forked process inherited the patch
    group = use(name)
    group.start()
    _FROM_ENVIRONMENT[name] = group
    sys.stderr.write(f"layerswap: {ENVIRONMENT} applied {name} in process {os.getpid()}\n")
