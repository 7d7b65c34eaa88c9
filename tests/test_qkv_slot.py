"""The ``qkv`` slot: the projections an attention computes from one input, read from its
forward and packed into one product, on the models the decoder slot refuses (hybrids,
multi-head latent attention, Llama 4, Gemma 4) and on every family; the projections stay
the model's own parameters, and every path that moves them is checked when it runs."""

from __future__ import annotations

import copy
import gc
import io
import threading
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from test_mlp_slot import _model, _train_step
from test_norm_slot import _ids, _state, coverage_report, listed_and_swept
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoConfig, AutoModelForCausalLM

import layerswap
from layerswap.backends.projections import PackedLinear, ProjectionsReplacement
from layerswap.errors import SubstitutionError, SwapWarning, UpstreamDriftError
from layerswap.projections import ProjectionSpec, classify
from layerswap.swap import rebuild_originals

#: the model types people run in late 2026 whose attentions the slot packs
POPULAR = (
    "qwen3_next",
    "qwen3_5_text",
    "falcon_h1",
    "lfm2",
    "jamba",
    "bamba",
    "granitemoehybrid",
    "deepseek_v2",
    "deepseek_v3",
    "llama4_text",
    "gemma4_text",
    "gemma3n_text",
)
FAST = ("qwen3_next", "deepseek_v3", "llama4_text")


def _lanes() -> list[Any]:
    return [pytest.param(t, marks=() if t in FAST else pytest.mark.slow, id=t) for t in POPULAR]


def _packed(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, ProjectionsReplacement)]


