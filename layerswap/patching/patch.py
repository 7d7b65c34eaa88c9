"""``patch``: one reversible replacement of one attribute (and, optionally, its aliases)."""

from __future__ import annotations

import sys
import types
import warnings
from collections.abc import Callable
from threading import get_ident
from typing import Any, Literal, overload

from layerswap.errors import LazyPatchWarning, TargetTypeError
from layerswap.patching import stack as _stack
from layerswap.patching.context import ContextDispatch
from layerswap.patching.scoped import _ACTIVE, _HERE, _SEQUENCE, Scoped
from layerswap.patching.sites import NOTSET, Site, make_site
from layerswap.patching.target import ParsedTarget

__all__ = ["Patch", "patch"]

Scope = Literal["process", "context"]
ValueFactory = Callable[[Site, Any], Any]
"""Builds a layer's value from the site and the raw value below it (used by ``wrap``)."""


class Patch(Scoped):
    """A reversible replacement of ``owner.attribute``; see :func:`patch`."""

    _tokens: list[Any] = []  # noqa: RUF012 - replaced, never mutated, per instance
    _pending_flag = False
    _hook_cancelled: list[bool] | None = None
    _layers: list[_stack.Layer] = []  # noqa: RUF012 - replaced, never mutated
    _sites: list[Site] = []  # noqa: RUF012 - replaced, never mutated
    _bound_before: frozenset[tuple[int, str]] = frozenset()
    # Settings at their defaults live on the class, so a plain patch sets three
    # attributes when it is created (a patch cycle is measured against mock's).
    _parsed: ParsedTarget | None = None
    _create = False
    _aliases = False
    _lazy = False
    _scope: Scope = "process"
    _factory: ValueFactory | None = None
    _simple = True  # process scope, no aliases, no factory: the fast path may apply

    def __init__(
        self,
        owner: Any,
        attribute: str | None,
        new: Any,
        *,
        create: bool = False,
        aliases: bool = False,
        lazy: bool = False,
        scope: Scope = "process",
        factory: ValueFactory | None = None,
        _parsed: ParsedTarget | None = None,
    ) -> None:
        self._owner = owner
        self._attribute = attribute
        self._new = new
        if create or aliases or lazy or scope != "process" or factory or _parsed is not None:
            self._configure(create, aliases, lazy, scope, factory, _parsed)

    def _configure(
        self,
        create: bool,
        aliases: bool,
        lazy: bool,
        scope: Scope,
        factory: ValueFactory | None,
        parsed: ParsedTarget | None,
    ) -> None:
        if scope not in ("process", "context"):
            raise TargetTypeError(f"scope must be 'process' or 'context', got {scope!r}")
        self._parsed = _parsed = parsed
        self._create = create
        self._aliases = aliases
        self._lazy = lazy
        self._scope = scope
        self._factory = factory
        self._simple = not aliases and scope == "process" and factory is None
        if lazy and _parsed is None:
            raise TargetTypeError("lazy=True needs a string target ('package.module:Name')")
        if _parsed is not None and lazy:
            _parsed.module_name_for_lazy()  # validate the form now: bad input fails early

    # -- settings ------------------------------------------------------------------------
    @property
    def target(self) -> str:
        """The target as the user named it."""
        return self._label()

    @property
    def new(self) -> Any:
        """The replacement value (for ``wrap``: the value shown at the first site)."""
        if self._factory is not None and self._layers:
            return self._layers[0].value
        return self._new

    @property
    def sites(self) -> list[tuple[Any, str]]:
        """Every ``(owner, attribute)`` this patch writes while it is active."""
        return [
            (site.owner, site.name)
            for site in self._sites or [layer.site for layer in self._layers]
        ]

    def _label(self) -> str:
        if self._parsed is not None:
            return self._parsed.text
        owner = self._owner
        if isinstance(owner, types.ModuleType):
            return f"{owner.__name__}.{self._attribute}"
        if isinstance(owner, type):
            return f"{owner.__qualname__}.{self._attribute}"
        return f"<{type(owner).__qualname__} object>.{self._attribute}"

    def _site_texts(self) -> tuple[str, ...]:
        return tuple(site.describe() for site in self._sites)

    def _new_text(self) -> str:
        return _stack._short(self.new)

    def _pending(self) -> bool:
        return self._pending_flag

    def _copy(self) -> Patch:
        return Patch(
            self._owner,
            self._attribute,
            self._new,
            create=self._create,
            aliases=self._aliases,
            lazy=self._lazy,
            scope=self._scope,
            factory=self._factory,
            _parsed=self._parsed,
        )

    # -- apply / revert ----------------------------------------------------------------
    def _set_factory(self, factory: ValueFactory) -> None:
        """Make this patch a wrap: each layer's value is built by ``factory``."""
        self._factory = factory
        self._simple = False

    def _apply(self) -> None:
        parsed = self._parsed
        if parsed is None:
            owner, name = self._owner, self._attribute
        else:
            if self._lazy:
                module = parsed.module_name_for_lazy()
                if module not in sys.modules:
                    self._register_lazy(module)
                    return
            owner, name = parsed.resolve()
        if self._simple:
            kind = type(owner)
            if kind is types.ModuleType or kind is type:
                # The common case, kept short: one attribute in a module's or a
                # plain class's own __dict__, not patched yet.
                layer = _stack.push_own_attribute(owner, name, self._new, self)  # type: ignore[arg-type]
                if layer is not None:
                    self._layers = [layer]
                    self._sites = [layer.site]
                    return
        self._apply_to(owner, name)

    def _apply_to(self, owner: Any, name: Any) -> None:
        first = make_site(owner, name)
        if not self._aliases and self._scope == "process":
            # The common case, kept short: one site, one layer.
            self._layers = [_stack.push(first, self._new, self._factory, self, self._create)]
            self._sites = [first]
            return
        sites = [first]
        if self._aliases:
            aliases, self._bound_before = _alias_sites(first, self._new)
            sites.extend(aliases)
        factory = self._context_factory() if self._scope == "context" else self._factory
        layers: list[_stack.Layer] = []
        tokens: list[Any] = []
        try:
            for site in sites:
                layers.append(_stack.push(site, self._new, factory, self, self._create))
                if self._scope == "context":
                    value = layers[-1].value
                    dispatch = getattr(value, "__layerswap_dispatch__", value)
                    tokens.append((dispatch, dispatch.activate(self._new)))
        except BaseException:
            for dispatch, token in reversed(tokens):
                dispatch.deactivate(token)
            for layer in reversed(layers):
                _stack.remove(layer)
            raise
        self._tokens = tokens
        self._sites = [layer.site for layer in layers]
        self._layers = layers

    def _context_factory(self) -> Callable[[Site, Any], Any]:
        if self._factory is not None:
            raise TargetTypeError("scope='context' cannot be combined with wrap()")
        if not (callable(self._new) or isinstance(self._new, (staticmethod, classmethod))):
            raise TargetTypeError(
                f"scope='context' replaces functions and methods; {self._label()} "
                f"cannot be replaced by the non-callable {self._new!r}"
            )

        def make_dispatch(site: Site, below: Any) -> Any:
            visible = below if below is not NOTSET else site.visible()
            if not callable(visible) and not isinstance(visible, (staticmethod, classmethod)):
                raise TargetTypeError(
                    f"scope='context' replaces functions and methods; {self._label()} is {visible!r}"
                )
            return ContextDispatch(below, site, visible).visible

        make_dispatch.rebuild = False  # type: ignore[attr-defined]  # finds its below itself
        return make_dispatch

    def __enter__(self) -> Patch:
        # Scoped.__enter__ and _start, inlined: the common case costs fewer frames.
        frame = sys._getframe(1)
        code = frame.f_code
        if code.co_filename.startswith(_HERE):  # entered by the engine itself (a group)
            return Scoped.__enter__(self)
        origin = (code.co_filename, frame.f_lineno, code.co_name)  # new tuple: the claim
        if self.__dict__.setdefault("_claim", origin) is not origin:
            self._refuse_start()
        try:
            owner = self._owner
            kind = type(owner)
            layer = None
            if self._simple and self._parsed is None and (kind is types.ModuleType or kind is type):
                layer = _stack.push_own_attribute(owner, self._attribute, self._new, self)  # type: ignore[arg-type]
            if layer is None:
                self._apply()
            else:
                self._layers = [layer]
        except BaseException:
            del self.__dict__["_claim"]
            raise
        _ACTIVE[id(self)] = self
        self._started = (origin, get_ident(), next(_SEQUENCE), False)
        return self

    def __exit__(self, exc_type: object, *exc_info: object) -> None:
        if self.__dict__.pop("_started", None) is None:
            return
        _ACTIVE.pop(id(self), None)
        try:
            layers = self._layers
            if self._simple and not self._lazy and len(layers) == 1:
                self._layers = []
                message = _stack.remove(layers[0])
                if message is not None:
                    _stack.warn_conflicts([message], stacklevel=2)
            else:
                self._revert()
        except Exception:
            if exc_type is None:
                raise
            # the block's own exception is the one that propagates
        finally:
            self.__dict__.pop("_claim", None)

    def stack_position(self) -> int | None:
        """Where this patch's layer sits among the live patches of its attribute (0: the
        oldest), ``None`` when it is not started."""
        return _stack.position_of(self._layers[0]) if self._layers else None

    def restack(self, position: int) -> None:
        """Put this started patch's layer back at ``position`` among the live patches of
        its attribute (:meth:`stack_position` gave it before a stop): a patch started
        again goes on top, above newer ones it was under before."""
        if self._layers:
            _stack.move_to(self._layers[0], position)

    def _revert(self) -> None:
        if not self._lazy:
            self._remove_layers()
            return
        with _stack.LOCK:  # an import hook may be applying this very patch right now
            if self._pending_flag:
                self._pending_flag = False
                if self._hook_cancelled is not None:
                    self._hook_cancelled[0] = True
                return
            self._remove_layers()

    def _remove_layers(self) -> None:
        layers, self._layers = self._layers, []
        if len(layers) == 1 and not self._tokens and not self._aliases:
            message = _stack.remove(layers[0])
            if message is not None:
                _stack.warn_conflicts([message], stacklevel=4)
            return
        for dispatch, token in reversed(self._tokens):
            dispatch.deactivate(token)
        self._tokens = []
        conflicts = [m for m in map(_stack.remove, reversed(layers)) if m is not None]
        if self._aliases and layers:
            _unbind_late_aliases(layers, self._bound_before)
        _stack.warn_conflicts(conflicts, stacklevel=4)

    # -- lazy (post-import hook) ---------------------------------------------------------
    def _register_lazy(self, module: str) -> None:
        import wrapt

        cancelled = [False]
        self._hook_cancelled = cancelled
        self._pending_flag = True
        parsed = self._parsed
        assert parsed is not None

        def apply_on_import(_module: Any) -> None:
            # This runs inside the import of ``module``, holding its import lock.
            # Resolution (which may import more) happens before the stack lock is
            # taken; the lock only guards the pending check and the writes.
            if cancelled[0]:
                return
            failure: Exception | None = None
            try:
                owner, name = parsed.resolve()
            except Exception as exc:
                failure = exc
            with _stack.LOCK:
                if cancelled[0] or not self._pending_flag:
                    return
                self._pending_flag = False
                try:
                    if failure is not None:
                        raise failure
                    self._apply_to(owner, name)
                    return
                except Exception as exc:
                    # The import itself must go on: the failure belongs to the patch,
                    # which ends here (inactive, nothing changed) and says why.
                    cancelled[0] = True
                    self._end()
                    failure = exc
            warnings.warn(
                f"lazy patch of {self._label()} could not be applied when {module!r} "
                f"was imported, so it is not active: {failure}",
                LazyPatchWarning,
                stacklevel=2,
            )

        wrapt.register_post_import_hook(apply_on_import, module)


