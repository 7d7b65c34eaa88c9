"""A swapped model under transformers' Trainer and accelerate: checkpoints restore every weight.

Trainer writes checkpoints in the original layout (``save_pretrained``) and reads them
back with plain ``model.load_state_dict``; the swapped layers convert on load, so a
resumed run is the uninterrupted run, loss for loss and weight for weight.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
from fresh import run_json
from models import tiny_model
from safetensors.torch import load_file
from transformers import PreTrainedModel, Trainer, TrainingArguments

import layerswap
from layerswap.errors import ConversionError

STEPS = 4


class _Tokens(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """Random token rows, labels equal to inputs (causal LM)."""

    def __init__(self, vocab_size: int, rows: int = 16, length: int = 12, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(1, vocab_size, (rows, length), generator=generator)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[index], "labels": self.ids[index]}


def _swapped(name: str) -> PreTrainedModel:
    model = tiny_model(name, num_hidden_layers=2).train()
    layerswap.swap(model, backend="fused")
    return model


def _args(out: Path, **overrides: Any) -> TrainingArguments:
    settings: dict[str, Any] = {
        "output_dir": str(out),
        "max_steps": STEPS,
        "per_device_train_batch_size": 4,
        "learning_rate": 1e-2,
        "logging_steps": 1,
        "save_steps": 2,
        "save_strategy": "steps",
        "report_to": [],
        "use_cpu": True,
        "seed": 0,
        "disable_tqdm": True,
    }
    settings.update(overrides)
    return TrainingArguments(**settings)


def _losses(trainer: Trainer) -> dict[int, float]:
    return {entry["step"]: entry["loss"] for entry in trainer.state.log_history if "loss" in entry}


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3"])
def test_resume_from_checkpoint_continues_the_uninterrupted_run(name: str, tmp_path: Path) -> None:
    model = _swapped(name)
    data = _Tokens(model.config.vocab_size)
    whole = Trainer(model=model, args=_args(tmp_path / "whole"), train_dataset=data)
    whole.train()
    checkpoint = tmp_path / "whole" / "checkpoint-2"
    saved = load_file(str(checkpoint / "model.safetensors"))
    assert "model.layers.0.self_attn.q_proj.weight" in saved  # the original layout on disk
    assert not any("qkv_proj" in key for key in saved)

    resumed_model = _swapped(name)  # same initial weights; the checkpoint must replace them all
    resumed = Trainer(model=resumed_model, args=_args(tmp_path / "resumed"), train_dataset=data)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    whole_losses, resumed_losses = _losses(whole), _losses(resumed)
    assert set(resumed_losses) == set(whole_losses) == {1, 2, 3, 4}
    for step in (3, 4):  # trained after the resume
        assert resumed_losses[step] == whole_losses[step], step
    for (key, expected), (_, actual) in zip(
        model.state_dict().items(), resumed_model.state_dict().items(), strict=True
    ):
        torch.testing.assert_close(actual, expected, rtol=0, atol=0, msg=key)


def test_load_best_model_at_end_restores_the_best_checkpoint(tmp_path: Path) -> None:
    model = _swapped("qwen2")
    data = _Tokens(model.config.vocab_size)
    scores = iter([1.0, 0.0])  # the first evaluation (step 2) is the best: it must come back

    def score(_: Any) -> dict[str, float]:
        return {"score": next(scores)}

    args = _args(
        tmp_path,
        eval_strategy="steps",
        eval_steps=2,
        load_best_model_at_end=True,
        metric_for_best_model="score",
        greater_is_better=True,
    )
    trainer = Trainer(
        model=model, args=args, train_dataset=data, eval_dataset=data, compute_metrics=score
    )
    trainer.train()
    assert trainer.state.best_model_checkpoint is not None
    assert trainer.state.best_model_checkpoint.endswith("checkpoint-2")
    best = tiny_model("qwen2", num_hidden_layers=2)
    best.load_state_dict(load_file(f"{trainer.state.best_model_checkpoint}/model.safetensors"))
    final = tiny_model("qwen2", num_hidden_layers=2)
    final.load_state_dict(load_file(str(tmp_path / "checkpoint-4" / "model.safetensors")))
    ids = data.ids[:2]
    model.eval()
    with torch.no_grad():
        assert not torch.allclose(final(ids).logits, best(ids).logits, atol=1e-3)
        torch.testing.assert_close(model(ids).logits, best(ids).logits, atol=1e-5, rtol=0)


def test_accelerate_save_state_and_load_state_restore_weights_and_optimizer(
    tmp_path: Path,
) -> None:
    from accelerate import Accelerator

    def step(model: PreTrainedModel, optimizer: torch.optim.Optimizer, ids: torch.Tensor) -> float:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return float(loss)

    ids = _Tokens(512).ids[:4]
    accelerator = Accelerator(cpu=True)
    model = _swapped("qwen3")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    step(model, optimizer, ids)
    accelerator.save_state(str(tmp_path))
    expected = [step(model, optimizer, ids) for _ in range(2)]

    fresh = _swapped("qwen3")
    fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    restorer = Accelerator(cpu=True)
    fresh, fresh_optimizer = restorer.prepare(fresh, fresh_optimizer)
    restorer.load_state(str(tmp_path))
    assert [step(fresh, fresh_optimizer, ids) for _ in range(2)] == expected


def test_accelerate_load_state_of_an_original_model_fills_a_swapped_one(tmp_path: Path) -> None:
    from accelerate import Accelerator

    original = tiny_model("llama", num_hidden_layers=2)
    saver = Accelerator(cpu=True)
    saver.prepare(original)
    saver.save_state(str(tmp_path))

    swapped = _swapped("llama")
    with torch.no_grad():
        for param in swapped.parameters():
            param.zero_()
    loader = Accelerator(cpu=True)
    loader.prepare(swapped)
    loader.load_state(str(tmp_path))
    ids = _Tokens(512).ids[:2]
    swapped.eval()
    with torch.no_grad():
        torch.testing.assert_close(swapped(ids).logits, original(ids).logits, atol=1e-5, rtol=0)


def _lora(name: str) -> Any:
    from peft import LoraConfig, get_peft_model

    model = _swapped(name)
    torch.manual_seed(5)
    return get_peft_model(model, LoraConfig(target_modules="all-linear", r=4))


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_lora_on_a_swapped_model_checkpoints_resumes_and_ships_to_plain_transformers(
    name: str, tmp_path: Path
) -> None:
    """Trainer's PEFT checkpoints are original-layout adapters; a run resumed from one
    is the uninterrupted run; the final adapter on a plain model gives the same logits."""
    from peft import PeftModel

    model = _lora(name)
    data = _Tokens(model.config.vocab_size)
    whole = Trainer(model=model, args=_args(tmp_path / "whole"), train_dataset=data)
    whole.train()
    checkpoint = tmp_path / "whole" / "checkpoint-2"
    saved = load_file(str(checkpoint / "adapter_model.safetensors"))
    assert any(".q_proj.lora_A" in key for key in saved)
    assert not any("qkv_proj" in key or "gate_up_proj" in key for key in saved)

    resumed_model = _lora(name)
    resumed = Trainer(model=resumed_model, args=_args(tmp_path / "resumed"), train_dataset=data)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    whole_losses, resumed_losses = _losses(whole), _losses(resumed)
    assert set(resumed_losses) == set(whole_losses) == {1, 2, 3, 4}
    for step in (3, 4):
        assert resumed_losses[step] == pytest.approx(whole_losses[step], rel=1e-6), step

    whole.save_model(str(tmp_path / "final"))
    plain = PeftModel.from_pretrained(tiny_model(name, num_hidden_layers=2), tmp_path / "final")
    ids = data.ids[:2]
    with torch.no_grad():
        torch.testing.assert_close(
            plain.eval()(ids).logits, model.eval()(ids).logits, atol=1e-5, rtol=0
        )


@pytest.mark.parametrize("safe", [True, False], ids=["safetensors", "bin"])
def test_accelerate_save_model_writes_the_original_layout(tmp_path: Path, safe: bool) -> None:
    """``Accelerator.save_model`` exports a model for plain transformers; it wrote a swapped
    model's ``state_dict()`` as it is (``qkv_proj``, ``gate_up_proj``). Now it writes the
    original's names and values, sharded or not, over an earlier save's shards, and plain
    transformers loads it whole; the swapped model stays as it was."""
    from accelerate import Accelerator

    original = tiny_model("qwen3", num_hidden_layers=2).eval()
    expected = original.state_dict()
    swapped = tiny_model("qwen3", num_hidden_layers=2).eval()
    swapped.load_state_dict(expected)
    layerswap.swap(swapped, backend="fused")
    before = {k: v.clone() for k, v in swapped.state_dict().items()}
    accelerator = Accelerator(cpu=True)
    prepared = accelerator.prepare(swapped)
    target = tmp_path / "exported"
    accelerator.save_model(prepared, target, max_shard_size="200KB", safe_serialization=safe)
    stale = target / (
        "model-00009-of-00099.safetensors" if safe else "pytorch_model-00009-of-00099.bin"
    )
    stale.write_bytes(b"")  # as an earlier, larger save left it
    accelerator.save_model(prepared, target, max_shard_size="200KB", safe_serialization=safe)
    assert not stale.exists()
    written: dict[str, torch.Tensor] = {}
    files = sorted(target.glob("*.safetensors" if safe else "*.bin"))
    assert len(files) > 1  # sharded
    for path in files:
        written.update(load_file(path) if safe else torch.load(path, weights_only=True))
    assert set(written) == set(expected)
    for key, value in expected.items():
        assert torch.equal(written[key], value), key
    plain = tiny_model("qwen3", num_hidden_layers=2).eval()
    plain.load_state_dict(written, strict=True)
    ids = _Tokens(512).ids[:2]
    with torch.no_grad():
        torch.testing.assert_close(plain(ids).logits, original(ids).logits, atol=0, rtol=0)
    after = swapped.state_dict()
    assert set(after) == set(before) and all(torch.equal(after[k], before[k]) for k in before)


def test_accelerate_save_model_that_would_write_fused_names_writes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A state gathered past the layers' own ``state_dict`` (DeepSpeed ZeRO-3's
    consolidated one) keeps the swapped layout: refused, with the target untouched."""
    from accelerate import Accelerator

    swapped = _swapped("llama").eval()
    accelerator = Accelerator(cpu=True)
    gathered = {k: v.clone() for k, v in swapped.state_dict().items()}
    monkeypatch.setattr(Accelerator, "get_state_dict", lambda self, model, unwrap=True: gathered)
    target = tmp_path / "exported"
    target.mkdir()
    (target / "README.md").write_text("kept")
    with pytest.raises(ConversionError, match=r"save_model would write .*gate_up_proj"):
        accelerator.save_model(swapped, target)
    assert [p.name for p in target.iterdir()] == ["README.md"]
    assert [p.name for p in tmp_path.iterdir()] == ["exported"]  # no staging left


