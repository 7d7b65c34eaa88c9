"""Swapped models under torch.distributed, and substitutions in DataLoader workers.

The two-process test runs DDP over gloo on the CPU: each rank builds the same tiny
Llama, a copy swapped with ``llama.decoder.fused``, wraps both in
``DistributedDataParallel`` and takes one training step on data of its own. The
swapped model's allreduced gradients and updated weights, mapped back to the original
layout through the substitution's converter, must equal the original model's. The same
ranks then repeat the gradient check with FSDP (``fully_shard``).
"""

from __future__ import annotations

import copy
import dataclasses
import datetime
import os
import pickle
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from ranks import free_port, run_ranks
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset
from transformers.models.llama import modeling_llama

import layerswap
from layerswap.distributed import applied_substitutions, check_ranks_agree, reapply
from layerswap.errors import SubstitutionError, SwapWarning, UnknownSubstitutionError
from layerswap.registry import families, get, unregister
from layerswap.swap import decoder_layers, substitution_of, swap

SUBSTITUTION = "llama.decoder.fused"
WORLD_SIZE = 2
SPAWN_TIMEOUT_S = 120


# --- DDP over gloo, two processes ----------------------------------------------------------


def _in_original_layout(
    model: torch.nn.Module, tensor_of: Callable[[torch.nn.Parameter], Any]
) -> dict[str, torch.Tensor]:
    """A tensor per parameter (its gradient, its value), keyed and shaped as the original's.

    The fused converter only renames and concatenates, so splitting a fused tensor
    with ``to_original`` gives exactly the tensor of each original parameter — for
    gradients too. FSDP's sharded tensors are gathered first.
    """
    tensors = {}
    for name, param in model.named_parameters():
        tensor = tensor_of(param)
        if hasattr(tensor, "full_tensor"):
            tensor = tensor.full_tensor()
        tensors[name] = tensor.detach().clone()
    for qualname, layer in decoder_layers(model):
        sub = substitution_of(layer)
        if sub is None:
            continue
        prefix = qualname + "."
        local = {
            key[len(prefix) :]: tensors.pop(key) for key in list(tensors) if key.startswith(prefix)
        }
        converted = sub.converter.to_original(local, model.config)
        tensors.update({prefix + key: value for key, value in converted.items()})
    return tensors


def _gradients(param: torch.nn.Parameter) -> Any:
    return param.grad


def _values(param: torch.nn.Parameter) -> Any:
    return param


def _models() -> tuple[torch.nn.Module, torch.nn.Module]:
    """The same tiny Llama twice (fixed seed): as built, and swapped."""
    family = families()["llama"]
    original = family.build(family.tiny_config(num_hidden_layers=2), seed=0).train()
    swapped = copy.deepcopy(original)
    swap(swapped, SUBSTITUTION)
    return original, swapped


def _train_one_rank(rank: int, port: int, out_dir: str) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", rank=rank, world_size=WORLD_SIZE, timeout=datetime.timedelta(seconds=60)
    )
    try:
        original, swapped = _models()
        check_ranks_agree(swapped)
        # ranks that disagree are told so, on every rank
        try:
            check_ranks_agree(original if rank == 0 else swapped)
            disagreement = ""
        except SubstitutionError as exc:
            disagreement = str(exc)

        generator = torch.Generator().manual_seed(1000 + rank)  # each rank its own data
        input_ids = torch.randint(0, original.config.vocab_size, (2, 12), generator=generator)
        report: dict[str, Any] = {"disagreement": disagreement}
        for label, model in (("original", original), ("swapped", swapped)):
            ddp = DistributedDataParallel(model)
            optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
            loss = ddp(input_ids=input_ids, labels=input_ids).loss
            loss.backward()
            optimizer.step()
            report[f"{label}_class"] = type(model.model.layers[0]).__name__
            report[f"{label}_loss"] = float(loss)
            report[f"{label}_grads"] = _in_original_layout(model, _gradients)
            report[f"{label}_weights"] = _in_original_layout(model, _values)

        # the same with FSDP (fully_shard): every layer's parameters sharded over the ranks
        mesh = init_device_mesh("cpu", (WORLD_SIZE,))
        for label, model in zip(("original", "swapped"), _models(), strict=True):
            for layer in model.model.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
            model(input_ids=input_ids, labels=input_ids).loss.backward()
            report[f"{label}_fsdp_grads"] = _in_original_layout(model, _gradients)
        torch.save(report, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # spawned processes
def test_ddp_and_fsdp_gradients_of_swapped_and_original_models_agree_on_two_ranks(tmp_path):
    run_ranks(
        _train_one_rank,
        (free_port(), str(tmp_path)),
        nprocs=WORLD_SIZE,
        timeout_s=SPAWN_TIMEOUT_S,
    )
    ranks = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(WORLD_SIZE)]

    for report in ranks:
        assert report["original_class"] == "LlamaDecoderLayer"
        assert report["swapped_class"] == "FusedLlamaDecoderLayer"
        torch.testing.assert_close(report["swapped_loss"], report["original_loss"])
        for kind in ("grads", "weights", "fsdp_grads"):
            expected, actual = report[f"original_{kind}"], report[f"swapped_{kind}"]
            assert actual.keys() == expected.keys()
            for name, tensor in expected.items():
                torch.testing.assert_close(
                    actual[name], tensor, rtol=1e-4, atol=1e-6, msg=f"{kind} {name}"
                )
        assert "rank 0: " in report["disagreement"] and "rank 1: " in report["disagreement"]
    # each rank saw its own data, and DDP and FSDP made the gradients the same on every rank
    assert ranks[0]["original_loss"] != ranks[1]["original_loss"]
    for kind in ("swapped_grads", "swapped_fsdp_grads"):
        for name, grad in ranks[0][kind].items():
            assert torch.equal(grad, ranks[1][kind][name]), f"{kind} {name}"


