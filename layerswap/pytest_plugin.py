"""pytest plugin: the ``layerswap`` fixture and marker, ``--layerswap``, and the leak guard.

Installed with the package (entry point ``pytest11``, name ``layerswap``), so every
pytest run in an environment with layerswap has it:

* fixture ``layerswap``: ``.patch``, ``.patch_dict``, ``.wrap``, ``.use``, ``.swap``,
  all undone at teardown, newest first (like ``monkeypatch``);
* marker ``@pytest.mark.layerswap("llama.decoder.fused", ...)``: the test, its
  fixtures included, runs with those substitutions applied;
* option ``--layerswap=NAME[,NAME...]``: the whole session runs with them applied —
  a model repository's own tests against swapped layers;
* leak guard: a test that leaves a layerswap patch active errors at teardown, naming
  the patch and the line that started it; the patch is stopped so that later tests
  see the original (ini option ``layerswap_leak_guard = false`` turns it off).

The plugin imports torch and transformers only when a substitution is used, so a
suite that does not use it pays nothing for it. See docs/pytest.md.
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Iterator, Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, final, overload

import pytest

from layerswap.errors import LayerswapError, PatchConflictWarning
from layerswap.patching import (
    DictPatch,
    Patch,
    PatchGroup,
    Scoped,
    active_patches,
    patch_dict,
    patches,
    wrap,
)
from layerswap.patching import patch as _patch

if TYPE_CHECKING:
    from torch import nn

    from layerswap.substitution import Substitution
    from layerswap.swap import SwapHandle

__all__ = ["LayerswapFixture", "session_substitutions"]

OPTION = "layerswap"
LEAK_GUARD_INI = "layerswap_leak_guard"
MARKER = "layerswap"


# --- state --------------------------------------------------------------------------------


@dataclass
class _SessionState:
    """What the plugin keeps per pytest run (in ``config.stash``, never in globals:
    ``pytester`` runs nested sessions in one process)."""

    names: tuple[str, ...] = ()
    """Substitutions applied to the whole session by ``--layerswap``."""
    group: PatchGroup | None = None
    leak_guard: bool = True
    owned: dict[int, tuple[Scoped, pytest.FixtureDef[Any]]] = field(default_factory=dict)
    """Patches started while a fixture of class scope or wider was being set up."""
    fixture_leaks: list[tuple[Scoped, str]] = field(default_factory=list)
    """Patches such a fixture left active after its own teardown, to report."""


@dataclass
class _ItemState:
    before: list[Scoped]
    """Patches live when the test's setup began (kept referenced so ids stay unique)."""
    marked: PatchGroup | None = None


_SESSION = pytest.StashKey[_SessionState]()
_ITEM = pytest.StashKey[_ItemState]()


def _session(config: pytest.Config) -> _SessionState:
    state = config.stash.get(_SESSION, None)
    if state is None:
        state = config.stash[_SESSION] = _SessionState()
    return state


def _live() -> list[Scoped]:
    return [info.patch for info in active_patches()]


def _frame_origin(depth: int) -> tuple[str, int, str]:
    frame = sys._getframe(depth + 1)
    return (frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name)


def _start(scoped: Scoped, origin: tuple[str, int, str]) -> None:
    # Started as if by ``start()`` (restore_all() stops it), but with the origin of the
    # user's code: ``active_patches()`` and the leak guard then point at the test, not
    # at this module.
    scoped._start(manual=True, origin=origin)


def _split_names(values: list[str] | None) -> tuple[str, ...]:
    names: list[str] = []
    for value in values or ():
        for name in value.split(","):
            name = name.strip()
            if name and name not in names:
                names.append(name)
    return tuple(names)


def session_substitutions(config: pytest.Config) -> tuple[str, ...]:
    """Names of the substitutions applied to the whole run by ``--layerswap``.

    Example (in a ``conftest.py``)::

        from layerswap.pytest_plugin import session_substitutions

        def pytest_report_header(config):
            return f"decoder: {session_substitutions(config) or 'original'}"
    """
    state = config.stash.get(_SESSION, None)
    return state.names if state is not None else ()


# --- the fixture ---------------------------------------------------------------------------


@dataclass
class _Change:
    undo: Any  # a started Scoped (stop) or a SwapHandle (undo)
    monkeypatch_mark: tuple[int, int] | None


