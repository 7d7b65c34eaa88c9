"""Where behaviour proofs are kept: one small JSON file per (versions, substitution, config kind).

A proof (:mod:`layerswap.proof`) costs about a second; its verdict is stored on disk so
that it is paid once per transformers, torch and layerswap release and kind of config, not
per process. The directory is ``$LAYERSWAP_CACHE`` when set, else ``layerswap/proofs``
under the user cache directory (``$XDG_CACHE_HOME``, default ``~/.cache``). Files are
written whole (a temporary file renamed), so concurrent processes never read half a
verdict; a file that cannot be read or written is treated as absent (the proof runs again).

Example::

    from layerswap import verdicts

    verdicts.directory()                 # PosixPath('/home/me/.cache/layerswap/proofs')
    verdicts.read(key)                   # a dict, or None when not proven yet
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import os
import tempfile
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from layerswap.versions import __version__, transformers_version

__all__ = [
    "adopt",
    "collected",
    "directory",
    "key_for",
    "kept_together",
    "layerswap_digest",
    "read",
    "remember",
    "remembered",
    "stored",
    "versions",
    "write",
]


def directory() -> Path:
    """The directory verdicts live in (not created until one is written).

    Example::

        os.environ["LAYERSWAP_CACHE"] = "/tmp/proofs"; directory()   # PosixPath('/tmp/proofs')
    """
    moved = os.environ.get("LAYERSWAP_CACHE")
    if moved:
        return Path(moved).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "layerswap" / "proofs"


@functools.lru_cache(maxsize=1)
def layerswap_digest() -> str:
    """A digest of layerswap's own source: an edited layerswap is a new layerswap to prove.

    Reads the package's ``.py`` files once per process (about a millisecond).
    """
    root = Path(__file__).resolve().parent
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(path.relative_to(root).as_posix().encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def versions() -> dict[str, str]:
    """The versions a verdict holds for: transformers, torch, layerswap (and its source),
    and the kernel libraries a backend runs (Liger, TransformerEngine, Triton) where installed.

    Example::

        versions()   # {'transformers': '5.24.0', 'torch': '2.13.0+cpu', 'layerswap': ...}
    """
    import torch
    import transformers

    found = {
        "transformers": str(transformers.__version__),
        "torch": str(torch.__version__),
        "layerswap": f"{__version__}+{layerswap_digest()}",
    }
    # the kernels a backend's layers run, where installed: another release, other kernels
    found.update(_kernel_versions())
    return found


#: import name -> the distributions whose version counts (the import name is looked up
#: first: asking for a distribution that is not installed scans every path entry)
_KERNEL_DISTRIBUTIONS = {
    "liger_kernel": ("liger-kernel",),
    "transformer_engine": ("transformer-engine", "transformer-engine-torch"),
    "triton": ("triton",),
}


@functools.cache
def _kernel_versions() -> dict[str, str]:
    import importlib.util

    found = {}
    for module, distributions in _KERNEL_DISTRIBUTIONS.items():
        try:
            if importlib.util.find_spec(module) is None:
                continue
        except (ImportError, ValueError):
            continue
        for name in distributions:
            try:
                found[name] = importlib.metadata.version(name)
            except importlib.metadata.PackageNotFoundError:
                continue
    return found


def _path(key: str, kind: str | None = None) -> Path:
    base = directory() if kind is None else directory() / kind
    return base / f"{key}.json"


def key_for(*parts: str) -> str:
    """A file name for ``parts`` and the current :func:`versions`: a new release, a new key."""
    text = json.dumps([versions(), *parts], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def read(key: str, kind: str | None = None) -> dict[str, Any] | None:
    """The verdict stored under ``key``, or ``None`` (never proven, or unreadable).

    ``kind`` names a subdirectory for answers other than proofs (``"coverage"``), which
    :func:`stored` does not list.
    """
    try:
        data = json.loads(_path(key, kind).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def stored() -> list[dict[str, Any]]:
    """Every verdict in the directory (unreadable files left out)."""
    found = []
    for path in sorted(directory().glob("*.json")):
        data = read(path.stem)
        if data is not None:
            found.append(data)
    return found


def write(key: str, verdict: dict[str, Any], kind: str | None = None) -> bool:
    """Store ``verdict`` under ``key``, atomically; ``False`` when the directory is not
    writable (the verdict then holds for this process only)."""
    target = _path(key, kind)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        handle, temporary = tempfile.mkstemp(dir=target.parent, prefix=".", suffix=".tmp")
        with os.fdopen(handle, "w", encoding="utf-8") as stream:
            json.dump(verdict, stream, indent=1, sort_keys=True)
        os.replace(temporary, target)
    except OSError:
        return False
    return True


# --- answers about the installed transformers, kept per release -----------------------

_ANSWERS: dict[str, dict[str, Any]] = {}
_ANSWERS_LOCK = threading.Lock()
#: while :func:`kept_together` runs (its depth), and the kinds whose tables wait to be
#: written on leaving it
_TOGETHER: dict[str, Any] = {"depth": 0, "waiting": set()}
#: what each :func:`collected` block has been given to keep, innermost last
_COLLECTORS: list[dict[str, dict[str, Any]]] = []


def remembered(
    kind: str, key: str, compute: Callable[[], str | None], *, module: str | None = None
) -> str | None:
    """``compute()``, answered once per transformers release and layerswap source.

    What a backend says about a family from transformers' source (why its head cannot
    take a causal LM, why a tiny layer has an attention it cannot run) costs an import of
    the modeling module; the answer is kept on disk, one table per ``kind``, so that
    ``layerswap list`` imports no modeling module after the first time. ``module`` names
    the transformers module the answer reads: an edited file (its size or time changed)
    is asked again. ``key`` says what was asked (a family's declaration).

    Example::

        remembered("head", family_key, lambda: head_refusal(family), module=family.module)
    """
    stamp = _source_stamp(module) if module is not None else None
    with _ANSWERS_LOCK:
        table = _answers(kind)
        entry = table.get(key)
        if isinstance(entry, dict) and entry.get("stamp") == stamp and "answer" in entry:
            answer = entry["answer"]
            return answer if answer is None else str(answer)
    answer = compute()
    remember(kind, key, answer, module=module)
    return answer


def remember(kind: str, key: str, answer: str | None, *, module: str | None = None) -> None:
    """Keep ``answer`` as :func:`remembered` would have computed it (an answer computed in
    another process: the model types :mod:`layerswap.coverage` infers in forked ones)."""
    remember_all(kind, {key: (answer, module)})


def remember_all(kind: str, answers: Mapping[str, tuple[str | None, str | None]]) -> None:
    """:func:`remember` each ``key: (answer, module)`` of ``answers``, the table written
    once."""
    if not answers:
        return
    with _ANSWERS_LOCK:
        table = _answers(kind)
        for key, (answer, module) in answers.items():
            stamp = _source_stamp(module) if module is not None else None
            table[key] = {"answer": answer, "stamp": stamp}
            for collector in _COLLECTORS:
                collector.setdefault(kind, {})[key] = table[key]
        _keep(kind, table)


def _keep(kind: str, table: dict[str, Any]) -> None:
    """Write ``kind``'s table, or mark it waiting inside :func:`kept_together` (under
    ``_ANSWERS_LOCK``)."""
    if _TOGETHER["depth"]:
        _TOGETHER["waiting"].add(kind)
    else:
        write(_answers_key(kind), table, kind="answers")


@contextmanager
def collected() -> Iterator[dict[str, dict[str, Any]]]:
    """Within the block, every answer :func:`remember` keeps is also put in the dictionary
    this yields (``{kind: {key: entry}}``): what a forked process sends back to its parent,
    which keeps it with :func:`adopt`.

    Example::

        with verdicts.collected() as found:
            backend.unsupported(family, "norm")
        return found                              # in the parent: verdicts.adopt(found)
    """
    found: dict[str, dict[str, Any]] = {}
    with _ANSWERS_LOCK:
        _COLLECTORS.append(found)
    try:
        yield found
    finally:
        with _ANSWERS_LOCK:
            # by identity: two collectors may hold equal answers
            del _COLLECTORS[next(i for i, c in enumerate(_COLLECTORS) if c is found)]


def adopt(found: Mapping[str, Mapping[str, Any]]) -> None:
    """Keep the answers :func:`collected` gathered (in another process), as they were."""
    with _ANSWERS_LOCK:
        for kind, entries in found.items():
            if entries:
                table = _answers(kind)
                table.update(entries)
                _keep(kind, table)


@contextmanager
def kept_together() -> Iterator[None]:
    """Within the block, every answer :func:`remember` keeps waits in memory; on leaving
    it (an error too), each table that changed is written once.

    A table is one file written whole, so keeping answers one by one rewrites it once per
    answer: thousands of writes for ``layerswap list --all`` on a new transformers
    release. Answers are read back from memory meanwhile, so nothing is asked twice. A
    process forked inside the block writes nothing of its own (its parent keeps what it
    sends back).

    Example::

        with verdicts.kept_together():
            for family in families:
                backend.unsupported(family, "norm")   # each answer remembered, one write
    """
    with _ANSWERS_LOCK:
        _TOGETHER["depth"] += 1
        owner = os.getpid()
    try:
        yield
    finally:
        with _ANSWERS_LOCK:
            _TOGETHER["depth"] -= 1
            if not _TOGETHER["depth"] and os.getpid() == owner:
                waiting, _TOGETHER["waiting"] = _TOGETHER["waiting"], set()
                for kind in sorted(waiting):
                    write(_answers_key(kind), _answers(kind), kind="answers")


def _answers_key(kind: str) -> str:
    text = json.dumps([transformers_version(), layerswap_digest(), kind])
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _answers(kind: str) -> dict[str, Any]:
    """The table of ``kind``, read from disk once per process."""
    table = _ANSWERS.get(kind)
    if table is None:
        table = read(_answers_key(kind), kind="answers") or {}
        _ANSWERS[kind] = table
    return table


@functools.cache
def _distribution(name: str) -> importlib.metadata.Distribution | None:
    try:
        return importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _source_stamp(module: str) -> str | None:
    """The size and modification time of ``module``'s file, found without importing it."""
    distribution = _distribution(module.partition(".")[0])
    if distribution is None:
        return None
    try:
        path = Path(str(distribution.locate_file(module.replace(".", "/") + ".py")))
        status = path.stat()
    except (OSError, ValueError):
        return None
    return f"{status.st_size}:{status.st_mtime_ns}"