class _Products(TorchDispatchMode):
    """Counts the matrix products run under it."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm):
            self.count += 1
        return func(*args, **(kwargs or {}))


def _products(module: nn.Module, *args: Any, **kwargs: Any) -> int:
    with torch.no_grad(), _Products() as counted:
        module(*args, **kwargs)
    return counted.count


# --- what an attention's forward projects from one input, read from its source -----------


class _Attention(nn.Module):
    def __init__(self, width: int = 16, *, bias: tuple[bool, bool, bool] = (False,) * 3) -> None:
        super().__init__()
        self.q_proj = nn.Linear(width, width, bias=bias[0])
        self.k_proj = nn.Linear(width, width // 2, bias=bias[1])
        self.v_proj = nn.Linear(width, width // 2, bias=bias[2])
        self.o_proj = nn.Linear(width, width, bias=False)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        q = self.q_proj(hidden_states)
        k = self.k_proj(hidden_states)
        v = self.v_proj(hidden_states)
        return self.o_proj(q * torch.cat([k, v], -1))


class _CrossAttention(_Attention):
    def forward(self, hidden_states: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        q = self.q_proj(hidden_states)
        k = self.k_proj(memory)
        v = self.v_proj(memory)
        return self.o_proj(q * torch.cat([k, v], -1))


class _Reassigned(_Attention):
    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        q = self.q_proj(hidden_states)
        hidden_states = hidden_states * 2
        k = self.k_proj(hidden_states)
        v = self.v_proj(hidden_states)
        return self.o_proj(q * torch.cat([k, v], -1))


class _ChangedInPlace(_Attention):
    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        q = self.q_proj(hidden_states)
        hidden_states.mul_(2)
        k = self.k_proj(hidden_states)
        v = self.v_proj(hidden_states)
        return self.o_proj(q * torch.cat([k, v], -1))


def test_the_projections_called_on_one_input_form_a_group() -> None:
    assert classify(_Attention()) == ProjectionSpec((("q_proj", "k_proj", "v_proj"),), (False,))
    # keys and values from another tensor: they are a group of their own, the query alone
    assert classify(_CrossAttention()) == ProjectionSpec((("k_proj", "v_proj"),), (False,))
    # the input assigned anew between the calls (its right side still reads the old one)
    assert classify(_Reassigned()) == ProjectionSpec((("k_proj", "v_proj"),), (False,))
    # changed in place between the calls: under inference_mode no version counter says so
    assert classify(_ChangedInPlace()) == ProjectionSpec((("k_proj", "v_proj"),), (False,))


def test_the_popular_attentions_are_read_with_their_own_names() -> None:
    llama4 = _model("llama4_text").model.layers[0].self_attn
    assert classify(llama4).groups == (("q_proj", "k_proj", "v_proj"),)
    deepseek = _model("deepseek_v3").model.layers[0].self_attn  # multi-head latent attention
    assert classify(deepseek).groups == (("q_a_proj", "kv_a_proj_with_mqa"),)


def test_what_the_slot_does_not_pack_is_said_with_the_reason() -> None:
    # with biases and without, one product each (Whisper's k_proj has none)
    assert classify(_Attention(bias=(True, False, True))) == ProjectionSpec(
        (("q_proj", "v_proj"),), (True,)
    )
    mixed = _Attention(bias=(True, False, False))
    mixed.v_proj = nn.Sequential(nn.Linear(16, 8))  # no in_features: not a projection
    assert "of q_proj+k_proj some have a bias and some none" in str(classify(mixed))
    wrapped = _Attention()
    wrapped.k_proj = nn.utils.parametrizations.weight_norm(nn.Linear(16, 8))
    assert "k_proj is a ParametrizedLinear, not an nn.Linear" in str(classify(wrapped))
    alone = _Attention()
    alone.k_proj = nn.Sequential(nn.Linear(16, 8))  # no in_features: not a projection
    alone.v_proj = nn.Sequential(nn.Linear(16, 8))
    assert "calls no two of its projections on one input" in str(classify(alone))


# --- swapped: the same numbers, one product ------------------------------------------------


@pytest.mark.parametrize("model_type", _lanes())
def test_a_popular_model_packs_its_attentions_and_computes_the_same(
    model_type: str, tmp_path: Path
) -> None:
    model = _model(model_type)
    ids, before = _ids(model), _state(model)
    params = dict(model.named_parameters())
    with torch.no_grad():
        logits = model(ids).logits
    tokens = model.generate(ids, max_new_tokens=4, do_sample=False)

    handle = layerswap.swap(model, f"{model_type}.qkv.fused")
    assert len(handle) > 0
    for name, original, made in handle.swapped:
        module = model.get_submodule(name)
        assert type(module) is made and isinstance(module, original)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, logits, rtol=1e-5, atol=1e-5)
    assert torch.equal(model.generate(ids, max_new_tokens=4, do_sample=False), tokens)
    # the same parameters under the same names: the original layout is what is saved
    assert all(p is params[n] for n, p in model.named_parameters())
    model.save_pretrained(tmp_path)
    plain = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert not _packed(plain)
    with torch.no_grad():
        torch.testing.assert_close(plain(ids).logits, logits, rtol=1e-5, atol=1e-5)

    handle.undo()
    assert not _packed(model) and not any(type(m) is PackedLinear for m in model.modules())
    after = _state(model)
    assert all(torch.equal(after[k], before[k]) for k in before)
    # each projection holds a storage of its own again
    attention = model.get_submodule(handle.swapped[0][0])
    storages = {id(p.untyped_storage()) for p in attention.parameters()}
    assert len({p.untyped_storage().data_ptr() for p in attention.parameters()}) == len(storages)


def test_an_attention_computes_its_projections_as_one_product() -> None:
    model = layerswap.get_family("llama").build(seed=0).eval()
    ids = _ids(model)
    attention = model.model.layers[0].self_attn
    x = torch.randn(1, 5, model.config.hidden_size)
    q, k, v = attention.q_proj, attention.k_proj, attention.v_proj

    def three(x: torch.Tensor) -> None:
        q(x), k(x), v(x)

    products = _products(model, ids)
    with layerswap.swap(model, "llama.qkv.fused"):
        # the weights are slices of one tensor, in the order forward calls them
        assert q.weight.data_ptr() + q.weight.nbytes == k.weight.data_ptr()
        assert k.weight.data_ptr() + k.weight.nbytes == v.weight.data_ptr()
        # one product per attention where the original ran three
        assert _products(model, ids) == products - 2 * model.config.num_hidden_layers
        # outside the attention's forward each projection computes its own product
        assert _products(three, x) == 3
        group = q._layerswap_group
        group.opened()  # as the attention's forward does
        try:
            assert _products(three, x) == 1
            # a projection called on another tensor computes the group's product anew
            assert _products(lambda x: (q(x), k(x.clone()), v(x)), x) == 3
        finally:
            group.closed()
        with torch.no_grad():
            torch.testing.assert_close(k(x), nn.functional.linear(x, k.weight))


def test_training_gives_the_original_loss_and_gradients_and_the_optimizer_steps_alike() -> None:
    family = layerswap.get_family("qwen2")  # q/k/v biases
    ids = _ids(family.build())
    models = [family.build(seed=0), family.build(seed=0)]
    layerswap.swap(models[1], "qwen2.qkv.fused")
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in models]
    (loss, grads), (packed_loss, packed_grads) = map(_train_step, models, (ids, ids))
    torch.testing.assert_close(packed_loss, loss, rtol=1e-5, atol=1e-6)
    assert packed_grads.keys() == grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(packed_grads[name], grad, rtol=1e-4, atol=1e-6)
    for _ in range(3):  # the optimizer updates the slices in place
        for optimizer in optimizers:
            optimizer.step()
        (loss, _), (packed_loss, _) = map(_train_step, models, (ids, ids))
        torch.testing.assert_close(packed_loss, loss, rtol=1e-4, atol=1e-5)
    attention = models[1].model.layers[0].self_attn
    assert attention.q_proj._layerswap_group.packed()  # stepped in place: still one tensor
    assert attention.q_proj.bias.data_ptr() + attention.q_proj.bias.nbytes == (
        attention.k_proj.bias.data_ptr()
    )


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_gradient_checkpointing_around_the_layers_recomputes_the_packed_product(
    reentrant: bool,
) -> None:
    model = layerswap.get_family("qwen3").build(seed=0)
    ids = _ids(model)
    model.gradient_checkpointing_enable({"use_reentrant": reentrant})
    loss, grads = _train_step(model, ids)
    with layerswap.swap(model, "qwen3.qkv.fused"), _Products() as counted:
        swapped_loss, swapped_grads = _train_step(model, ids)
    torch.testing.assert_close(swapped_loss, loss, rtol=1e-5, atol=1e-6)
    for name, grad in grads.items():
        torch.testing.assert_close(swapped_grads[name], grad, rtol=1e-4, atol=1e-6)
    with _Products() as original:
        _train_step(model, ids)
    # forward, the recomputed forward and backward each run one product per attention
    # where the original ran three
    layers = model.config.num_hidden_layers
    assert original.count - counted.count == layers * (2 + 2 + 2 * 2)


def test_moved_weights_are_packed_again_at_the_next_call() -> None:
    """``model.to`` gives each weight a tensor of its own: the next call packs them again,
    a deep copy likewise, and the numbers follow the moved weights."""
    model = layerswap.get_family("llama").build(seed=0).eval()
    ids = _ids(model)
    layerswap.swap(model, "llama.qkv.fused")
    group = model.model.layers[0].self_attn.q_proj._layerswap_group
    model.to(torch.float64)
    assert not group.packed()
    reference = copy.deepcopy(model)
    rebuild_originals(reference, "llama.qkv.fused")
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, reference(ids).logits)
    assert group.packed()
    assert model.model.layers[0].self_attn.q_proj.weight.dtype == torch.float64
    again = copy.deepcopy(model)
    with torch.inference_mode():
        torch.testing.assert_close(again(ids).logits, reference(ids).logits)
    assert again.model.layers[0].self_attn.q_proj._layerswap_group.packed()
    # packed under inference_mode, the copy still trains
    again.train()
    again(ids, labels=ids).loss.backward()


def test_weights_another_library_holds_are_left_to_it_and_said() -> None:
    """ZeRO-3 and FSDP keep parameters as views of a flat buffer of their own: the group is
    not packed (that would take them from it), the projections compute their own products,
    and a warning says so once."""
    model = layerswap.get_family("llama").build(seed=0).eval()
    ids = _ids(model)
    with torch.no_grad():
        expected = model(ids).logits
    layerswap.swap(model, "llama.qkv.fused")
    params = list(model.parameters())[::-1]  # not in the order the attention calls them
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    start = 0
    for param in params:
        param.data = flat[start : start + param.numel()].view_as(param)
        start += param.numel()
    with (
        pytest.warns(SwapWarning, match="q_proj\\+k_proj\\+v_proj are not packed.*ZeRO-3"),
        torch.no_grad(),
    ):
        got = model(ids).logits
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert params[0].data_ptr() == flat.data_ptr()  # the buffer still holds them


def test_weights_in_storages_of_their_own_side_by_side_are_not_taken_for_packed() -> None:
    """Separate tensors may lie back to back in memory (a caching allocator after
    ``model.to``; a checkpoint read in file order): they are packed anew, never read as one."""
    model = layerswap.get_family("llama").build(seed=0).eval()
    ids = _ids(model)
    with torch.no_grad():
        expected = model(ids).logits
    layerswap.swap(model, "llama.qkv.fused")
    attention = model.model.layers[0].self_attn
    members = (attention.q_proj, attention.k_proj, attention.v_proj)
    memory = torch.empty(sum(m.weight.numel() for m in members)).untyped_storage()
    start = 0
    for member in members:
        size = member.weight.numel() * member.weight.element_size()
        own = torch.empty(0).set_(memory[start : start + size], 0, member.weight.shape)
        own.copy_(member.weight.detach())
        member.weight.data = own
        start += size
    group = attention.q_proj._layerswap_group
    assert not group.packed()
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, expected, rtol=1e-5, atol=1e-5)
    assert group.packed()


def test_weights_made_when_called_are_made_before_the_product() -> None:
    """Pruning recomputes each projection's weight in a pre-hook when it is called: the
    projections compute their own products, from what their hooks make."""
    import torch.nn.utils.prune as prune

    family = layerswap.get_family("llama")
    ids = _ids(family.build())
    models = [family.build(seed=0), family.build(seed=0)]
    layerswap.swap(models[1], "llama.qkv.fused")
    for model in models:
        for layer in model.model.layers:
            for name in ("q_proj", "k_proj", "v_proj"):
                prune.l1_unstructured(getattr(layer.self_attn, name), "weight", amount=0.5)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.5) for m in models]
    for _ in range(3):
        (loss, _), (swapped_loss, _) = map(_train_step, models, (ids, ids))
        torch.testing.assert_close(swapped_loss, loss, rtol=1e-5, atol=1e-6)
        for optimizer in optimizers:
            optimizer.step()


@pytest.mark.parametrize("frozen", [False, True], ids=["trained", "frozen"])
def test_a_weight_changed_in_place_before_the_backward_pass_is_refused_as_by_the_original(
    frozen: bool,
) -> None:
    """Trained or frozen (a LoRA fine-tune's base weights), a projection's weight changed in
    place between forward and backward makes the backward pass fail, as the original's
    does: its input's gradient would be computed from the changed weight."""
    for swapped in (False, True):
        model = layerswap.get_family("llama").build(seed=0)
        if frozen:
            model.requires_grad_(False)
            model.get_input_embeddings().weight.requires_grad_(True)
        if swapped:
            layerswap.swap(model, "llama.qkv.fused")
        ids = _ids(model)
        loss = model(ids, labels=ids).loss
        with torch.no_grad():
            model.model.layers[0].self_attn.k_proj.weight.mul_(2)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            loss.backward()


def test_a_product_is_handed_over_only_in_the_mode_it_was_made_in() -> None:
    model = layerswap.get_family("llama").build(seed=0)
    attention = model.model.layers[0].self_attn
    x = torch.randn(1, 5, model.config.hidden_size)
    layerswap.swap(model, "llama.qkv.fused")
    group = attention.q_proj._layerswap_group
    group.opened()
    try:
        with torch.no_grad():
            attention.q_proj(x)
        assert attention.k_proj(x).requires_grad  # made anew, with grad
        attention.q_proj(x)
        assert group._local.pending is not None
    finally:
        group.closed()
    # nothing made in one call of the attention is kept after it
    assert group._local.pending is None


def test_projections_hooked_by_accelerate_before_the_swap_are_kept_and_after_it_packed() -> None:
    from accelerate.hooks import ModelHook, add_hook_to_module, remove_hook_from_module

    model = layerswap.get_family("llama").build(seed=0).eval()
    ids = _ids(model)
    add_hook_to_module(model.model.layers[0].self_attn.k_proj, ModelHook())
    with layerswap.swap(model, "llama.qkv.fused") as handle:
        assert "k_proj: its forward is set on the instance (an accelerate hook)" in (
            handle.report()
        )
        assert len(handle) == model.config.num_hidden_layers - 1
    products = _products(model, ids)
    with torch.no_grad():
        expected = model(ids).logits
    v_proj = model.model.layers[1].self_attn.v_proj
    handle = layerswap.swap(model, "llama.qkv.fused")
    add_hook_to_module(v_proj, ModelHook())
    # the hook runs the projection's own forward, which takes its slice
    assert _products(model, ids) == products - 2 * (model.config.num_hidden_layers - 1)
    # the hook calls PackedLinear's forward: undone under it, v_proj would call a forward
    # its class no longer has; refused, then undone once the hook is off
    with pytest.raises(SubstitutionError, match="v_proj's forward was set on the instance"):
        handle.undo()
    remove_hook_from_module(v_proj)
    handle.undo()
    with torch.no_grad():
        assert torch.equal(model(ids).logits, expected)


def test_torch_func_transforms_run_the_projections_as_the_original() -> None:
    from torch.func import functional_call, grad

    model = layerswap.get_family("llama").build(seed=0)
    ids = _ids(model)
    params = {n: p.detach() for n, p in model.named_parameters()}

    def loss(params: dict[str, torch.Tensor]) -> torch.Tensor:
        out: torch.Tensor = functional_call(model, params, (ids,), {"labels": ids}).loss
        return out

    expected = grad(loss)(params)
    layerswap.swap(model, "llama.qkv.fused")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SwapWarning)  # the tensors given are not the model's
        got = grad(loss)(params)
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, rtol=1e-4, atol=1e-6)


