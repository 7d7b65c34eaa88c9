"""The global view of a tensor-parallel swapped model's state is the fused layout (issue 39).

Each rank of a tensor-parallel fused layer holds ``[q_r; k_r; v_r]`` under a DTensor that
says ``Shard(0)``. Two CPU processes (gloo) shard swapped models with
``DistributedConfig(tp_size=2)`` and move their state through torch's distributed
checkpointing: full state dicts, ``dcp.save``/``dcp.load`` from two ranks to one process
and from one process to two ranks, and between two sharded models. Each must land what
an unsharded swapped model holds: equal tensors, equal logits.
"""

from __future__ import annotations

import datetime
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from ranks import free_port, run_ranks
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

import layerswap
from layerswap import hf_internals
from layerswap.errors import ParallelismError
from layerswap.packed_optim import watch_optimizer
from layerswap.registry import families

WORLD_SIZE = 2
SPAWN_TIMEOUT_S = 240
# llama: grouped-query attention (q and k/v parts of different sizes); qwen2: q/k/v biases
FAMILIES = ("llama", "qwen2")
TINY = {
    "num_hidden_layers": 2,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 128,
}
FULL = StateDictOptions(full_state_dict=True)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not hf_internals.loads_sharded_on_read(),
        reason="this transformers loads sharded models without shard-on-read (before 5.24)",
    ),
]


def _checkpoint(directory: Path, family_name: str, seed: int) -> Path:
    family = families()[family_name]
    model = family.build(family.tiny_config(**TINY), seed=seed)
    path = directory / f"{family_name}-seed{seed}"
    model.save_pretrained(path)
    return path


def _input_ids() -> torch.Tensor:
    return torch.randint(0, 100, (2, 9), generator=torch.Generator().manual_seed(0))


def _logits(model: Any) -> torch.Tensor:
    with torch.no_grad():
        return model(_input_ids()).logits


def _whole(family_name: str, checkpoint: Path | str) -> Any:
    from transformers import AutoModelForCausalLM

    with layerswap.use(f"{family_name}.decoder.fused"):
        return AutoModelForCausalLM.from_pretrained(checkpoint)


def _rank(rank: int, port: int, work: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(WORLD_SIZE),
    )
    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    dist.init_process_group(
        "gloo", rank=rank, world_size=WORLD_SIZE, timeout=datetime.timedelta(seconds=120)
    )
    root = Path(work)
    try:
        report: dict[str, Any] = {}
        for family_name in FAMILIES:

            def sharded(seed: int, family_name: str = family_name) -> Any:
                with layerswap.use(f"{family_name}.decoder.fused"):
                    return AutoModelForCausalLM.from_pretrained(
                        root / f"{family_name}-seed{seed}",
                        distributed_config=DistributedConfig(tp_size=WORLD_SIZE),
                    )

            model = sharded(0)
            found: dict[str, Any] = {"logits": _logits(model)}
            found["full"] = get_model_state_dict(model, options=FULL)
            # two ranks -> checkpoint, read back by one process in the test
            dcp.save(get_model_state_dict(model), checkpoint_id=root / f"{family_name}-tp2")
            # two ranks -> two ranks: into a model holding other weights
            other = sharded(1)
            state = get_model_state_dict(other)
            dcp.load(state, checkpoint_id=root / f"{family_name}-tp2")
            set_model_state_dict(other, state)
            found["tp2_to_tp2"] = _logits(other)
            # one process -> two ranks: the test saved an unsharded swapped model (seed 0)
            other = sharded(1)
            state = other.state_dict()
            dcp.load(state, checkpoint_id=root / f"{family_name}-whole")
            other.load_state_dict(state)
            found["tp1_to_tp2"] = _logits(other)
            # a full state dict (an unsharded swapped model's) spread over the ranks
            other = sharded(1)
            whole_state = _whole(family_name, root / f"{family_name}-seed0").state_dict()
            set_model_state_dict(other, whole_state, options=FULL)
            found["full_to_tp2"] = _logits(other)
            report[family_name] = found
        torch.save(report, root / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_state_of_a_tensor_parallel_swapped_model_moves_in_the_fused_layout(tmp_path):
    wholes = {}
    for family_name in FAMILIES:
        _checkpoint(tmp_path, family_name, seed=0)
        _checkpoint(tmp_path, family_name, seed=1)
        wholes[family_name] = _whole(family_name, tmp_path / f"{family_name}-seed0")
        dcp.save(wholes[family_name].state_dict(), checkpoint_id=tmp_path / f"{family_name}-whole")

    run_ranks(_rank, (free_port(), str(tmp_path)), nprocs=WORLD_SIZE, timeout_s=SPAWN_TIMEOUT_S)
    ranks = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(WORLD_SIZE)]

    for family_name, whole in wholes.items():
        expected_state = whole.state_dict()
        expected_logits = _logits(whole)
        for report in ranks:
            found = report[family_name]
            torch.testing.assert_close(found["logits"], expected_logits, rtol=1e-4, atol=1e-5)
            # the full state dict is an unsharded swapped model's, tensor for tensor
            assert found["full"].keys() == expected_state.keys(), family_name
            for key, tensor in expected_state.items():
                assert torch.equal(found["full"][key], tensor), f"{family_name} {key}"
            for way in ("tp2_to_tp2", "tp1_to_tp2", "full_to_tp2"):
                torch.testing.assert_close(
                    found[way], expected_logits, rtol=1e-4, atol=1e-5, msg=f"{family_name} {way}"
                )
        # two ranks -> one process: an unsharded swapped model holding other weights
        other = _whole(family_name, tmp_path / f"{family_name}-seed1")
        state = other.state_dict()
        dcp.load(state, checkpoint_id=tmp_path / f"{family_name}-tp2")
        other.load_state_dict(state)
        for key, tensor in expected_state.items():
            assert torch.equal(other.state_dict()[key], tensor), f"{family_name} {key}"
        torch.testing.assert_close(_logits(other), expected_logits)