def _alias_sites(first: Site, new: Any) -> tuple[list[Site], frozenset[tuple[int, str]]]:
    """Module globals elsewhere bound to the same object (``from x import Y``).

    Also returns which module globals were already bound to ``new`` (its own
    module, say), so that stop() can tell them from names bound while patched.
    """
    value = first.visible()
    if value is NOTSET or isinstance(value, _LITERALS):
        return [], frozenset()  # interned/shared literals would match unrelated names
    found: list[Site] = []
    bound_to_new: set[tuple[int, str]] = set()
    for module in list(sys.modules.values()):
        namespace = getattr(module, "__dict__", None)
        if not isinstance(namespace, dict):
            continue
        for name, candidate in list(namespace.items()):
            if candidate is value and not (module is first.owner and name == first.name):
                found.append(make_site(module, name))
            elif candidate is new:
                bound_to_new.add((id(module), name))
    return found, frozenset(bound_to_new)


_LITERALS = (int, float, str, bytes, bool, type(None))


def _unbind_late_aliases(
    layers: list[_stack.Layer], bound_before: frozenset[tuple[int, str]]
) -> None:
    """Rebind module globals that copied the replacement while it was live.

    A module imported during an ``aliases=True`` patch runs ``from x import Y`` and
    binds the replacement; without this it would keep it after stop.
    """
    written = {id(layer.value): layer.value for layer in layers}
    if any(isinstance(value, _LITERALS) for value in written.values()):
        return
    first = layers[0].site
    restored = first.visible()

    def bound_before_or_first(site: Site) -> bool:
        key = (id(site.owner), site.name)
        return key in bound_before or (site.owner is first.owner and site.name == first.name)

    # a late alias a newer aliases=True patch took over: restored when that one stops
    _stack.rebase_originals(written, restored, bound_before_or_first)
    for module in list(sys.modules.values()):
        namespace = getattr(module, "__dict__", None)
        if not isinstance(namespace, dict):
            continue
        for name, candidate in list(namespace.items()):
            if id(candidate) in written and written[id(candidate)] is candidate:
                if (id(module), name) in bound_before or (
                    module is first.owner and name == first.name
                ):
                    continue
                if restored is NOTSET:
                    namespace.pop(name, None)
                else:
                    namespace[name] = restored


