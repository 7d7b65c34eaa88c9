"""The ``layerswap`` command line, driven as a user drives it.

A few runs go through a real interpreter (``python -m layerswap``: exit codes, plugin
entry points, output to a pipe); the rest call :func:`layerswap.cli.main` in process,
which is the same code path minus the interpreter start.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from command_line import run
from models import swapped_layer_count, tiny_config
from typer.testing import CliRunner

from layerswap.cli import app
from layerswap.registry import families, get, get_family

FAMILIES = sorted(families())


def run_process(*args: str, pythonpath: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {key: value for key, value in os.environ.items() if key != "FORCE_COLOR"}
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(pythonpath), env.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, "-m", "layerswap", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


def logits_of(model: Any) -> torch.Tensor:
    ids = torch.arange(1, 13).reshape(2, 6)
    with torch.no_grad():
        return model(input_ids=ids).logits  # type: ignore[no-any-return]


# --- the main job, in a real interpreter ----------------------------------------------


@pytest.mark.slow  # full verification through the command line
def test_patch_llama_passes_and_prints_a_plain_table() -> None:
    result = run_process("patch", "--model", "llama")

    assert result.returncode == 0, result.stderr
    assert result.stderr == ""  # no progress display when stderr is not a terminal
    assert "\x1b" not in result.stdout  # no colour codes into a pipe
    lines = result.stdout.splitlines()
    assert lines[0] == (
        "patch: llama.decoder.fused (4 layers swapped: LlamaDecoderLayer -> FusedLlamaDecoderLayer)"
    )
    for index in range(4):
        row = next(line for line in lines if f"model.layers.{index} " in line)
        assert row.rstrip().endswith("PASS")
    assert lines[-1] == "PASS: the swapped model matches the original"


PLUGIN = """
    import dataclasses

    import layerswap

    _FUSED = layerswap.get("llama.decoder.fused")


    class BrokenLayer(_FUSED.replacement_class()):
        # a bug in one layer only: layer 2's output projection is 1% too large
        def __init__(self, config, layer_idx):
            super().__init__(config, layer_idx)
            if layer_idx == 2:
                self.self_attn.o_proj.register_forward_hook(lambda m, a, out: out * 1.01)


    BROKEN = dataclasses.replace(
        _FUSED, name="llama.decoder.broken", backend="broken", replacement=BrokenLayer
    )
