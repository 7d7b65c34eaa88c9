"""A backend from another package joins through the ``layerswap.backends`` entry point.

``examples/third_party_backend`` is a real installable package; here it is put on the
path with a ``.dist-info`` holding the entry points its ``pyproject.toml`` declares (what
``pip install`` writes), and used in a fresh interpreter, as a user's process would.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

# the standard library's TOML reader arrived in Python 3.11
tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python 3.11+")

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "third_party_backend"


@pytest.fixture
def installed(tmp_path: Path) -> dict[str, str]:
    """An environment whose interpreter sees the example package as pip would install it."""
    project = tomllib.loads((EXAMPLE / "pyproject.toml").read_text())["project"]
    dist_info = tmp_path / f"{project['name'].replace('-', '_')}-{project['version']}.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: {project['version']}\n"
    )
    groups = project["entry-points"]
    (dist_info / "entry_points.txt").write_text(
        "".join(
            f"[{group}]\n" + "".join(f"{name} = {value}\n" for name, value in points.items())
            for group, points in groups.items()
        )
    )
    path = os.pathsep.join([str(tmp_path), str(EXAMPLE), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": path}


def _run(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args], env=env, capture_output=True, text=True, timeout=300, check=False
    )


@pytest.mark.slow  # installs a package
def test_an_installed_backend_covers_every_family_and_verifies(installed: dict[str, str]) -> None:
    script = textwrap.dedent(
        """
        import dataclasses

        import torch

        import layerswap

        backend = layerswap.get_backend("guarded")
        subs = layerswap.substitutions(backend="guarded")
        assert {s.family for s in subs} == set(layerswap.families()), subs
        assert all(s.slot == "decoder" for s in subs)

        # a family registered after the backend gets its substitution too
        later = dataclasses.replace(layerswap.get_family("llama"), name="llama-later")
        added = [s.name for s in layerswap.register_family(later)]
        assert "llama-later.decoder.guarded" in added, added

        model = layerswap.get_family("qwen3").build(seed=0)
        report = layerswap.verify(model, "qwen3.decoder.guarded")
        assert report.passed, report

        ids = torch.randint(0, model.config.vocab_size, (1, 8))
        with layerswap.swap(model, backend="guarded"):
            layer = model.model.layers[1]
            assert type(layer).__name__ == "GuardedQwen3DecoderLayer"
            with torch.no_grad():
                layer.mlp.down_proj.weight[0, 0] = float("nan")
            try:
                model(ids)
            except FloatingPointError as exc:
                assert "decoder layer 1" in str(exc), exc
            else:
                raise AssertionError("the guard did not stop the NaN")
        assert type(model.model.layers[1]).__name__ == "Qwen3DecoderLayer"
        print("ok")
        """
    )
    result = _run(installed, "-c", script)

    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.strip().endswith("ok")


@pytest.mark.slow  # installs a package
def test_the_cli_lists_and_verifies_an_installed_backend(installed: dict[str, str]) -> None:
    listed = _run(installed, "-m", "layerswap", "list", "--backend", "guarded")
    verified = _run(installed, "-m", "layerswap", "verify", "--model", "llama", "-b", "guarded")

    assert listed.returncode == 0, listed.stderr[-2000:]
    assert "llama.decoder.guarded" in listed.stdout
    assert verified.returncode == 0, verified.stderr[-2000:]
    assert "llama.decoder.guarded" in verified.stdout


@pytest.mark.slow  # installs a package
def test_without_the_package_the_backend_is_unknown_with_a_suggestion() -> None:
    result = _run(
        dict(os.environ),
        "-c",
        "import layerswap\n"
        "try:\n"
        "    layerswap.get_backend('guardd')\n"
        "except LookupError as exc:\n"
        "    print(exc)\n",
    )

    assert result.returncode == 0, result.stderr[-2000:]
    assert "no backend named 'guardd'" in result.stdout
    assert "Known: fused, liger, te." in result.stdout