# --- DataLoader workers started with spawn ---------------------------------------------


class DecoderClassInWorker(Dataset[str]):
    """Builds a one-layer Llama in the worker: the class of its decoder layer, and how
    many live patches replace that class there."""

    def __len__(self) -> int:
        return 1

    def __getitem__(self, index: int) -> str:
        config = families()["llama"].tiny_config(num_hidden_layers=1)
        model = modeling_llama.LlamaModel(config)
        patched = [i for i in layerswap.active_patches() if i.target.endswith(":LlamaDecoderLayer")]
        return f"{type(model.layers[0]).__name__} x{len(patched)}"


def _from_worker(worker_init_fn: Any, context: str) -> list[str]:
    loader = DataLoader(
        DecoderClassInWorker(),
        batch_size=None,
        num_workers=1,
        multiprocessing_context=context,
        worker_init_fn=worker_init_fn,
    )
    return list(loader)


@pytest.mark.slow  # spawned processes
def test_spawned_dataloader_workers_get_the_substitution_back_with_reapply():
    with layerswap.use(SUBSTITUTION):
        init = reapply()
    # A spawned worker is a fresh interpreter, and the block has ended here anyway: only
    # reapply, which captured the substitution when it was created, can apply it there.
    assert _from_worker(init, "spawn") == ["FusedLlamaDecoderLayer x1"]
    assert modeling_llama.LlamaDecoderLayer.__name__ == "LlamaDecoderLayer"


def test_forked_workers_keep_the_inherited_substitution_without_applying_it_twice():
    with layerswap.use(SUBSTITUTION):
        assert _from_worker(reapply(), "fork") == ["FusedLlamaDecoderLayer x1"]


# --- in one process ------------------------------------------------------------------------


def test_applied_substitutions_lists_what_use_applies_while_it_applies_it():
    assert applied_substitutions() == ()
    with layerswap.use(SUBSTITUTION), layerswap.use("qwen2.decoder.fused"):
        names = [sub.name for sub in applied_substitutions()]
        assert names == [SUBSTITUTION, "qwen2.decoder.fused"]
    assert applied_substitutions() == ()


def test_a_plain_patch_to_another_class_is_not_a_substitution():
    with layerswap.patch(modeling_llama, "LlamaDecoderLayer", modeling_llama.LlamaMLP):
        assert applied_substitutions() == ()


def test_reapply_captures_the_substitutions_applied_when_it_is_created():
    with layerswap.use(SUBSTITUTION):
        init = reapply()
    assert init.names == (SUBSTITUTION,)
    copied = pickle.loads(pickle.dumps(init))
    assert copied.names == (SUBSTITUTION,)
    assert copied.substitutions[0] is get(SUBSTITUTION)  # the registry's own object


def test_reapply_outside_use_warns_that_workers_get_the_originals():
    with pytest.warns(SwapWarning, match="no layerswap substitution is applied here"):
        init = reapply()
    assert init.names == ()


def test_reapply_with_an_unknown_name_fails_where_it_is_created():
    with pytest.raises(UnknownSubstitutionError, match=r"did you mean 'llama\.decoder\.fused'"):
        reapply(["llama.decoder.fusd"])


def _seed_worker(worker_id: int) -> None:
    torch.manual_seed(worker_id)


def test_reapply_calls_the_users_own_worker_init_fn_and_pickles_it():
    init = pickle.loads(pickle.dumps(reapply([SUBSTITUTION], then=_seed_worker)))
    assert init.then is _seed_worker
    assert init.names == (SUBSTITUTION,)


def test_a_substitution_that_does_not_pickle_is_sent_by_its_registered_name():
    local = dataclasses.replace(
        get(SUBSTITUTION), name="llama.decoder.local", requirement=lambda: None
    )
    registered = layerswap.register(local)
    try:
        copied = pickle.loads(pickle.dumps(reapply([registered])))
        assert copied.substitutions[0] is registered
        unregistered = dataclasses.replace(registered, name="llama.decoder.nowhere")
        with pytest.raises(
            SubstitutionError, match=r"cannot send substitution 'llama\.decoder\.nowhere'"
        ):
            pickle.dumps(reapply([unregistered]))
    finally:
        unregister("llama.decoder.local")


def test_check_ranks_agree_does_nothing_without_a_process_group():
    assert not dist.is_initialized()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_ranks_agree()