def test_other_savers_write_the_original_layout_inside_original_layout_state(
    tmp_path: Path,
) -> None:
    """safetensors' ``save_model`` and huggingface_hub's ``save_torch_model`` take
    ``state_dict()`` as it is (the swapped layout); inside ``original_layout_state`` they
    write the original's names and values, and after it ``state_dict()`` is as before."""
    from huggingface_hub import save_torch_model
    from safetensors.torch import save_model

    from layerswap.saving import original_layout_state

    expected = tiny_model("llama", num_hidden_layers=2).state_dict()
    swapped = _swapped("llama")
    swapped.load_state_dict(expected)
    before = set(swapped.state_dict())
    assert before != set(expected)
    (tmp_path / "hub").mkdir()
    with original_layout_state(swapped):
        save_model(swapped, str(tmp_path / "model.safetensors"))
        save_torch_model(swapped, tmp_path / "hub")
    for path in (tmp_path / "model.safetensors", tmp_path / "hub" / "model.safetensors"):
        written = load_file(path)
        assert set(written) == set(expected)
        assert all(torch.equal(written[k], v) for k, v in expected.items())
    assert set(swapped.state_dict()) == before


def test_accelerate_save_model_of_a_model_sharded_by_fsdp_is_refused(tmp_path: Path) -> None:
    """FSDP's own state-dict hooks expect the swapped layers' names: a save of a swapped
    model sharded by ``fully_shard`` failed inside torch with an AttributeError. It is
    refused first, naming FSDP, and writes nothing."""
    code = f"""
        import json, os, socket
        import torch.distributed as dist
        from accelerate import Accelerator
        from torch.distributed.fsdp import fully_shard
        import layerswap
        from layerswap.errors import ConversionError
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{{port}}", rank=0, world_size=1)
        model = layerswap.get_family("llama").build(seed=0)
        layerswap.swap(model, "llama.decoder.fused")
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        target = os.path.join({str(tmp_path)!r}, "out")
        try:
            Accelerator(cpu=True).save_model(model, target)
            found = ["saved", sorted(os.listdir(target))]
        except ConversionError as exc:
            found = [str(exc), os.path.exists(target)]
        dist.destroy_process_group()
        print(json.dumps(found))
    """
    message, exists = run_json(code, tmp_path / "cache")
    assert "sharded by FSDP" in message and "nothing was written" in message
    assert exists is False