def test_threads_running_one_model_each_get_their_own_products() -> None:
    model = layerswap.get_family("llama").build(seed=0).eval()
    inputs = [
        torch.randint(3, 100, (1, 6), generator=torch.Generator().manual_seed(i)) for i in range(4)
    ]
    with torch.no_grad():
        expected = [model(ids).logits for ids in inputs]
    layerswap.swap(model, "llama.qkv.fused")
    failures: list[str] = []

    def run(i: int) -> None:
        for _ in range(10):
            with torch.no_grad():
                got = model(inputs[i]).logits
            if not torch.allclose(got, expected[i], rtol=1e-5, atol=1e-5):
                failures.append(f"thread {i}")

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures


def test_use_builds_and_loads_with_the_attentions_packed(tmp_path: Path) -> None:
    original = _model("deepseek_v3")
    ids = _ids(original)
    with torch.no_grad():
        expected = original(ids).logits
    original.save_pretrained(tmp_path)
    with layerswap.use("deepseek_v3.qkv.fused"), warnings.catch_warnings(record=True) as told:
        warnings.simplefilter("always")
        loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
        built = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tmp_path))
    # built on the meta device, then loaded: nothing to pack at construction, and no
    # warning that it could not be (the first forward packs what was loaded)
    assert not [w for w in told if issubclass(w.category, SwapWarning)]
    assert _packed(loaded) and _packed(built)
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, expected, rtol=1e-5, atol=1e-5)
    assert loaded.model.layers[0].self_attn.q_a_proj._layerswap_group.packed()
    assert not _packed(AutoModelForCausalLM.from_config(original.config))


