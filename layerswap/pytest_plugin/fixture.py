"""The ``layerswap`` fixture: patches and swaps made in a test, undone at teardown newest first.

Like ``monkeypatch``, and together with it: the fixture requests ``monkeypatch`` and,
at teardown, unwinds the two fixtures' changes as one last-in, first-out sequence.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Iterator, Mapping, MutableMapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, final, overload

import pytest

from layerswap.errors import PatchConflictWarning
from layerswap.patching import DictPatch, Origin, Patch, PatchGroup, Scoped, patch_dict, wrap
from layerswap.patching import patch as engine_patch
from layerswap.pytest_plugin.session import session_substitutions

if TYPE_CHECKING:
    from torch import nn

    from layerswap.handle import SwapHandle
    from layerswap.substitution import Substitution

__all__ = ["LayerswapFixture", "layerswap"]


@dataclass
class _Change:
    undo: Scoped | SwapHandle  # a started patch (stop) or a swap (undo)
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

    def _record(self, undo: Scoped | SwapHandle) -> None:
        self._changes.append(_Change(undo, _monkeypatch_mark(self._monkeypatch)))

    def _started(self, scoped: Scoped) -> None:
        # Started as if by ``start()`` (restore_all() stops it), at the line of the test
        # that called the fixture method: active_patches() and the leak guard point
        # there, not here. Two frames up: the public method, then its caller.
        scoped.start(origin=_frame_origin(2))
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
        started = engine_patch(
            target, *args, create=create, aliases=aliases, lazy=lazy, scope=scope
        )
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
        from layerswap.use import use  # torch: only when a substitution is used

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
        from layerswap.swap import swap  # torch: only when a substitution is used

        handle = swap(model, substitution, backend=backend)
        self._record(handle)
        return handle

    def undo(self) -> None:
        """Undo every change made through this fixture so far, newest first.

        Changes made afterwards are undone at teardown as usual. ``monkeypatch``
        changes are left alone (they are undone by ``monkeypatch``).

        Example::

            layerswap.use("llama.decoder.fused")
            fused = LlamaForCausalLM(config)
            layerswap.undo()
            original = LlamaForCausalLM(config)
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


@pytest.fixture
def layerswap(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> Iterator[LayerswapFixture]:
    """Scoped layerswap patches and swaps, undone at teardown newest first.

    ``.patch``, ``.patch_dict``, ``.wrap`` (as in the engine), ``.use(name)``,
    ``.swap(model, name)``, ``.undo()``. Works together with ``monkeypatch`` in any
    order: the combined changes are undone last-in, first-out.

    Example::

        def test_fused_layers(layerswap):
            layerswap.use("llama.decoder.fused")
            model = LlamaForCausalLM(config)
            assert type(model.model.layers[0]).__name__ == "FusedLlamaDecoderLayer"
    """
    fixture = LayerswapFixture(monkeypatch, session_substitutions(request.config))
    yield fixture
    fixture._undo(interleave=True)


def _frame_origin(depth: int) -> Origin:
    """``(file, line, function)`` of the frame ``depth`` levels above the caller."""
    frame = sys._getframe(depth + 1)
    return (frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name)


# --- joint unwinding with monkeypatch -------------------------------------------------------
#
# These two functions read pytest's private undo logs, ``MonkeyPatch._setattr`` and
# ``MonkeyPatch._setitem``, because pytest offers no public way to do what they do:
# ``MonkeyPatch`` has ``undo()``, which undoes everything, and nothing that tells how
# many changes it holds or undoes only the newest ones. (Intercepting its public
# methods instead would mean re-implementing its undo, or changing what the test's own
# ``monkeypatch.undo()`` does.) Where the logs are not lists, the fixture undoes its
# own changes first, as if the two fixtures were independent (see docs/pytest.md).


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
    assert monkeypatch is not None  # a mark exists only where there is a monkeypatch
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
