"""A ``torch.distributed.checkpoint`` checkpoint of an original model, loaded into a swapped
model (:mod:`layerswap.dcp_loads`): the original layout's parts are read into the joined
tensors, or the load is refused before any tensor is read. One process, no process group.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from models import prompt_logits, swapped_llama, tiny_model
from torch.distributed.checkpoint import DefaultLoadPlanner

from layerswap.errors import ConversionError

QKV = "model.layers.0.self_attn.qkv_proj.weight"


def _save(state: dict[str, torch.Tensor], path: Path) -> Path:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no process group: one process", as intended
        dcp.save(state, checkpoint_id=path)
    return path


def _load(state: dict[str, torch.Tensor], path: Path, *, partial: bool = True) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(state, checkpoint_id=path, planner=DefaultLoadPlanner(allow_partial_load=partial))


_IDS = torch.tensor([[1, 5, 9, 22, 3, 7]])


def _step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> float:
    """One training step on a fixed batch; its loss."""
    loss = model(input_ids=_IDS, labels=_IDS).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return float(loss.detach())


@pytest.fixture
def original(tmp_path: Path) -> tuple[Path, torch.Tensor]:
    model = tiny_model("llama", seed=0, num_hidden_layers=2)
    return _save(model.state_dict(), tmp_path / "original"), prompt_logits(model)


def test_an_original_dcp_checkpoint_loads_whole_into_a_swapped_model(
    original: tuple[Path, torch.Tensor],
) -> None:
    path, expected = original
    model = swapped_llama(seed=7)
    assert not torch.allclose(prompt_logits(model), expected)
    state = model.state_dict()
    _load(state, path)
    model.load_state_dict(state)
    torch.testing.assert_close(prompt_logits(model), expected, rtol=1e-5, atol=1e-5)


def test_an_original_dcp_checkpoint_loads_with_the_default_planner_too(
    original: tuple[Path, torch.Tensor],
) -> None:
    """DCP raised about the missing qkv_proj; now nothing is missing."""
    path, expected = original
    model = swapped_llama(seed=7)
    state = model.state_dict()
    _load(state, path, partial=False)
    model.load_state_dict(state)
    torch.testing.assert_close(prompt_logits(model), expected, rtol=1e-5, atol=1e-5)


def test_copies_of_the_state_and_a_nested_state_load_the_original_layout(
    original: tuple[Path, torch.Tensor], tmp_path: Path
) -> None:
    path, expected = original
    model = swapped_llama(seed=7)
    copies = {key: value.clone() for key, value in model.state_dict().items()}
    _load(copies, path)
    model.load_state_dict(copies)
    torch.testing.assert_close(prompt_logits(model), expected, rtol=1e-5, atol=1e-5)

    nested_path = tmp_path / "nested"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(
            {"model": tiny_model("llama", seed=0, num_hidden_layers=2).state_dict()},
            checkpoint_id=nested_path,
        )
    model = swapped_llama(seed=7)
    nested = {"model": model.state_dict()}
    _load(nested, nested_path)  # type: ignore[arg-type]
    model.load_state_dict(nested["model"])
    torch.testing.assert_close(prompt_logits(model), expected, rtol=1e-5, atol=1e-5)


def test_a_checkpoint_of_some_layers_loads_them_and_keeps_the_rest(tmp_path: Path) -> None:
    """A legitimately partial checkpoint (layer 0 and no lm_head): what it holds is read,
    joined; the rest keeps the model's own values, as any partial load does."""
    original = tiny_model("llama", seed=0, num_hidden_layers=2)
    state = {
        key: value
        for key, value in original.state_dict().items()
        if not key.startswith(("model.layers.1.", "lm_head."))
    }
    path = _save(state, tmp_path / "layer0")
    model = swapped_llama(seed=7)
    own = {key: value.clone() for key, value in model.state_dict().items()}
    loaded = model.state_dict()
    _load(loaded, path)
    model.load_state_dict(loaded)
    after = model.state_dict()
    attention = "model.layers.0.self_attn."
    joined = torch.cat([state[f"{attention}{p}_proj.weight"] for p in "qkv"])
    assert torch.equal(after[QKV], joined)
    mlp = "model.layers.0.mlp."
    joined = torch.cat([state[f"{mlp}gate_proj.weight"], state[f"{mlp}up_proj.weight"]])
    assert torch.equal(after[f"{mlp}gate_up_proj.weight"], joined)
    for key, value in after.items():
        if key.startswith(("model.layers.1.", "lm_head.")):
            assert torch.equal(value, own[key]), key