def _saved(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    found: dict[str, torch.Tensor] = {}
    for path in sorted(directory.glob("*.safetensors")):
        found.update(load_file(path))
    return found


def test_savers_that_deduplicate_by_storage_write_every_packed_projection(tmp_path: Path) -> None:
    """The packed projections are slices of one storage. accelerate's save_model and
    save_state kept one tensor per storage and dropped k_proj and v_proj with a log line;
    safetensors' save_model and huggingface_hub's savers refused. Each writes the original's
    tensors, every one, and they load back; state_dict() still aliases the weights."""
    from accelerate import Accelerator
    from huggingface_hub import save_torch_state_dict
    from safetensors.torch import load_model, save_model

    model = layerswap.get_family("llama").build(seed=0).eval()
    ids = _ids(model)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        logits = model(ids).logits
    layerswap.swap(model, "llama.qkv.fused")
    state = model.state_dict()
    weight = model.model.layers[0].self_attn.k_proj.weight
    # in place through state_dict (an EMA's copy_) still reaches the model
    assert state["model.layers.0.self_attn.k_proj.weight"].data_ptr() == weight.data_ptr()
    accelerator = Accelerator(cpu=True)
    assert accelerator.prepare(model) is model
    saves = {
        "save_model": lambda d: accelerator.save_model(model, d),
        "save_state": accelerator.save_state,
        "safetensors": lambda d: save_model(model, str(d / "model.safetensors")),
        "hub": lambda d: save_torch_state_dict(model.state_dict(), d),
    }
    for name, save in saves.items():
        directory = tmp_path / name
        directory.mkdir()
        save(directory)
        written = _saved(directory)
        assert sorted(written) == sorted(expected), name
        assert all(torch.equal(written[k], v) for k, v in expected.items()), name
    fresh = layerswap.get_family("llama").build(seed=1).eval()
    layerswap.swap(fresh, "llama.qkv.fused")
    missing, unexpected = load_model(fresh, str(tmp_path / "safetensors" / "model.safetensors"))
    assert not missing and not unexpected
    with torch.no_grad():
        torch.testing.assert_close(fresh(ids).logits, logits, rtol=1e-5, atol=1e-5)


def test_separated_copies_disjoint_slices_and_keeps_tied_tensors() -> None:
    from layerswap.sliced_saves import separated

    packed = torch.arange(12.0)
    tied = torch.ones(3)
    state = {"q": packed[:4], "k": packed[4:8], "v": packed[8:], "a": tied, "b": tied}
    out = separated(state)
    storages = {out[k].untyped_storage().data_ptr() for k in "qkv"}
    assert len(storages) == 3 and all(torch.equal(out[k], state[k]) for k in "qkv")
    assert out["a"] is tied and out["b"] is tied  # one tensor under two names: as it was
    whole = {"w": packed, "part": packed[:4]}  # overlapping: a view of a saved tensor
    assert separated(whole)["part"] is whole["part"]
    # one attention module in two layers: its slices twice, under two names each
    shared = {"0.q": packed[:4], "0.k": packed[4:8], "1.q": packed[:4], "1.k": packed[4:8]}
    out = separated(shared)
    assert out["0.q"] is out["1.q"] and out["0.k"] is out["1.k"]  # still tied, by name
    assert out["0.q"].untyped_storage().data_ptr() != packed.untyped_storage().data_ptr()


def test_slices_are_saved_whole_after_undo_and_in_another_process(tmp_path: Path) -> None:
    """The slices outlive the swap that made them: a state dict taken before ``undo()``,
    and a packed model ``torch.load`` brings into a process that never swapped (nothing of
    layerswap imported but what unpickling imports)."""
    import subprocess
    import sys

    from accelerate.utils import save

    model = layerswap.get_family("llama").build(seed=0).eval()
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    handle = layerswap.swap(model, "llama.qkv.fused")
    with torch.no_grad():
        model(_ids(model))  # packed
    torch.save(model, tmp_path / "model.pt")
    state = model.state_dict()
    handle.undo()
    save(state, tmp_path / "state.safetensors", safe_serialization=True)
    from safetensors.torch import load_file

    written = load_file(tmp_path / "state.safetensors")
    assert sorted(written) == sorted(expected)
    code = (
        "import sys, torch\n"
        "from accelerate import Accelerator\n"
        "model = torch.load(sys.argv[1], weights_only=False)\n"
        "Accelerator(cpu=True).save_model(model, sys.argv[2])\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "model.pt"), str(tmp_path / "fresh")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    written = _saved(tmp_path / "fresh")
    assert sorted(written) == sorted(expected)
    assert all(torch.equal(written[k], v) for k, v in expected.items())


def _pair(name: str = "llama", **overrides: Any) -> tuple[nn.Module, nn.Module]:
    """A tiny model of the family ``name`` and a copy of it with its attentions packed."""
    family = layerswap.get_family(name)
    original = family.build(family.tiny_config(**overrides), seed=0).eval()
    packed = copy.deepcopy(original)
    layerswap.swap(packed, f"{name}.qkv.fused")
    return original, packed


def test_forward_mode_ad_through_the_weights_gives_the_originals_tangent() -> None:
    """Dual weights (``torch.autograd.forward_ad``): a packed product would drop their
    tangents, so under a dual level each projection computes its own."""
    import torch.autograd.forward_ad as fwad
    from torch.func import functional_call

    original, packed = _pair()
    for model in (original, packed):  # SDPA's CPU kernel has no forward-mode derivative
        model.config._attn_implementation = "eager"
    ids = _ids(original)

    def tangent(model: nn.Module) -> torch.Tensor:
        params = {k: v.detach() for k, v in model.named_parameters()}
        torch.manual_seed(3)
        with fwad.dual_level():
            duals = {
                k: fwad.make_dual(v, torch.randn_like(v) if "k_proj" in k else torch.zeros_like(v))
                for k, v in params.items()
            }
            out = functional_call(model, duals, (ids,)).logits
            found: torch.Tensor = fwad.unpack_dual(out).tangent
        return found

    expected = tangent(original)
    assert expected.abs().max() > 0
    torch.testing.assert_close(tangent(packed), expected, rtol=1e-5, atol=1e-5)


def test_a_bias_given_or_taken_after_the_swap_is_computed_as_by_the_original() -> None:
    for overrides, change in (({}, "give"), ({"attention_bias": True}, "take")):
        original, packed = _pair(**overrides)
        ids = _ids(original)
        for model in (original, packed):
            attention = model.model.layers[0].self_attn
            if change == "give":
                torch.manual_seed(7)
                attention.k_proj.bias = nn.Parameter(torch.randn(attention.k_proj.out_features))
            else:
                attention.v_proj.bias = None
        with torch.no_grad(), pytest.warns(SwapWarning, match="a bias was given to or taken"):
            actual = packed(ids).logits
        with torch.no_grad():
            torch.testing.assert_close(actual, original(ids).logits, rtol=1e-5, atol=1e-5)


def test_heads_pruned_after_the_swap_are_packed_at_their_new_sizes() -> None:
    """New, smaller weights (heads pruned in place): the group reads its sizes off them
    when it packs again, and no weight takes another's values."""
    original, packed = _pair(num_key_value_heads=8)
    ids = _ids(original)
    for model in (original, packed):
        attention = model.model.layers[0].self_attn
        for name in ("q_proj", "k_proj", "v_proj"):
            linear = getattr(attention, name)
            linear.weight = nn.Parameter(linear.weight.detach()[:64].clone())
            linear.out_features = 64
        attention.o_proj.weight = nn.Parameter(attention.o_proj.weight.detach()[:, :64].clone())
        attention.o_proj.in_features = 64
        attention.config = copy.copy(attention.config)
        attention.config.num_attention_heads = attention.config.num_key_value_heads = 4
    with torch.no_grad():
        torch.testing.assert_close(packed(ids).logits, original(ids).logits, rtol=1e-5, atol=1e-5)
    assert packed.model.layers[0].self_attn.q_proj._layerswap_group.packed()
    assert all(torch.equal(packed.state_dict()[k], v) for k, v in original.state_dict().items())


def test_a_projections_output_changed_in_place_trains_as_the_originals() -> None:
    """A forward hook (or a PEFT layer's ``result +=``) changing one projection's output in
    place: each output is a tensor of its own in training, so the backward pass runs, to
    the original's gradients (Qwen3's q/k norms keep q and k for it: as views of one
    product, changing v bumped their version too)."""
    original, packed = _pair("qwen3")
    ids = _ids(original)
    grads = []
    for model in (original, packed):
        model.train()
        attention = model.model.layers[0].self_attn
        attention.v_proj.register_forward_hook(lambda m, i, out: out.add_(0.5))
        model(ids, labels=ids).loss.backward()
        grads.append({k: p.grad for k, p in model.named_parameters()})
    for name, expected in grads[0].items():
        torch.testing.assert_close(grads[1][name], expected, rtol=1e-4, atol=1e-6)


def test_a_family_clamping_q_k_and_v_in_place_is_proven() -> None:
    """OLMo clamps each projection's output in place (``clamp_``, where ``clip_qkv`` is
    set): as views of one product, the clamp of one bumped the others' version and the
    proof's backward pass failed, refusing a correct swap."""
    from layerswap.proof import prove

    for name in ("olmo", "olmoe"):
        sub = layerswap.get(f"{name}.qkv.fused")
        config = sub.parts.family.tiny_config(clip_qkv=0.5)
        verdict = prove(sub, config, force=True)
        assert verdict.passed, verdict.message()


def test_verify_compares_a_qkv_swap_with_the_original() -> None:
    report = layerswap.verify(_model("qwen3_next"), "qwen3_next.qkv.fused", backward=True)
    assert report.passed, report.summary()


def test_the_norm_and_mlp_slots_compose_with_it_and_all_undo_in_any_order() -> None:
    model = _model("qwen3_next")
    ids, before = _ids(model), _state(model)
    with torch.no_grad():
        expected = model(ids).logits
    handles = [layerswap.swap(model, f"qwen3_next.{slot}.fused") for slot in ("qkv", "norm", "mlp")]
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, expected, rtol=1e-5, atol=1e-5)
    for handle in (handles[1], handles[0], handles[2]):
        handle.undo()
    assert not _packed(model)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())


