"""``scope="context"``: a replacement visible only to the current thread / asyncio task.

The site holds a small dispatcher instead of the replacement. Each call (or
attribute access, for methods) looks up a :class:`contextvars.ContextVar`: in the
context that started the patch it finds the replacement; everywhere else it finds
nothing and falls through to the value that was below it. New threads start with
an empty context and asyncio tasks copy the context they were created in, so the
replacement follows the code that asked for it and nothing else.

On a class the dispatcher is a descriptor (``__get__`` binds whichever function the
context chose). On a module or one instance, where nothing binds, the site holds a
plain function made with :func:`forwarder`: it has the original's ``__name__``,
``__doc__``, ``__module__`` and signature, and ``inspect.iscoroutinefunction`` /
``isgeneratorfunction`` answer as for the original.
"""

from __future__ import annotations

import contextvars
from typing import Any

from layerswap.patching.sites import NOTSET, Site
from layerswap.patching.wraps import forwarder

__all__ = ["ContextDispatch"]


class ContextDispatch:
    """Calls (or binds) the context's replacement if there is one, else what was below.

    ``visible`` is what the site holds: the dispatcher itself on a class, else a
    function that looks like ``like`` (the original) and calls the dispatcher.
    """

    __slots__ = ("__weakref__", "_below", "_site", "_var", "visible")

    def __init__(self, below: Any, site: Site, like: Any) -> None:
        self._below = below
        self._site = site
        self._var: contextvars.ContextVar[Any] = contextvars.ContextVar(
            f"layerswap:{site.describe()}", default=NOTSET
        )
        self.visible: Any = self
        if not isinstance(site.owner, type):
            function = forwarder(like, self)
            function.__layerswap_dispatch__ = self  # type: ignore[attr-defined]
            self.visible = function

    def activate(self, new: Any) -> contextvars.Token[Any]:
        return self._var.set(new)

    def deactivate(self, token: contextvars.Token[Any]) -> None:
        try:
            self._var.reset(token)
        except ValueError:  # stopped from another context: clear it here
            self._var.set(NOTSET)

    def _current(self) -> Any:
        impl = self._var.get()
        if impl is not NOTSET:
            return impl
        below = self._value_below()
        if below is NOTSET:  # the original was inherited: look it up past the site
            return _inherited(self._site)
        return below

    def _value_below(self) -> Any:
        # Looked up at call time, not fixed when pushed: a layer below this one may
        # have been stopped since (any stop order is allowed).
        from layerswap.patching.stack import _STACKS

        stack = _STACKS.get(self._site.key)
        if stack is not None:
            for index, layer in enumerate(stack.layers):
                if layer.value is self.visible:
                    return stack.value_below(index)
        return self._below

    def __get__(self, instance: Any, owner: type | None = None) -> Any:
        impl = self._current()
        bind = getattr(type(impl), "__get__", None)
        return impl if bind is None else bind(impl, instance, owner)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        impl = self._current()
        if isinstance(impl, (staticmethod, classmethod)):
            impl = impl.__func__
        return impl(*args, **kwargs)

    @property
    def __wrapped__(self) -> Any:
        return self._current()

    def __repr__(self) -> str:
        return f"<context-scoped patch of {self._site.describe()}>"


def _inherited(site: Site) -> Any:
    owner = site.owner
    klass = owner if isinstance(owner, type) else type(owner)
    mro = klass.__mro__[1:] if isinstance(owner, type) else klass.__mro__
    for base in mro:
        if site.name in base.__dict__:
            raw = base.__dict__[site.name]
            if not isinstance(owner, type):
                bind = getattr(type(raw), "__get__", None)
                return raw if bind is None else bind(raw, owner, klass)
            return raw
    raise AttributeError(site.name)
