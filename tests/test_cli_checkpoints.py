"""A user's own checkpoint through the command line: every fault is one line and exit 2.

A checkpoint that would load partly random, a file that cannot be read, a tensor of the
wrong shape, a ``--save`` that would clobber another model or fail late: each is refused
before anything is written, in one line on stderr that names the tensor or the file. The
faults in checkpoints run through a real interpreter (``python -m layerswap``), the
rest in process (the same code path minus the interpreter start).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from command_line import run
from safetensors.torch import load_file, save_file

from layerswap.registry import get_family

TENSOR = "model.layers.1.mlp.down_proj.weight"


def run_process(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {key: value for key, value in os.environ.items() if key != "FORCE_COLOR"}
    return subprocess.run(
        [sys.executable, "-m", "layerswap", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd,
        timeout=300,
    )


def checkpoint(directory: Path, family: str = "llama", dtype: torch.dtype | None = None) -> Any:
    found = get_family(family)
    model = found.build(found.tiny_config(num_hidden_layers=2), seed=5)
    if dtype is not None:
        model = model.to(dtype)
    model.save_pretrained(directory)
    return model


def files_in(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def one_error_line(err: str) -> str:
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("layerswap: error: ")
    return lines[0]


# --- faults in the checkpoint, through a real interpreter --------------------------------


def drop_tensor(directory: Path) -> None:
    tensors = load_file(directory / "model.safetensors")
    del tensors[TENSOR]
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})


def truncate(directory: Path) -> None:
    path = directory / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def reshape(directory: Path) -> None:
    tensors = load_file(directory / "model.safetensors")
    tensors[TENSOR] = torch.zeros(3, 5)
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.slow  # a fresh interpreter per fault
@pytest.mark.parametrize(
    ("damage", "expected"),
    [
        (drop_tensor, f"lacks 1 tensor the model needs, so the model would be partly random: {TENSOR} (not in model.safetensors)"),
        (truncate, "model.safetensors is not a readable safetensors file (truncated or corrupt?)"),
        (reshape, f"tensor {TENSOR} has shape (3, 5) in model.safetensors, but the config gives (128, 256)"),
    ],
    ids=["missing-tensor", "truncated-file", "wrong-shape"],
)  # fmt: skip
def test_a_faulty_checkpoint_is_refused_in_one_line_and_nothing_is_saved(
    tmp_path: Path, damage: Any, expected: str
) -> None:
    checkpoint(tmp_path / "ckpt")
    damage(tmp_path / "ckpt")

    done = run_process("patch", "--config", "ckpt", "--save", "out", cwd=tmp_path)

    assert done.returncode == 2, done.stderr
    assert done.stdout == ""
    assert expected in one_error_line(done.stderr)
    assert not (tmp_path / "out").exists()


def test_library_load_refuses_a_checkpoint_that_would_be_partly_random(tmp_path: Path) -> None:
    from transformers import LlamaForCausalLM

    from layerswap import load_checkpoint
    from layerswap.errors import CheckpointError

    original = checkpoint(tmp_path)
    assert torch.equal(
        load_checkpoint(LlamaForCausalLM, tmp_path).lm_head.weight, original.lm_head.weight
    )
    drop_tensor(tmp_path)
    with pytest.raises(CheckpointError, match=TENSOR):
        load_checkpoint(LlamaForCausalLM, tmp_path)


def test_an_index_naming_an_absent_shard_is_refused(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    found = get_family("llama")
    model = found.build(found.tiny_config(num_hidden_layers=2), seed=5)
    model.save_pretrained(tmp_path, max_shard_size="200KB")
    shards = sorted(tmp_path.glob("model-*.safetensors"))
    assert len(shards) > 1
    shards[-1].unlink()

    code, out, err = run(capsys, "patch", "--config", str(tmp_path))

    assert code == 2 and out == ""
    assert f"names {shards[-1].name}, which {tmp_path} does not have" in one_error_line(err)


# --- --save: the checkpoint's dtype, checked first, whole or nothing ---------------------


def test_save_keeps_the_checkpoints_dtype_and_says_which_dtype_was_verified(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM

    original = checkpoint(tmp_path / "ckpt", dtype=torch.bfloat16)

    code, out, err = run(
        capsys, "patch", "--config", str(tmp_path / "ckpt"), "--save", str(tmp_path / "out")
    )

    assert code == 0, err
    assert "device: cpu, float32 (--dtype; the checkpoint's weights are bfloat16)" in out
    assert f"to {tmp_path / 'out'} (bfloat16)" in out
    assert json.loads((tmp_path / "out" / "config.json").read_text())["dtype"] == "bfloat16"
    saved = load_file(tmp_path / "out" / "model.safetensors")
    assert {t.dtype for t in saved.values()} == {torch.bfloat16}
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    for name, tensor in original.state_dict().items():
        assert torch.equal(reloaded.state_dict()[name], tensor), name
    assert oct((tmp_path / "out").stat().st_mode & 0o777) != oct(0o700)


def test_save_into_a_non_empty_directory_is_refused_before_any_work(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    checkpoint(tmp_path / "qwen3", family="qwen3")
    before = files_in(tmp_path / "qwen3")

    code, out, err = run(capsys, "patch", "-m", "llama", "--save", str(tmp_path / "qwen3"))

    assert code == 2 and out == ""
    assert "directory is not empty" in one_error_line(err) and "--overwrite" in err
    assert files_in(tmp_path / "qwen3") == before


def test_overwrite_replaces_the_old_model_whole(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    target = tmp_path / "out"
    found = get_family("qwen3")
    found.build(found.tiny_config(num_hidden_layers=2), seed=1).save_pretrained(
        target, max_shard_size="200KB"
    )
    assert (target / "model.safetensors.index.json").exists()

    code, _, err = run(capsys, "patch", "-m", "llama", "--save", str(target), "--overwrite")

    assert code == 0, err
    assert sorted(p.name for p in target.iterdir()) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
    ]  # no stale shards or index of the old model
    assert json.loads((target / "config.json").read_text())["model_type"] == "llama"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no leftovers


def test_overwrite_refuses_a_directory_that_is_not_a_model(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    (tmp_path / "notes.txt").write_text("mine")

    code, _, err = run(capsys, "patch", "-m", "llama", "--save", str(tmp_path), "--overwrite")

    assert code == 2
    assert "holds files that are not a saved model's (notes.txt)" in one_error_line(err)
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_save_where_nothing_can_be_written_is_refused_before_any_work(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    (tmp_path / "a-file").write_text("")

    code, _, err = run(capsys, "patch", "-m", "llama", "--save", str(tmp_path / "a-file" / "out"))

    assert code == 2
    assert f"{tmp_path / 'a-file'} is a file, not a directory" in one_error_line(err)


def test_an_interrupted_save_leaves_nothing_behind(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers import PreTrainedModel

    from layerswap import peft_targets

    # layerswap's own save_pretrained advice (armed by the first swap) goes on first, as in
    # any later run: the stand-in below wraps it, and each is undone in its own order
    peft_targets.guard()
    real_save = PreTrainedModel.save_pretrained

    def interrupted(self: Any, directory: Any, *args: Any, **kwargs: Any) -> None:
        real_save(self, directory, *args, **kwargs)  # config and weights written, then ^C
        raise KeyboardInterrupt

    monkeypatch.setattr(PreTrainedModel, "save_pretrained", interrupted)

    code, _, _ = run(capsys, "patch", "-m", "llama", "--save", str(tmp_path / "out"))

    assert code == 130
    assert list(tmp_path.iterdir()) == []


# --- names and paths where the other was expected ----------------------------------------


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["patch", "--model", "deepseek_v3"], "no family covers deepseek_v3's decoder layers ("),
        (["patch", "--model", "xlnet"], "xlnet is a transformers model type that layerswap does not cover: "),
        (["patch", "--model", "llava"], "llava is a multimodal wrapper whose language model the llama family covers; "),
        (["coverage", "llava"], "pass --model llama (or --substitution llama.decoder.fused)"),
        (["patch", "--model", "./nope"], "--model takes a family name, not a path (./nope: no such file or directory)"),
        (["coverage", "./nope"], "./nope: no such file or directory"),
        (["patch", "--overwrite", "-m", "llama"], "--overwrite applies to --save"),
    ],
)  # fmt: skip
def test_names_and_paths_mixed_up_get_one_line_saying_what_to_pass(
    capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    code, out, err = run(capsys, *args)

    assert code == 2 and out == ""
    assert message in one_error_line(err)


def test_a_refused_family_gives_coverages_reason() -> None:
    from layerswap.cli.models import find_family
    from layerswap.cli.problems import UsageProblem
    from layerswap.coverage import why_not_covered

    with pytest.raises(UsageProblem) as refused:
        find_family("deepseek_v3")
    assert why_not_covered("deepseek_v3") in str(refused.value)
    assert "multi-head latent attention" in str(refused.value)
    # the slots below its decoder layers take it: the message names their substitutions
    for slot in ("norm", "mlp", "experts", "qkv", "head"):
        assert f"deepseek_v3.{slot}.fused" in str(refused.value), slot
    assert "--substitution" in str(refused.value)
    with pytest.raises(UsageProblem) as nothing:  # nothing of XLNet's causal LM is swapped
        find_family("xlnet")
    assert str(nothing.value).endswith(why_not_covered("xlnet"))


def test_a_checkpoint_directory_given_to_model_is_taken_as_config(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    checkpoint(tmp_path / "ckpt", family="qwen3")

    code, out, err = run(capsys, "patch", "--model", str(tmp_path / "ckpt"), "--json")

    assert code == 0, err
    report = json.loads(out)
    assert report["substitution"] == "qwen3.decoder.fused"
    assert report["model"]["source"] == f"checkpoint {tmp_path / 'ckpt'}"