@pytest.mark.parametrize("slot", ["qkv"])
def test_a_packed_model_pickles_and_copies_with_its_classes(slot: str) -> None:
    model = _model("qwen3_next")
    ids = _ids(model)
    handle = layerswap.swap(model, f"qwen3_next.{slot}.fused")
    with torch.no_grad():
        expected = model(ids).logits
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    for again in (torch.load(buffer, weights_only=False), copy.deepcopy(model)):
        kinds = {name: type(again.get_submodule(name)) for name, _, _ in handle.swapped}
        assert kinds == {name: made for name, _, made in handle.swapped}
        attention = again.get_submodule(handle.swapped[0][0])
        assert attention.q_proj._layerswap_group.members[0] is attention.q_proj
        with torch.no_grad():
            assert torch.equal(again(ids).logits, expected)


# --- refused, changing nothing ------------------------------------------------------------


def test_swapping_twice_is_refused() -> None:
    model = _model("qwen3_next")
    with (
        layerswap.swap(model, "qwen3_next.qkv.fused"),
        pytest.raises(SubstitutionError, match=r"already swapped by qwen3_next\.qkv\.fused"),
    ):
        layerswap.swap(model, "qwen3_next.qkv.fused")


def test_after_the_decoder_slot_no_original_attention_is_left_to_pack() -> None:
    model = layerswap.get_family("llama").build()
    with layerswap.swap(model, "llama.decoder.fused"):
        classes = {type(m) for m in model.modules()}
        with pytest.raises(SubstitutionError, match=r"decoder layers are llama\.decoder\.fused's"):
            layerswap.swap(model, "llama.qkv.fused")
        assert {type(m) for m in model.modules()} == classes


