"""The run's settings: ``--layerswap`` for the whole session, the marker for one test, the header.

Both apply substitutions with :func:`layerswap.use`: the option when pytest configures
itself (each xdist worker for itself), the marker before the test's fixtures are set up,
so that fixtures building models get the replacement layers. The option also reaches
processes a test starts with ``torch.multiprocessing.spawn``/``start_processes``: each
applies the substitutions before it runs (:class:`layerswap.distributed.WithSubstitutions`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pytest

from layerswap.errors import LayerswapError
from layerswap.patching import Origin, Patch, PatchGroup, patches, wrap

if TYPE_CHECKING:
    from layerswap.distributed import Propagation

__all__ = [
    "MARKER",
    "OPTION",
    "pytest_addoption",
    "pytest_configure",
    "pytest_report_header",
    "pytest_runtest_setup_marker",
    "pytest_runtest_teardown_marker",
    "pytest_unconfigure",
    "session_substitutions",
]

OPTION = "layerswap"
MARKER = "layerswap"


@dataclass
class _Session:
    """What ``--layerswap`` applied to this run (in ``config.stash``, never in globals:
    ``pytester`` runs nested sessions in one process)."""

    names: tuple[str, ...] = ()
    group: PatchGroup | None = None
    propagation: Propagation | None = None


_SESSION = pytest.StashKey[_Session]()
_MARKED = pytest.StashKey[PatchGroup]()


def session_substitutions(config: pytest.Config) -> tuple[str, ...]:
    """Names of the substitutions applied to the whole run by ``--layerswap``.

    Example (in a ``conftest.py``)::

        from layerswap.pytest_plugin import session_substitutions

        def pytest_report_header(config):
            return f"decoder: {session_substitutions(config) or 'original'}"
    """
    state = config.stash.get(_SESSION, None)
    return state.names if state is not None else ()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("layerswap")
    group.addoption(
        "--layerswap",
        action="append",
        dest=OPTION,
        default=None,
        metavar="NAME[,NAME...]",
        help="run the whole session with these layerswap substitutions applied "
        "(layerswap.use), e.g. --layerswap=llama.decoder.fused",
    )


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        f"{MARKER}(*names): run the test, its fixtures included, with these layerswap "
        "substitutions applied (layerswap.use)",
    )
    state = config.stash[_SESSION] = _Session()
    names = _split_names(config.getoption(OPTION, default=None))
    if not names:
        return
    problem = _unusable(names)
    if problem is not None:
        raise pytest.UsageError(f"--layerswap: {problem}")
    state.names = names
    if _is_xdist_controller(config):
        return  # it runs no tests; each worker applies the substitutions itself
    group = _applied(names, where="--layerswap")
    if isinstance(group, str):
        raise pytest.UsageError(group)
    group = patches(group, _carried_to_spawned(names))
    try:
        group.start()
    except LayerswapError as exc:
        raise pytest.UsageError(f"--layerswap: {exc}") from exc
    state.group = group
    # processes the tests start that import layerswap (multiprocessing spawn/forkserver,
    # torchrun) apply them too: layerswap.distributed.propagate
    from layerswap.distributed import propagate

    state.propagation = propagate(names)


def pytest_unconfigure(config: pytest.Config) -> None:
    state = config.stash.get(_SESSION, None)
    if state is not None and state.propagation is not None:
        state.propagation.stop()
        state.propagation = None
    if state is not None and state.group is not None:
        state.group.stop()
        state.group = None


def pytest_report_header(config: pytest.Config) -> list[str]:
    names = session_substitutions(config)
    if not names:
        return []
    from layerswap.registry import get  # torch: only when a substitution is used

    described = []
    for name in names:
        sub = get(name)
        original = sub.original.rpartition(":")[2]
        replacement = sub.replacement_class().__name__
        described.append(f"{name} ({original} -> {replacement})")
    return [f"layerswap: whole session runs with {', '.join(described)}"]


# The marker's two hooks share their names with the leak guard's, and the package
# exposes every hook in one namespace: specname keeps the names apart.


@pytest.hookimpl(specname="pytest_runtest_setup")
def pytest_runtest_setup_marker(item: pytest.Item) -> None:
    """Apply the ``layerswap`` markers: before the fixtures (pytest's own setup of the
    test runs after this plugin's), so that fixtures building models get the
    replacement layers."""
    names = _marked_names(item)
    if isinstance(names, str):
        pytest.fail(names, pytrace=False)
    if not names:
        return
    group = _applied(names, where=f"@pytest.mark.{MARKER}")
    if isinstance(group, str):
        pytest.fail(group, pytrace=False)
    try:
        group.start(origin=_test_origin(item))
    except LayerswapError as exc:
        pytest.fail(f"@pytest.mark.{MARKER}: {exc}", pytrace=False)
    item.stash[_MARKED] = group


@pytest.hookimpl(wrapper=True, specname="pytest_runtest_teardown")
def pytest_runtest_teardown_marker(
    item: pytest.Item, nextitem: pytest.Item | None
) -> Iterator[None]:
    """Undo the markers after the fixtures have been torn down (and before the leak
    guard, the outermost wrapper, looks for patches left active)."""
    try:
        return (yield)
    finally:
        group = item.stash.get(_MARKED, None)
        if group is not None:
            del item.stash[_MARKED]
            group.stop()


def _split_names(values: list[str] | None) -> tuple[str, ...]:
    names: list[str] = []
    for value in values or ():
        for name in value.split(","):
            name = name.strip()
            if name and name not in names:
                names.append(name)
    return tuple(names)


def _unusable(names: tuple[str, ...]) -> str | None:
    """Why one of ``names`` cannot be applied here (unknown, cannot run), else ``None``."""
    from layerswap.registry import get

    for name in names:
        try:
            reason = get(name).unmet_requirement()
        except LayerswapError as exc:
            return str(exc)
        if reason is not None:
            return f"{name} cannot run here: {reason}"
    return None


def _is_xdist_controller(config: pytest.Config) -> bool:
    distributing = getattr(config.option, "dist", "no") not in (None, "no")
    return distributing and not hasattr(config, "workerinput")


def _applied(names: tuple[str, ...], *, where: str) -> PatchGroup | str:
    """One unstarted group that applies ``names`` in order, or the reason it cannot."""
    from layerswap.use import use

    try:
        return patches(*(use(name) for name in names))
    except LayerswapError as exc:
        return f"{where}: {exc}"


#: where torch starts worker processes (torch.multiprocessing.spawn calls it too)
START_PROCESSES = "torch.multiprocessing.spawn:start_processes"


def _carried_to_spawned(names: tuple[str, ...]) -> Patch:
    """A patch of ``torch.multiprocessing``'s process start: each process it starts with
    ``spawn`` or ``forkserver`` applies ``names`` before the function it runs (a forked
    one inherits them). Lazy: torch is not imported for it."""

    def carry(
        wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        from layerswap.distributed import WithSubstitutions

        try:
            bound = inspect.signature(wrapped).bind(*args, **kwargs)
        except TypeError:
            return wrapped(*args, **kwargs)
        if bound.arguments.get("start_method", "spawn") != "fork":
            bound.arguments["fn"] = WithSubstitutions(bound.arguments["fn"], names)
        return wrapped(*bound.args, **bound.kwargs)

    return wrap(START_PROCESSES, carry, lazy=True, aliases=True)


def _marked_names(item: pytest.Item) -> tuple[str, ...] | str:
    names: list[str] = []
    # outermost (module, class) first, so the closest marker ends on top of the stack
    for mark in reversed(list(item.iter_markers(MARKER))):
        if not mark.args or mark.kwargs:
            return (
                f"@pytest.mark.{MARKER} takes one or more substitution names, e.g. "
                f'@pytest.mark.{MARKER}("llama.decoder.fused"); got {mark.args!r} {mark.kwargs!r}'
            )
        for name in mark.args:
            if not isinstance(name, str):
                return f"@pytest.mark.{MARKER} takes substitution names (str), got {name!r}"
            if name not in names:
                names.append(name)
    return tuple(names)


def _test_origin(item: pytest.Item) -> Origin:
    """The test's own line: the marker's patches are reported as started there."""
    path, line, name = item.location
    return (str(item.config.rootpath / path), (line or 0) + 1, name)
