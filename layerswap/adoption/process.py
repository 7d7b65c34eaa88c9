"""Process-wide state a patch function may set: torch's switches and the environment.

Neither is a name in a ``__dict__`` (``torch.backends.cuda.matmul.allow_tf32 = True``
goes to torch's C++ context), so :class:`ProcessState` reads them, before the function runs
and after: a fixed list of torch's switches (:func:`torch_switches`), each read by the
expression that reads it and set back through torch's setters, and ``os.environ``.

Switches that torch keeps linked form one :class:`Switches` group, set back together: the
float32 precision is read through the legacy getters (``get_float32_matmul_precision()``,
``allow_tf32``) and the new ``fp32_precision`` ones, and written back legacy first, then
each field that still differs (the order that gives back every reading).

Example::

    state = ProcessState.take()
    torch.backends.cudnn.benchmark = True
    [(group.names[i], before[i], after[i]) for group, before, after in state.changed()
     for i in range(len(before)) if before[i] != after[i]]
    # [("torch.backends.cudnn.benchmark", False, True)]
"""

from __future__ import annotations

import dataclasses
import functools
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["UNREADABLE", "ProcessState", "Switches", "set_environ", "torch_switches"]


class _Unreadable:
    def __repr__(self) -> str:
        return "<unreadable>"


#: what a reading that raised gives (torch refuses a legacy getter after a mix of APIs)
UNREADABLE: Any = _Unreadable()


@dataclass(frozen=True)
class Switches:
    """Linked switches: ``names`` are the expressions that read them (``reads``), and
    ``write`` makes them hold a tuple of values again (those :data:`UNREADABLE` left)."""

    names: tuple[str, ...]
    reads: tuple[Callable[[], Any], ...]
    write: Callable[[tuple[Any, ...]], None]
    #: module attributes torch rebinds with them (``torch.Storage`` with the default dtype):
    #: set back with them, not changes of their own
    rebinds: tuple[str, ...] = ()

    def read(self) -> tuple[Any, ...]:
        return tuple(_read(read) for read in self.reads)


def _read(read: Callable[[], Any]) -> Any:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return read()
    except Exception:
        return UNREADABLE


def _setting(owner: Callable[[], Any], attribute: str) -> tuple[Callable[[], Any], Any]:
    def read() -> Any:
        return getattr(owner(), attribute)

    def write(value: Any) -> None:
        setattr(owner(), attribute, value)

    return read, write


def _single(name: str, read: Callable[[], Any], write: Callable[[Any], None]) -> Switches:
    def put(values: tuple[Any, ...]) -> None:
        (value,) = values
        if value is not UNREADABLE and _read(read) != value:
            write(value)

    return Switches((name,), (read,), put)


def _attribute(path: str) -> Switches:
    """``torch.backends.cudnn.benchmark``: read and set as the attribute."""
    *parts, attribute = path.split(".")[1:]

    def owner() -> Any:
        obj: Any = torch
        for part in parts:
            obj = getattr(obj, part)
        return obj

    read, write = _setting(owner, attribute)
    return _single(path, read, write)


def _function(getter: str, setter: str) -> Switches:
    """``torch.get_num_threads()``, set by ``torch.set_num_threads``."""

    def named(path: str) -> Callable[..., Any]:
        obj: Any = torch
        for part in path.split(".")[1:]:
            obj = getattr(obj, part)
        return obj  # type: ignore[no-any-return]

    return _single(f"{getter}()", lambda: named(getter)(), lambda value: named(setter)(value))


def _deterministic() -> Switches:
    def write(values: tuple[Any, ...]) -> None:
        mode, warn_only = values
        if UNREADABLE not in values:
            torch.use_deterministic_algorithms(mode, warn_only=warn_only)

    return Switches(
        (
            "torch.are_deterministic_algorithms_enabled()",
            "torch.is_deterministic_algorithms_warn_only_enabled()",
        ),
        (
            torch.are_deterministic_algorithms_enabled,
            torch.is_deterministic_algorithms_warn_only_enabled,
        ),
        write,
    )


#: the ``fp32_precision`` fields of torch's new precision API: (backend, op) and its name
_FP32_FIELDS = (
    (("generic", "all"), "torch.backends.fp32_precision"),
    (("cuda", "all"), "torch.backends.cudnn.fp32_precision"),
    (("cuda", "matmul"), "torch.backends.cuda.matmul.fp32_precision"),
    (("cuda", "conv"), "torch.backends.cudnn.conv.fp32_precision"),
    (("cuda", "rnn"), "torch.backends.cudnn.rnn.fp32_precision"),
    (("mkldnn", "all"), "torch.backends.mkldnn.fp32_precision"),
    (("mkldnn", "matmul"), "torch.backends.mkldnn.matmul.fp32_precision"),
    (("mkldnn", "conv"), "torch.backends.mkldnn.conv.fp32_precision"),
    (("mkldnn", "rnn"), "torch.backends.mkldnn.rnn.fp32_precision"),
)


