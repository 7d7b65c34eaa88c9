"""DeepSpeed ZeRO-3 on two CPU ranks: swapped models load, train and save like the original.

Each rank (``DS_ACCELERATOR=cpu``, gloo) loads the same tiny Llama checkpoint with
transformers' ZeRO-3 switch on (``HfDeepSpeedConfig``: ``from_pretrained`` builds inside
``deepspeed.zero.Init``, every parameter partitioned), hands it to ``deepspeed.initialize``
with SGD, takes one training step on data of its own and saves the gathered 16-bit weights
with ``save_pretrained(state_dict=...)``, as the HF Trainer does under ZeRO-3. The same is
done for a model loaded inside ``layerswap.use`` (fused decoder and fused head) and for a
partitioned model swapped with ``layerswap.swap`` (decoder and head). Their losses, before
and after the step, must equal the original's, and what they save must be the original's
layout with the original's values (so the same gradients were applied).
"""

from __future__ import annotations

import datetime
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from ranks import free_port, run_ranks

WORLD_SIZE = 2
SPAWN_TIMEOUT_S = 300
DECODER = "llama.decoder.fused"
HEAD = "llama.head.fused"
DS_CONFIG: dict[str, Any] = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 1,
    "zero_optimization": {
        "stage": 3,
        "stage3_gather_16bit_weights_on_model_save": True,
        "stage3_param_persistence_threshold": 0,  # every tensor partitioned, small ones too
    },
    "zero_allow_untested_optimizer": True,
}


def _tiny_checkpoint(path: Path) -> None:
    from layerswap.registry import families

    family = families()["llama"]
    config = family.tiny_config(
        num_hidden_layers=2,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    )
    family.build(config, seed=0).save_pretrained(path)


def _mixed_checkpoint(checkpoint: Path, out: Path) -> None:
    """``checkpoint`` with layer 0's q/k/v and a ``qkv_proj`` of its own beside them."""
    import shutil

    from safetensors.torch import load_file, save_file

    out.mkdir()
    shutil.copy(checkpoint / "config.json", out / "config.json")
    state = load_file(str(checkpoint / "model.safetensors"))
    parts = [state[f"model.layers.0.self_attn.{n}_proj.weight"] for n in "qkv"]
    state["model.layers.0.self_attn.qkv_proj.weight"] = torch.randn(torch.cat(parts).shape)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})


def _train_and_save(model: torch.nn.Module, batch: dict[str, torch.Tensor], out: Path) -> dict:
    """One SGD step under a ZeRO-3 engine; the losses before and after; saved as the Trainer does."""
    import deepspeed

    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=DS_CONFIG)
    engine.train()
    loss = engine(**batch).loss
    engine.backward(loss)
    engine.step()
    with torch.no_grad():
        after = engine(**batch).loss
    # what accelerate's get_state_dict (the Trainer's save under ZeRO-3) gathers, rank 0 only
    state = engine._zero3_consolidated_16bit_state_dict()
    if torch.distributed.get_rank() == 0:
        model.save_pretrained(out, state_dict=state)
    return {"loss": loss.item(), "after": after.item(), "engine": engine}


def _gathered_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=None):
        return {name: param.detach().clone() for name, param in model.named_parameters()}


