"""A copy of the installed transformers with some files edited or left out: another
release, as far as the code under test can tell, without installing one.

The copy is a mirror: real directories, every file a symlink to the installed one (no
``__pycache__``), so it costs a fraction of a second and no disk; only the edited files are real
copies. Its ``.dist-info`` is mirrored beside it, so ``importlib.metadata`` (the version,
a module's file found without importing it) answers from the copy too. Put the returned
directory first on ``PYTHONPATH`` of a fresh interpreter (``fresh.run_json(...,
path=[...])``): the process imports the copy, and the installed transformers is untouched.

Example::

    from edited_transformers import edited_transformers
    from fresh import run_json

    # a release without the apertus1p5 family, and with Llama's decoder layer renamed
    site = edited_transformers(tmp_path, {
        "models/apertus1p5": None,
        "models/llama/modeling_llama.py": lambda text: text.replace(
            "LlamaDecoderLayer", "LlamaLayer"),
    })
    run_json("import json, layerswap; ...", tmp_path / "cache", path=[site])

An edit should leave the module importable: a class deleted while another line of its
module still names it is a ``NameError`` at import, not a release that lacks it.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable, Mapping
from pathlib import Path

__all__ = ["Edit", "edited_transformers", "installed_transformers"]

#: a file's new text from its text; ``None`` in place of an edit leaves the path (a file
#: or a whole directory) out of the copy
Edit = Callable[[str], str]


def installed_transformers() -> Path:
    """The installed transformers package directory, found without importing it."""
    spec = importlib.util.find_spec("transformers")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("transformers is not installed")
    return Path(next(iter(spec.submodule_search_locations)))


def edited_transformers(directory: Path, edits: Mapping[str, Edit | None]) -> Path:
    """A mirror of the installed transformers under ``directory / "site"`` with ``edits``
    applied; the directory to put first on ``PYTHONPATH``.

    ``edits`` maps a path relative to the package (``"models/llama/modeling_llama.py"``)
    to a function of the file's text giving its new text, or to ``None`` to leave that
    file or directory out. A path that is not in the installed release raises, and so
    does an edit that changes nothing: a test that edits nothing tests nothing.
    """
    package = installed_transformers()
    site = directory / "site"
    if site.exists():
        raise FileExistsError(f"{site} exists: one copy per directory (a test's tmp_path)")
    for relative, edit in edits.items():
        if not (package / relative).exists():
            raise FileNotFoundError(f"transformers {package} has no {relative}")
        if edit is not None and not (package / relative).is_file():
            raise IsADirectoryError(f"{relative} is a directory: only None leaves it out")
    left_out = {package / relative for relative, edit in edits.items() if edit is None}
    _mirror(package, site / package.name, left_out)
    for dist_info in package.parent.glob(f"{package.name}-*.dist-info"):
        _mirror(dist_info, site / dist_info.name, set())
    for relative, edit in edits.items():
        if edit is None:
            continue
        original = (package / relative).read_text()
        text = edit(original)
        if text == original:
            raise ValueError(f"the edit of {relative} changes nothing")
        copy = site / package.name / relative
        copy.unlink()
        copy.write_text(text)
    return site


def _mirror(source: Path, target: Path, left_out: set[Path]) -> None:
    """``target`` as ``source``'s tree: real directories, files as symlinks, ``left_out``
    paths and ``__pycache__`` skipped."""
    for root, dirs, files in os.walk(source):
        here = Path(root)
        dirs[:] = [d for d in dirs if d != "__pycache__" and here / d not in left_out]
        mirrored = target / here.relative_to(source)
        mirrored.mkdir(parents=True, exist_ok=True)
        for name in files:
            if here / name not in left_out:
                (mirrored / name).symlink_to(here / name)