def _fp32_fields() -> list[tuple[str, Callable[[], Any], Callable[[Any], None]]]:
    """The ``fp32_precision`` fields this torch has (none before torch 2.9)."""
    getter: Any = getattr(torch._C, "_get_fp32_precision_getter", None)
    setter: Any = getattr(torch._C, "_set_fp32_precision_setter", None)
    if getter is None or setter is None:
        return []
    fields: list[tuple[str, Callable[[], Any], Callable[[Any], None]]] = []
    for key, name in _FP32_FIELDS:
        read = functools.partial(getter, *key)
        if _read(read) is not UNREADABLE:
            fields.append((name, read, functools.partial(setter, *key)))
    return fields


def _precision() -> Switches:
    """The float32 precision: the legacy readings and the new API's fields, linked in
    torch's context (setting one moves others; reading a legacy one after a mix of APIs
    raises), set back legacy first, then each field that still differs."""
    matmul = _setting(lambda: torch.backends.cuda.matmul, "allow_tf32")
    cudnn = _setting(lambda: torch.backends.cudnn, "allow_tf32")
    legacy: list[tuple[str, Callable[[], Any], Callable[[Any], None]]] = [
        (
            "torch.get_float32_matmul_precision()",
            torch.get_float32_matmul_precision,
            torch.set_float32_matmul_precision,
        ),
        ("torch.backends.cudnn.allow_tf32", *cudnn),
        ("torch.backends.cuda.matmul.allow_tf32", *matmul),
    ]
    every = [*legacy, *_fp32_fields()]

    def write(values: tuple[Any, ...]) -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's advice against the legacy API
            for index, ((_, read, put), value) in enumerate(zip(every, values, strict=True)):
                # the legacy precision always: it resets what the fields are read against
                if value is not UNREADABLE and (index == 0 or _read(read) != value):
                    put(value)

    names = tuple(name for name, _, _ in every)
    return Switches(names, tuple(read for _, read, _ in every), write)


@functools.cache
def torch_switches() -> tuple[Switches, ...]:
    """torch's process-wide switches a patch may set, each group readable here."""
    groups = [
        _precision(),
        _attribute("torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction"),
        _attribute("torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction"),
        _attribute("torch.backends.cudnn.enabled"),
        _attribute("torch.backends.cudnn.benchmark"),
        _attribute("torch.backends.cudnn.deterministic"),
        _attribute("torch.backends.mkldnn.enabled"),
        _deterministic(),
        *(
            _function(
                f"torch.backends.cuda.{kind}_sdp_enabled", f"torch.backends.cuda.enable_{kind}_sdp"
            )
            for kind in ("flash", "mem_efficient", "math", "cudnn")
        ),
        _function("torch.get_num_threads", "torch.set_num_threads"),
        dataclasses.replace(
            _function("torch.get_default_dtype", "torch.set_default_dtype"),
            rebinds=("torch.Storage",),
        ),
    ]
    return tuple(group for group in groups if UNREADABLE not in group.read())


@dataclass
class ProcessState:
    """What each group of :func:`torch_switches` and ``os.environ`` held when taken."""

    switches: list[tuple[Switches, tuple[Any, ...]]] = field(default_factory=list)
    environ: dict[str, str] = field(default_factory=dict)

    @classmethod
    def take(cls) -> ProcessState:
        return cls([(group, group.read()) for group in torch_switches()], dict(os.environ))

    def changed(self) -> list[tuple[Switches, tuple[Any, ...], tuple[Any, ...]]]:
        """Each group whose readings differ now: (the group, before, now)."""
        found = []
        for group, before in self.switches:
            now = group.read()
            if now != before:
                found.append((group, before, now))
        return found

    def environ_changed(self) -> list[tuple[str, str | None, str | None]]:
        """Each variable set, changed or removed: (name, before, now; ``None``: unset)."""
        now = dict(os.environ)
        names = [*self.environ, *(name for name in now if name not in self.environ)]
        return [
            (name, self.environ.get(name), now.get(name))
            for name in names
            if self.environ.get(name) != now.get(name)
        ]

    def rebase(self, then: ProcessState) -> None:
        """Take what changed since ``then`` (an import's doing) as the state before."""
        for index, ((group, before), (_, old)) in enumerate(
            zip(self.switches, then.switches, strict=True)
        ):
            now = group.read()
            values = tuple(
                new if new != was else value
                for value, was, new in zip(before, old, now, strict=True)
            )
            self.switches[index] = (group, values)
        for name, _, new in then.environ_changed():
            if new is None:
                self.environ.pop(name, None)
            else:
                self.environ[name] = new


def set_environ(name: str, value: str | None) -> None:
    """``os.environ[name] = value``; ``None`` removes it."""
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value
