"""``ttl_cache``: an LRU cache whose entries expire, safe with tensor arguments."""

from __future__ import annotations

import hashlib
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable
from types import MethodType
from typing import TYPE_CHECKING, Any, NamedTuple, ParamSpec, Protocol, TypeVar, cast, overload

from layerswap.decorators._advice import Advice, Answer, describe, loaded_torch

if TYPE_CHECKING:
    from layerswap.decorators._advice import Args, Kwargs, Wrapped

__all__ = ["CacheInfo", "CachedFunction", "ttl_cache"]

P = ParamSpec("P")
R = TypeVar("R")


class CacheInfo(NamedTuple):
    """What ``cache_info()`` returns, as in :func:`functools.lru_cache`, plus ``ttl``."""

    hits: int
    misses: int
    maxsize: int | None
    currsize: int
    ttl: float


class CachedFunction(Protocol[P, R]):
    """What ``@ttl_cache(...)`` returns, for type checkers: the function plus the cache methods.

    On a method, attribute access gives a callable with the same return type
    (argument types are not tracked through binding, as for ``functools.lru_cache``).
    """

    __wrapped__: Callable[P, R]

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R: ...

    def cache_clear(self) -> None: ...

    def cache_info(self) -> CacheInfo: ...

    @overload
    def __get__(self, instance: None, owner: type[Any] | None = None) -> CachedFunction[P, R]: ...

    @overload
    def __get__(self, instance: object, owner: type[Any] | None = None) -> Callable[..., R]: ...


class _Entry(Answer):
    """A cached result: the answer to a later call with the same key, until it expires."""

    __slots__ = ("expires", "refs")

    def __init__(self, value: Any, expires: float, refs: tuple[Any, ...]) -> None:
        super().__init__(value)
        self.expires = expires
        # The tensors whose id() is in the key: holding them means no new tensor can be
        # given the same id while this entry exists.
        self.refs = refs


# What a miss leaves for storing the result: the key, and the tensors it holds.
_Miss = tuple[Hashable, tuple[Any, ...]]

_ATOMIC = frozenset({int, float, str, bool, bytes, type(None), complex})
_KWARGS_MARK = object()  # separates positional from keyword arguments in a key


