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
from edited_transformers import edited_transformers
from fresh import run_json

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
    assert "(known: fused, liger, te)" in result.stdout


# issue 38, item 7: on transformers 5.18 (inside the supported range; apertus1p5 arrived
# later) registering this backend, whose replacement reads family.decoder_class(), raised
# UpstreamDriftError for apertus1p5, a family nobody asked for
LACKING = {
    # the release before the family arrived: its models/ directory is not there
    "module": {"models/apertus1p5": None},
    # its module is there, its decoder layer class under another name
    "class": {
        "models/apertus1p5/modeling_apertus1p5.py": lambda text: text.replace(
            "Apertus1p5TextDecoderLayer", "Apertus1p5TextLayer"
        )
    },
}

REGISTERING = """
    import json

    import layerswap
    from layerswap.errors import LayerswapError
    from layerswap.registry import offers
    from layerswap_guarded import BACKEND

    offered = [offer.name for offer in layerswap.register_backend(BACKEND)]
    try:
        layerswap.get("apertus1p5.decoder.guarded")
        error = None
    except LayerswapError as exc:
        error = str(exc)
    listed = {o.name: o.unmet_requirement() for o in offers(family="apertus1p5")}
    try:  # every one listed is made: a family with a missing class fails here
        made = sorted(s.family for s in layerswap.substitutions(backend="guarded"))
    except LayerswapError as exc:
        made = str(exc)
    print(json.dumps({
        "offered": offered,
        "error": error,
        "llama": layerswap.get("llama.decoder.guarded").replacement_class().__name__,
        "listed": listed,
        "made": made,
    }))
"""


@pytest.mark.slow  # a fresh interpreter on an edited copy of transformers
@pytest.mark.parametrize("lacking", list(LACKING))
def test_registering_a_backend_never_fails_for_a_family_the_release_lacks(
    lacking: str, tmp_path: Path
) -> None:
    from transformers import __version__ as version

    site = edited_transformers(tmp_path, LACKING[lacking])

    found = run_json(REGISTERING, tmp_path / "cache", path=[site, EXAMPLE])

    assert {"apertus1p5.decoder.guarded", "llama.decoder.guarded"} <= set(found["offered"])
    assert found["llama"] == "GuardedLlamaDecoderLayer"
    # the substitution asked for by name fails, naming the family and the release
    assert found["error"] is not None
    assert "apertus1p5" in found["error"] and f"transformers {version}" in found["error"]
    if lacking == "module":
        # listed as absent, with the reason; never made
        assert found["listed"]["apertus1p5.decoder.guarded"] == (
            f"transformers {version} has no apertus1p5 model "
            "(no transformers.models.apertus1p5.modeling_apertus1p5)"
        )
        assert "apertus1p5" not in found["made"] and "llama" in found["made"]