"""


@pytest.fixture
def broken_plugin(tmp_path: Path) -> Path:
    """A directory holding an installed-looking plugin that registers a broken substitution."""
    (tmp_path / "broken_layerswap_plugin.py").write_text(textwrap.dedent(PLUGIN))
    info = tmp_path / "broken_layerswap_plugin-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: broken-layerswap-plugin\nVersion: 0.1\n"
    )
    (info / "entry_points.txt").write_text(
        "[layerswap.substitutions]\nbroken = broken_layerswap_plugin:BROKEN\n"
    )
    return tmp_path


@pytest.mark.slow  # full verification through the command line
def test_broken_substitution_from_a_plugin_fails_with_exit_1_naming_layer_2_saving_nothing(
    broken_plugin: Path,
) -> None:
    out = broken_plugin / "out"
    result = run_process(
        "patch",
        "--substitution",
        "llama.decoder.broken",
        "--save",
        str(out),
        pythonpath=broken_plugin,
    )

    assert result.returncode == 1, result.stderr
    layer_2 = next(line for line in result.stdout.splitlines() if "model.layers.2 " in line)
    assert "FAIL" in layer_2 and "first divergent layer" in layer_2
    layer_1 = next(line for line in result.stdout.splitlines() if "model.layers.1 " in line)
    assert "PASS" in layer_1
    assert (
        "FAIL: llama.decoder.broken does not match the original: first divergent layer: 2 (model.layers.2)"
        in result.stdout
    )
    assert f"not saved to {out}: verification failed" in result.stdout
    assert not out.exists()


def test_console_script_is_declared() -> None:
    scripts = importlib.metadata.entry_points(group="console_scripts", name="layerswap")
    assert [script.value for script in scripts] == ["layerswap.cli:main"]


# --- patch, in process -------------------------------------------------------------------


@pytest.mark.one_family  # the command is the same for every family
@pytest.mark.parametrize("family", FAMILIES)
def test_patch_passes_for_every_family(capsys: pytest.CaptureFixture[str], family: str) -> None:
    code, out, err = run(capsys, "patch", "--model", family, "--json")

    assert code == 0, err
    report = json.loads(out)  # nothing but JSON on stdout
    assert report["passed"] is True
    assert report["substitution"] == f"{family}.decoder.fused"
    assert report["verification"]["first_divergent_layer"] is None
    assert report["model"]["layers"] == tiny_config(family).get_text_config().num_hidden_layers
    assert len(report["swapped"]) == swapped_layer_count(tiny_config(family))
    assert report["swapped"][0]["replacement"].startswith("Fused")


def test_patch_without_verification_only_swaps(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "patch", "-m", "mistral", "--no-verify", "--json")

    assert code == 0
    assert json.loads(out)["verification"] is None


def test_patch_with_bench_adds_timings(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "patch", "-m", "llama", "--bench")

    assert code == 0
    assert "forward+backward (ms)" in out
    assert "PASS: the swapped model matches the original" in out


def test_save_writes_the_original_layout_for_plain_transformers(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM

    code, out, err = run(capsys, "patch", "-m", "qwen3", "--seed", "3", "--save", str(tmp_path))

    assert code == 0, err
    assert f"saved the swapped model in the original layout to {tmp_path}" in out
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)  # no layerswap involved
    assert type(loaded.model.layers[0]).__name__ == "Qwen3DecoderLayer"
    original = get_family("qwen3").build(seed=3)
    assert torch.equal(logits_of(loaded), logits_of(original))


def test_model_dir_loads_a_local_checkpoint(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    family = get_family("llama")
    checkpoint = family.build(family.tiny_config(num_hidden_layers=2), seed=7)
    checkpoint.save_pretrained(tmp_path / "checkpoint")
    saved = tmp_path / "saved"

    code, out, err = run(
        capsys, "patch", "--config", str(tmp_path / "checkpoint"), "--save", str(saved), "--json"
    )

    assert code == 0, err
    report = json.loads(out)
    assert report["substitution"] == "llama.decoder.fused"  # family from config.json
    assert report["model"]["layers"] == 2
    assert report["model"]["source"] == f"checkpoint {tmp_path / 'checkpoint'}"
    round_trip = type(checkpoint).from_pretrained(saved)
    assert torch.equal(logits_of(round_trip), logits_of(checkpoint))


def test_config_json_builds_that_shape_with_random_weights(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    path = tmp_path / "small.json"
    get_family("qwen2").tiny_config(num_hidden_layers=3, hidden_size=64).to_json_file(path)

    code, out, err = run(capsys, "verify", "-m", "qwen2", "--config", str(path), "--json")

    assert code == 0, err
    report = json.loads(out)
    assert len(report["layers"]) == 3 and report["passed"] is True


# --- verify and bench, in process ------------------------------------------------------


def test_verify_compares_backward_and_generation(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "verify", "-m", "qwen3", "--backward", "--generate", "2")

    assert code == 0, err
    assert "backward (whole model):" in out
    assert "cached decoding: 2 greedy tokens with the KV cache, agreement 100%" in out


def test_verify_streaming_reports_its_mode(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "verify", "-m", "llama", "--streaming", "--backward", "--json")

    assert code == 0
    report = json.loads(out)
    assert report["mode"] == "streaming" and report["backward"]["local"] is True


def test_verify_tolerance_option_overrides_the_default(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, _ = run(capsys, "verify", "-m", "llama", "--tolerance", "0.5", "--json")

    assert code == 0
    assert json.loads(out)["tolerance"]["rtol"] == 0.5


def test_bench_json_has_both_models(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(
        capsys, "bench", "-m", "llama", "--batch", "1", "--seq", "4", "--steps", "1",
        "--warmup", "0", "--no-backward", "--json",
    )  # fmt: skip

    assert code == 0
    report = json.loads(out)
    assert report["substitution"] == "llama.decoder.fused"
    assert report["original"]["forward_backward_ms"] is None
    assert report["swapped"]["forward_ms"] > 0


# --- list and doctor ---------------------------------------------------------------------


def test_list_shows_every_substitution_and_why_it_cannot_run() -> None:
    result = CliRunner().invoke(app, ["list"])

    assert result.exit_code == 0
    for family in FAMILIES:
        assert f"{family}.decoder.fused" in result.stdout
    te = get("llama.decoder.te")
    reason = te.unmet_requirement()
    if reason is not None:
        assert f"no: {reason}" in result.stdout


def test_list_json_filters_by_family() -> None:
    result = CliRunner().invoke(app, ["list", "--family", "qwen2", "--json"])

    rows = json.loads(result.stdout)
    assert {row["family"] for row in rows} == {"qwen2"}
    fused = next(row for row in rows if row["backend"] == "fused")
    assert fused == {
        "name": "qwen2.decoder.fused",
        "family": "qwen2",
        "backend": "fused",
        "usable": True,
        "reason": None,
        "description": get("qwen2.decoder.fused").description,
    }


def test_doctor_reports_versions_and_backends() -> None:
    result = CliRunner().invoke(app, ["doctor", "--json"])

    assert result.exit_code == 0
    report = json.loads(result.stdout)
    components = {row["component"]: row["status"] for row in report["environment"]}
    assert components["torch"] == torch.__version__
    assert set(components) >= {"python", "transformers", "CUDA", "TransformerEngine"}
    assert report["backends"]["fused"] == {"usable": True, "reason": None}
    assert report["backends"]["te"]["usable"] is (
        get("llama.decoder.te").unmet_requirement() is None
    )


# --- usage and environment problems: exit 2, one line -------------------------------------


NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["patch", "--model", "qwen"], "unknown model family 'qwen'; did you mean"),
        (["patch", "--model", "llama", "--config", "/no/such/dir"], "no such file or directory"),
        (["patch", "--model", "llama", "--dtype", "float64"], "unknown dtype 'float64'"),
        (["patch", "--model", "llama", "--device", "tpu"], "unknown device 'tpu'"),
        (["patch", "--model", "llama", "--backend", "triton"], "no 'triton' substitution"),
        (["patch", "--substitution", "llama.decoder.fusd"], "did you mean 'llama.decoder.fused'"),
        (["patch"], "--model is required"),
        (["patch", "--model", "llama", "--frobnicate"], "No such option: --frobnicate"),
        (["bench", "--model", "llama", "--steps", "0"], "Invalid value for '--steps'"),
        (["verify", "--model", "llama", "--streaming", "--generate", "2"], "streaming=False"),
        (["nonsense"], "No such command 'nonsense'"),
        pytest.param(
            ["patch", "--model", "llama", "--device", "cuda"],
            "CUDA was requested but is not available",
            marks=NO_CUDA,
        ),
        pytest.param(
            ["patch", "--model", "llama", "--backend", "te"],
            "llama.decoder.te cannot run here",
            marks=pytest.mark.skipif(
                get("llama.decoder.te").unmet_requirement() is None, reason="te can run here"
            ),
        ),
        (["patch", "--model", "llama", "--fp8"], "--fp8 runs TransformerEngine layers"),
        pytest.param(
            ["verify", "--model", "qwen2", "--backend", "te", "--fp8", "--fp8-recipe", "current"],
            "qwen2.decoder.te_fp8 cannot run here",
            marks=pytest.mark.skipif(
                get("qwen2.decoder.te_fp8").unmet_requirement() is None, reason="fp8 runs here"
            ),
        ),
    ],
)
def test_usage_problems_exit_2_with_one_line(
    capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    code, out, err = run(capsys, *args)

    assert code == 2
    assert out == ""
    assert len(err.splitlines()) == 1, err
    assert err.startswith("layerswap: error: ")
    assert message in err


def test_config_of_another_family_is_refused(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    path = tmp_path / "qwen2.json"
    get_family("qwen2").tiny_config().to_json_file(path)

    code, _, err = run(capsys, "patch", "--model", "llama", "--config", str(path))

    assert code == 2
    assert "describes a 'qwen2' model, not llama" in err


def test_directory_without_config_is_refused(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    code, _, err = run(capsys, "patch", "--model", "llama", "--config", str(tmp_path))

    assert code == 2
    assert "directory has no config.json" in err


def test_bare_command_prints_help(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys)

    assert code == 0
    for command in ("list", "patch", "verify", "bench", "doctor"):
        assert command in out


def test_bad_options_and_files_are_one_line_and_exit_2(tmp_path: Path, capsys: Any) -> None:
    """Each used to give a traceback, or to be ignored while the command ran anyway."""
    not_json = tmp_path / "notes.txt"
    not_json.write_text("no json here")
    a_list = tmp_path / "list.json"
    a_list.write_text("[1, 2]")
    invalid = tmp_path / "invalid.json"
    invalid.write_text(
        json.dumps({**get_family("llama").tiny_config().to_dict(), "num_attention_heads": 7})
    )
    cases = [
        (["patch", "--model", "llama", "--device", "cuda:x"], "unknown device 'cuda:x'"),
        (
            ["patch", "--substitution", "llama.decoder.fused", "--backend", "te"],
            "--substitution llama.decoder.fused names its backend",
        ),
        (["patch", "--model", "llama", "--fp8-recipe", "delayed"], "add --fp8 to use it"),
        (["list", "--backend", "fusde"], "no backend named 'fusde'; did you mean 'fused'"),
        (["coverage", str(not_json)], "not a readable config JSON"),
        (["coverage", str(a_list)], "a config is a JSON object, not list"),
        (["coverage", str(invalid)], "invalid config: "),
        (["patch", "--config", str(invalid)], "cannot read config"),
        (["coverage", str(tmp_path)], "a directory without a config.json"),
        (["verify", "--model", "llama", "--tolerance", "inf"], "takes a finite number"),
        (
            ["patch", "--model", "llama", "--save", str(not_json / "model")],
            "notes.txt is a file, not a directory",
        ),
    ]
    for args, message in cases:
        code, out, err = run(capsys, *args)
        assert code == 2 and message in err, (args, out, err)
        assert "Traceback" not in err


def test_a_device_name_is_read_whatever_its_case(capsys: Any) -> None:
    code, out, err = run(capsys, "patch", "--model", "llama", "--device", " CPU ", "--no-verify")
    assert code == 0, err
    assert "device: cpu" in out


def test_an_adapter_directory_that_is_no_adapter_is_one_line_and_never_looked_up(
    tmp_path: Path, capsys: Any
) -> None:
    """Read as a local directory, never resolved on the Hub: each fault said in one line."""
    cases = {
        "broken": ("{", "not readable JSON"),
        "a_list": ("[1]", "no PEFT adapter config"),
        "no_type": ('{"r": 8}', "no PEFT adapter config"),
        "no_weights": ('{"peft_type": "LORA", "r": 8}', "no weights file"),
    }
    for name, (text, message) in cases.items():
        directory = tmp_path / name
        directory.mkdir()
        (directory / "adapter_config.json").write_text(text)
        code, out, err = run(capsys, "adapter", str(directory), "--model", "llama")
        assert code == 2 and message in err and "Traceback" not in err, (name, out, err)
    code, _, err = run(capsys, "adapter", str(tmp_path), "--model", "llama")
    assert code == 2 and "no adapter_config.json" in err