# --- optimizer state ------------------------------------------------------------------------

QKV = "model.layers.0.self_attn.qkv_proj.weight"
MOMENTS = ("exp_avg", "exp_avg_sq")


def _train(model: Any, optimizer: Any, steps: int) -> float:
    """``steps`` AdamW steps on the same batch; the last loss."""
    ids = _input_ids()
    for _ in range(steps):
        loss = model(ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return float(loss.detach())


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _loss(model: Any) -> float:
    with torch.no_grad():
        return float(model(_input_ids(), labels=_input_ids()).loss)


def _adamw(model: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2)


def _same_moments(found: torch.optim.Optimizer, expected: torch.optim.Optimizer) -> bool:
    """Whether each rank-local moment of ``found`` equals ``expected``'s (same parameters)."""
    return all(
        torch.equal(_local(found.state[param][key]), _local(state[key]))
        for param, state in expected.state.items()
        for key in MOMENTS
    )


def _optim_rank(rank: int, port: int, work: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(WORLD_SIZE),
    )
    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    dist.init_process_group(
        "gloo", rank=rank, world_size=WORLD_SIZE, timeout=datetime.timedelta(seconds=120)
    )
    root = Path(work)
    try:
        with layerswap.use("llama.decoder.fused"):
            model = AutoModelForCausalLM.from_pretrained(
                root / "llama-seed0", distributed_config=DistributedConfig(tp_size=WORLD_SIZE)
            )
        optimizer = _adamw(model)
        _train(model, optimizer, steps=2)
        full = get_optimizer_state_dict(model, optimizer, options=FULL)
        dcp.save(
            {
                "model": get_model_state_dict(model),
                "optim": get_optimizer_state_dict(model, optimizer),
            },
            checkpoint_id=root / "llama-optim-tp2",
        )
        # the sharded state round-trips at the same degree: a new optimizer, loaded
        again = _adamw(model)
        state = {"optim": get_optimizer_state_dict(model, again)}
        dcp.load(state, checkpoint_id=root / "llama-optim-tp2")
        set_optimizer_state_dict(model, again, state["optim"])
        # the full state spread over the ranks again
        from_full = _adamw(model)
        set_optimizer_state_dict(model, from_full, full, options=FULL)
        # per-rank state loaded into an optimizer that never stepped: its layout cannot be
        # told, so its first step refuses it, unless the optimizer was watched before
        per_rank = optimizer.state_dict()
        blind = _adamw(model)
        blind.load_state_dict(per_rank)
        with pytest.raises(ParallelismError, match=r"qkv_proj\.weight"):
            blind.step()
        watched = _adamw(model)
        watch_optimizer(watched)
        watched.load_state_dict(per_rank)
        report = {
            "full": {k: full["state"][QKV][k] for k in MOMENTS},
            "same_degree": _same_moments(again, optimizer),
            "from_full": _same_moments(from_full, optimizer),
            "per_rank": _same_moments(watched, optimizer),
            "next_loss": (_train(model, optimizer, steps=1), _loss(model))[1],
        }
        torch.save(report, root / f"optim-rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_optimizer_state_of_a_tensor_parallel_swapped_model_moves_in_the_fused_layout(tmp_path):
    _checkpoint(tmp_path, "llama", seed=0)
    run_ranks(
        _optim_rank, (free_port(), str(tmp_path)), nprocs=WORLD_SIZE, timeout_s=SPAWN_TIMEOUT_S
    )
    ranks = [torch.load(tmp_path / f"optim-rank{rank}.pt") for rank in range(WORLD_SIZE)]

    whole = _whole("llama", tmp_path / "llama-seed0")
    optimizer = _adamw(whole)
    _train(whole, optimizer, steps=2)
    expected = optimizer.state[whole.get_parameter(QKV)]
    for report in ranks:
        assert report["same_degree"]
        assert report["from_full"]
        assert report["per_rank"]
        # the full optimizer state is the unsharded swapped model's, in [q; k; v] order
        for key in MOMENTS:
            torch.testing.assert_close(report["full"][key], expected[key], msg=key)

    # two ranks -> one process: the unsharded model goes on from where the two ranks were
    loaded = _whole("llama", tmp_path / "llama-seed0")
    resumed = _adamw(loaded)
    state = {"model": loaded.state_dict(), "optim": get_optimizer_state_dict(loaded, resumed)}
    dcp.load(state, checkpoint_id=tmp_path / "llama-optim-tp2")
    loaded.load_state_dict(state["model"])
    set_optimizer_state_dict(loaded, resumed, state["optim"])
    for key in MOMENTS:
        torch.testing.assert_close(resumed.state[loaded.get_parameter(QKV)][key], expected[key])
    _train(loaded, resumed, steps=1)
    next_loss = _loss(loaded)
    for report in ranks:
        assert report["next_loss"] == pytest.approx(next_loss, rel=1e-4)