def test_accelerate_save_model_of_one_model_in_two_threads_and_nested(tmp_path: Path) -> None:
    """The original-layout hooks sit on the model's own layers: two saves of one model at
    once failed ("tensor 'self_attn.qkv_proj.weight' is missing"), and so did a save
    inside ``original_layout_state``. Both now write the original layout."""
    import threading

    from accelerate import Accelerator

    from layerswap.saving import original_layout_state

    expected = set(tiny_model("llama", num_hidden_layers=2).state_dict())
    swapped = _swapped("llama")
    accelerator = Accelerator(cpu=True)
    errors: list[BaseException] = []

    def save(name: str) -> None:
        try:
            for _ in range(3):
                accelerator.save_model(swapped, tmp_path / name)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=save, args=(f"t{i}",)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    with original_layout_state(swapped):
        accelerator.save_model(swapped, tmp_path / "nested")
    for name in ("t0", "t1", "nested"):
        assert set(load_file(tmp_path / name / "model.safetensors")) == expected


def test_a_save_into_a_target_on_another_filesystem_and_stale_bin_shards(tmp_path: Path) -> None:
    """The staging directory sat beside the target: a target linked to another filesystem
    failed to move ("Invalid cross-device link"); it is now made inside the target. An
    unsharded ``.bin`` save removes an earlier save's ``.bin`` shards, as accelerate does."""
    from accelerate import Accelerator

    shm = Path("/dev/shm")
    if not shm.is_dir() or shm.stat().st_dev == tmp_path.stat().st_dev:
        pytest.skip("needs /dev/shm on a filesystem of its own")
    swapped = _swapped("llama")
    accelerator = Accelerator(cpu=True)
    elsewhere = Path(tempfile.mkdtemp(dir=shm))
    try:
        (tmp_path / "out").symlink_to(elsewhere)
        accelerator.save_model(swapped, tmp_path / "out")
        swapped.save_pretrained(tmp_path / "out")
        assert (elsewhere / "model.safetensors").is_file()
    finally:
        shutil.rmtree(elsewhere)
    target = tmp_path / "bins"
    accelerator.save_model(swapped, target, max_shard_size="200KB", safe_serialization=False)
    assert len(list(target.glob("pytorch_model-*.bin"))) > 1
    accelerator.save_model(swapped, target, safe_serialization=False)
    assert (target / "pytorch_model.bin").is_file()
    assert not list(target.glob("pytorch_model-*.bin"))