def test_projections_an_adapter_wraps_already_are_kept_with_the_order() -> None:
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(
        layerswap.get_family("llama").build(), LoraConfig(r=4, target_modules=["q_proj", "v_proj"])
    )
    with pytest.raises(SubstitutionError, match=r"q_proj is a Linear, not an nn\.Linear.*before"):
        layerswap.swap(model.base_model.model, "llama.qkv.fused")
    assert not _packed(model)


def test_the_first_use_proof_catches_a_wrong_product() -> None:
    """A backend whose packed product forgets the weights' gradients: its proof fails and
    the swap is refused before the model changes."""
    from layerswap.backends import projections

    class Forgetful(ProjectionsReplacement):
        backend = "forgetful"
        kernels = {"packed": "forgetful"}

        def _layerswap_attach(self, changes: Any) -> None:
            super()._layerswap_attach(changes)
            for member in self.modules():
                if type(member) is PackedLinear:
                    changes.set_class(member, _Detached)

    class _Detached(PackedLinear):
        def forward(self, input: torch.Tensor) -> torch.Tensor:
            return super().forward(input).detach()

    import dataclasses

    base = layerswap.get("llama.qkv.fused")
    sub = dataclasses.replace(base, name="llama.qkv.forgetful", replacement=Forgetful)
    model = layerswap.get_family("llama").build()
    with pytest.raises(UpstreamDriftError, match=r"llama\.qkv\.forgetful"):
        layerswap.swap(model, sub)
    assert not _packed(model)
    assert projections.PackedLinear not in {type(m) for m in model.modules()}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("model_type", POPULAR)
