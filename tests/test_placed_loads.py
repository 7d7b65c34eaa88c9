"""Loads that match a checkpoint's names against the model's before ``load_state_dict``
runs (:mod:`layerswap.placed_loads`): an original-layout checkpoint loads whole into a
swapped model, on every rank and with a ``device_map``, or is refused."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import accelerate.utils as accelerate_modeling
import pytest
import torch
from models import prompt_logits, swapped_llama, tiny_config, tiny_model
from ranks import free_port, run_ranks
from safetensors.torch import load_file, save_file
from transformers import LlamaForCausalLM

import layerswap
from layerswap.errors import ConversionError

FUSED = "llama.decoder.fused"


@pytest.fixture
def original_checkpoint(tmp_path: Path) -> tuple[Path, torch.Tensor]:
    original = tiny_model("llama", seed=0, num_hidden_layers=2)
    # shards of a few tensors each: a layer's q, k and v fall in different files
    original.save_pretrained(tmp_path, max_shard_size="40KB")
    assert len(list(tmp_path.glob("*.safetensors"))) > 2
    return tmp_path, prompt_logits(original)


#: accelerate places tensors one by one with a device map, and loads each file's state
#: into the model without one
DEVICE_MAPS = pytest.mark.parametrize("device_map", [{"": "cpu"}, None], ids=["placed", "loaded"])


@DEVICE_MAPS
def test_accelerate_places_an_original_checkpoint_by_name_into_a_swapped_model(
    original_checkpoint: tuple[Path, torch.Tensor],
    device_map: dict[str, str] | None,
    caplog: pytest.LogCaptureFixture,
) -> None:
    path, expected = original_checkpoint
    model = swapped_llama(seed=7)
    assert not torch.equal(prompt_logits(model), expected)
    # as a script calls it: a module's name, bound before or after the swap
    with caplog.at_level(logging.WARNING, logger="accelerate"):
        accelerate_modeling.load_checkpoint_in_model(model, str(path), device_map=device_map)
    torch.testing.assert_close(prompt_logits(model), expected, rtol=1e-5, atol=1e-5)
    # every tensor of the checkpoint was used: accelerate says none was left out
    assert "were not used" not in caplog.text


def test_accelerate_loading_bound_under_another_name_before_the_swap_converts_too(
    original_checkpoint: tuple[Path, torch.Tensor],
) -> None:
    path, expected = original_checkpoint
    bound = {"load": accelerate_modeling.load_checkpoint_in_model}  # held before any swap
    model = swapped_llama(seed=7)
    bound["load"](model, str(path), device_map={"": "cpu"})
    torch.testing.assert_close(prompt_logits(model), expected, rtol=1e-5, atol=1e-5)


def test_accelerate_loading_reads_the_names_layerswap_reads() -> None:
    """The locals of accelerate's load_checkpoint_in_model read while it reads a file,
    and the function it reads files with, are there in the installed accelerate."""
    from accelerate.utils import modeling

    from layerswap.placed_loads import ACCELERATE_LOAD_LOCALS, ADVICE

    code = modeling.load_checkpoint_in_model.__code__
    assert set(ACCELERATE_LOAD_LOCALS) <= set(code.co_varnames)
    module, name = ADVICE[-1][0].split(":")
    assert module == modeling.__name__ and name in code.co_names


def test_load_checkpoint_and_dispatch_fills_an_empty_swapped_model(
    original_checkpoint: tuple[Path, torch.Tensor],
) -> None:
    from accelerate import init_empty_weights, load_checkpoint_and_dispatch

    path, expected = original_checkpoint
    with layerswap.use(FUSED), init_empty_weights():
        model = LlamaForCausalLM(tiny_config("llama", num_hidden_layers=2))
    model = load_checkpoint_and_dispatch(model, str(path), device_map="auto")
    model.model.rotary_emb.__init__(model.config)  # a buffer init_empty_weights left empty
    torch.testing.assert_close(prompt_logits(model), expected, rtol=1e-5, atol=1e-5)


@DEVICE_MAPS
def test_a_checkpoint_giving_a_joined_tensor_in_part_is_refused_by_accelerate(
    original_checkpoint: tuple[Path, torch.Tensor], device_map: dict[str, str] | None
) -> None:
    path, _ = original_checkpoint
    index = json.loads((path / "model.safetensors.index.json").read_text())
    key = "model.layers.1.self_attn.k_proj.weight"
    shard = path / index["weight_map"].pop(key)
    tensors = load_file(shard)
    del tensors[key]
    save_file(tensors, shard, metadata={"format": "pt"})
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    model = swapped_llama(seed=7)
    before = {key: value.clone() for key, value in model.state_dict().items()}
    with pytest.raises(ConversionError, match=r"k_proj\.weight'.*nothing was loaded"):
        accelerate_modeling.load_checkpoint_in_model(model, str(path), device_map=device_map)
    assert all(torch.equal(before[key], value) for key, value in model.state_dict().items())


@DEVICE_MAPS
def test_a_checkpoint_giving_a_layer_in_both_layouts_is_refused_by_accelerate(
    tmp_path: Path, device_map: dict[str, str] | None
) -> None:
    original = tiny_model("llama", seed=0, num_hidden_layers=2)
    state = {key: value.contiguous() for key, value in original.state_dict().items()}
    swapped = swapped_llama(seed=0)
    key = "model.layers.0.self_attn.qkv_proj.weight"
    state[key] = swapped.state_dict()[key].clone()  # a stray second layout of layer 0
    state.pop("lm_head.weight", None)  # tied to the embeddings
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    model = swapped_llama(seed=7)
    before = {name: value.clone() for name, value in model.state_dict().items()}
    with pytest.raises(ConversionError, match="both in the original layout"):
        accelerate_modeling.load_checkpoint_in_model(model, str(tmp_path), device_map=device_map)
    assert all(torch.equal(before[name], value) for name, value in model.state_dict().items())


def test_a_full_state_given_in_part_is_refused_with_strict_and_reported_without() -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    state = tiny_model("llama", seed=0, num_hidden_layers=2).state_dict()
    del state["model.layers.0.self_attn.v_proj.weight"]
    model = swapped_llama(seed=7)
    before = {key: value.clone() for key, value in model.state_dict().items()}
    with pytest.raises(ConversionError, match=r"v_proj\.weight' missing; nothing was loaded"):
        set_model_state_dict(model, dict(state), options=StateDictOptions(full_state_dict=True))
    assert all(torch.equal(before[key], value) for key, value in model.state_dict().items())
    result = set_model_state_dict(
        model, dict(state), options=StateDictOptions(full_state_dict=True, strict=False)
    )
    assert "model.layers.0.self_attn.v_proj.weight" in result.missing_keys


def _broadcast_rank(rank: int, port: int, out: str) -> None:
    from torch import distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        original = tiny_model("llama", seed=0, num_hidden_layers=2)
        state: dict[str, Any] = dict(original.state_dict()) if rank == 0 else {}
        model = swapped_llama(seed=7)
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        result = set_model_state_dict(model, state, options=options)
        torch.save(
            {
                "difference": (prompt_logits(model) - prompt_logits(original)).abs().max(),
                "result": result,
            },
            f"{out}/rank{rank}.pt",
        )
    finally:
        dist.destroy_process_group()


def _broadcast_partial_rank(rank: int, port: int, out: str) -> None:
    from torch import distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        state: dict[str, Any] = {}
        if rank == 0:
            state = dict(tiny_model("llama", seed=0, num_hidden_layers=2).state_dict())
            del state["model.layers.0.self_attn.v_proj.weight"]
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        try:
            set_model_state_dict(swapped_llama(seed=7), state, options=options)
            said = "loaded"
        except ConversionError as exc:
            said = str(exc)
        (Path(out) / f"rank{rank}.txt").write_text(said)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_a_state_broadcast_in_part_is_refused_on_every_rank(tmp_path: Path) -> None:
    """Refused on rank 0 alone, the other ranks would wait in torch's broadcast."""
    run_ranks(_broadcast_partial_rank, (free_port(), str(tmp_path)), nprocs=2, timeout_s=180)
    for rank in range(2):
        said = (tmp_path / f"rank{rank}.txt").read_text()
        assert "v_proj.weight' missing; nothing was loaded" in said, f"rank {rank}: {said}"