@final
class LayerswapFixture:
    """The ``layerswap`` fixture: scoped patches and swaps undone at teardown, newest first.

    Each method starts its change immediately and returns the started object, which
    the test may also stop itself, in any order (stacks of patches on one attribute
    unwind correctly whatever the order). At teardown every change still in effect
    is undone, newest first.

    Example::

        def test_layers_are_fused(layerswap):
            layerswap.use("llama.decoder.fused")
            model = LlamaForCausalLM(config)
            assert type(model.model.layers[0]).__name__ == "FusedLlamaDecoderLayer"

        def test_swap_a_built_model(layerswap, tiny_llama):
            handle = layerswap.swap(tiny_llama, "llama.decoder.fused")
            assert len(handle) == tiny_llama.config.num_hidden_layers
    """

    def __init__(
        self,
        monkeypatch: pytest.MonkeyPatch | None = None,
        session: tuple[str, ...] = (),
    ) -> None:
        self._changes: list[_Change] = []
        self._monkeypatch = monkeypatch
        self._session = session

    @property
    def session_substitutions(self) -> tuple[str, ...]:
        """Substitutions applied to the whole run by ``--layerswap`` (not undone here)."""
        return self._session

    def _record(self, undo: Any) -> None:
        self._changes.append(_Change(undo, _monkeypatch_mark(self._monkeypatch)))

    def _started(self, scoped: Scoped) -> None:
        _start(scoped, _frame_origin(2))
        self._record(scoped)

    @overload
    def patch(
        self,
        target: str,
        new: Any,
        /,
        *,
        create: bool = ...,
        aliases: bool = ...,
        lazy: bool = ...,
        scope: Literal["process", "context"] = ...,
    ) -> Patch: ...

    @overload
    def patch(
        self,
        target: object,
        attribute: str,
        new: Any,
        /,
        *,
        create: bool = ...,
        aliases: bool = ...,
        lazy: bool = ...,
        scope: Literal["process", "context"] = ...,
    ) -> Patch: ...

    def patch(
        self,
        target: Any,
        *args: Any,
        create: bool = False,
        aliases: bool = False,
        lazy: bool = False,
        scope: Literal["process", "context"] = "process",
    ) -> Patch:
        """:func:`layerswap.patch`, started now; undone at teardown.

        Example::

            layerswap.patch("transformers.activations:ACT2FN", {...})
            layerswap.patch(torch.nn.functional, "silu", my_silu)
        """
        __tracebackhide__ = True
        started = _patch(target, *args, create=create, aliases=aliases, lazy=lazy, scope=scope)
        self._started(started)
        return started

    def patch_dict(
        self,
        target: MutableMapping[Any, Any] | str,
        values: Mapping[Any, Any] | None = None,
        *,
        clear: bool = False,
    ) -> DictPatch:
        """:func:`layerswap.patch_dict`, started now; undone at teardown.

        Example::

            layerswap.patch_dict(os.environ, {"TOKENIZERS_PARALLELISM": "false"})
        """
        __tracebackhide__ = True
        started = patch_dict(target, values, clear=clear)
        self._started(started)
        return started

    @overload
    def wrap(self, target: str, wrapper: Any, /) -> Patch: ...

    @overload
    def wrap(self, target: object, attribute: str, wrapper: Any, /) -> Patch: ...

    def wrap(self, target: Any, *args: Any, lazy: bool = False, aliases: bool = False) -> Patch:
        """:func:`layerswap.wrap`, started now; undone at teardown.

        Example::

            calls = []
            def count(wrapped, instance, args, kwargs):
                calls.append(type(instance).__name__)
                return wrapped(*args, **kwargs)
            layerswap.wrap(model.model.layers[0], "forward", count)
        """
        __tracebackhide__ = True
        # forwarded as given (either call shape); the engine checks it
        engine_wrap: Any = wrap
        started: Patch = engine_wrap(target, *args, lazy=lazy, aliases=aliases)
        self._started(started)
        return started

    def use(self, substitution: str | Substitution) -> PatchGroup:
        """:func:`layerswap.use`, started now: models built in the test get the replacement.

        Example::

            layerswap.use("llama.decoder.fused")
            model = LlamaForCausalLM(config)
        """
        __tracebackhide__ = True
        from layerswap.use import use

        started = use(substitution)
        self._started(started)
        return started

    def swap(
        self,
        model: nn.Module,
        substitution: str | Substitution | None = None,
        *,
        backend: str | None = None,
    ) -> SwapHandle:
        """:func:`layerswap.swap` on a built model; undone (weights back) at teardown.

        Example::

            handle = layerswap.swap(model, "llama.decoder.fused")
            print(handle.report())
        """
        __tracebackhide__ = True
        from layerswap.swap import swap

        handle = swap(model, substitution, backend=backend)
        self._record(handle)
        return handle

    def undo(self) -> None:
        """Undo every change made through this fixture so far, newest first.

        Changes made afterwards are undone at teardown as usual. ``monkeypatch``
        changes are left alone (they are undone by ``monkeypatch``).
        """
        self._undo(interleave=False)

    def _undo(self, *, interleave: bool) -> None:
        changes, self._changes = self._changes, []
        errors: list[BaseException] = []
        for change in reversed(changes):
            try:
                coordinated = False
                if interleave and change.monkeypatch_mark is not None:
                    _undo_monkeypatch_after(self._monkeypatch, change.monkeypatch_mark)
                    coordinated = any(change.monkeypatch_mark)
                with warnings.catch_warnings():
                    if coordinated:
                        # monkeypatch wrote the same attributes before this change was
                        # made; layerswap sees those writes as foreign, but the joint
                        # unwind restores them in order, so there is nothing to report
                        warnings.simplefilter("ignore", PatchConflictWarning)
                    if isinstance(change.undo, Scoped):
                        change.undo.stop()
                    else:
                        change.undo.undo()
            except BaseException as exc:  # undo the rest, then report the first
                errors.append(exc)
        if errors:
            raise errors[0]

    def __repr__(self) -> str:
        return f"<LayerswapFixture {len(self._changes)} changes>"