def test_on_a_gpu_the_attentions_verify(model_type: str, dtype: torch.dtype) -> None:
    report = layerswap.verify(
        _model(model_type), f"{model_type}.qkv.fused", dtype=dtype, device="cuda", backward=True
    )
    assert report.passed, report.summary()


# --- the contract's clients: torch.compile, PEFT -----------------------------------------


@pytest.mark.slow  # compiles twice
def test_compile_traces_the_packed_model_in_one_graph_to_the_same_gradients() -> None:
    from test_mlp_slot import compiles_in_one_graph_to_the_same_gradients

    compiles_in_one_graph_to_the_same_gradients(
        layerswap.get_family("qwen3").build(seed=0), "qwen3.qkv.fused"
    )


def test_a_lora_adapter_on_the_projections_trains_and_merges_as_on_the_original(
    tmp_path: Path,
) -> None:
    from peft import LoraConfig, PeftModel, get_peft_model

    family = layerswap.get_family("llama")
    ids = _ids(family.build())
    config = LoraConfig(r=4, target_modules=["q_proj", "k_proj", "v_proj"], init_lora_weights=False)
    torch.manual_seed(1)
    plain_peft = get_peft_model(family.build(seed=0), copy.deepcopy(config))
    expected_loss, expected_grads = _train_step(plain_peft, ids)

    swapped = family.build(seed=0)
    handle = layerswap.swap(swapped, "llama.qkv.fused")
    torch.manual_seed(1)
    peft_model = get_peft_model(swapped, config)
    loss, grads = _train_step(peft_model, ids)
    assert _packed(peft_model)
    torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=1e-6)
    assert grads.keys() == expected_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected_grads[name], rtol=1e-4, atol=1e-6)
    peft_model.eval()
    with torch.no_grad():
        expected = peft_model(ids).logits
    peft_model.save_pretrained(tmp_path)
    merged = copy.deepcopy(peft_model).merge_and_unload()
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, expected, rtol=1e-5, atol=1e-5)
    handle.undo()
    plain = PeftModel.from_pretrained(family.build(seed=0), tmp_path).eval()
    with torch.no_grad():
        torch.testing.assert_close(plain(ids).logits, expected, rtol=1e-5, atol=1e-5)


# --- what it covers -----------------------------------------------------------------------


def test_model_coverage_names_the_attentions_the_slot_replaces() -> None:
    from layerswap.coverage import model_coverage

    row = {r.substitution: r for r in model_coverage("qwen3").rows}["qwen3.qkv.fused"]
    assert row.unsupported is None
    layers = layerswap.get_family("qwen3").tiny_config().num_hidden_layers
    assert row.replaces == (f"the attentions (Qwen3Attention x{layers})",)


@pytest.mark.slow  # every model type of the installed transformers, on the meta device
def test_list_all_names_the_model_types_whose_attentions_are_packed() -> None:
    # every model type the list says the fused qkv slot takes was proven by the sweep
    # (scripts/norm_sweep.py --slot qkv) on this transformers release
    listed = listed_and_swept("qkv", "attentions")
    assert len(listed) >= 150, len(listed)
    assert set(POPULAR) <= listed
    rows = coverage_report()
    assert "no attention class" in str(rows["mamba"].slots["qkv"]["fused"])


def test_the_command_line_patches_a_model_types_attentions() -> None:
    from typer.testing import CliRunner

    from layerswap.cli import app

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = CliRunner().invoke(app, ["patch", "--substitution", "qwen3_next.qkv.fused"])
    assert result.exit_code == 0, result.output
    assert "Qwen3NextAttention -> FusedProjections[Qwen3NextAttention]" in result.output
    assert "PASS: the swapped model matches the original" in result.output


def test_restore_all_leaves_the_safeguards_of_swapped_models_on(tmp_path: Path) -> None:
    """``restore_all()`` (a cleanup of leaked patches) took off the advice that keeps a
    swapped model's saves in the original layout, while the models stayed swapped:
    accelerate's save_model dropped k_proj and v_proj of a qkv-swapped model, and PEFT's
    saves of a decoder-swapped one wrote the fused names. It stops the user's patches alone."""
    from types import SimpleNamespace

    from accelerate import Accelerator
    from safetensors.torch import load_file

    from layerswap.peft_targets import _held, is_guard
    from layerswap.sliced_saves import _needed, is_own

    original = set(layerswap.get_family("llama").build(seed=0).state_dict())
    packed = layerswap.get_family("llama").build(seed=0).eval()
    layerswap.swap(packed, "llama.qkv.fused")
    fused = layerswap.get_family("llama").build(seed=0).eval()
    handle = layerswap.swap(fused, "llama.decoder.fused")
    mine = SimpleNamespace(value=1)
    layerswap.patch(mine, "value", 2).start()
    assert layerswap.restore_all() == 1 and mine.value == 1
    kept = [info.patch for info in layerswap.active_patches()]
    assert any(is_own(p) for p in kept) and any(is_guard(p) for p in kept)
    Accelerator(cpu=True).save_model(packed, tmp_path / "packed")
    assert set(load_file(tmp_path / "packed" / "model.safetensors")) == original
    fused.save_pretrained(tmp_path / "fused")
    assert set(load_file(tmp_path / "fused" / "model.safetensors")) == original
    handle.undo()
    del packed, fused, handle
    gc.collect()
    # no swapped model holds the PEFT and save advice any more: restore_all() stops it
    layerswap.restore_all()
    guards = [info for info in layerswap.active_patches() if is_guard(info.patch)]
    assert _held() or not guards
    # nor, once no packed storage lives (none copied or unpickled), the sliced-save advice
    sliced = [info for info in layerswap.active_patches() if is_own(info.patch)]
    assert _needed() or not sliced


