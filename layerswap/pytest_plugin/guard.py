"""The leak guard: a test that leaves a layerswap patch active errors at teardown.

The report names the patch and the line that started it, and the patch is stopped so
that later tests see the original. Ownership goes by *when* a patch was started: one
started while a fixture of class scope or wider was being set up belongs to that
fixture, and is checked when the fixture is finalized. The ini option
``layerswap_leak_guard = false`` turns the guard off.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import pytest

from layerswap.patching import PatchGroup, Scoped, active_patches

if TYPE_CHECKING:
    from layerswap.substitution import Substitution

__all__ = [
    "LEAK_GUARD_INI",
    "pytest_addoption_leak_guard",
    "pytest_fixture_post_finalizer",
    "pytest_fixture_setup",
    "pytest_runtest_setup",
    "pytest_runtest_teardown",
]

LEAK_GUARD_INI = "layerswap_leak_guard"


@dataclass
class _Guard:
    """The guard's state for one pytest run (in ``config.stash``: ``pytester`` runs
    nested sessions in one process)."""

    enabled: bool
    owned: dict[int, tuple[Scoped, pytest.FixtureDef[Any]]] = field(default_factory=dict)
    """Patches started while a fixture of class scope or wider was being set up."""
    fixture_leaks: list[tuple[Scoped, str]] = field(default_factory=list)
    """Patches such a fixture left active after its own teardown, to report."""


_GUARD = pytest.StashKey[_Guard]()
# Patches live when the test's setup began (kept referenced, so their ids stay unique).
_BEFORE = pytest.StashKey[list[Scoped]]()
_ADOPTED_BEFORE = pytest.StashKey[list[Any]]()


def _guard(config: pytest.Config) -> _Guard:
    state = config.stash.get(_GUARD, None)
    if state is None:
        state = config.stash[_GUARD] = _Guard(enabled=bool(config.getini(LEAK_GUARD_INI)))
    return state


def _live() -> list[Scoped]:
    return [info.patch for info in active_patches()]


def _adoptions() -> list[Any]:
    """The adoptions in effect (none where adoption was never imported)."""
    adopting = sys.modules.get("layerswap.adoption.adopting")
    return [] if adopting is None else adopting.live_adoptions()


# Hook names are shared with the marker's in the package's one namespace (see
# session.py); pytest_addoption is named apart for the same reason.


@pytest.hookimpl(specname="pytest_addoption")
def pytest_addoption_leak_guard(parser: pytest.Parser) -> None:
    parser.addini(
        LEAK_GUARD_INI,
        type="bool",
        default=True,
        help="error a test that leaves a layerswap patch active (default: true)",
    )


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    # outermost: everything started from here on is the test's
    item.stash[_BEFORE] = _live()
    item.stash[_ADOPTED_BEFORE] = _adoptions()
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_fixture_setup(
    fixturedef: pytest.FixtureDef[Any], request: pytest.FixtureRequest
) -> Iterator[Any]:
    if fixturedef.scope == "function":
        return (yield)
    # A fixture wider than one test may keep patches active across tests; they are
    # its own, to be stopped by its teardown, not a leak of the test that set it up.
    alive = _live()  # referenced through the window, so no new patch can reuse an id
    before = {id(scoped) for scoped in alive}
    try:
        return (yield)
    finally:
        state = _guard(request.config)
        for scoped in _live():
            if id(scoped) not in before and id(scoped) not in state.owned:
                state.owned[id(scoped)] = (scoped, fixturedef)


def pytest_fixture_post_finalizer(
    fixturedef: pytest.FixtureDef[Any], request: pytest.FixtureRequest
) -> None:
    state = request.config.stash.get(_GUARD, None)
    if state is None or not state.owned:
        return
    mine = [key for key, (_, owner) in state.owned.items() if owner is fixturedef]
    left = [state.owned.pop(key)[0] for key in mine]
    if not state.enabled:
        return
    where = f"fixture {fixturedef.argname!r} ({fixturedef.scope} scope)"
    for scoped in _collapse([s for s in _without_own(left) if s.is_active]):
        state.fixture_leaks.append((scoped, where))


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    try:
        result = yield
    except BaseException as exc:
        message = _finish(item)
        if message is not None and hasattr(exc, "add_note"):
            exc.add_note(message)
        raise
    message = _finish(item)
    if message is not None:
        pytest.fail(message, pytrace=False)
    return result


def _finish(item: pytest.Item) -> str | None:
    """Stop the patches left active; the leak report, if there is one."""
    before = item.stash.get(_BEFORE, None)
    state = _guard(item.config)
    leaks: list[tuple[Scoped, str]] = []
    adopted: list[Any] = []
    if before is not None and state.enabled:
        # an adoption left in effect is one leak, undone whole (its dict entries and code
        # changes too, which are no patches), not the patches behind its rebindings
        known_adoptions = {id(a) for a in item.stash.get(_ADOPTED_BEFORE, [])}
        adopted = [a for a in _adoptions() if id(a) not in known_adoptions]
        theirs = {id(p) for adoption in adopted for p in adoption.patches()}
        known = {id(scoped) for scoped in before} | theirs
        new = [
            scoped
            for scoped in _live()
            if id(scoped) not in known and id(scoped) not in state.owned
        ]
        leaks.extend((scoped, "the test") for scoped in _collapse(_without_own(new)))
    leaks.extend(state.fixture_leaks)
    state.fixture_leaks = []
    if not leaks and not adopted:
        return None
    root = os.fspath(item.config.rootpath) + os.sep
    lines = [
        f"  layerswap.adopt({adoption.name}), adopted at "
        f"{adoption.origin.replace(root, '')} (left by the test)"
        for adoption in adopted
    ]
    for scoped, who in leaks:
        lines.append(f"  {_describe(scoped, item.config.rootpath)} (left by {who})")
    for scoped, _ in reversed(leaks):
        scoped.stop()  # stopped now, so later tests see the original
    for adoption in reversed(adopted):
        adoption.undo()
    total = len(leaks) + len(adopted)
    count = f"{total} layerswap patch{'es' if total > 1 else ''}"
    return (
        f"{item.nodeid} left {count} active:\n"
        + "\n".join(lines)
        + "\nStopped now, so later tests see the originals. Use a `with` block, or the "
        "`layerswap` fixture (undone at teardown); set `layerswap_leak_guard = false` "
        "to turn this check off."
    )


def _without_own(started: list[Scoped]) -> list[Scoped]:
    """``started`` less layerswap's own patches, which are no leak: the PEFT target check a
    swap arms and the save advice for packed slices (:mod:`layerswap.sliced_saves`),
    stopped here, silently (the next swap, or packing, arms them again), so that the next
    test sees what it started alone."""
    sliced = sys.modules.get("layerswap.sliced_saves")  # never imported: nothing armed
    if sliced is not None:
        for scoped in started:
            if sliced.is_own(scoped):
                scoped.stop()
        started = [scoped for scoped in started if not sliced.is_own(scoped)]
    own = sys.modules.get("layerswap.peft_targets")  # never imported: nothing armed
    if own is None:
        return started
    for scoped in started:
        if own.is_guard(scoped):
            scoped.stop()
    return [scoped for scoped in started if not own.is_guard(scoped)]


def _collapse(leaked: list[Scoped]) -> list[Scoped]:
    """Leaked patches, without the members of a leaked group (the group says it all)."""
    members = {
        id(member)
        for scoped in leaked
        if isinstance(scoped, PatchGroup)
        for member in scoped.members
    }
    return [scoped for scoped in leaked if id(scoped) not in members]


def _describe(scoped: Scoped, rootpath: os.PathLike[str]) -> str:
    info = scoped.info()
    sub = _substitution_used_by(scoped)
    if sub is not None:  # a use() group: its name says more than its member patches
        text = f"layerswap.use({sub.name!r}), started at {info.origin}"
    else:
        text = str(info)
    root = os.fspath(rootpath) + os.sep
    return text.replace(root, "")


def _substitution_used_by(scoped: Scoped) -> Substitution | None:
    """The substitution whose :func:`layerswap.use` group ``scoped`` is, else ``None``."""
    # A use() group exists only once its module is imported; importing it (and torch)
    # here just to find out would make a plain patch's leak report cost seconds.
    if "layerswap.use" not in sys.modules:
        return None
    from layerswap.use import SubstitutionUse

    return scoped.substitution if isinstance(scoped, SubstitutionUse) else None