def _monkeypatch_mark(monkeypatch: pytest.MonkeyPatch | None) -> tuple[int, int] | None:
    """How long monkeypatch's undo logs are now (``None`` if they cannot be read)."""
    if monkeypatch is None:
        return None
    setattrs = getattr(monkeypatch, "_setattr", None)
    setitems = getattr(monkeypatch, "_setitem", None)
    if not isinstance(setattrs, list) or not isinstance(setitems, list):
        return None
    return (len(setattrs), len(setitems))


def _undo_monkeypatch_after(monkeypatch: pytest.MonkeyPatch | None, mark: tuple[int, int]) -> None:
    """Undo the ``monkeypatch`` changes made after ``mark``, newest first.

    The two fixtures keep separate undo logs. When a test patches one attribute with
    both (layerswap first, monkeypatch on top), undoing them fixture by fixture would
    restore in the wrong order: each would see the other's value as a foreign write
    and one of them would put a replaced value back for good. Replaying monkeypatch's
    newer entries here, through a MonkeyPatch of their own (pytest's own undo code),
    keeps the combined order exactly last-in, first-out.
    """
    assert monkeypatch is not None
    setattrs: list[Any] = monkeypatch._setattr
    setitems: list[Any] = monkeypatch._setitem
    attr_mark, item_mark = mark
    if len(setattrs) <= attr_mark and len(setitems) <= item_mark:
        return
    newer = pytest.MonkeyPatch()
    newer._setattr = setattrs[attr_mark:]
    newer._setitem = setitems[item_mark:]
    del setattrs[attr_mark:]
    del setitems[item_mark:]
    newer.undo()


@pytest.fixture
def layerswap(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> Iterator[LayerswapFixture]:
    """Scoped layerswap patches and swaps, undone at teardown newest first.

    ``.patch``, ``.patch_dict``, ``.wrap`` (as in the engine), ``.use(name)``,
    ``.swap(model, name)``, ``.undo()``. Works together with ``monkeypatch`` in any
    order: the combined changes are undone last-in, first-out.
    """
    fixture = LayerswapFixture(monkeypatch, session_substitutions(request.config))
    yield fixture
    fixture._undo(interleave=True)


# --- option, marker, header -----------------------------------------------------------------


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
    parser.addini(
        LEAK_GUARD_INI,
        type="bool",
        default=True,
        help="error a test that leaves a layerswap patch active (default: true)",
    )


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        f"{MARKER}(*names): run the test, its fixtures included, with these layerswap "
        "substitutions applied (layerswap.use)",
    )
    state = _session(config)
    state.leak_guard = bool(config.getini(LEAK_GUARD_INI))
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
    try:
        group.start()
    except LayerswapError as exc:
        raise pytest.UsageError(f"--layerswap: {exc}") from exc
    state.group = group


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


def pytest_unconfigure(config: pytest.Config) -> None:
    state = config.stash.get(_SESSION, None)
    if state is not None and state.group is not None:
        state.group.stop()
        state.group = None