def _rank(rank: int, port: int, out_dir: str) -> None:
    os.environ.update(
        DS_ACCELERATOR="cpu",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(WORLD_SIZE),
    )
    torch.set_num_threads(1)
    import deepspeed
    from transformers import LlamaForCausalLM
    from transformers.integrations import HfDeepSpeedConfig

    import layerswap
    from layerswap.errors import ConversionError, ParallelismError
    from layerswap.zero3 import is_partitioned

    deepspeed.init_distributed(dist_backend="gloo", timeout=datetime.timedelta(seconds=120))
    out = Path(out_dir)
    checkpoint = out / "checkpoint"
    if rank == 0:
        _tiny_checkpoint(checkpoint)
        _mixed_checkpoint(checkpoint, out / "mixed")
    torch.distributed.barrier()
    generator = torch.Generator().manual_seed(1000 + rank)  # each rank its own data
    input_ids = torch.randint(0, 512, (2, 12), generator=generator)
    batch = {"input_ids": input_ids, "labels": input_ids}
    report: dict[str, Any] = {}
    zero3 = HfDeepSpeedConfig(DS_CONFIG)  # transformers' switch: from_pretrained in zero.Init
    try:
        original = LlamaForCausalLM.from_pretrained(checkpoint)
        report["partitioned"] = all(is_partitioned(p) for p in original.parameters())
        initial = _gathered_state(original)

        # swap() of a partitioned model, and undo: the original weights back, bitwise
        probe = LlamaForCausalLM.from_pretrained(checkpoint)
        handle = layerswap.swap(probe, DECODER)
        report["swapped_partitioned"] = all(is_partitioned(p) for p in probe.parameters())
        handle.undo()
        back = _gathered_state(probe)
        report["undo_bitwise"] = back.keys() == initial.keys() and all(
            torch.equal(back[name], tensor) for name, tensor in initial.items()
        )

        # the sub-layer slots read a partitioned model's modules by their whole shapes
        for slot in ("mlp", "norm"):
            try:
                layerswap.swap(probe, f"llama.{slot}.fused").undo()
                report[f"{slot}_swap"] = "undone"
            except Exception as exc:
                report[f"{slot}_swap"] = f"{type(exc).__name__}: {exc}"
        back = _gathered_state(probe)
        report["slots_bitwise"] = all(torch.equal(back[n], t) for n, t in initial.items())

        trained = _train_and_save(original, batch, out / "original")
        for label in ("loss", "after"):
            report[f"original_{label}"] = trained[label]
        # a model DeepSpeed has taken cannot be swapped: refused, naming ZeRO-3
        try:
            layerswap.swap(original, DECODER)
            report["refusal"] = ""
        except ParallelismError as exc:
            report["refusal"] = str(exc)

        # a checkpoint giving a layer both layouts: refused, as without ZeRO-3
        try:
            with layerswap.use(DECODER):
                LlamaForCausalLM.from_pretrained(out / "mixed")
            report["mixed_refusal"] = ""
        except ConversionError as exc:
            report["mixed_refusal"] = str(exc)

        with layerswap.use(DECODER), layerswap.use(HEAD):
            built = LlamaForCausalLM.from_pretrained(checkpoint)
        report["use_classes"] = (type(built.model.layers[0]).__name__, type(built).__qualname__)
        trained = _train_and_save(built, batch, out / "use")
        report["use_loss"], report["use_after"] = trained["loss"], trained["after"]

        swapped = LlamaForCausalLM.from_pretrained(checkpoint)
        layerswap.swap(swapped, DECODER)
        layerswap.swap(swapped, HEAD)
        # nothing else gathers lm_head.weight here (no engine yet): the fused loss must
        weight = swapped.lm_head.weight
        report["head_weight_shape"] = tuple(weight.shape)
        hidden = torch.randn(2, 12, 64, generator=generator)
        fused_loss = swapped._causal_lm_loss(hidden, input_ids, {}).item()
        with deepspeed.zero.GatheredParameters([weight], modifier_rank=None):
            logits = hidden[:, :-1] @ weight.t()
        expected = torch.nn.functional.cross_entropy(
            logits.reshape(-1, 512), input_ids[:, 1:].reshape(-1)
        )
        report["head_gathered_loss"] = (fused_loss, expected.item())
        trained = _train_and_save(swapped, batch, out / "swap")
        report["swap_loss"], report["swap_after"] = trained["loss"], trained["after"]
    finally:
        del zero3
        torch.save(report, out / f"rank{rank}.pt")
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


@pytest.mark.slow  # spawned processes
def test_zero3_loading_swapping_training_and_saving_match_the_original(tmp_path, monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (the integrations extra)")
    from transformers import LlamaForCausalLM

    run_ranks(_rank, (free_port(), str(tmp_path)), nprocs=WORLD_SIZE, timeout_s=SPAWN_TIMEOUT_S)
    ranks = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(WORLD_SIZE)]
    for report in ranks:
        assert report["partitioned"]  # the checkpoint really loaded partitioned
        assert report["swapped_partitioned"] and report["undo_bitwise"]
        assert report["use_classes"] == ("FusedLlamaDecoderLayer", "FusedLlamaForCausalLM")
        for path in ("use", "swap"):
            for label in ("loss", "after"):
                assert report[f"{path}_{label}"] == pytest.approx(
                    report[f"original_{label}"], rel=1e-5
                ), f"{path} {label}"
        assert report["head_weight_shape"] == (0,)
        assert report["head_gathered_loss"][0] == pytest.approx(report["head_gathered_loss"][1])
        assert "ZeRO-3" in report["refusal"] and "swap before" in report["refusal"]
        assert "mixes the original layout" in report["mixed_refusal"]
        assert report["mlp_swap"] == report["norm_swap"] == "undone", report
        assert report["slots_bitwise"]
    assert ranks[0]["original_loss"] != ranks[1]["original_loss"]  # each rank its own data

    # what each saved is the original layout, loadable by plain transformers, same values
    expected = LlamaForCausalLM.from_pretrained(tmp_path / "original").state_dict()
    for path in ("use", "swap"):
        saved = LlamaForCausalLM.from_pretrained(tmp_path / path)
        assert type(saved.model.layers[0]).__name__ == "LlamaDecoderLayer"
        state = saved.state_dict()
        assert state.keys() == expected.keys(), path
        for name, tensor in expected.items():
            torch.testing.assert_close(state[name], tensor, rtol=1e-5, atol=1e-6, msg=name)


def test_layerswaps_own_models_are_built_with_transformers_zero3_switch_off(monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (the integrations extra)")
    from transformers.integrations import HfDeepSpeedConfig, is_deepspeed_zero3_enabled

    from layerswap.zero3 import outside_partitioning

    switch = HfDeepSpeedConfig(DS_CONFIG)
    assert is_deepspeed_zero3_enabled()
    with pytest.raises(RuntimeError, match="inside"), outside_partitioning():
        assert not is_deepspeed_zero3_enabled()
        raise RuntimeError("inside")
    assert is_deepspeed_zero3_enabled()  # the same object back, after an exception too
    del switch
    assert not is_deepspeed_zero3_enabled()
