"""The transformers source an original decoder layer runs: what a verdict vouches for.

A behaviour proof (:mod:`layerswap.proof`) compares an original layer with its
replacement on one transformers. Its version string alone does not say which code that
was: an install from git main keeps one dev version across commits, and a locally
patched release keeps the release's. So a verdict is keyed by a digest of the files
themselves: the family's modeling module, every transformers module it imports by name
(one level: the modules whose functions its classes call), and the shared modules
:data:`layerswap.hf_internals.SHARED_SOURCES` that every layer reaches at run time
(masks, caches, rotary tables, the attention functions, generation). Another file, or
the same file changed, is another source: the verdict is proven again.

Files are found under the transformers package Python imported (``transformers.__file__``,
so a copy first on ``PYTHONPATH`` is the one read), never imported here, and hashed once
per process (a few milliseconds per family).

Example::

    from layerswap import sources

    sources.digest("transformers.models.llama.modeling_llama")   # '3f9c0d...'
    sources.files("transformers.models.llama.modeling_llama")    # [Path(...), ...]
"""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib.util
import operator
import re
import sys
import uuid
import weakref
from collections.abc import Iterable, Mapping
from pathlib import Path
from types import FunctionType, ModuleType
from typing import Any

from layerswap.hf_internals import SHARED_SOURCES
from layerswap.patching import rebases, unpatched

__all__ = [
    "class_digest",
    "code_digest",
    "digest",
    "files",
    "live_digest",
    "package_root",
    "vouched_code",
]


def package_root() -> Path | None:
    """The directory of the transformers package Python imports (``None``: not installed)."""
    import importlib.util

    spec = importlib.util.find_spec("transformers")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def _file_of(root: Path, dotted: str) -> Path | None:
    """``transformers.x.y`` -> its ``x/y.py`` or ``x/y/__init__.py`` under ``root``."""
    parts = dotted.split(".")[1:]
    if not parts:
        return root / "__init__.py"
    base = root.joinpath(*parts)
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _imported(module: str, source: str) -> set[str]:
    """The transformers modules ``source`` (the text of ``module``) imports by name, a
    name that is itself a module (``from ...integrations import sdpa_attention``) too."""
    package = module.rpartition(".")[0].split(".")
    found: set[str] = set()
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return found
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("transformers."))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = package[: len(package) - node.level + 1]
                base = ".".join([*anchor, *([node.module] if node.module else [])])
            else:
                base = node.module or ""
            if base.split(".")[0] != "transformers":
                continue
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


@functools.cache
def _covered(module: str) -> dict[str, Path]:
    """The transformers modules :func:`digest` covers for ``module`` (its own, those it
    imports by name, the shared ones), each with its file; empty when transformers or the
    module is not there."""
    root = package_root()
    if root is None:
        return {}
    own = _file_of(root, module)
    if own is None:
        return {}
    names = _imported(module, own.read_text(encoding="utf-8", errors="replace"))
    names.update(f"transformers.{name}" for name in SHARED_SOURCES)
    found = {module: own}
    for name in names:
        path = _file_of(root, name)
        if path is not None:
            found[name] = path
    return found


@functools.cache
def files(module: str) -> tuple[Path, ...]:
    """The files whose content :func:`digest` covers for ``module``, sorted; empty when
    transformers or the module is not there."""
    return tuple(sorted(set(_covered(module).values())))


@functools.cache
def _file_digest(path: Path) -> bytes:
    return hashlib.sha256(path.read_bytes()).digest()


@functools.cache
def digest(module: str) -> str:
    """A digest of the transformers source ``module``'s layers run (:func:`files`): the
    same on every machine for the same files, another for any edit. ``""`` when
    transformers or the module is not there (nothing to vouch for).

    Example::

        digest("transformers.models.qwen3.modeling_qwen3")   # '9a1e77c2b0d4f815'
    """
    found = files(module)
    if not found:
        return ""
    root = package_root()
    combined = hashlib.sha256()
    for path in found:
        combined.update(path.relative_to(root).as_posix().encode() if root else b"")
        combined.update(_file_digest(path))
    return combined.hexdigest()[:16]