@pytest.mark.slow
def test_every_rank_loads_an_original_state_broadcast_from_rank_0(tmp_path: Path) -> None:
    run_ranks(_broadcast_rank, (free_port(), str(tmp_path)), nprocs=2, timeout_s=180)
    for rank in range(2):
        report = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        assert report["difference"] < 1e-5, f"rank {rank} kept its own fused tensors"
        assert not report["result"].missing_keys and not report["result"].unexpected_keys


def _accelerate_broadcast_partial_rank(rank: int, port: int, path: str, out: str) -> None:
    from torch import distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        model = swapped_llama(seed=7)
        try:
            accelerate_modeling.load_checkpoint_in_model(model, path, broadcast_from_rank0=True)
            said = "loaded"
        except ConversionError as exc:
            said = str(exc)
        (Path(out) / f"rank{rank}.txt").write_text(said)
        dist.barrier()  # rank 0 stays until every rank has its word
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_accelerate_broadcasting_a_checkpoint_in_part_is_refused_on_every_rank(
    tmp_path: Path,
) -> None:
    """Without a device_map, broadcast_from_rank0: rank 0 alone reads the files; a refusal
    there was rank 0's alone, and the other ranks waited for its word in
    set_model_state_dict."""
    state = {
        key: value.contiguous()
        for key, value in tiny_model("llama", seed=0, num_hidden_layers=2).state_dict().items()
    }
    del state["model.layers.1.self_attn.k_proj.weight"]
    checkpoint = tmp_path / "checkpoint"
    checkpoint.mkdir()
    save_file(state, str(checkpoint / "model.safetensors"), metadata={"format": "pt"})
    args = (free_port(), str(checkpoint), str(tmp_path))
    run_ranks(_accelerate_broadcast_partial_rank, args, nprocs=2, timeout_s=120)
    for rank in range(2):
        said = (tmp_path / f"rank{rank}.txt").read_text()
        assert "not 'model.layers.1.self_attn.k_proj.weight'" in said, f"rank {rank}: {said}"
