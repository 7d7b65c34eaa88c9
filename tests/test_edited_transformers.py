"""The helper that makes another transformers release out of the installed one
(tests/edited_transformers.py): what it leaves out is gone, what it edits is a real file,
the rest is the installed release's, and its mistakes are refused."""

from __future__ import annotations

from pathlib import Path

import pytest
from edited_transformers import edited_transformers, installed_transformers

MODELING = "models/llama/modeling_llama.py"


def _renamed(text: str) -> str:
    return text.replace("LlamaDecoderLayer", "LlamaLayer")


def test_the_copy_leaves_out_edits_and_links_the_rest(tmp_path: Path) -> None:
    installed = installed_transformers()

    site = edited_transformers(tmp_path, {"models/apertus1p5": None, MODELING: _renamed})

    copy = site / "transformers"
    assert not (copy / "models" / "apertus1p5").exists()
    edited = copy / MODELING
    assert not edited.is_symlink() and "class LlamaLayer(" in edited.read_text()
    assert (installed / MODELING).read_text().count("class LlamaDecoderLayer(") == 1
    assert (copy / "__init__.py").resolve() == (installed / "__init__.py").resolve()
    assert (copy / "models" / "qwen3" / "modeling_qwen3.py").is_symlink()
    assert not list(copy.rglob("__pycache__"))
    assert list(site.glob("transformers-*.dist-info/METADATA"))


@pytest.mark.parametrize(
    ("edits", "error"),
    [
        ({"models/no_such_family": None}, FileNotFoundError),
        ({"models/llama": _renamed}, IsADirectoryError),
        ({MODELING: lambda text: text}, ValueError),
    ],
    ids=["missing-path", "directory-edited", "edit-changes-nothing"],
)
def test_an_edit_that_cannot_mean_anything_is_refused(
    tmp_path: Path, edits: dict[str, object], error: type[Exception]
) -> None:
    with pytest.raises(error):
        edited_transformers(tmp_path, edits)  # type: ignore[arg-type]
