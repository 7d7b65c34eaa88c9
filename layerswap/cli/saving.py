"""``--save DIR``: checked before any work, written whole or not at all.

The directory is checked first (before a model is built): it must be new or empty, or
hold only a saved model's files and come with ``--overwrite``; its parent must be
writable. The model is then written to a temporary directory beside it and renamed into
place once complete, so an interrupted save (Ctrl-C, a full disk) leaves the directory
as it was. With ``--overwrite`` the old directory is replaced whole: no stale shard or
index of the previous model survives.
"""

from __future__ import annotations

import contextlib
import fnmatch
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from layerswap.cli.problems import UsageProblem

if TYPE_CHECKING:
    import torch

__all__ = ["SaveTarget", "save_target"]

#: what ``save_pretrained`` (and a tokenizer's) writes: the files --overwrite may replace
_MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "*.safetensors",
    "*.safetensors.index.json",
    "pytorch_model*.bin",
    "pytorch_model.bin.index.json",
    "tokenizer*",
    "special_tokens_map.json",
    "vocab.*",
    "merges.txt",
    "chat_template.*",
)


@dataclass(frozen=True)
class SaveTarget:
    """Where ``--save`` writes, checked: ``replaces`` when an old model is there."""

    path: Path
    replaces: bool

    def write(self, model: Any, dtype: torch.dtype | None) -> None:
        """``model.save_pretrained`` into a temporary directory, then renamed into place.

        ``dtype`` (the checkpoint's own, when the model came from one) is the dtype the
        weights are written in; the model is cast back afterwards.
        """
        parent = self.path.absolute().parent
        parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{self.path.name}.partial-", dir=parent))
        umask = os.umask(0)
        os.umask(umask)
        staging.chmod(0o777 & ~umask)  # mkdtemp's 0700 would be the saved directory's mode
        try:
            with _in_dtype(model, dtype):
                model.save_pretrained(staging)
            if self.replaces:
                old = Path(tempfile.mkdtemp(prefix=f".{self.path.name}.old-", dir=parent))
                os.replace(self.path, old / "model")
                os.replace(staging, self.path)
                shutil.rmtree(old, ignore_errors=True)
            else:
                if self.path.exists():  # an empty directory
                    self.path.rmdir()
                os.replace(staging, self.path)
        finally:
            shutil.rmtree(staging, ignore_errors=True)


@contextlib.contextmanager
def _in_dtype(model: Any, dtype: torch.dtype | None) -> Any:
    current = next((p.dtype for p in model.parameters() if p.is_floating_point()), None)
    if dtype is None or current is None or dtype == current:
        yield
        return
    model.to(dtype)
    try:
        yield
    finally:
        model.to(current)


def save_target(path: Path, overwrite: bool) -> SaveTarget:
    """Check ``--save PATH`` before any work; a usage problem says what is wrong."""
    path = path.expanduser()
    if path.exists() and not path.is_dir():
        raise UsageProblem(f"--save {path}: exists and is not a directory")
    entries = sorted(p.name for p in path.iterdir()) if path.is_dir() else []
    if entries and not overwrite:
        raise UsageProblem(
            f"--save {path}: directory is not empty ({_some(entries)}); pass --overwrite "
            "to replace the model saved there, or choose a new directory"
        )
    if entries:
        foreign = [name for name in entries if not _is_model_file(path / name)]
        if foreign:
            raise UsageProblem(
                f"--save {path} --overwrite: the directory holds files that are not a "
                f"saved model's ({_some(foreign)}); --overwrite replaces only a model "
                "directory"
            )
    parent = path.absolute().parent
    existing = parent
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise UsageProblem(f"--save {path}: {existing} is a file, not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UsageProblem(f"--save {path}: cannot write in {existing} (permission denied)")
    return SaveTarget(path, replaces=bool(entries))


def _is_model_file(path: Path) -> bool:
    return path.is_file() and any(fnmatch.fnmatch(path.name, p) for p in _MODEL_FILES)


def _some(names: list[str]) -> str:
    shown = ", ".join(names[:3])
    return shown + (f" and {len(names) - 3} more" if len(names) > 3 else "")