@overload
def patch(
    target: str,
    new: Any,
    /,
    *,
    create: bool = ...,
    aliases: bool = ...,
    lazy: bool = ...,
    scope: Scope = ...,
) -> Patch: ...


@overload
def patch(
    target: object,
    attribute: str,
    new: Any,
    /,
    *,
    create: bool = ...,
    aliases: bool = ...,
    lazy: bool = ...,
    scope: Scope = ...,
) -> Patch: ...


def patch(
    target: Any,
    *args: Any,
    create: bool = False,
    aliases: bool = False,
    lazy: bool = False,
    scope: Scope = "process",
) -> Patch:
    """Replace an attribute, reversibly: ``patch("pkg.mod:Name", new)`` or ``patch(obj, "attr", new)``.

    The target is resolved when the patch starts. Use it as a context manager, a
    decorator, or with ``start()``/``stop()``. Several patches of one attribute
    form a stack that may be stopped in any order; the original comes back, the
    very same object, when the last one stops — also on any exception.

    Options: ``create=True`` adds a missing attribute (deleted on stop);
    ``aliases=True`` also rebinds every other module global bound to the same
    object (``from x import Y`` copies); ``lazy=True`` waits for the module to be
    imported; ``scope="context"`` (functions and methods) shows the replacement
    only to the current thread / asyncio task.

    Example::

        with layerswap.patch("transformers.models.llama.modeling_llama:LlamaDecoderLayer", MyLayer):
            model = LlamaForCausalLM(config)

        with layerswap.patch(torch.nn.functional, "silu", my_silu):
            ...
    """
    __tracebackhide__ = True
    # A str subclass instance with an attribute name is an object to patch, not a target.
    if isinstance(target, str) and (type(target) is str or len(args) != 2):
        if len(args) != 1:
            raise TargetTypeError(
                f"patch({target!r}, new) takes the replacement as its second argument"
                + (
                    "; for an object and an attribute name use patch(obj, 'attr', new)"
                    if len(args) == 2
                    else ""
                )
            )
        return Patch(
            None,
            None,
            args[0],
            create=create,
            aliases=aliases,
            lazy=lazy,
            scope=scope,
            _parsed=ParsedTarget(target),
        )
    if len(args) != 2 or not isinstance(args[0], str):
        raise TargetTypeError(
            "patch() takes a target string and a replacement, patch('pkg.mod:Name', new), "
            f"or an object, an attribute name and a replacement, patch(obj, 'attr', new); "
            f"got patch({_stack._short(target, 40)}, {', '.join(_stack._short(a, 40) for a in args)})"
        )
    if not args[0]:
        raise TargetTypeError("the attribute name must be a non-empty string")
    if create or aliases or lazy or scope != "process":
        return Patch(
            target, args[0], args[1], create=create, aliases=aliases, lazy=lazy, scope=scope
        )
    return Patch(target, args[0], args[1])
