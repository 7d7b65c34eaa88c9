"""Swapped models loaded sharded by transformers: tensor parallel and FSDP loading.

Two CPU processes (gloo) load the same tiny checkpoint three ways: whole in one
process (the reference), sharded as the original, and sharded inside
``layerswap.use`` (``from_pretrained(..., distributed_config=DistributedConfig(...))``).
The swapped model's logits, greedy generation, loss and the loss after one SGD step
equal the original's; ``save_pretrained`` writes the checkpoint's own tensors back.
"""

from __future__ import annotations

import datetime
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from models import FAMILIES
from ranks import free_port, run_ranks
from safetensors.torch import load_file

import layerswap
from layerswap import hf_internals, parallel
from layerswap.backends import _layer
from layerswap.errors import ParallelismError
from layerswap.registry import families

WORLD_SIZE = 2
SPAWN_TIMEOUT_S = 240
# llama: GQA; qwen3: per-head q/k norms (replicated, gradient all-reduced); qwen2: q/k/v biases
TP_FAMILIES = ("llama", "qwen3", "qwen2")

pytestmark = pytest.mark.skipif(
    not hf_internals.loads_sharded_on_read(),
    reason="this transformers loads sharded models without shard-on-read (before 5.24)",
)


def _checkpoint(directory: Path, family_name: str) -> Path:
    family = families()[family_name]
    model = family.build(family.tiny_config(num_hidden_layers=2), seed=0)
    path = directory / family_name
    model.save_pretrained(path)
    return path