def test_undo_checks_the_packed_projections_before_changing_anything() -> None:
    """A projection's forward hooked since the swap (accelerate's ``cpu_offload`` hooks the
    projections, not the attention) or its class changed since (a parametrization) refuses
    the undo with nothing undone; with the hooks or the parametrization taken off, the
    undo restores the original bitwise. Before, the first undid the classes under a
    stale bound forward (every later forward failed) and the second stopped half-way."""
    from accelerate import cpu_offload
    from accelerate.hooks import remove_hook_from_module
    from torch.nn.utils import parametrize

    class Same(nn.Module):
        def forward(self, weight: torch.Tensor) -> torch.Tensor:
            return weight * 1.0

    model = layerswap.get_family("llama").build(seed=0).eval()
    ids = _ids(model)
    with torch.no_grad():
        expected = model(ids).logits
    before = _state(model)
    handle = layerswap.swap(model, "llama.qkv.fused")
    cpu_offload(model, execution_device="cpu")
    with pytest.raises(SubstitutionError, match=r"q_proj's forward was set.*nothing was undone"):
        handle.undo()
    assert handle.active and _packed(model)
    remove_hook_from_module(model, recurse=True)
    handle.undo()
    with torch.no_grad():
        assert torch.equal(model(ids).logits, expected)
    assert not any(type(m) is PackedLinear for m in model.modules())

    # o_proj keeps the forward accelerate's removal leaves bound on it (its own): it keeps
    # its class too, so the model swaps again
    assert "forward" in vars(model.model.layers[0].self_attn.o_proj)
    handle = layerswap.swap(model, "llama.qkv.fused")
    assert len(handle) == model.config.num_hidden_layers
    q_proj = model.model.layers[0].self_attn.q_proj
    parametrize.register_parametrization(q_proj, "weight", Same())
    with pytest.raises(SubstitutionError, match=r"q_proj is now a ParametrizedPackedLinear"):
        handle.undo()
    assert handle.active and len(_packed(model)) == len(handle)
    parametrize.remove_parametrizations(q_proj, "weight")
    handle.undo()
    after = _state(model)
    assert all(torch.equal(after[k], before[k]) for k in before)


def test_undo_after_a_bias_was_taken_gives_every_projection_its_own_storage() -> None:
    """A bias removed since the swap (the group then computes each projection alone, with
    a warning): the undo completes, and the remaining biases are no longer slices of the
    packed tensor."""
    model = _model("qwen2")
    ids = _ids(model)
    handle = layerswap.swap(model, "qwen2.qkv.fused")
    attention = model.model.layers[0].self_attn
    attention.k_proj.bias = None
    with pytest.warns(SwapWarning, match="bias"), torch.no_grad():
        model(ids)
    handle.undo()
    assert not handle.active and not _packed(model)
    q, v = attention.q_proj.bias, attention.v_proj.bias
    assert q.untyped_storage().nbytes() == q.numel() * q.element_size()
    assert q.untyped_storage().data_ptr() != v.untyped_storage().data_ptr()


def test_undo_gives_a_copied_projection_its_class_back() -> None:
    """PEFT's ``modules_to_save`` deep-copies a packed projection into the model (with a
    copy of its group): the undo leaves no layerswap class behind, and the numbers stay."""
    from peft import LoraConfig, get_peft_model

    model = layerswap.get_family("llama").build(seed=0).eval()
    ids = _ids(model)
    handle = layerswap.swap(model, "llama.qkv.fused")
    tuned = get_peft_model(model, LoraConfig(target_modules=["o_proj"], modules_to_save=["q_proj"]))
    with torch.no_grad():
        expected = tuned(ids).logits
    handle.undo()
    left = [n for n, m in tuned.named_modules() if type(m).__module__.startswith("layerswap")]
    assert left == []
    with torch.no_grad():
        torch.testing.assert_close(tuned(ids).logits, expected, rtol=1e-5, atol=1e-5)


def test_restore_all_takes_the_sliced_save_advice_off_once_no_packed_storage_lives(
    tmp_path: Path,
) -> None:
    """In a fresh process: on while the model is packed, and while a state dict taken
    before the undo holds slices of the packed storage; off at the next ``restore_all()``
    once neither lives, so ``active_patches()`` can be emptied again; on at the next
    packing."""
    from fresh import run_json

    found = run_json(
        """
        import gc, json, layerswap
        from layerswap.sliced_saves import is_own

        def own():
            return sum(is_own(info.patch) for info in layerswap.active_patches())

        model = layerswap.get_family("llama").build(seed=0)
        handle = layerswap.swap(model, "llama.qkv.fused")
        seen = [layerswap.restore_all(), own()]
        state = model.state_dict()
        handle.undo()
        gc.collect()
        seen += [layerswap.restore_all(), own()]
        del state
        gc.collect()
        seen += [layerswap.restore_all(), own(), len(layerswap.active_patches())]
        layerswap.swap(model, "llama.qkv.fused")
        seen.append(own())
        print(json.dumps(seen))
        """,
        tmp_path,
    )
    armed = found[1]
    assert armed > 0
    assert found == [0, armed, 0, armed, armed, 0, 0, armed]
