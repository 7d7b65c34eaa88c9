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
import sys
import uuid
from pathlib import Path

from layerswap.hf_internals import SHARED_SOURCES

__all__ = ["code_digest", "digest", "files", "package_root"]


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
def files(module: str) -> tuple[Path, ...]:
    """The files whose content :func:`digest` covers for ``module``, sorted; empty when
    transformers or the module is not there."""
    root = package_root()
    if root is None:
        return ()
    own = _file_of(root, module)
    if own is None:
        return ()
    names = _imported(module, own.read_text(encoding="utf-8", errors="replace"))
    names.update(f"transformers.{name}" for name in SHARED_SOURCES)
    found = {own}
    for name in names:
        path = _file_of(root, name)
        if path is not None:
            found.add(path)
    return tuple(sorted(found))


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
    return [own_path] if own_path is not None else []


def _version_of(top: str) -> str:
    from importlib import metadata

    for distribution in metadata.packages_distributions().get(top, []):
        try:
            return f"{distribution} {metadata.version(distribution)}"
        except metadata.PackageNotFoundError:
            continue
    return ""