class ttl_cache(Advice):
    """Cache results by argument for ``ttl`` seconds, keeping at most ``maxsize`` (LRU).

    Like :func:`functools.lru_cache` with expiry: an entry older than ``ttl`` seconds
    of ``clock`` (monotonic, injectable) is recomputed; past ``maxsize`` entries
    the least recently used goes (``maxsize=None``: no bound). Thread-safe; two
    threads missing on the same key at once may both compute. ``cache_clear()`` and
    ``cache_info()`` exist on this object and on each function it decorates.

    Arguments must be hashable, as for ``lru_cache`` — except tensors, which are
    keyed one of two ways (``tensors=``):

    * ``"identity"`` (default): ``(id, version counter, data_ptr, shape, stride,
      dtype, device)``, and the entry holds a reference to the tensor. O(1) and no
      device sync. The version counter moves on every in-place op, so a mutated
      tensor misses; holding the reference means its ``id`` cannot be reused by a
      new tensor while the entry lives. An *equal* but distinct tensor misses, and
      writes through ``tensor.data`` (which has its own version counter) are not
      seen. Inference-mode tensors have no version counter and are keyed by content.
    * ``"content"``: ``(shape, dtype, device, 128-bit BLAKE2 of the bytes)``. Equal
      tensors share an entry and nothing is held, but each call copies every tensor
      argument to the host and hashes it.

    Entries also hold the other arguments (``self`` for methods), as ``lru_cache``
    does; ``maxsize`` bounds what is kept alive.

    Example::

        @ttl_cache(ttl=300, maxsize=32)
        def causal_mask(seq_len: int, device: str) -> torch.Tensor:
            return torch.full((seq_len, seq_len), float("-inf"), device=device).triu(1)

        causal_mask(128, "cpu") is causal_mask(128, "cpu")   # True for five minutes
        causal_mask.cache_info()   # CacheInfo(hits=1, misses=1, maxsize=32, currsize=1, ttl=300.0)
    """

    refuses_generators = (
        "a cached generator would be handed, exhausted, to every later call; cache a "
        "function that returns list(...) of it instead"
    )

    __slots__ = (
        "_by_content",
        "_clock",
        "_entries",
        "_hits",
        "_lock",
        "_misses",
        "maxsize",
        "ttl",
    )

    def __init__(
        self,
        ttl: float = 60.0,
        maxsize: int | None = 128,
        *,
        clock: Callable[[], float] | None = None,
        tensors: str = "identity",
    ) -> None:
        if not isinstance(ttl, (int, float)) or isinstance(ttl, bool) or ttl <= 0:
            raise TypeError(f"ttl must be a number of seconds > 0, got {ttl!r}")
        if maxsize is not None and (not isinstance(maxsize, int) or maxsize < 0):
            raise ValueError(f"maxsize must be an int >= 0 or None, got {maxsize!r}")
        if tensors not in ("identity", "content"):
            raise ValueError(f"tensors must be 'identity' or 'content', got {tensors!r}")
        self.ttl = float(ttl)
        self.maxsize = maxsize
        self._clock = clock  # None: time.monotonic, looked up at each call
        self._by_content = tensors == "content"
        self._entries: OrderedDict[Hashable, _Entry] = OrderedDict()
        self._lock = threading.Lock()
        self._hits = 0
        self._misses = 0

    # -- keys ----------------------------------------------------------------------

    def _tensor_key(self, torch: Any, tensor: Any, refs: list[Any]) -> Hashable:
        if self._by_content or tensor.is_inference():
            data = tensor.detach().reshape(-1).contiguous().view(torch.uint8).cpu().numpy()
            digest = hashlib.blake2b(data.tobytes(), digest_size=16).digest()
            return ("tensor", tuple(tensor.shape), tensor.dtype, tensor.device, digest)
        refs.append(tensor)
        return (
            "tensor",
            id(tensor),
            tensor._version,
            tensor.data_ptr(),
            tuple(tensor.shape),
            tensor.stride(),
            tensor.dtype,
            tensor.device,
        )

    def _freeze(self, torch: Any, value: Any, refs: list[Any]) -> Any:
        if type(value) in _ATOMIC:  # the common case, decided without isinstance
            return value
        if isinstance(value, torch.Tensor):
            return self._tensor_key(torch, value, refs)
        kind = type(value)
        if isinstance(value, (tuple, list)):
            # Lists become keys too; the type stays in, so [1] and (1,) differ (and a
            # namedtuple from a plain tuple).
            return (kind, tuple(self._freeze(torch, item, refs) for item in value))
        if isinstance(value, dict):
            return (kind, tuple((k, self._freeze(torch, v, refs)) for k, v in value.items()))
        return value

    def _key(self, wrapped: Wrapped, instance: Any, args: Args, kwargs: Kwargs) -> _Miss:
        # The function is part of the key: one cache object may be wrapped around
        # several methods or instances through layerswap.wrap.
        function = wrapped.__func__ if type(wrapped) is MethodType else wrapped
        torch = loaded_torch()
        refs: list[Any] = []
        frozen_args: tuple[Any, ...] = args
        frozen_kwargs: tuple[Any, ...] = tuple(kwargs.items()) if kwargs else ()
        # Without torch no tensor can exist; with it, only rebuild what holds non-scalars.
        if torch is not None:
            freeze = self._freeze
            for arg in args:
                if type(arg) not in _ATOMIC:
                    frozen_args = tuple([freeze(torch, a, refs) for a in args])
                    break
            if kwargs:
                frozen_kwargs = tuple([(k, freeze(torch, v, refs)) for k, v in kwargs.items()])
        key = (function, instance, frozen_args, _KWARGS_MARK, frozen_kwargs)
        try:
            hash(key)
        except TypeError as error:
            raise TypeError(
                f"ttl_cache: {describe(wrapped, instance)}() was called with an unhashable "
                f"argument ({error}); cached functions need hashable arguments or tensors"
            ) from None
        return key, tuple(refs)

    # -- lookup and store ------------------------------------------------------------

    def _before(
        self, wrapped: Wrapped, instance: Any, args: Args, kwargs: Kwargs
    ) -> _Entry | _Miss:
        """The live entry for this call (a hit), else what ``_returned`` needs to store."""
        key, refs = self._key(wrapped, instance, args, kwargs)
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                if (self._clock or time.monotonic)() < entry.expires:
                    self._entries.move_to_end(key)
                    self._hits += 1
                    return entry
                del self._entries[key]
            self._misses += 1
        return key, refs

    def _returned(self, wrapped: Wrapped, instance: Any, miss: _Miss, value: Any) -> None:
        key, refs = miss
        if self.maxsize == 0:
            return
        with self._lock:
            now = (self._clock or time.monotonic)()
            self._entries[key] = _Entry(value, now + self.ttl, refs)
            self._entries.move_to_end(key)
            # Expired entries still hold their arguments; drop those in the way cheaply.
            while self._entries:
                oldest = next(iter(self._entries.values()))
                if oldest.expires > now:
                    break
                self._entries.popitem(last=False)
            if self.maxsize is not None:
                while len(self._entries) > self.maxsize:
                    self._entries.popitem(last=False)

    # -- management ------------------------------------------------------------------

    def cache_clear(self) -> None:
        """Drop every entry (and the references they hold) and zero the counters."""
        with self._lock:
            self._entries.clear()
            self._hits = self._misses = 0

    def cache_info(self) -> CacheInfo:
        """Hits, misses, maxsize, live entries (expired ones are dropped first) and ttl."""
        with self._lock:
            now = (self._clock or time.monotonic)()
            for key in [k for k, e in self._entries.items() if e.expires <= now]:
                del self._entries[key]
            return CacheInfo(self._hits, self._misses, self.maxsize, len(self._entries), self.ttl)

    def __call__(self, func: Callable[P, R]) -> CachedFunction[P, R]:  # type: ignore[override]
        wrapper: Callable[P, R] = super().__call__(func)
        return cast("CachedFunction[P, R]", wrapper)

    def _decorated(self, wrapper: Callable[..., Any]) -> None:
        wrapper.cache_clear = self.cache_clear  # type: ignore[attr-defined]
        wrapper.cache_info = self.cache_info  # type: ignore[attr-defined]
