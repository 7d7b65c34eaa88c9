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
    "Reapply",
    "WithSubstitutions",
    "applied_substitutions",
    "check_ranks_agree",
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
