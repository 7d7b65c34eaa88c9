"""The proof vouches only for what it checked.

A verdict is keyed by the transformers source the original runs and the attention
implementation; the proof's tiny model keeps every kind of layer the user's config
selects and runs past every position threshold it sets; a keyword a model passes its
layers at call time is handled as the original handles it or refused. The tests that
change transformers do it as an upstream commit would: a copy of the installed package,
one file edited, first on ``PYTHONPATH`` of a fresh interpreter.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from edited_transformers import edited_transformers
from fresh import run_json
from transformers import LlamaConfig, LlamaForCausalLM

import layerswap
from layerswap import proof, shrink, sources
from layerswap.comparison.inputs import default_length, inputs_for
from layerswap.comparison.judgement import proof_batch
from layerswap.comparison.placement import working_copy
from layerswap.errors import RequirementError, SwapWarning, UpstreamDriftError
from layerswap.placement import Placement
from layerswap.proof_key import proof_device
from layerswap.registry import get, get_family

LLAMA = "transformers.models.llama.modeling_llama"


@pytest.fixture
def proofs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    store = tmp_path / "proofs"
    monkeypatch.setenv("LAYERSWAP_CACHE", str(store))
    monkeypatch.setattr(proof, "_MEMO", {})
    return store


def tiny_llama(**overrides: Any) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        num_hidden_layers=2,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        **overrides,
    )
    return LlamaForCausalLM(config).eval()


# --- the verdict's key -------------------------------------------------------------------


def test_the_source_digest_covers_the_modeling_module_and_what_every_layer_reaches() -> None:
    found = {path.as_posix().split("/transformers/")[-1] for path in sources.files(LLAMA)}
    assert "models/llama/modeling_llama.py" in found
    for shared in ("masking_utils.py", "cache_utils.py", "integrations/sdpa_attention.py"):
        assert shared in found
    assert len(sources.digest(LLAMA)) == 16
    assert sources.digest(LLAMA) != sources.digest("transformers.models.qwen3.modeling_qwen3")
    assert sources.digest("transformers.models.no_such_family.modeling_none") == ""


def test_a_verdict_is_keyed_by_the_attention_implementation(proofs: Path) -> None:
    sub = get("llama.decoder.fused")
    sdpa = tiny_llama(attn_implementation="sdpa").config
    eager = tiny_llama(attn_implementation="eager").config
    assert proof.proof_key(sub, sdpa) != proof.proof_key(sub, eager)
    verdict = proof.prove(sub, eager)
    assert verdict.passed and verdict.attention == "eager"


def test_a_verdict_is_keyed_by_the_family_declaration(proofs: Path) -> None:
    """A family declared again otherwise (``register_family(..., replace=True)``, a
    plugin's family edited between runs) builds other layers: its verdict is its own, in
    memory and on disk, and a wrong declaration is refused where the right one was proven."""
    base = get_family("ministral")
    torch.manual_seed(0)
    model = base.causal_lm_class()(base.tiny_config()).eval()
    config = model.config
    right = proof.proof_key(get("ministral.decoder.fused"), config)
    layerswap.swap(model, "ministral.decoder.fused").undo()
    try:
        layerswap.register_family(base.replace(rotary="interleaved"), replace=True)
        wrong = get("ministral.decoder.fused")
        assert proof.proof_key(wrong, config) != right
        with pytest.raises(UpstreamDriftError, match="differs"):
            layerswap.swap(model, wrong)
    finally:
        layerswap.register_family(base, replace=True)
    assert proof.proof_key(get("ministral.decoder.fused"), config) == right


def test_a_verdict_whose_source_changed_is_stale_not_proven(
    proofs: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from layerswap.cli.proving import proofs_row

    sub = get("llama.decoder.fused")
    verdict = proof.prove(sub, None)
    assert verdict.passed and verdict.source == sources.digest(LLAMA) and verdict.module == LLAMA
    assert "llama.decoder.fused" in proof.proven_here()
    assert not verdict.changed_since()

    edited = {LLAMA: "0" * 16}
    monkeypatch.setattr(sources, "digest", lambda module: edited.get(module, ""))
    assert verdict.changed_since()
    assert "llama.decoder.fused" not in proof.proven_here()
    assert "llama.decoder.fused" in proof.changed_here()
    row = proofs_row()
    assert "1 changed since proven" in row["status"]
    assert "changed since proven" in row["enables"] and "llama" in row["enables"]
    # the changed source is another key: proven again, not the stored verdict returned
    assert proof.proof_key(sub, None) != verdict_key(sub)


def fresh_key(sub: Any) -> str:
    """``sub``'s key with its code read again from the disk."""
    sources.code_digest.cache_clear()
    sources._file_digest.cache_clear()
    return proof.proof_key(sub, None)


def test_a_replacement_of_a_plugin_or_the_users_own_code_is_keyed_by_that_code(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """layerswap's source digest covers its own layers; a layer from elsewhere is keyed by
    its own code, so that a verdict is not reused once that code changes."""
    import dataclasses

    package = tmp_path / "my_kernels"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "layers.py").write_text("class MyLayer:\n    scale = 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    sub = dataclasses.replace(get("llama.decoder.fused"), replacement="my_kernels.layers:MyLayer")

    before = fresh_key(sub)
    assert fresh_key(sub) == before  # the same code, the same key
    (package / "layers.py").write_text("class MyLayer:\n    scale = 1.5\n")
    assert fresh_key(sub) != before
    assert sources.code_digest("layerswap.backends.fused.decoder") == ""  # layerswap's digest
    assert sources.code_digest("transformers.models.llama.modeling_llama") == ""


def test_a_replacement_in_a_plain_module_is_keyed_by_the_modules_beside_it_it_imports(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A user's ``my_layer.py`` (no package) calling a kernel in ``my_kernel.py`` beside
    it: an edit of the kernel is another code, and a module beside them it does not
    import is not part of it."""
    import dataclasses

    (tmp_path / "my_layer.py").write_text("import my_kernel\n\nclass MyLayer:\n    pass\n")
    (tmp_path / "my_kernel.py").write_text("def post(x):\n    return x\n")
    (tmp_path / "unrelated.py").write_text("X = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    sub = dataclasses.replace(get("llama.decoder.fused"), replacement="my_layer:MyLayer")

    before = fresh_key(sub)
    (tmp_path / "unrelated.py").write_text("X = 2\n")
    assert fresh_key(sub) == before
    (tmp_path / "my_kernel.py").write_text("def post(x):\n    return x * 1.01\n")
    assert fresh_key(sub) != before


def verdict_key(sub: Any) -> str:
    stored = [path.stem for path in Path(os.environ["LAYERSWAP_CACHE"]).glob("*.json")]
    return stored[0]


def test_the_original_patched_at_run_time_is_proven_again_and_refused(
    proofs: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A verdict proven on transformers' code as its files say does not vouch for code
    rebound in this process since (a user's or another library's patch of the original's
    MLP): the key changes, the proof compares the swap with the code the original runs
    now, and the swap is refused; undone, the key and the verdict are the old ones."""
    from transformers.models.llama import modeling_llama

    model = tiny_llama()
    sub = get("llama.decoder.fused")
    assert proof.prove(sub, model.config).passed
    before = proof.proof_key(sub, model.config)
    forward = modeling_llama.LlamaMLP.forward
    monkeypatch.setattr(modeling_llama.LlamaMLP, "forward", lambda self, x: forward(self, x) * 1.5)
    assert proof.proof_key(sub, model.config) != before
    with pytest.raises(UpstreamDriftError, match="patched in this process"):
        layerswap.swap(model, sub)
    assert not layerswap.active_patches()
    monkeypatch.undo()
    assert proof.proof_key(sub, model.config) == before
    layerswap.swap(model, sub).undo()


@pytest.mark.parametrize("where", ["function", "method", "class", "another class's method"])
def test_the_live_digest_follows_each_rebind_and_its_undo_read_after_read(
    where: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the process binds is read again only where a namespace or a class dict holds
    other objects: a digest taken, then a rebind, reads the rebind (and keeps reading it),
    and the undo reads as before; layerswap's own patch is seen through."""
    from transformers.models.llama import modeling_llama

    before = sources.live_digest(LLAMA)
    assert sources.live_digest(LLAMA) == before
    owner: Any = {
        "function": modeling_llama,
        "method": modeling_llama.LlamaAttention,
        "class": modeling_llama,
        "another class's method": modeling_llama.LlamaRMSNorm,
    }[where]
    name = {"function": "rotate_half", "class": "LlamaMLP"}.get(where, "forward")
    kept = getattr(owner, name)
    with layerswap.patch(owner, name, lambda *args: kept(*args)):
        assert sources.live_digest(LLAMA) == before  # seen through
    if where == "class":
        replacement: Any = type("LlamaMLP", (kept,), {"__module__": LLAMA})
    else:
        replacement = lambda *args: kept(*args)  # noqa: E731
    monkeypatch.setattr(owner, name, replacement)
    changed = sources.live_digest(LLAMA)
    assert changed != before and sources.live_digest(LLAMA) == changed
    monkeypatch.undo()
    assert sources.live_digest(LLAMA) == before
    if where != "class":  # a function's code replaced in place: no object rebound
        function = getattr(kept, "__func__", kept)
        edited = function.__code__.replace(co_name="edited", co_firstlineno=1)
        monkeypatch.setattr(function, "__code__", edited)
        assert sources.live_digest(LLAMA) != before
        monkeypatch.undo()
        assert sources.live_digest(LLAMA) == before


def test_a_namespace_is_read_again_when_a_patch_it_sees_through_is_rebased(
    make_module: Callable[[str, str], str],
) -> None:
    """A live patch's original changed in place (a late alias an older ``aliases=True``
    patch bound, taken over by a newer one: the older stops) changes what the digest
    sees through the newer patch, while the namespace holds the same objects: it is read
    again (:func:`layerswap.patching.rebases`), not taken from what it held."""
    source = make_module("rebased_src", "def helper():\n    return 'original'\n")
    late = make_module("rebased_user", f"from {source} import helper\n")
    __import__(source)

    def older_helper() -> str:
        return "older"

    def newer_helper() -> str:
        return "newer"

    older = layerswap.patch(f"{source}:helper", older_helper, aliases=True).start()
    __import__(late)  # binds the older replacement
    newer = layerswap.patch(f"{source}:helper", newer_helper, aliases=True).start()
    module = sys.modules[late]
    try:
        seen = b"".join(sources._namespace_parts(module, late))  # type: ignore[arg-type]
        assert b"older_helper" in seen  # what the newer patch was laid over
        older.stop()  # the newer one's original is no longer the older replacement
        again = b"".join(sources._namespace_parts(module, late))  # type: ignore[arg-type]
        assert module.helper is newer_helper  # the namespace holds what it held
        assert b"older_helper" not in again and again != seen
    finally:
        newer.stop()
        older.stop()


def test_a_replacement_failing_to_build_on_the_users_config_raises_as_it_is(
    proofs: Path,
) -> None:
    """The replacement's own error building the proof's copy (its constructor, its
    converter) is raised as it is: not taken for a config the shrink broke (the family's
    tiny config proven instead, passed), and no verdict is stored."""
    import dataclasses

    fused = get("llama.decoder.fused").replacement_class()

    class Picky(fused):  # type: ignore[misc, valid-type]
        def __init__(self, config: Any, layer_idx: int) -> None:
            if getattr(config, "picky", False):
                raise RuntimeError("this replacement refuses picky configs")
            super().__init__(config, layer_idx)

    sub = dataclasses.replace(
        get("llama.decoder.fused"), name="llama.decoder.picky", replacement=Picky
    )
    config = tiny_llama().config
    config.picky = True
    with pytest.raises(RuntimeError, match="refuses picky configs"):
        proof.prove(sub, config)
    assert not list(proofs.glob("*.json"))


class _FirstRowGradient(torch.autograd.Function):
    """``x @ w.T`` whose weight gradient reads the batch's first sequence only: the input
    gradient, and so every gradient below it, is right."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        return x @ weight.t()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, weight = ctx.saved_tensors
        return grad @ weight, grad[:1].flatten(0, -2).t() @ x[:1].flatten(0, -2)


def test_a_layer_computing_its_own_weight_gradients_wrong_is_refused(proofs: Path) -> None:
    """The backward check compares every parameter's gradient, mapped to the original's
    layout, not only the embeddings' and the head's: a kernel bug that reaches no
    gradient below the layer is caught."""
    import dataclasses

    fused = get("llama.decoder.fused").replacement_class()

    class Down(torch.nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return _FirstRowGradient.apply(x, self.weight)  # type: ignore[no-any-return]

    class WrongWeightGradient(fused):  # type: ignore[misc, valid-type]
        def __init__(self, config: Any, layer_idx: int) -> None:
            super().__init__(config, layer_idx)
            down = self.mlp.down_proj
            self.mlp.down_proj = Down(down.in_features, down.out_features, bias=False)

    sub = dataclasses.replace(
        get("llama.decoder.fused"), name="llama.decoder.wrong_grad", replacement=WrongWeightGradient
    )
    verdict = proof.prove(sub, tiny_llama().config)
    assert not verdict.passed and verdict.check == "backward"
    assert "mlp.down_proj.weight" in verdict.detail


def test_a_layer_computing_otherwise_in_training_mode_is_refused(proofs: Path) -> None:
    """The backward check runs in training mode, the mode a backward pass is taken in,
    where the original's training pass is deterministic: a replacement whose training
    path differs (a branch on ``self.training``) is refused, though its eval-mode
    outputs, decoding and eval-mode gradients are all the original's."""
    import dataclasses

    fused = get("llama.decoder.fused").replacement_class()

    class OffInTraining(fused):  # type: ignore[misc, valid-type]
        def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            out = super().forward(hidden_states, *args, **kwargs)
            return out * 1.01 if self.training else out

    sub = dataclasses.replace(
        get("llama.decoder.fused"), name="llama.decoder.off_in_training", replacement=OffInTraining
    )
    verdict = proof.prove(sub, tiny_llama().config)
    assert not verdict.passed and verdict.check == "backward", verdict.detail
    assert "gradient" in verdict.detail or verdict.detail.startswith("loss"), verdict.detail


def test_a_replacement_leaving_out_the_originals_dropout_is_refused(proofs: Path) -> None:
    """Where the original computes at random in training (attention dropout), the
    backward check cannot compare call for call and runs in eval mode, but not before
    it has seen the swapped model random in training too: one that drops the dropout
    trains another model, and is refused, saying so."""
    import dataclasses

    fused = get("llama.decoder.fused").replacement_class()

    class NoDropout(fused):  # type: ignore[misc, valid-type]
        def __init__(self, config: Any, layer_idx: int) -> None:
            super().__init__(config, layer_idx)
            self.self_attn.attention_dropout = 0.0

    sub = dataclasses.replace(
        get("llama.decoder.fused"), name="llama.decoder.no_dropout", replacement=NoDropout
    )
    config = tiny_llama(attention_dropout=0.1).config
    verdict = proof.prove(sub, config)
    assert not verdict.passed and verdict.check == "backward", verdict.detail
    assert "dropout" in verdict.detail
    assert proof.prove("llama.decoder.fused", config).passed


def test_a_dropout_left_out_beside_one_kept_is_refused_naming_it(proofs: Path) -> None:
    """Phi-3 with an attention dropout and a residual dropout: a replacement that keeps
    the residual one and leaves the attention's out is still random in training, which
    hid the missing dropout (proven). Each dropout is tried alone; the one left out is
    named. The fused layer, which keeps both, is proven."""
    import dataclasses

    base = get("phi3.decoder.fused")
    fused = base.replacement_class()

    class NoAttentionDropout(fused):  # type: ignore[misc, valid-type]
        def __init__(self, config: Any, layer_idx: int) -> None:
            super().__init__(config, layer_idx)
            self.self_attn.attention_dropout = 0.0

    sub = dataclasses.replace(base, name="phi3.decoder.no_dropout", replacement=NoAttentionDropout)
    config = get_family("phi3").tiny_config(attention_dropout=0.1, resid_pdrop=0.1)
    verdict = proof.prove(sub, config)
    assert not verdict.passed and verdict.check == "backward", verdict.detail
    assert "only attention_dropout" in verdict.detail, verdict.detail
    assert proof.prove(base, config).passed


def _wrong_in_bfloat16() -> Any:
    import dataclasses

    fused = get("llama.decoder.fused").replacement_class()

    class OffInBfloat16(fused):  # type: ignore[misc, valid-type]
        def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            out = super().forward(hidden_states, *args, **kwargs)
            if hidden_states.dtype != torch.bfloat16:
                return out
            return hidden_states + 1.5 * (out - hidden_states)  # the layer's update off by half

    return dataclasses.replace(
        get("llama.decoder.fused"), name="llama.decoder.off_in_bf16", replacement=OffInBfloat16
    )


def test_a_model_computing_in_bfloat16_is_proven_in_bfloat16(proofs: Path) -> None:
    """A swap of a model in bfloat16 proves the replacement in bfloat16 too (its own
    verdict): a replacement computing otherwise only there is refused for that model,
    naming the dtype, and the model is left as it was; the float32 model takes it."""
    sub = _wrong_in_bfloat16()
    model = tiny_llama().to(torch.bfloat16)
    before = {name: p.clone() for name, p in model.state_dict().items()}
    with pytest.raises(UpstreamDriftError, match="forward in bfloat16 differs"):
        layerswap.swap(model, sub)
    assert all(type(layer).__name__ == "LlamaDecoderLayer" for layer in model.model.layers)
    assert all(torch.equal(before[name], p) for name, p in model.state_dict().items())
    layerswap.swap(tiny_llama(), sub).undo()
    assert Placement.of(model) == Placement(torch.bfloat16, torch.device("cpu"))


@pytest.mark.parametrize(("dtype", "scale"), [(torch.bfloat16, 1.02), (torch.float16, 1.01)])
def test_a_norm_a_little_off_only_in_low_precision_is_refused(
    proofs: Path, dtype: torch.dtype, scale: float
) -> None:
    """Held to twice the original's own rounding error, not the dtype's default relative
    tolerance, which on the proof's tiny model is several times it (a norm 4% off in
    bfloat16 was proven)."""
    import dataclasses

    fused = get("llama.decoder.fused").replacement_class()

    class NormOff(fused):  # type: ignore[misc, valid-type]
        def __init__(self, config: Any, layer_idx: int) -> None:
            super().__init__(config, layer_idx)
            norm = self.input_layernorm
            forward = norm.forward
            norm.forward = lambda x: forward(x) * (1.0 if x.dtype == torch.float32 else scale)

    sub = dataclasses.replace(
        get("llama.decoder.fused"), name="llama.decoder.norm_off", replacement=NormOff
    )
    verdict = proof.prove(sub, tiny_llama().config, dtype=dtype)
    assert not verdict.passed and verdict.check.startswith("forward in "), verdict.detail
    assert proof.prove("llama.decoder.fused", tiny_llama().config, dtype=dtype).passed


def _wrong_past_position_15() -> Any:
    import dataclasses

    fused = get("llama.decoder.fused").replacement_class()

    class OffPast15(fused):  # type: ignore[misc, valid-type]
        def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            out = super().forward(hidden_states, *args, **kwargs)
            if hidden_states.shape[1] <= 16:
                return out
            scale = torch.ones_like(out[..., :1])
            scale[:, 16:] = 1.5  # the layer's output off from position 16 on
            return out * scale

    return dataclasses.replace(
        get("llama.decoder.fused"), name="llama.decoder.off_past_15", replacement=OffPast15
    )


def test_a_layer_wrong_only_past_position_15_is_refused(proofs: Path) -> None:
    """The proof runs one sequence of 64 tokens alone too: its padded batch (two prompts of
    8 tokens, 3 decoded) never reached position 16, and a layer wrong only past it was
    proven (long prompts are what a user runs)."""
    verdict = proof.prove(_wrong_past_position_15(), tiny_llama().config)
    assert not verdict.passed
    assert verdict.check == "forward on one long sequence", verdict.detail
    assert proof.prove("llama.decoder.fused", tiny_llama().config).passed


def _gradient_off_in_low_precision(scale: float) -> Any:
    """The identity, whose backward scales the gradient by ``scale`` in bfloat16 or
    float16 only (a kernel with a backward of its own per dtype, as Triton kernels have)."""

    class Off(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            ctx.low = x.dtype != torch.float32
            return x.clone()

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
            return grad * scale if ctx.low else grad

    return Off


@pytest.mark.parametrize(("dtype", "scale"), [(torch.bfloat16, 1.1), (torch.float16, 1.02)])
def test_a_layer_whose_backward_is_off_only_in_low_precision_is_refused(
    proofs: Path, dtype: torch.dtype, scale: float
) -> None:
    """The low-precision check takes the backward pass too: the gradients of the input
    embeddings and the head, held to eight times the original's own error against
    float32. Two layers each scaling their gradient by 1.1 only in bfloat16 (1.02 in
    float16) ran their forward proven and their backward unchecked there."""
    import dataclasses

    fused = get("llama.decoder.fused").replacement_class()
    off = _gradient_off_in_low_precision(scale)

    class BackwardOff(fused):  # type: ignore[misc, valid-type]
        def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            return off.apply(super().forward(hidden_states, *args, **kwargs))

    sub = dataclasses.replace(
        get("llama.decoder.fused"), name="llama.decoder.backward_off", replacement=BackwardOff
    )
    config = tiny_llama().config
    verdict = proof.prove(sub, config, dtype=dtype)
    assert not verdict.passed and verdict.check == f"backward in {verdict.dtype}", verdict
    assert verdict.detail.startswith("embedding gradient"), verdict.detail
    assert proof.prove(sub, config).passed  # in float32 it computes as the original
    assert proof.prove("llama.decoder.fused", config, dtype=dtype).passed


def test_a_model_cast_after_its_swap_is_proven_in_its_new_dtype_before_it_runs(
    proofs: Path,
) -> None:
    """Swapped in float32, then cast to bfloat16: its next forward pass proves the
    replacement in bfloat16 first, and is refused where it computes otherwise there (it
    ran unproven). Undone, the model runs as the original, with no hook left."""
    model = tiny_llama()
    batch = {"input_ids": torch.arange(3, 11).reshape(1, 8)}
    handle = layerswap.swap(model, _wrong_in_bfloat16())
    model(**batch)  # float32: proven at the swap
    with pytest.raises(UpstreamDriftError, match=r"(?s)forward in bfloat16 differs.*since"):
        model.to(torch.bfloat16)  # proven at the cast (compiled next, it would run unproven)
    for _ in range(2):  # then refused at every forward pass, not once
        with pytest.raises(UpstreamDriftError, match="bfloat16"):
            model(**batch)
    handle.undo()
    assert not model._forward_pre_hooks and "_apply" not in vars(model)
    model(**batch)

    right = tiny_llama()
    with layerswap.swap(right, "llama.decoder.fused"):
        right.to(torch.bfloat16)
        right(**batch)
        dtypes = [v.dtype for v in proof._MEMO.values() if v.substitution == "llama.decoder.fused"]
        assert dtypes.count("bfloat16") == 1, dtypes


def test_a_model_switched_to_another_attention_after_its_swap_is_proven_there_first(
    proofs: Path,
) -> None:
    """The attention implementation is part of what a verdict vouches for: swapped under
    SDPA, then switched (``set_attn_implementation("eager")``), the model's next forward
    pass proves the replacement under eager attention first, and is refused where it
    computes otherwise there (it ran unproven). The right replacement is proven there."""
    import dataclasses

    fused = get("llama.decoder.fused").replacement_class()

    class OffUnderEager(fused):  # type: ignore[misc, valid-type]
        def __init__(self, config: Any, layer_idx: int) -> None:
            super().__init__(config, layer_idx)
            self.read = config  # the model's config: it reads its attention there

        def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            out = super().forward(hidden_states, *args, **kwargs)
            eager = self.read._attn_implementation == "eager"
            return hidden_states + 1.5 * (out - hidden_states) if eager else out

    wrong = dataclasses.replace(
        get("llama.decoder.fused"), name="llama.decoder.off_under_eager", replacement=OffUnderEager
    )
    model = tiny_llama()
    assert model.config._attn_implementation == "sdpa"
    batch = {"input_ids": torch.arange(3, 11).reshape(1, 8)}
    handle = layerswap.swap(model, wrong)
    model(**batch)  # proven at the swap, under SDPA
    model.set_attn_implementation("eager")
    for _ in range(2):  # refused at every forward pass, not once
        with pytest.raises(UpstreamDriftError, match="attn_implementation 'eager'"):
            model(**batch)
    handle.undo()
    model(**batch)

    model.set_attn_implementation("sdpa")
    with layerswap.swap(model, "llama.decoder.fused"):
        model.set_attn_implementation("eager")
        model(**batch)
        proven = {
            v.attention for v in proof._MEMO.values() if v.substitution == "llama.decoder.fused"
        }
        assert proven == {"sdpa", "eager"}, proven


def test_a_model_built_inside_use_and_switched_to_eager_attention_is_proven_there(
    proofs: Path,
) -> None:
    """Built inside ``use()`` from a config whose ``dtype`` is a name (as
    ``save_pretrained`` leaves it: the layers read a copy of it), then switched to eager
    attention: its next forward pass is proven under eager, on the model's own config."""
    config = tiny_llama().config
    config.dtype = "float32"
    with layerswap.use("llama.decoder.fused"):
        model = LlamaForCausalLM(config)
    assert isinstance(model.config.dtype, str)
    batch = {"input_ids": torch.arange(3, 11).reshape(1, 8)}
    model(**batch)
    model.set_attn_implementation("eager")
    model(**batch)
    proven = {v.attention for v in proof._MEMO.values() if v.substitution == "llama.decoder.fused"}
    assert proven == {"sdpa", "eager"}, proven


def _wrong_under_autocast() -> Any:
    import dataclasses

    fused = get("llama.decoder.fused").replacement_class()

    class OffUnderAutocast(fused):  # type: ignore[misc, valid-type]
        def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            out = super().forward(hidden_states, *args, **kwargs)
            if not torch.is_autocast_enabled(hidden_states.device.type):
                return out
            return hidden_states + 1.5 * (out - hidden_states)  # the layer's update off by half

    return dataclasses.replace(
        get("llama.decoder.fused"),
        name="llama.decoder.off_under_autocast",
        replacement=OffUnderAutocast,
    )


def test_a_proof_run_inside_the_callers_autocast_compares_in_float32(proofs: Path) -> None:
    """A proof started under the caller's ``torch.autocast`` (a swap, or the first forward
    pass of a guarded model, inside Trainer's ``bf16=True``) ran its float32 checks in
    bfloat16 and refused a correct layer (its embedding gradient 0.0046 off), a verdict
    then stored for float32."""
    with torch.autocast("cpu", dtype=torch.bfloat16):
        verdict = proof.prove("llama.decoder.fused", tiny_llama().config, force=True)
    assert verdict.passed, verdict.detail
    assert verdict.autocast is None  # prove() asked for no autocast run


def test_a_model_run_under_autocast_is_proven_under_autocast_before_it_runs(proofs: Path) -> None:
    """Swapped in float32, then run under ``torch.autocast`` (its weights stay float32,
    its matmuls run in bfloat16): the first pass under autocast proves the replacement
    there, refused where it computes otherwise there; outside autocast it runs as
    proven. A swap made under autocast proves it there at once."""
    model = tiny_llama()
    batch = {"input_ids": torch.arange(3, 11).reshape(1, 8)}
    handle = layerswap.swap(model, _wrong_under_autocast())
    model(**batch)  # float32: proven at the swap
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert Placement.of(model).autocast == torch.bfloat16
        with pytest.raises(
            UpstreamDriftError,
            match=r"(?s)forward under autocast to bfloat16 differs.*under autocast",
        ):
            model(**batch)
    assert Placement.of(model).autocast is None
    model(**batch)
    handle.undo()
    with (
        torch.autocast("cpu", dtype=torch.bfloat16),
        pytest.raises(UpstreamDriftError, match="under autocast to bfloat16"),
    ):
        layerswap.swap(tiny_llama(), _wrong_under_autocast())

    right = tiny_llama()
    with layerswap.swap(right, "llama.decoder.fused"), torch.autocast("cpu", dtype=torch.bfloat16):
        for _ in range(2):
            right(**batch)
    autocasts = [
        v.autocast for v in proof._MEMO.values() if v.substitution == "llama.decoder.fused"
    ]
    assert autocasts.count("bfloat16") == 1, autocasts


def test_accelerates_mixed_precision_is_proven_under_its_autocast(proofs: Path) -> None:
    """accelerate's ``mixed_precision="bf16"`` (Trainer's ``bf16=True``) wraps the model's
    ``forward`` in ``torch.autocast``, inside the hook on the model: the autocast run was
    never proven, and a replacement 10% off there ran. The check on the base model sees
    it: refused before the pass; a correct replacement runs, proven under autocast."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    batch = {"input_ids": torch.arange(3, 11).reshape(1, 8)}
    model = tiny_llama()
    layerswap.swap(model, _wrong_under_autocast())
    # accelerate's state is one per process: another test's Accelerator() set it already
    AcceleratorState._reset_state(reset_partial_state=True)
    try:
        accelerator = Accelerator(cpu=True, mixed_precision="bf16")
        with pytest.raises(UpstreamDriftError, match="under autocast to bfloat16"):
            accelerator.prepare(model)(**batch)
        right = tiny_llama()
        with layerswap.swap(right, "llama.decoder.fused"):
            accelerator.prepare(right)(**batch)
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
    autocasts = [
        v.autocast for v in proof._MEMO.values() if v.substitution == "llama.decoder.fused"
    ]
    assert autocasts.count("bfloat16") == 1, autocasts


def test_the_base_model_cast_or_run_alone_is_proven_where_it_computes(proofs: Path) -> None:
    """The guard's hook sat on the swapped model alone: its base model cast on its own
    (``model.model.to(torch.bfloat16)``) or run on its own under autocast ran unproven.
    Both are proven (and refused here) before the pass; undone, no hook is left."""
    batch = {"input_ids": torch.arange(3, 11).reshape(1, 8)}
    model = tiny_llama()
    handle = layerswap.swap(model, _wrong_under_autocast())
    with (
        torch.autocast("cpu", dtype=torch.bfloat16),
        pytest.raises(UpstreamDriftError, match="under autocast to bfloat16"),
    ):
        model.model(**batch)
    model.model(**batch)  # outside autocast: as proven
    handle.undo()
    assert not model._forward_pre_hooks and not model.model._forward_pre_hooks
    model = tiny_llama()
    with layerswap.swap(model, _wrong_in_bfloat16()):
        model.model.to(torch.bfloat16)
        with pytest.raises(UpstreamDriftError, match="forward in bfloat16 differs"):
            model.model(**batch)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_cuda_model_run_under_autocast_is_proven_under_cuda_autocast(proofs: Path) -> None:
    """Trainer's ``bf16=True`` on a GPU: float32 weights, CUDA autocast. The first pass under
    it proves the replacement there (CUDA's bfloat16 kernels), refused where it computes
    otherwise there; a correct one runs, proven once."""
    batch = {"input_ids": torch.arange(3, 11, device="cuda").reshape(1, 8)}
    model = tiny_llama().cuda()
    with layerswap.swap(model, _wrong_under_autocast()):
        model(**batch)
        with (
            torch.autocast("cuda", dtype=torch.bfloat16),
            pytest.raises(UpstreamDriftError, match="under autocast to bfloat16"),
        ):
            model(**batch)
    right = tiny_llama().cuda()
    with layerswap.swap(right, "llama.decoder.fused"), torch.autocast("cuda", dtype=torch.bfloat16):
        right(**batch)
        right(**batch)
    proven = [v for v in proof._MEMO.values() if v.substitution == "llama.decoder.fused"]
    assert [v.autocast for v in proven].count("bfloat16") == 1, proven


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_model_moved_to_cuda_after_its_swap_is_proven_on_cuda_before_it_runs(
    proofs: Path,
) -> None:
    model = tiny_llama()
    with layerswap.swap(model, "llama.decoder.fused"):
        model.cuda()(input_ids=torch.arange(3, 11, device="cuda").reshape(1, 8))
    cuda_key = proof.proof_key(
        get("llama.decoder.fused"), tiny_llama().config, torch.device("cuda")
    )
    assert cuda_key in proof._MEMO


def test_a_guarded_model_is_freed_when_deleted_and_its_copies_cast_themselves(
    proofs: Path,
) -> None:
    """The guard refers to the model weakly: a swapped model deleted is freed at once, not
    at the next garbage collection (its weights held on, and a GPU ran out of memory);
    a deep copy's or an unpickled copy's cast casts the copy, not the original."""
    import copy
    import gc
    import pickle
    import weakref

    model = tiny_llama()
    layerswap.swap(model, "llama.decoder.fused")
    for twin in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        twin.to(torch.float64)
        assert next(twin.parameters()).dtype == torch.float64
        assert next(model.parameters()).dtype == torch.float32
    alive = weakref.ref(model)
    gc.disable()
    try:
        del model
        assert alive() is None
    finally:
        gc.enable()


def test_a_deep_copy_of_a_swapped_model_is_guarded_as_the_original_is(proofs: Path) -> None:
    """A deep copy (TRL's reference model, an EMA copy) computes as the original until it
    is cast: cast to bfloat16, it is proven there and refused, naming the dtype, as the
    original would be; so is a copy of its base model alone. The original, undone, and
    the copy made before, keep their own guards."""
    import copy

    batch = {"input_ids": torch.arange(3, 11).reshape(1, 8)}
    model = tiny_llama()
    handle = layerswap.swap(model, _wrong_in_bfloat16())
    twin = copy.deepcopy(model)
    alone = copy.deepcopy(model.model)
    handle.undo()
    proven = len(proof._MEMO)
    twin(**batch)  # float32: what the original was proven at, not proven again
    alone(**batch)
    assert len(proof._MEMO) == proven
    # verify's and the benchmark's scratch copy is compared with the original by them
    scratch = working_copy(twin, torch.device("cpu"), torch.bfloat16, trainable=False)
    assert not scratch.model._forward_pre_hooks and "_apply" not in vars(scratch)
    for copied in (twin, alone):
        with pytest.raises(UpstreamDriftError, match=r"(?s)forward in bfloat16 differs.*since"):
            copied.to(torch.bfloat16)
        with pytest.raises(UpstreamDriftError, match="bfloat16"):
            copied(**batch)
    model.to(torch.bfloat16)(**batch)  # undone: the original's layers, no guard
    assert not model._forward_pre_hooks and not model.model._forward_pre_hooks


def test_a_model_built_inside_use_and_cast_is_proven_where_it_runs(proofs: Path) -> None:
    """``use()`` proves at construction (on the meta device inside ``from_pretrained``);
    a model cast after it is proven in its dtype at its first forward pass."""
    config = tiny_llama().config
    with layerswap.use(_wrong_in_bfloat16()):
        model = LlamaForCausalLM(config)
    model(input_ids=torch.arange(3, 11).reshape(1, 8))
    for layer in model.model.layers:  # cast layer by layer: seen at the forward pass
        layer.to(torch.bfloat16)
    model.model.embed_tokens.to(torch.bfloat16)
    with pytest.raises(UpstreamDriftError, match="bfloat16"):
        model(input_ids=torch.arange(3, 11).reshape(1, 8))


def test_a_models_placement_is_what_most_of_its_weights_hold() -> None:
    """The dtype and device most floating-point weights hold, by element count: a norm
    kept in float32 beside bfloat16 projections leaves the model a bfloat16 one, and a
    model built on the meta device (inside ``from_pretrained``) has a dtype and no device."""
    model = tiny_llama().to(torch.bfloat16)
    model.model.norm.float()
    assert Placement.of(model) == Placement(torch.bfloat16, torch.device("cpu"))
    with torch.device("meta"):
        built = LlamaForCausalLM(tiny_llama().config).to(torch.float16)
    assert Placement.of(built) == Placement(torch.float16, None)
    assert Placement.of(torch.nn.Module()) == Placement()


def test_the_proof_runs_where_the_substitution_runs(proofs: Path) -> None:
    """On the model's device where the substitution runs there; a substitution that runs
    on the CPU is proven there for a model on the CPU, or on a device this machine lacks."""
    fused = get("llama.decoder.fused")
    assert proof_device(fused, torch.device("cpu")) == torch.device("cpu")
    if not torch.cuda.is_available():
        assert proof_device(fused, torch.device("cuda")) == torch.device("cpu")
    verdict = proof.prove(fused, tiny_llama().config, device="cpu")
    assert verdict.passed
    assert proof.proof_key(fused, tiny_llama().config, torch.device("cpu")) in proof._MEMO


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_cuda_models_swap_is_proven_on_cuda(proofs: Path) -> None:
    """A fused swap of a model on CUDA is proven on CUDA (the kernels it will run), not on
    the CPU."""
    layerswap.swap(tiny_llama().cuda(), "llama.decoder.fused").undo()
    keys = [key for key, v in proof._MEMO.items() if v.substitution == "llama.decoder.fused"]
    cuda_key = proof.proof_key(
        get("llama.decoder.fused"), tiny_llama().config, torch.device("cuda")
    )
    assert keys == [cuda_key]


def test_check_proves_in_the_dtype_asked(proofs: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``layerswap check --dtype bfloat16`` proves as the first use of a bfloat16 model
    would (its verdict is the one that use finds); a dtype it does not know is a usage
    error that proves nothing."""
    from command_line import run

    code, out, _ = run(capsys, "check", "llama", "--dtype", "bf16", "--json")
    assert code == 0, out
    assert [row["status"] for row in json.loads(out)] == ["proven"]
    stored = [json.loads(path.read_text()) for path in proofs.rglob("*.json")]
    assert [v.get("dtype") for v in stored if v.get("substitution") == "llama.decoder.fused"] == [
        "bfloat16"
    ]
    code, _, err = run(capsys, "check", "llama", "--dtype", "float8")
    assert code == 2 and "unknown dtype" in err


def test_the_verdicts_key_names_a_low_precision_dtype_only(proofs: Path) -> None:
    sub = get("llama.decoder.fused")
    config = tiny_llama().config
    plain = proof.proof_key(sub, config)
    assert proof.proof_key(sub, config, dtype=torch.float32) == plain
    keys = {proof.proof_key(sub, config, dtype=dt) for dt in (torch.bfloat16, torch.float16)}
    assert plain not in keys and len(keys) == 2


def test_a_model_loaded_in_float16_inside_use_is_proven_in_float16(
    proofs: Path, tmp_path: Path
) -> None:
    """``from_pretrained(dtype=torch.float16)`` inside ``use()`` builds its layers in
    float16: the first-use proof runs in float16 too, and its verdict says so."""
    tiny_llama().save_pretrained(tmp_path / "tiny")
    with layerswap.use("llama.decoder.fused"):
        model = LlamaForCausalLM.from_pretrained(tmp_path / "tiny", dtype=torch.float16)
    assert model.dtype == torch.float16
    found = [v for v in proof._MEMO.values() if v.substitution == "llama.decoder.fused"]
    assert [v.dtype for v in found] == ["float16"] and found[0].passed
    assert "in float32 and float16" in found[0].message()


def test_a_replacement_or_converter_changed_under_one_name_is_proven_again(
    proofs: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The replacement's methods rebound at run time, or another converter registered
    under the same name (gate and up swapped), are other substitutions to prove: the
    converter's is refused."""
    import dataclasses

    from layerswap.weights import Concat

    model = tiny_llama()
    sub = get("llama.decoder.fused")
    before = proof.proof_key(sub, model.config)
    replacement = sub.replacement_class()
    forward = replacement.forward
    monkeypatch.setattr(replacement, "forward", lambda self, *a, **k: forward(self, *a, **k))
    assert proof.proof_key(sub, model.config) != before
    monkeypatch.undo()
    assert proof.proof_key(sub, model.config) == before

    rules = tuple(
        dataclasses.replace(rule, sources=tuple(reversed(rule.sources)))
        if isinstance(rule, Concat) and "gate_proj" in rule.sources[0]
        else rule
        for rule in sub.converter.rules
    )
    assert rules != sub.converter.rules
    wrong = dataclasses.replace(sub, converter=dataclasses.replace(sub.converter, rules=rules))
    assert wrong.name == sub.name and proof.proof_key(wrong, model.config) != before
    assert not proof.prove(wrong, model.config).passed


# --- call-time keywords ------------------------------------------------------------------


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "padded"])
def test_is_causal_false_at_call_time_is_computed_as_the_original_computes_it(
    proofs: Path, attention: str, padded: bool
) -> None:
    model = tiny_llama(attn_implementation=attention)
    ids = torch.randint(3, 128, (2, 8), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    if padded:
        mask[1, :3] = 0
    with torch.no_grad():
        expected = model(ids, attention_mask=mask, is_causal=False).logits
        causal = model(ids, attention_mask=mask).logits
        with layerswap.swap(model, "llama.decoder.fused"):
            got = model(ids, attention_mask=mask, is_causal=False).logits
    real = mask.bool()
    torch.testing.assert_close(got[real], expected[real], rtol=1e-5, atol=1e-5)
    if not padded or attention == "eager":  # the option changes what the original computes
        assert (expected - causal).abs().max() > 1e-2


def test_a_keyword_the_layer_does_not_know_is_refused_at_the_call_naming_it(proofs: Path) -> None:
    model = tiny_llama()
    ids = torch.randint(3, 128, (1, 6))
    model(ids, temperature_scale=0.5)  # the original takes it (and here reads it nowhere)
    with layerswap.swap(model, "llama.decoder.fused"):
        with pytest.raises(UpstreamDriftError, match=r"temperature_scale=0\.5.*does not know"):
            model(ids, temperature_scale=0.5)
        # what every layer ignores under sdpa goes through: Trainer's item count
        model(ids, labels=ids, num_items_in_batch=torch.tensor(5))


def test_a_boolean_mask_under_eager_attention_is_refused_at_the_call(proofs: Path) -> None:
    """transformers' eager attention adds a 4-D mask to the scores: a boolean one masks
    nothing there, where the fused layer would mask with it. Refused, naming the mask; a
    float mask is computed as the original computes it."""
    from layerswap.errors import RequirementError

    model = tiny_llama(attn_implementation="eager")
    ids = torch.randint(3, 128, (2, 8), generator=torch.Generator().manual_seed(1))
    allowed = torch.ones(2, 1, 8, 8, dtype=torch.bool).tril()
    additive = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
    with torch.no_grad():
        expected = model(ids, attention_mask=additive).logits
        with layerswap.swap(model, "llama.decoder.fused"):
            with pytest.raises(RequirementError, match="boolean 4-D attention mask under eager"):
                model(ids, attention_mask=allowed)
            got = model(ids, attention_mask=additive).logits
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_a_layer_that_does_not_handle_is_causal_refuses_it() -> None:
    from layerswap.hf_internals import read_layer_call

    read_layer_call({"is_causal": False}, accepted=frozenset({"is_causal"}))
    with pytest.raises(UpstreamDriftError, match=r"TEDecoder.*is_causal=False.*attention option"):
        read_layer_call({"is_causal": False}, layer="TEDecoder")


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_a_config_field_the_original_ignores_leaves_the_swapped_layer_causal(
    proofs: Path, family: str
) -> None:
    """Llama and Qwen 3 configs may carry ``use_bidirectional_attention=True`` (Gemma 3's
    field): their attention stays causal, and so must the replacement's, where the model
    passes its layers no mask (no padding, SDPA)."""
    config = get_family(family).tiny_config()
    config.use_bidirectional_attention = True
    torch.manual_seed(0)
    model = get_family(family).causal_lm_class()(config).eval()
    ids = torch.randint(3, 128, (2, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(ids).logits
        with layerswap.swap(model, f"{family}.decoder.fused"):
            got = model(ids).logits
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_the_proof_runs_the_model_without_a_mask() -> None:
    """A layer attending both ways where the model passes no mask is caught by the proof's
    unpadded forward (a left-padded batch always carries a mask)."""
    import copy

    from layerswap.comparison.first_difference import first_difference
    from layerswap.comparison.tolerance import Tolerance

    reference = tiny_llama()
    candidate = copy.deepcopy(reference)
    for layer in candidate.model.layers:
        layer.self_attn.is_causal = False  # transformers' SDPA reads it where no mask is given
    ids = torch.randint(3, 128, (2, 8), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    batch = {"input_ids": ids, "attention_mask": mask}

    check, detail = first_difference(
        reference, candidate, batch, Tolerance.scaled(1e-4), new_tokens=2
    )

    assert check == "forward on a batch without padding", detail
    assert first_difference(reference, reference, batch, Tolerance.scaled(1e-4), new_tokens=2) == (
        None,
        "6 checks equal",
    )


# --- what the tiny model keeps -----------------------------------------------------------


def test_the_proof_keeps_a_layer_of_every_kind_past_the_fourth() -> None:
    from transformers import Qwen3MoeConfig, SmolLM3Config

    nope_last = SmolLM3Config(num_hidden_layers=6, no_rope_layers=[1, 1, 1, 1, 1, 0])
    shrunk = shrink.shrunk_config(get_family("smollm3"), nope_last)
    assert shrunk.num_hidden_layers == 6 and shrunk.no_rope_layers == [1, 1, 1, 1, 1, 0]

    dense_late = Qwen3MoeConfig(num_hidden_layers=12, mlp_only_layers=[7])
    assert shrink.shrunk_config(get_family("qwen3_moe"), dense_late).num_hidden_layers == 8

    # every layer alike: the family's tiny count, not the user's 32
    plain = LlamaConfig(num_hidden_layers=32)
    tiny = get_family("llama").tiny_config().num_hidden_layers
    assert shrink.shrunk_config(get_family("llama"), plain).num_hidden_layers == tiny


@pytest.mark.parametrize(
    ("sizes", "shape"),
    [
        # Qwen3-0.6B: heads of 128 in a width of 1024 (16 heads): a non-square o_proj
        (
            {"hidden_size": 1024, "num_attention_heads": 16, "num_key_value_heads": 8,
             "head_dim": 128},
            {"head_dim_apart": True, "kv_heads": "groups"},
        ),
        # Llama-2-7B: multi-head attention, every head its own keys and values
        (
            {"hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 32,
             "head_dim": 128},
            {"head_dim_apart": False, "kv_heads": "all"},
        ),
        # one key-value head for all (Gemma 2B)
        (
            {"hidden_size": 2048, "num_attention_heads": 8, "num_key_value_heads": 1,
             "head_dim": 256},
            {"head_dim_apart": False, "kv_heads": "one"},
        ),
    ],
)  # fmt: skip
def test_the_tiny_model_keeps_the_relations_of_the_attention_sizes(
    sizes: dict[str, int], shape: dict[str, Any]
) -> None:
    """Sizes shrink, but a head size apart from ``hidden / heads`` and multi-head or
    one-key-value-head attention stay so (the family's tiny config has neither), and
    each is a kind of config of its own in the verdict's key."""
    family = get_family("qwen3")
    config = family.tiny_config(**sizes)
    assert shrink.shape_of(config.to_dict()) == shape
    tiny = shrink.shrunk_config(family, config)
    assert shrink.shape_of(tiny.to_dict()) == shape
    assert tiny.hidden_size == family.tiny_config().hidden_size
    plain = family.tiny_config()
    assert shrink.config_kind(config) != shrink.config_kind(plain) or shape == shrink.shape_of(
        plain.to_dict()
    )


def test_rotary_parameters_sized_by_the_head_dimension_shrink_with_it(proofs: Path) -> None:
    """Qwen2-VL's multimodal rotary sections sum to half its head dimension (128: [16, 24,
    24]), Phi-3.5's LongRoPE factors are one per frequency (48): at the tiny head
    dimension the first crashed the original tiny model (the swap was refused) and the
    second did not build (the family's tiny config was proven instead)."""
    import transformers

    vl = transformers.Qwen2VLConfig(
        text_config={
            "hidden_size": 3584,
            "intermediate_size": 18944,
            "num_hidden_layers": 28,
            "num_attention_heads": 28,
            "num_key_value_heads": 4,
            "vocab_size": 152064,
            "rope_parameters": {
                "rope_type": "default",
                "mrope_section": [16, 24, 24],
                "rope_theta": 1000000.0,
            },
        }
    )
    tiny = shrink.shrunk_config(get_family("qwen2_vl"), vl).get_text_config()
    head = tiny.hidden_size // tiny.num_attention_heads
    assert sum(tiny.rope_parameters["mrope_section"]) == head // 2
    with torch.device("meta"):
        model = transformers.Qwen2VLForConditionalGeneration(vl)
    with warnings.catch_warnings():
        warnings.simplefilter("error", SwapWarning)  # proven on its own config
        layerswap.swap(model, "qwen2_vl.decoder.fused").undo()

    long = [1.0 + 0.05 * i for i in range(48)]
    phi = transformers.Phi3Config(
        hidden_size=3072,
        intermediate_size=8192,
        num_hidden_layers=32,
        num_attention_heads=24,
        num_key_value_heads=8,
        vocab_size=200064,
        partial_rotary_factor=0.75,
        pad_token_id=199999,
        max_position_embeddings=131072,
        rope_parameters={
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "short_factor": [1.0] * 48,
            "long_factor": long,
            "original_max_position_embeddings": 4096,
        },
    )
    small = shrink.shrunk_config(get_family("phi3"), phi)
    factors = small.rope_parameters["long_factor"]
    assert len(factors) == int(small.hidden_size // small.num_attention_heads * 0.75) // 2
    assert factors[0] == long[0] and factors[-1] == long[-1]  # they still differ as the user's
    assert proof.prove(get("phi3.decoder.fused"), phi).config == "shrunk"


def test_a_config_proven_through_the_familys_tiny_config_is_not_stored_as_its_own(
    proofs: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the user's config cannot be shrunk, the family's tiny config is proven with a
    warning, and the verdict is stored as the family's: another process proves again (and
    warns again), never taking it for a proof of that config."""
    sub = get("llama.decoder.fused")
    config = tiny_llama().config

    def unshrinkable(family: Any, config: Any) -> Any:
        raise ValueError("a field sized for the full model")

    monkeypatch.setattr(shrink, "shrunk_config", unshrinkable)
    with pytest.warns(SwapWarning, match="proved the family's tiny config instead"):
        assert proof.prove(sub, config).config == "family"
    stored = [json.loads(p.read_text()) for p in proofs.glob("*.json")]
    assert stored and all(v["config"] == "family" for v in stored)
    assert not (proofs / f"{proof.proof_key(sub, config)}.json").exists()
    assert (proofs / f"{proof.proof_key(sub, None)}.json").exists()
    monkeypatch.setattr(proof, "_MEMO", {})  # another process
    with pytest.warns(SwapWarning, match="proved the family's tiny config instead"):
        proof.prove(sub, config)


def test_the_proof_runs_past_every_position_threshold() -> None:
    from transformers import Ministral3Config

    config = Ministral3Config(
        sliding_window=4096,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 1e6,
            "factor": 16.0,
            "original_max_position_embeddings": 16384,
            "llama_4_scaling_beta": 0.1,
        },
    )
    assert shrink.position_thresholds(config) == {
        "sliding_window": 4096,
        "rope_parameters.original_max_position_embeddings": 16384,
    }
    shrunk = shrink.shrunk_config(get_family("ministral3"), config)
    assert shrink.position_thresholds(shrunk) == {
        "sliding_window": shrink.PROOF_WINDOW,
        "rope_parameters.original_max_position_embeddings": shrink.PROOF_WINDOW,
    }
    assert proof.prove(get("ministral3.decoder.fused"), config).passed


def test_the_proof_runs_a_chunked_scan_past_its_first_chunk() -> None:
    # Falcon-H1's Mamba 2 mixers scan in chunks of 256 positions: a proof on an 8-token
    # prompt never carried the scan's state from one chunk to the next
    from transformers import FalconH1Config

    sub = get("falcon_h1.qkv.fused")
    config = FalconH1Config(mamba_chunk_size=256)
    assert shrink.position_thresholds(config) == {"mamba_chunk_size": 256}
    shrunk = shrink.shrunk_config(sub.parts.family, config)
    assert shrink.position_thresholds(shrunk) == {"mamba_chunk_size": shrink.PROOF_WINDOW}
    # the family's own tiny config (what `check` and the sweeps prove) spans two chunks too
    assert sub.parts.family.tiny_config().mamba_chunk_size == shrink.PROOF_WINDOW
    assert get("nemotron_h.qkv.fused").parts.family.tiny_config().chunk_size == shrink.PROOF_WINDOW
    assert proof.prove(sub, config).passed


def test_verify_runs_past_a_window_it_can_reach_and_says_which_it_cannot() -> None:
    near = tiny_llama()
    near.config.sliding_window = 40  # read by position_thresholds alone
    assert default_length(near) == 44 and inputs_for(near)["input_ids"].shape[-1] == 44
    model = tiny_llama()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert layerswap.verify(model, "llama.decoder.fused").passed
    assert not [w for w in caught if issubclass(w.category, SwapWarning)]
    model.config.max_position_embeddings = 8192
    model.config.sliding_window = 4096  # llama ignores it; the warning reads the config
    with pytest.warns(SwapWarning, match=r"compares 20 positions.*sliding_window=4096"):
        layerswap.verify(model, "llama.decoder.fused")


# --- upstream changes, as a commit would make them ----------------------------------------

#: a fresh interpreter's verdict on swapping a tiny model of ``family`` (its config given by
#: ``config``, a Python expression): "swapped", or the refusal's type and message
SWAP = """
    import json, torch, transformers, layerswap
    from layerswap.registry import get_family
    family = get_family({family!r})
    config = {config}
    torch.manual_seed(0)
    model = family.causal_lm_class()(config).eval()
    try:
        layerswap.swap(model, {family!r} + ".decoder.fused")
        print(json.dumps(["swapped", ""]))
    except layerswap.errors.LayerswapError as error:
        print(json.dumps([type(error).__name__, str(error)]))
"""


def swap_in(cache: Path, family: str, config: str, site: Path | None = None) -> list[str]:
    code = textwrap.dedent(SWAP).format(family=family, config=config)
    found: list[str] = run_json(code, cache, path=[site] if site else [])
    return found


LLAMA_CONFIG = (
    "transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128, "
    "num_attention_heads=4, num_key_value_heads=2, vocab_size=128, attn_implementation={!r})"
)

#: edits an upstream commit could make, each changing what the original computes
EDITS = {
    "attention output scaled": (
        "models/llama/modeling_llama.py",
        "        attn_output = self.o_proj(attn_output)\n",
        "        attn_output = self.o_proj(attn_output) * 1.5\n",
    ),
    "(1 + w) RMSNorm": (
        "models/llama/modeling_llama.py",
        "        return self.weight * hidden_states.to(input_dtype)\n",
        "        return (1.0 + self.weight) * hidden_states.to(input_dtype)\n",
    ),
}


def edit(path: str, old: str, new: str) -> dict[str, Any]:
    def change(text: str) -> str:
        assert old in text, f"{path} no longer holds {old!r}"
        return text.replace(old, new)

    return {path: change}


@pytest.mark.slow
@pytest.mark.parametrize("change", sorted(EDITS))
def test_a_source_changed_under_the_same_version_is_proven_again_and_refused(
    tmp_path: Path, change: str
) -> None:
    cache = tmp_path / "proofs"
    config = LLAMA_CONFIG.format("sdpa")
    assert swap_in(cache, "llama", config) == ["swapped", ""]
    site = edited_transformers(tmp_path, edit(*EDITS[change]))
    # the same version string, another source: stale until proven again
    doctor = run_json(
        """
        import json
        from layerswap.cli.proving import proofs_row
        print(json.dumps(proofs_row()))
        """,
        cache,
        path=[site],
    )
    assert "changed since proven" in doctor["status"] and "llama" in doctor["enables"]
    kind, message = swap_in(cache, "llama", config, site)
    assert kind == "UpstreamDriftError" and "does not behave like the original" in message


@pytest.mark.slow
def test_an_eager_only_change_is_proven_on_an_eager_model(tmp_path: Path) -> None:
    cache = tmp_path / "proofs"
    site = edited_transformers(
        tmp_path,
        edit(
            "models/llama/modeling_llama.py",
            "    attn_weights = torch.matmul(query, key_states.transpose(2, 3)) * scaling\n",
            "    attn_weights = torch.matmul(query, key_states.transpose(2, 3)) * scaling * 1.1\n",
        ),
    )
    assert swap_in(cache, "llama", LLAMA_CONFIG.format("sdpa"), site) == ["swapped", ""]
    kind, message = swap_in(cache, "llama", LLAMA_CONFIG.format("eager"), site)
    assert kind == "UpstreamDriftError", message


#: LlamaModel hands its layers a new option through **kwargs, and the attention reads it
OPTION_EDITS = {
    "models/llama/modeling_llama.py": lambda text: text.replace(
        "                use_cache=use_cache,\n                **kwargs,\n",
        "                use_cache=use_cache,\n                attention_temperature=2.0,\n"
        "                **kwargs,\n",
    ).replace(
        "        attn_output = self.o_proj(attn_output)\n",
        "        attn_output = self.o_proj(attn_output) / kwargs.get('attention_temperature', 1.0)\n",
    )
}


@pytest.mark.slow
def test_an_option_passed_only_through_kwargs_is_refused_naming_it(tmp_path: Path) -> None:
    site = edited_transformers(tmp_path, OPTION_EDITS)
    kind, message = swap_in(tmp_path / "proofs", "llama", LLAMA_CONFIG.format("sdpa"), site)
    assert kind == "UpstreamDriftError" and "attention_temperature=2.0" in message


@pytest.mark.slow
def test_a_query_scaling_past_the_configs_span_is_proven_past_it(tmp_path: Path) -> None:
    # Ministral 3's query temperature starts at rope original_max_position_embeddings:
    # an upstream change of where it starts shows only past that span
    site = edited_transformers(
        tmp_path,
        edit(
            "models/ministral3/modeling_ministral3.py",
            "torch.floor(positions_ids / max_position_embeddings)",
            "torch.floor((positions_ids + 1) / max_position_embeddings)",
        ),
    )
    config = (
        "family.tiny_config(max_position_embeddings=1024, rope_parameters={'rope_type': "
        "'yarn', 'rope_theta': 1e6, 'factor': 16.0, 'original_max_position_embeddings': 64, "
        "'llama_4_scaling_beta': 0.5})"
    )
    kind, message = swap_in(tmp_path / "proofs", "ministral3", config, site)
    assert kind == "UpstreamDriftError", message


@pytest.mark.slow
def test_a_layer_kind_past_the_fourth_layer_is_proven(tmp_path: Path) -> None:
    # SmolLM3's NoPE layers, changed upstream; the config's only NoPE layer is the sixth
    site = edited_transformers(
        tmp_path,
        edit(
            "models/smollm3/modeling_smollm3.py",
            "        if self.use_rope:\n",
            "        if not self.use_rope:\n            query_states = query_states * 1.5\n"
            "        if self.use_rope:\n",
        ),
    )
    config = "family.tiny_config(num_hidden_layers=6, no_rope_layers=[1, 1, 1, 1, 1, 0])"
    kind, message = swap_in(tmp_path / "proofs", "smollm3", config, site)
    assert kind == "UpstreamDriftError", message


@pytest.mark.slow
def test_a_contract_broken_at_run_time_is_one_line_and_exit_2_on_the_command_line(
    tmp_path: Path,
) -> None:
    site = edited_transformers(tmp_path, OPTION_EDITS)
    env = {
        **os.environ,
        "LAYERSWAP_CACHE": str(tmp_path / "proofs"),
        "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]),
    }
    done = subprocess.run(
        [sys.executable, "-m", "layerswap", "patch", "--model", "llama"],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("layerswap: error:")]
    assert len(errors) == 1 and "attention_temperature" in errors[0]
    assert json.dumps(done.stderr).count("\\n") <= 2  # one line, maybe a progress remnant


def test_the_proofs_prompts_hold_no_media_token_and_are_the_same_whatever_the_rng() -> None:
    """The prompts the first-use proof and an adoption's proof run (one builder,
    ``judgement.proof_batch``): a wrapper's image or video token would ask for features
    a text prompt lacks, and the seed is their own (the global generator's state, which
    model building consumes, changes nothing)."""
    config = get_family("qwen2_vl").tiny_config()
    media = {3, 4, 5, 6, 7, 8, 9, 10}
    for name, token in zip(("image_token_id", "video_token_id"), (3, 4), strict=True):
        setattr(config, name, token)
    config.vision_start_token_id, config.vision_end_token_id = 5, 10
    config.get_text_config().vocab_size = 12  # most ids are media ids now
    model = get_family("qwen2_vl").causal_lm_class()(config)
    first = proof_batch(model, torch.device("cpu"))
    torch.manual_seed(1234)
    torch.randn(100)
    again = proof_batch(model, torch.device("cpu"))
    ids = first["input_ids"][first["attention_mask"].bool()]
    assert not set(ids.tolist()) & {3, 4, 5, 10}
    assert set(ids.tolist()) & (media - {3, 4, 5, 10})  # the other ids are drawn
    assert torch.equal(first["input_ids"], again["input_ids"])
    assert first["attention_mask"][1, :3].sum() == 0 and first["attention_mask"][0].all()


def test_another_function_registered_as_sdpa_is_proven_before_it_runs(proofs: Path) -> None:
    """The verdict named the attention implementation, not the function transformers
    dispatches it to: a function registered under ``"sdpa"`` since (a user's or another
    library's kernel, computing otherwise) ran beside a replacement proven on
    transformers' own, from the verdict in memory and on disk. It is other code now: a
    swap after the registration proves it (refused here), and so does the next pass of a
    model swapped before it; with transformers' own back, the model runs again."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def rescaled(module: Any, *args: Any, **kwargs: Any) -> Any:
        kwargs["scaling"] = 2.0 * (kwargs.get("scaling") or module.scaling)
        return sdpa_attention_forward(module, *args, **kwargs)

    batch = {"input_ids": torch.arange(3, 11).reshape(1, 8)}
    swapped = tiny_llama()
    layerswap.swap(swapped, "llama.decoder.fused")
    swapped(**batch)
    try:
        AttentionInterface.register("sdpa", rescaled)
        with pytest.raises(UpstreamDriftError, match="differs"):
            swapped(**batch)
        with pytest.raises(UpstreamDriftError, match="differs"):
            layerswap.swap(tiny_llama(), "llama.decoder.fused")
    finally:
        AttentionInterface.register("sdpa", sdpa_attention_forward)
    swapped(**batch)


def test_a_base_model_pickled_alone_carries_no_more_than_itself(proofs: Path) -> None:
    """The guard's hook on the base model held the model for pickling: ``torch.save`` of
    the base model alone wrote the whole model (its head too), and failed to load once the
    model was gone. It pickles as a hook that checks nothing."""
    import gc
    import io

    def saved(module: torch.nn.Module) -> io.BytesIO:
        buffer = io.BytesIO()
        torch.save(module, buffer)
        buffer.seek(0)
        return buffer

    plain = len(saved(tiny_llama().model).getvalue())
    model = tiny_llama()
    head = model.lm_head.weight.numel() * model.lm_head.weight.element_size()
    layerswap.swap(model, "llama.decoder.fused")
    base = model.model
    assert len(saved(base).getvalue()) < plain + head // 2
    del model
    gc.collect()
    loaded = torch.load(saved(base), weights_only=False)
    loaded(input_ids=torch.arange(3, 11).reshape(1, 8))


def test_attention_functions_are_digested_by_what_they_compute() -> None:
    """Every ``functools.partial`` digested as "partial", and every instance of a class
    by its type: a verdict proven beside one was taken for any other. A partial is
    digested by the function it calls and its arguments, an instance by its class's call
    and its state; equal ones alike, in any process."""
    import functools

    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def scaled(module: Any, *args: Any, factor: float = 1.0, **kwargs: Any) -> Any:
        return sdpa_attention_forward(module, *args, **kwargs)

    class Scaled:
        def __init__(self, factor: float) -> None:
            self.factor = factor

        def __call__(self, module: Any, *args: Any, **kwargs: Any) -> Any:
            return sdpa_attention_forward(module, *args, **kwargs)

    one, two = functools.partial(scaled, factor=1.0), functools.partial(scaled, factor=2.0)
    assert sources.function_digest(one) != sources.function_digest(two)
    assert sources.function_digest(one) == sources.function_digest(
        functools.partial(scaled, factor=1.0)
    )
    assert sources.function_digest(Scaled(1.0)) != sources.function_digest(Scaled(2.0))
    assert sources.function_digest(Scaled(1.0)) == sources.function_digest(Scaled(1.0))
    assert "0x" not in sources.function_digest(functools.partial(scaled, object()))


@pytest.mark.parametrize("device", ["mps", "xpu"])
def test_a_model_on_a_device_no_proof_runs_on_is_refused(proofs: Path, device: str) -> None:
    """A model on a device the substitution is not proven on (``mps``, ``xpu``) was proven
    on the CPU, and that verdict taken for kernels that never ran there. It is refused,
    naming the device; a CPU model (moved to CUDA after, proven again there) is not."""
    from layerswap.proof import ensure_proven

    sub = get("llama.decoder.fused")
    config = tiny_llama().config
    with pytest.raises(RequirementError, match=rf"computes on {device}, where no proof"):
        ensure_proven(sub, config, Placement(torch.float32, torch.device(device), None))
    assert not list(proofs.glob("*.json"))  # nothing proven, nothing stored
    ensure_proven(sub, config, Placement(torch.float32, torch.device("cpu"), None))