def live_digest(module: str) -> str:
    """A digest of the code the modules :func:`digest` covers run in this process: each
    function they bind, and each method of a class they define, by where its code was
    written (file, line, name), seen through every patch of layerswap's engine (its own,
    and adopted ones: each proven). An install nobody patched gives the same digest in
    every process; a function or method rebound around layerswap (a user's patch,
    another library's) gives another, so that a verdict proven on the code as its files
    say does not vouch for the code the original runs now. Modules not imported yet, and
    packages (their namespaces fill lazily), are left out.

    Example::

        live_digest("transformers.models.llama.modeling_llama")   # 'b1946ac92492d234'
        modeling_llama.LlamaMLP.forward = my_forward
        live_digest("transformers.models.llama.modeling_llama")   # 'e4d909c290d0fb1c'
    """
    combined = hashlib.sha256()
    for name, path in sorted(_covered(module).items()):
        loaded = sys.modules.get(name)
        # a package's namespace fills as its submodules are first asked for (transformers'
        # lazy modules): what it binds is read where it is used, in the modules themselves
        if loaded is not None and path.name != "__init__.py":
            _fold_namespace(combined, loaded, name)
    return combined.hexdigest()[:16]


def class_digest(cls: type) -> str:
    """:func:`live_digest` of a replacement class: the methods of each class of its MRO
    outside torch, and the functions their modules bind."""
    combined = hashlib.sha256()
    modules: dict[str, None] = {}
    for klass in cls.__mro__:
        owner = getattr(klass, "__module__", "") or ""
        if owner.split(".")[0] in ("torch", "builtins", "typing", "abc"):
            continue
        _fold_class(combined, klass)
        modules[owner] = None
    for name in modules:
        loaded = sys.modules.get(name)
        if loaded is not None:
            _fold_namespace(combined, loaded, name)
    return combined.hexdigest()[:16]


def _fold_namespace(combined: Any, module: ModuleType, name: str) -> None:
    for part in _namespace_parts(module, name):
        combined.update(part if isinstance(part, bytes) else _class_text(part))


def _fold_class(combined: Any, cls: type) -> None:
    # a replacement's or a converter's class: read each time, not kept (a class made at
    # run time, a test's or a sweep's, is not held alive by what it folded to)
    combined.update(_read_class(cls))


# What a namespace and a class of one folds to is kept with the very objects it was read
# from: every key and value of its dict, and the code each function there runs (held, so
# that no other object takes their identity). While the dict holds the same objects, the
# functions the same code, and no live patch's original was changed in place
# (:func:`~layerswap.patching.rebases`), its text is the same and it is not read again.
# A rebind, a patch set or taken back, a function's ``__code__`` replaced, reads it again.
_NAMESPACES: dict[str, tuple[ModuleType, int, tuple[Any, ...], list[bytes | type]]] = {}
_CLASSES: weakref.WeakKeyDictionary[type, tuple[int, tuple[Any, ...], bytes]] = (
    weakref.WeakKeyDictionary()
)


def _held(namespace: Mapping[str, Any]) -> tuple[Any, ...]:
    values = namespace.values()
    return (*namespace, *values, *_codes(values))


def _codes(values: Iterable[Any]) -> list[Any]:
    """The code objects ``values`` run: each function's, a static or class method's, a
    property's getter's and setter's (``None`` where one has none)."""
    found: list[Any] = []
    for raw in values:
        kind = type(raw)
        if kind is FunctionType:
            found.append(raw.__code__)
        elif kind is staticmethod or kind is classmethod:
            found.append(getattr(raw.__func__, "__code__", None))
        elif isinstance(raw, property):
            found.append(getattr(raw.fget, "__code__", None))
            found.append(getattr(raw.fset, "__code__", None))
    return found


def _same(held: tuple[Any, ...], now: tuple[Any, ...]) -> bool:
    return len(held) == len(now) and all(map(operator.is_, held, now))