def _run(model: Any, input_ids: torch.Tensor) -> dict[str, Any]:
    with torch.no_grad():
        logits = model(input_ids).logits
    generated = model.generate(
        input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=4, do_sample=False
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    loss = model(input_ids, labels=input_ids).loss
    loss.backward()
    optimizer.step()
    with torch.no_grad():
        after = model(input_ids, labels=input_ids).loss
    return {"logits": logits, "generated": generated, "loss": loss.detach(), "after": after}


def _rank(rank: int, port: int, cases: list[tuple[str, str, str]], out_dir: str) -> None:
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
    try:
        report: dict[str, Any] = {}
        input_ids = torch.randint(0, 100, (2, 9), generator=torch.Generator().manual_seed(0))
        for family_name, engine, checkpoint in cases:
            sizes = {"tp": {"tp_size": WORLD_SIZE}, "fsdp": {"fsdp_size": WORLD_SIZE}}[engine]
            results = {"whole": _run(AutoModelForCausalLM.from_pretrained(checkpoint), input_ids)}
            sharded = {"distributed_config": DistributedConfig(**sizes)}
            original = AutoModelForCausalLM.from_pretrained(checkpoint, **sharded)
            try:  # a sharded model is not converted in place
                layerswap.swap(original, f"{family_name}.decoder.fused")
                results["swap_after"] = "no error"
            except ParallelismError as exc:
                results["swap_after"] = str(exc)
            results["original"] = _run(original, input_ids)
            with layerswap.use(f"{family_name}.decoder.fused"):
                swapped = AutoModelForCausalLM.from_pretrained(checkpoint, **sharded)
            qkv = swapped.model.layers[0].self_attn.qkv_proj.weight
            results["qkv_local_rows"] = qkv.to_local().shape[0]
            results["layer_class"] = type(swapped.model.layers[0]).__name__
            saved = f"{checkpoint}-{engine}-saved"
            swapped.save_pretrained(saved)  # before the training step changes the weights
            results["swapped"] = _run(swapped, input_ids)
            report[f"{family_name}-{engine}"] = results
            report[f"{family_name}-{engine}-saved"] = saved
        # the head slot's loss needs the whole vocabulary: refused, not computed on half
        with layerswap.use("llama.head.fused"):
            headed = AutoModelForCausalLM.from_pretrained(
                cases[0][2], distributed_config=DistributedConfig(tp_size=WORLD_SIZE)
            )
        try:
            headed.train()(input_ids, labels=input_ids)  # the fused loss runs in training
            report["head"] = "no error"
        except Exception as exc:
            report["head"] = f"{type(exc).__name__}: {exc}"
        # an override gathering a concatenated module: the rows arrive per rank, and the
        # gather would read them as whole parts; refused before any tensor loads
        overridden = {
            "model.layers.*.self_attn.qkv_proj": "colwise_gather_output",
            "model.layers.*.self_attn.o_proj": "rowwise_split_input",
        }
        try:
            with layerswap.use("llama.decoder.fused"):
                AutoModelForCausalLM.from_pretrained(
                    cases[0][2],
                    distributed_config=DistributedConfig(tp_size=WORLD_SIZE, tp_plan=overridden),
                )
            report["override"] = "no error"
        except ParallelismError as exc:
            report["override"] = str(exc)
        torch.save(report, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _spawn(cases: list[tuple[str, str, str]], out_dir: Path) -> list[dict[str, Any]]:
    run_ranks(
        _rank, (free_port(), cases, str(out_dir)), nprocs=WORLD_SIZE, timeout_s=SPAWN_TIMEOUT_S
    )
    return [torch.load(out_dir / f"rank{rank}.pt") for rank in range(WORLD_SIZE)]


@pytest.mark.slow
def test_tensor_parallel_and_fsdp_loading_of_swapped_models_equal_the_original(tmp_path):
    cases = [(name, "tp", str(_checkpoint(tmp_path, name))) for name in TP_FAMILIES]
    cases.append(("llama", "fsdp", cases[0][2]))
    ranks = _spawn(cases, tmp_path)

    for family_name, engine, checkpoint in cases:
        label = f"{family_name}-{engine}"
        config = families()[family_name].tiny_config()
        head_dim = config.hidden_size // config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or head_dim
        whole_rows = (config.num_attention_heads + 2 * config.num_key_value_heads) * head_dim
        for report in ranks:
            results = report[label]
            assert "Fused" in results["layer_class"], label  # FSDP subclasses it
            assert "already sharded" in results["swap_after"], label
            # each rank holds half of the fused projection: its heads of q, k and v (TP)
            # or its stretch of the parameter (FSDP)
            assert results["qkv_local_rows"] == whole_rows // WORLD_SIZE, label
            original, swapped, whole = results["original"], results["swapped"], results["whole"]
            for key in ("logits", "loss", "after"):
                torch.testing.assert_close(swapped[key], original[key], msg=f"{label} {key}")
            # FSDP-loaded models (the original too) take a different step than one whole
            # model (their gradients are reduced across the ranks): compared before it
            for key in ("logits", "loss", "after") if engine == "tp" else ("logits", "loss"):
                torch.testing.assert_close(
                    swapped[key], whole[key], rtol=1e-4, atol=1e-5, msg=f"{label} {key}"
                )
            assert torch.equal(swapped["generated"], original["generated"]), label
            assert torch.equal(swapped["generated"], whole["generated"]), label
        for report in ranks:
            assert "qkv_proj 'colwise_gather_output'" in report["override"], report["override"]
            assert report["head"].startswith("ParallelismError"), report["head"]
            assert "split lm_head's weight across ranks" in report["head"]
        # saving gathers the shards and writes the checkpoint's own layout and tensors
        written = load_file(Path(ranks[0][f"{label}-saved"]) / "model.safetensors")
        expected = load_file(Path(checkpoint) / "model.safetensors")
        assert written.keys() == expected.keys(), label
        for name, tensor in expected.items():
            assert torch.equal(written[name], tensor), f"{label} {name}"


# --- the plan, without processes ------------------------------------------------------------


def _swapped(family_name: str) -> Any:
    family = families()[family_name]
    with layerswap.use(f"{family_name}.decoder.fused"):
        return family.build(family.tiny_config(num_hidden_layers=2), seed=0)


def test_a_swapped_llama_shards_its_fused_projections_colwise_as_packed_shards():
    model = _swapped("llama")
    plan = model._tp_plan
    assert plan["model.layers.*.self_attn.qkv_proj"] == "colwise"
    assert plan["model.layers.*.mlp.gate_up_proj"] == "colwise"
    assert plan["model.layers.*.self_attn.o_proj"] == "rowwise"
    assert plan["model.layers.*.mlp.down_proj"] == "rowwise"
    originals = {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"}
    assert not any(name.rpartition(".")[2] in originals for name in plan)
    assert model.model._tp_plan["layers.*.self_attn.qkv_proj"] == "colwise"
    assert (
        model.config.base_model_tp_plan["layers.*.self_attn.q_proj"] == "colwise"
    )  # config untouched


def test_parts_the_original_gathers_stay_whole_on_every_rank():
    # OLMo 2 normalises q and k over all heads: the original gathers q/k/v outputs
    plan = _swapped("olmo2")._tp_plan
    assert "model.layers.*.self_attn.qkv_proj" not in plan
    assert plan["model.layers.*.self_attn.o_proj"] == "rowwise_split_input"
    assert plan["model.layers.*.mlp.gate_up_proj"] == "colwise"


def test_parts_sharded_in_different_styles_are_refused_when_transformers_applies_the_plan():
    from transformers.integrations.tensor_parallel import ALL_PARALLEL_STYLES

    sub = layerswap.get("llama.decoder.fused")
    model = _swapped("llama")
    original = dict(model.config.base_model_tp_plan)
    original["layers.*.self_attn.k_proj"] = "colwise_gather_output"
    layers = ["layers.0", "layers.1"]
    plan, refused = parallel.translate_tp_plan(original, sub, model.model, layers)
    assert plan["layers.*.self_attn.qkv_proj"] == parallel.REFUSED_STYLE
    (reason,) = refused.values()
    assert "self_attn.k_proj: colwise_gather_output" in reason and "packed" in reason
    model.model._tp_plan = original
    translated = parallel.tp_plan_of(model.model, sub, layers)
    assert translated is not None
    attention = model.model.layers[1].self_attn.qkv_proj
    with pytest.raises(ParallelismError, match="k_proj: colwise_gather_output"):
        ALL_PARALLEL_STYLES[parallel.REFUSED_STYLE].install_forward(attention, None)


@pytest.mark.parametrize("family_name", FAMILIES)
def test_every_swapped_family_plan_names_only_modules_it_has(family_name):
    model = _swapped(family_name)
    names = {parallel._wildcard(n) for n, _ in model.named_modules()}
    names |= {parallel._wildcard(n) for n, _ in model.named_parameters()}
    for key, style in (getattr(model, "_tp_plan", None) or {}).items():
        assert key in names, f"{family_name}: plan entry {key} ({style}) names nothing"


def test_layers_not_declared_sharded_are_refused_whole():
    import dataclasses

    model = _swapped("llama")
    sub = dataclasses.replace(layerswap.get("llama.decoder.fused"), tensor_parallel="not tested")
    plan, refused = parallel.translate_tp_plan(
        model.config.base_model_tp_plan, sub, model.model, ["layers.0", "layers.1"]
    )
    assert plan["layers.*"] == parallel.REFUSED_STYLE
    assert plan == {"layers.*": parallel.REFUSED_STYLE}  # no entry inside the layers
    assert refused == {"layers.*": "llama.decoder.fused: not tested"}
    for name in ("te", "liger"):
        assert layerswap.get_backend(name).tensor_parallel  # refused, with a reason
    assert layerswap.get_backend("fused").tensor_parallel is None


def test_swap_after_construction_translates_the_plan_and_undo_restores_it():
    family = families()["qwen3"]
    model = family.build(family.tiny_config(num_hidden_layers=2), seed=0)
    before = dict(model._tp_plan)
    handle = layerswap.swap(model, "qwen3.decoder.fused")
    assert model._tp_plan["model.layers.*.self_attn.qkv_proj"] == "colwise"
    assert model._tp_plan["model.layers.*.self_attn.q_norm"] == "replicated_with_grad_allreduce"
    handle.undo()
    assert model._tp_plan == before


# --- per-rank arithmetic --------------------------------------------------------------------


def test_a_packed_projection_splits_by_each_parts_share():
    assert _layer.local_sizes((256, 64, 64), 384) == [256, 64, 64]
    assert _layer.local_sizes((256, 64, 64), 192) == [128, 32, 32]
    with pytest.raises(ValueError, match="key/value heads"):
        _layer.local_sizes((256, 64, 64), 128)


def test_a_gathered_packed_tensor_is_reordered_to_whole_parts():
    q, k, v = torch.arange(8.0), torch.arange(10.0, 14.0), torch.arange(20.0, 24.0)
    # two ranks, each holding its half of q, of k and of v, gathered rank after rank
    gathered = torch.cat([q[:4], k[:2], v[:2], q[4:], k[2:], v[2:]])
    assert torch.equal(parallel.unpack_gathered(gathered, (8, 4, 4), 0, 2), torch.cat([q, k, v]))


def test_a_ranks_stretch_follows_torch_chunk():
    shards = [parallel.Shard(rank, 3, packed=False, group=None) for rank in range(3)]
    assert [parallel.stretch(10, shard) for shard in shards] == [(0, 4), (4, 4), (8, 2)]
    assert [parallel.local_part_sizes((10, 4), shard) for shard in shards] == [
        [4, 2],
        [4, 2],
        [2, 0],
    ]