def pytest_report_header(config: pytest.Config) -> list[str]:
    names = session_substitutions(config)
    if not names:
        return []
    from layerswap.registry import get

    described = []
    for name in names:
        sub = get(name)
        original = sub.original.rpartition(":")[2]
        replacement = sub.replacement_class().__name__
        described.append(f"{name} ({original} -> {replacement})")
    return [f"layerswap: whole session runs with {', '.join(described)}"]


# --- marker and leak guard ------------------------------------------------------------------


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


def _test_origin(item: pytest.Item) -> tuple[str, int, str]:
    path, line, name = item.location
    return (str(item.config.rootpath / path), (line or 0) + 1, name)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    # outermost: everything started from here on is the test's
    item.stash[_ITEM] = _ItemState(before=_live())
    return (yield)


@pytest.hookimpl(specname="pytest_runtest_setup")
def pytest_runtest_setup_markers(item: pytest.Item) -> None:
    """Apply the ``layerswap`` markers: before the fixtures (pytest's own setup of the
    test runs after this plugin's), so that fixtures building models get the
    replacement layers. Not part of the wrapper above: a wrapper that raises before
    it yields would keep the other plugins' wrappers from setting the test up."""
    names = _marked_names(item)
    if isinstance(names, str):
        pytest.fail(names, pytrace=False)
    if not names:
        return
    group = _applied(names, where=f"@pytest.mark.{MARKER}")
    if isinstance(group, str):
        pytest.fail(group, pytrace=False)
    try:
        _start(group, _test_origin(item))
    except LayerswapError as exc:
        pytest.fail(f"@pytest.mark.{MARKER}: {exc}", pytrace=False)
    item.stash[_ITEM].marked = group


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
        state = _session(request.config)
        for scoped in _live():
            if id(scoped) not in before and id(scoped) not in state.owned:
                state.owned[id(scoped)] = (scoped, fixturedef)


def pytest_fixture_post_finalizer(
    fixturedef: pytest.FixtureDef[Any], request: pytest.FixtureRequest
) -> None:
    state = request.config.stash.get(_SESSION, None)
    if state is None or not state.owned:
        return
    mine = [key for key, (_, owner) in state.owned.items() if owner is fixturedef]
    left = [state.owned.pop(key)[0] for key in mine]
    if not state.leak_guard:
        return
    where = f"fixture {fixturedef.argname!r} ({fixturedef.scope} scope)"
    for scoped in _collapse([s for s in _without_own(left) if s.is_active]):
        state.fixture_leaks.append((scoped, where))


def _without_own(started: list[Scoped]) -> list[Scoped]:
    """``started`` less layerswap's own PEFT target check, which a swap arms and which is
    no leak: stopped here, silently (the next swap arms it again)."""
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
    """Undo the marker, stop leaked patches; the leak report, if there is one."""
    state = item.stash.get(_ITEM, None)
    session = _session(item.config)
    if state is not None and state.marked is not None:
        state.marked.stop()
        state.marked = None
    leaks: list[tuple[Scoped, str]] = []
    if state is not None and session.leak_guard:
        before = {id(scoped) for scoped in state.before}
        new = [
            scoped
            for scoped in _live()
            if id(scoped) not in before and id(scoped) not in session.owned
        ]
        leaks.extend((scoped, "the test") for scoped in _collapse(_without_own(new)))
    leaks.extend(session.fixture_leaks)
    session.fixture_leaks = []
    if not leaks:
        return None
    lines = []
    for scoped, who in leaks:
        lines.append(f"  {_describe(scoped, item.config.rootpath)} (left by {who})")
    for scoped, _ in reversed(leaks):
        scoped.stop()  # stopped now, so later tests see the original
    count = f"{len(leaks)} layerswap patch{'es' if len(leaks) > 1 else ''}"
    return (
        f"{item.nodeid} left {count} active:\n"
        + "\n".join(lines)
        + "\nStopped now, so later tests see the originals. Use a `with` block, or the "
        "`layerswap` fixture (undone at teardown); set `layerswap_leak_guard = false` "
        "to turn this check off."
    )


def _describe(scoped: Scoped, rootpath: os.PathLike[str]) -> str:
    from layerswap.distributed import _substitution_of_group

    info = scoped.info()
    sub = _substitution_of_group(scoped)
    if sub is not None:  # a use() group: its name says more than its member patches
        text = f"layerswap.use({sub.name!r}), started at {info.origin}"
    else:
        text = str(info)
    root = os.fspath(rootpath) + os.sep
    return text.replace(root, "")