def _namespace_parts(module: ModuleType, name: str) -> list[bytes | type]:
    """What ``module``'s namespace folds to: the text of each function it binds, and each
    class it defines (folded by :func:`_class_text`, which checks its own dict)."""
    now, generation = _held(vars(module)), rebases()
    known = _NAMESPACES.get(name)
    if known is not None and known[0] is module and known[1] == generation and _same(known[2], now):
        return known[3]
    parts: list[bytes | type] = []
    for attr in sorted(vars(module)):
        if attr.startswith("_layerswap_"):  # bound by the rotary slot: only its classes call it
            continue
        value = unpatched(module, attr)
        if isinstance(value, type):
            if getattr(value, "__module__", None) == name:
                parts.append(f"{name}.{attr}".encode())
                parts.append(value)
        elif hasattr(value, "__code__"):
            parts.append(f"{name}.{attr}={_written(value)}".encode())
    _NAMESPACES[name] = (module, generation, now, parts)
    return parts


def _class_text(cls: type) -> bytes:
    """:func:`_read_class`, kept (a class a module of the digest defines)."""
    now, generation = _held(vars(cls)), rebases()
    known = _CLASSES.get(cls)
    if known is not None and known[0] == generation and _same(known[1], now):
        return known[2]
    text = _read_class(cls)
    _CLASSES[cls] = (generation, now, text)
    return text


def _read_class(cls: type) -> bytes:
    found = []
    for attr in sorted(vars(cls)):
        raw = vars(cls)[attr]
        if isinstance(raw, property):
            parts = [p for p in (raw.fget, raw.fset) if p is not None]
        elif isinstance(raw, (staticmethod, classmethod)) or hasattr(raw, "__code__"):
            got = unpatched(cls, attr)
            parts = [getattr(got, "__func__", got)]
        else:
            continue
        found.append(f"{attr}={','.join(map(_written, parts))}".encode())
    return b"".join(found)


def function_digest(function: Any) -> str:
    """Where ``function``'s code was written (file, line, name, through what it wraps),
    and outside transformers and layerswap (whose files are digested already) the digest
    of its module's code: another function, or the same one edited, gives another.

    Example::

        function_digest(sdpa_attention_forward)
        # 'transformers/integrations/sdpa_attention.py:67:sdpa_attention_forward'
    """
    if isinstance(function, functools.partial):  # what it calls, and with what
        bound = _ADDRESS.sub("", repr((function.args, sorted(function.keywords.items()))))
        return f"partial({function_digest(function.func)}, {bound})"
    if not hasattr(function, "__code__") and not isinstance(function, type):
        call = getattr(type(function), "__call__", None)  # noqa: B004 (the class's, not a test)
        if hasattr(call, "__code__"):  # an instance of a class of one's own: its call, its state
            held = sorted(vars(function).items()) if hasattr(function, "__dict__") else []
            state = _ADDRESS.sub("", repr(held))
            return f"{function_digest(call)}[{state}]"
    written = _written(function)
    module = getattr(function, "__module__", None) or ""
    if module.split(".")[0] in ("transformers", "layerswap") or not module:
        return written
    try:
        return f"{written}@{code_digest(module)}"
    except Exception:  # a module that cannot be read (made at run time): where it was written
        return written


def _written(function: Any) -> str:
    """Where ``function``'s code (and that of what it wraps) was written."""
    found = []
    for _ in range(8):
        code = getattr(function, "__code__", None)
        if code is None:
            found.append(getattr(function, "__qualname__", type(function).__name__))
            break
        found.append(f"{_place(code.co_filename)}:{code.co_firstlineno}:{code.co_name}")
        function = getattr(function, "__wrapped__", None)
        if function is None:
            break
    return "<".join(found)


@functools.cache
def _place(filename: str) -> str:
    """A code object's file, relative to the package it belongs to where it is one of
    transformers' or layerswap's (the same on every machine)."""
    path = Path(filename)
    for top in ("transformers", "layerswap"):
        if top in path.parts:
            index = len(path.parts) - 1 - path.parts[::-1].index(top)
            return "/".join(path.parts[index:])
    return filename