def test_a_part_the_checkpoint_lacks_is_named_or_keeps_its_rows(tmp_path: Path) -> None:
    """A joined tensor given in part: without allow_partial_load DCP names the missing
    part (not the joined tensor); with it, the given parts are read and the missing one's
    rows keep the model's own values."""
    original = tiny_model("llama", seed=0, num_hidden_layers=2).state_dict()
    state = {
        key: value
        for key, value in original.items()
        if not key.endswith("0.self_attn.v_proj.weight")
    }
    path = _save(state, tmp_path / "no-v")
    model = swapped_llama(seed=7)
    own = model.state_dict()[QKV].clone()
    with pytest.raises(BaseException, match=r"layers\.0\.self_attn\.v_proj\.weight"):
        _load(model.state_dict(), path, partial=False)
    loaded = model.state_dict()
    _load(loaded, path)
    model.load_state_dict(loaded)
    q, k = (original[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qk")
    rows = q.shape[0] + k.shape[0]
    after = model.state_dict()[QKV]
    assert torch.equal(after[:rows], torch.cat([q, k]))
    assert torch.equal(after[rows:], own[rows:])


def test_parts_of_another_shape_are_refused_before_anything_is_read(tmp_path: Path) -> None:
    state = dict(tiny_model("llama", seed=0, num_hidden_layers=2).state_dict())
    key = "model.layers.1.self_attn.k_proj.weight"
    state[key] = state[key][:-4].clone()  # a checkpoint of another configuration
    path = _save(state, tmp_path / "other")
    model = swapped_llama(seed=7)
    before = {name: value.clone() for name, value in model.state_dict().items()}
    loaded = model.state_dict()
    with pytest.raises(ConversionError, match=r"k_proj\.weight' is \(28, 128\).*Nothing was read"):
        _load(loaded, path)
    assert list(loaded) == list(before)
    assert all(torch.equal(before[name], value) for name, value in model.state_dict().items())


def test_a_model_and_optimizer_checkpoint_of_the_original_resumes_the_swapped_model(
    tmp_path: Path,
) -> None:
    """AdamW's moments of q/k/v are read into the joined tensor's, its step count from q's:
    the swapped model's next step is the original's."""
    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    original = tiny_model("llama", seed=0, num_hidden_layers=2)
    adamw = torch.optim.AdamW(original.parameters(), lr=1e-2)
    _step(original, adamw)
    state = {"model": original.state_dict(), "optim": get_optimizer_state_dict(original, adamw)}
    path = _save(state, tmp_path / "trained")  # type: ignore[arg-type]
    model = swapped_llama(seed=7)
    resumed = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state = {"model": model.state_dict(), "optim": get_optimizer_state_dict(model, resumed)}
    _load(state, path, partial=False)  # type: ignore[arg-type]
    model.load_state_dict(state["model"])
    set_optimizer_state_dict(model, resumed, state["optim"])
    moments = resumed.state[model.get_parameter(QKV)]["exp_avg"]
    attention = "model.layers.0.self_attn."
    expected = torch.cat(
        [
            adamw.state[original.get_parameter(f"{attention}{p}_proj.weight")]["exp_avg"]
            for p in "qkv"
        ]
    )
    assert torch.equal(moments, expected)
    assert _step(model, resumed) == pytest.approx(_step(original, adamw), rel=1e-5)
    assert _step(model, resumed) == pytest.approx(_step(original, adamw), rel=1e-4)


@pytest.fixture
def one_rank() -> Iterator[None]:
    """A process group of this process alone (a DTensor needs a mesh)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_a_sharded_joined_tensor_is_refused_before_anything_is_read(
    original: tuple[Path, torch.Tensor], one_rank: None
) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    path, _ = original
    model = swapped_llama(seed=7)
    before = {name: value.clone() for name, value in model.state_dict().items()}
    state = model.state_dict()
    mesh = init_device_mesh("cpu", (1,))
    state[QKV] = DTensor.from_local(state[QKV], mesh, [Shard(0)])
    keys = list(state)
    with pytest.raises(ConversionError, match=r"qkv_proj\.weight'; here that tensor is a DTensor"):
        _load(state, path)
    assert list(state) == keys
    assert all(torch.equal(before[name], value) for name, value in model.state_dict().items())


def test_a_swapped_layout_checkpoint_and_a_model_without_swapped_layers_load_as_before(
    original: tuple[Path, torch.Tensor], tmp_path: Path
) -> None:
    path, expected = original
    swapped = swapped_llama(seed=0)
    swapped_path = _save(swapped.state_dict(), tmp_path / "swapped")
    model = swapped_llama(seed=7)
    state = model.state_dict()
    _load(state, swapped_path, partial=False)
    model.load_state_dict(state)
    torch.testing.assert_close(prompt_logits(model), expected, rtol=1e-5, atol=1e-5)
    # an original model beside the swapped ones: its own layout, nothing joined or added
    plain = tiny_model("llama", seed=7, num_hidden_layers=2)
    state = plain.state_dict()
    keys = list(state)
    _load(state, path, partial=False)
    assert list(state) == keys
    plain.load_state_dict(state)
    torch.testing.assert_close(prompt_logits(plain), expected, rtol=1e-5, atol=1e-5)


def test_a_swapped_models_checkpoint_into_an_original_model_is_refused(
    tmp_path: Path,
) -> None:
    """A checkpoint in the swapped layout names qkv_proj where an original model's state
    names q/k/v: DCP missed them, or with allow_partial_load skipped them without a word
    while the rest loaded. Refused before anything is read, with either planner."""
    swapped = swapped_llama(seed=0)
    path = _save(swapped.state_dict(), tmp_path / "swapped")
    plain = tiny_model("llama", seed=7, num_hidden_layers=2)
    for partial in (True, False):
        state = plain.state_dict()
        before = {key: value.clone() for key, value in state.items()}
        with pytest.raises(
            ConversionError, match=r"holds '.*(qkv|gate_up)_proj\.weight'.*Nothing was read"
        ):
            _load(state, path, partial=partial)
        assert all(torch.equal(before[key], value) for key, value in state.items())


def test_dcp_loading_has_the_names_layerswap_advises() -> None:
    """The functions layerswap advises are there in the installed torch, called as read."""
    import inspect

    from torch.distributed.checkpoint import default_planner, state_dict_loader
    from torch.distributed.checkpoint.api import CheckpointException

    from layerswap.dcp_loads import ADVICE, DCP_LOAD_TARGET, DCP_PLAN_TARGET

    assert [target for target, _ in ADVICE] == [DCP_PLAN_TARGET, DCP_LOAD_TARGET]
    module, name = DCP_PLAN_TARGET.split(":")
    assert module == default_planner.__name__
    assert list(inspect.signature(getattr(default_planner, name)).parameters)[:3] == [
        "state_dict",
        "metadata",
        "strict",
    ]
    # the planner looks it up in its module when it plans: advice on the name reaches it
    assert name in default_planner.DefaultLoadPlanner.create_local_plan.__code__.co_names
    module, name = DCP_LOAD_TARGET.split(":")
    assert module == state_dict_loader.__name__
    assert name in inspect.unwrap(state_dict_loader.load).__code__.co_names
    assert "planner" in inspect.signature(getattr(state_dict_loader, name)).parameters
    assert isinstance(CheckpointException.failures, property)


def test_the_live_layouts_are_read_while_another_thread_swaps() -> None:
    """A dcp.load's plan reads the live swapped layers while other threads swap and copy
    (each adds a layer): it read a set changing size under it."""
    import sys
    import threading

    from layerswap import state

    hook = state.layout_hooks(swapped_llama(seed=7))[0][2]
    layers = [torch.nn.Module() for _ in range(2000)]  # a big swapped model's layers
    for layer in layers:
        state.install_load_hook(layer, hook.substitution, hook.config)
    stop = threading.Event()

    def swapping() -> None:
        made = []
        while not stop.is_set():
            layer = torch.nn.Module()
            state.install_load_hook(layer, hook.substitution, hook.config)
            made.append(layer)
            if len(made) > 50:
                made.clear()

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    thread = threading.Thread(target=swapping)
    thread.start()
    try:
        for _ in range(200):
            assert state.live_layout_hooks()
    finally:
        stop.set()
        thread.join()
        sys.setswitchinterval(interval)


def test_a_flattened_optimizer_checkpoint_of_the_original_resumes_each_group(
    tmp_path: Path,
) -> None:
    """An optimizer state flattened as torchtitan saves it
    (flatten_optimizer_state_dict=True) names each group's settings per parameter
    (``param_groups.<name>.lr``: numbers, not tensors) and torch rebuilds a group from its
    first parameter's: the joined tensor's were missing (DCP raised), or, with
    allow_partial_load, kept the new optimizer's lr for a group it leads."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    flat = StateDictOptions(flatten_optimizer_state_dict=True)

    def groups(model: torch.nn.Module) -> list[dict[str, object]]:
        named = list(model.named_parameters())
        return [
            {"params": [p for n, p in named if "self_attn" in n], "lr": 1e-2},
            {"params": [p for n, p in named if "self_attn" not in n], "lr": 1e-3},
        ]

    original = tiny_model("llama", seed=0, num_hidden_layers=2)
    adamw = torch.optim.AdamW(groups(original))
    _step(original, adamw)
    for group in adamw.param_groups:
        group["lr"] /= 2  # as a scheduler moves it
    state = {
        "model": original.state_dict(),
        "optim": get_optimizer_state_dict(original, adamw, options=flat),
    }
    path = _save(state, tmp_path / "trained")  # type: ignore[arg-type]
    for partial in (False, True):
        model = swapped_llama(seed=7)
        resumed = torch.optim.AdamW(groups(model))
        state = {
            "model": model.state_dict(),
            "optim": get_optimizer_state_dict(model, resumed, options=flat),
        }
        _load(state, path, partial=partial)  # type: ignore[arg-type]
        model.load_state_dict(state["model"])
        set_optimizer_state_dict(model, resumed, state["optim"], options=flat)
        assert [g["lr"] for g in resumed.param_groups] == [5e-3, 5e-4], partial
    copy = torch.optim.AdamW(groups(original))
    copy.load_state_dict(adamw.state_dict())
    assert _step(model, resumed) == pytest.approx(_step(original, copy), rel=1e-5)
    assert _step(model, resumed) == pytest.approx(_step(original, copy), rel=1e-4)


def test_an_optimizer_group_of_joined_tensors_alone_resumes_from_a_nested_state(
    tmp_path: Path,
) -> None:
    """A nested optimizer state (get_optimizer_state_dict's default) names each group's
    parameters in a list, which DCP reads from the checkpoint: in the original layout.
    torch matches a group to the optimizer's by those names, and a group of q/k/v alone
    matched none of the swapped model's (``KeyError: 'lr'``); the list read is named in
    the swapped layout, so the group resumes with the checkpoint's settings."""
    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    def groups(model: torch.nn.Module, attention: tuple[str, ...]) -> list[dict[str, object]]:
        named = list(model.named_parameters())
        joined = [p for n, p in named if any(part in n for part in attention)]
        rest = [p for n, p in named if not any(part in n for part in attention)]
        return [{"params": joined, "lr": 1e-2}, {"params": rest, "lr": 1e-3}]

    parts = ("q_proj", "k_proj", "v_proj")
    original = tiny_model("llama", seed=0, num_hidden_layers=2)
    adamw = torch.optim.AdamW(groups(original, parts))
    _step(original, adamw)
    for group in adamw.param_groups:
        group["lr"] /= 2  # as a scheduler moves it
    state = {"model": original.state_dict(), "optim": get_optimizer_state_dict(original, adamw)}
    path = _save(state, tmp_path / "trained")  # type: ignore[arg-type]
    for partial in (False, True):
        model = swapped_llama(seed=7)
        resumed = torch.optim.AdamW(groups(model, ("qkv_proj",)))
        state = {"model": model.state_dict(), "optim": get_optimizer_state_dict(model, resumed)}
        _load(state, path, partial=partial)  # type: ignore[arg-type]
        model.load_state_dict(state["model"])
        set_optimizer_state_dict(model, resumed, state["optim"])
        assert [g["lr"] for g in resumed.param_groups] == [5e-3, 5e-4], partial
    copy = torch.optim.AdamW(groups(original, parts))
    copy.load_state_dict(adamw.state_dict())
    assert _step(model, resumed) == pytest.approx(_step(original, copy), rel=1e-5)
    assert _step(model, resumed) == pytest.approx(_step(original, copy), rel=1e-4)


@pytest.mark.parametrize("lr", [float, torch.tensor], ids=["number", "tensor"])
def test_parts_of_one_joined_tensor_in_groups_of_other_settings_are_refused(
    tmp_path: Path, lr: Any
) -> None:
    """The original's optimizer trains q at another lr than k and v; the swapped model's
    qkv_proj has one group, so it could only resume with one part's lr (it took q's for
    all three, without a word). Refused before anything is read, nested or flattened; a
    tensor lr too, which DCP saves as a tensor, not with the groups' other settings."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    original = tiny_model("llama", seed=0, num_hidden_layers=2)
    named = list(original.named_parameters())
    adamw = torch.optim.AdamW(
        [
            {"params": [p for n, p in named if "q_proj" in n], "lr": lr(1e-2)},
            {"params": [p for n, p in named if "q_proj" not in n], "lr": lr(1e-3)},
        ]
    )
    _step(original, adamw)
    for flat in (False, True):
        options = StateDictOptions(flatten_optimizer_state_dict=flat)
        state = {
            "model": original.state_dict(),
            "optim": get_optimizer_state_dict(original, adamw, options=options),
        }
        path = _save(state, tmp_path / f"split-{flat}")  # type: ignore[arg-type]
        model = swapped_llama(seed=7)
        resumed = torch.optim.AdamW(model.parameters(), lr=lr(1.0))
        state = {
            "model": model.state_dict(),
            "optim": get_optimizer_state_dict(model, resumed, options=options),
        }
        before = {key: value.clone() for key, value in state["model"].items()}
        with pytest.raises(ConversionError, match=r"groups of different settings \(lr\)"):
            _load(state, path)  # type: ignore[arg-type]
        assert all(torch.equal(before[key], value) for key, value in state["model"].items())


def test_loads_that_read_no_joined_tensors_group_are_not_refused_for_split_groups(
    tmp_path: Path,
) -> None:
    """A checkpoint whose optimizer trains q at another lr than k and v: the swapped
    model's weights alone, and an original model with its own optimizer, load from it
    while a swapped model lives (both were refused: neither reads a joined tensor's
    group)."""
    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    def split(model: torch.nn.Module) -> list[dict[str, object]]:
        named = list(model.named_parameters())
        return [
            {"params": [p for n, p in named if "q_proj" in n], "lr": 1e-2},
            {"params": [p for n, p in named if "q_proj" not in n], "lr": 1e-3},
        ]

    original = tiny_model("llama", seed=0, num_hidden_layers=2)
    adamw = torch.optim.AdamW(split(original))
    _step(original, adamw)
    state = {"model": original.state_dict(), "optim": get_optimizer_state_dict(original, adamw)}
    path = _save(state, tmp_path / "split")  # type: ignore[arg-type]
    expected = prompt_logits(original)

    model = swapped_llama(seed=7)
    weights = {"model": model.state_dict()}
    _load(weights, path, partial=False)  # type: ignore[arg-type]
    model.load_state_dict(weights["model"])
    torch.testing.assert_close(prompt_logits(model), expected, rtol=1e-5, atol=1e-5)

    other = tiny_model("llama", seed=3, num_hidden_layers=2)
    resumed = torch.optim.AdamW(split(other))
    state = {"model": other.state_dict(), "optim": get_optimizer_state_dict(other, resumed)}
    _load(state, path, partial=False)  # type: ignore[arg-type]
    other.load_state_dict(state["model"])
    set_optimizer_state_dict(other, resumed, state["optim"])
    assert [g["lr"] for g in resumed.param_groups] == [1e-2, 1e-3]