#: an object's address in its ``repr``: another each run
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")

#: a package with more files than this is digested by its version and the module's own file
_PACKAGE_FILES = 300


@functools.cache
def code_digest(module: str) -> str:
    """A digest of the code module ``module`` belongs to, where neither layerswap's own
    source digest nor transformers' covers it: a replacement layer of a plugin or of the
    user's own code, so that a verdict proven on it is proven again once it changes.

    The files of its top-level package (every ``.py`` under it; the package's installed
    version and the module's own file where it holds more than a few hundred), or the
    module's file. ``""`` for layerswap's and transformers' modules; a module whose file
    cannot be read (a class defined in an interactive session) gets a digest of this
    process alone: its verdict is never reused by another.

    Example::

        code_digest("my_kernels.layers")   # '5d41402abc4b2a76'
    """
    top = module.split(".")[0]
    if top in ("layerswap", "transformers"):
        return ""
    paths = _code_files(module, top)
    if not paths:
        return f"unread-{uuid.uuid4().hex[:16]}"
    combined = hashlib.sha256()
    for path in paths:
        combined.update(path.name.encode())
        combined.update(_file_digest(path))
    combined.update(_version_of(top).encode())
    return combined.hexdigest()[:16]


def _code_files(module: str, top: str) -> list[Path]:
    loaded = sys.modules.get(module)
    own = getattr(loaded, "__file__", None)
    if own is None:
        try:
            spec = importlib.util.find_spec(module)
        except (ImportError, ValueError):
            spec = None
        own = spec.origin if spec is not None else None
    own_path = Path(own) if own and Path(own).is_file() else None
    try:
        package = importlib.util.find_spec(top)
    except (ImportError, ValueError):  # __main__, a half-imported package
        package = None
    locations = list(package.submodule_search_locations or []) if package else []
    if locations:
        found = sorted(p for location in locations for p in Path(location).rglob("*.py"))
        if len(found) <= _PACKAGE_FILES:
            return found
    return _with_siblings(own_path) if own_path is not None else []


def _with_siblings(path: Path) -> list[Path]:
    """``path`` (a module outside any package: a user's ``my_layer.py``) and the modules
    beside it that it imports, and those they import, so that an edit of a helper module
    the layer calls is another code."""
    found: dict[Path, None] = {}
    waiting = [path]
    while waiting and len(found) < _PACKAGE_FILES:
        current = waiting.pop()
        if current in found:
            continue
        found[current] = None
        try:
            tree = ast.parse(current.read_text(encoding="utf-8", errors="replace"))
        except (OSError, SyntaxError):
            continue
        for node in ast.walk(tree):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom) and not node.level
                else []
            )
            for name in names:
                sibling = current.parent / f"{name.split('.')[0]}.py"
                if sibling.is_file() and sibling not in found:
                    waiting.append(sibling)
    return sorted(found)


def _version_of(top: str) -> str:
    from importlib import metadata

    for distribution in metadata.packages_distributions().get(top, []):
        try:
            return f"{distribution} {metadata.version(distribution)}"
        except metadata.PackageNotFoundError:
            continue
    return ""


def vouched_code(
    original: str, replacement: str, replacement_class: type | None, converter: type
) -> dict[str, str]:
    """The code a verdict vouches for, by digest: the ``original`` modeling module's files
    and what this process binds of them, the ``replacement``'s module (outside layerswap:
    a plugin's, the user's own) and its resolved class (``None``: it cannot be resolved
    here, a GPU backend's on a CPU machine), and the ``converter`` class, likewise.

    Example::

        vouched_code("transformers.models.llama.modeling_llama",
                     "layerswap.backends.fused.decoder", FusedLlamaDecoderLayer, Converter)
    """
    return {
        "source": digest(original),
        "live_source": live_digest(original),
        "replacement_source": code_digest(replacement),
        "replacement_live": "" if replacement_class is None else class_digest(replacement_class),
        "converter_source": code_digest(converter.__module__),
        "converter_live": class_digest(converter),
    }
