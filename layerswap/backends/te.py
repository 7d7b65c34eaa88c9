"""The ``te`` backend: NVIDIA TransformerEngine decoder layers, BF16 and FP8, GPU only.

The layer is composed of the TransformerEngine modules that
``transformer_engine.pytorch.TransformerLayer`` is built from, under the same names:
``self_attention.layernorm_qkv`` (RMSNorm fused into the q/k/v projection,
``LayerNormLinear``), ``self_attention.core_attention`` (``DotProductAttention``: cuDNN
or flash kernels, GQA), ``self_attention.proj`` (``Linear``) and ``layernorm_mlp``
(RMSNorm + gated MLP, ``LayerNormMLP``). It is not ``TransformerLayer`` itself because
that class keeps its own KV cache (``InferenceParams``) where transformers passes a
``Cache``, has one ``bias`` switch for every projection (Qwen2 biases q/k/v only), and
takes one row of rotary angles for the whole batch. Owning the forward lets the layer
follow the transformers 5 decoder-layer contract exactly: it receives
``position_embeddings=(cos, sin)``, the mask the model built and the cache, and returns
the hidden-states tensor. That contract is :mod:`layerswap.backends._layer`, shared with
the ``fused`` backend; this module states what is TransformerEngine's own.

FP8 runs inside :func:`fp8_autocast` (TransformerEngine's autocast with a recipe of
your choice); outside it the layer computes in the parameters' dtype (BF16).

Nothing here imports TransformerEngine until a layer is built or FP8 is asked for, so
this module loads on any machine; :func:`unmet_requirement` says why it cannot run.

Example::

    import layerswap
    from layerswap.backends import te

    model = LlamaForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda()
    layerswap.swap(model, "llama.decoder.te")
    with te.fp8_autocast("current"):                 # optional: FP8 GEMMs
        logits = model(input_ids, use_cache=False).logits
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from layerswap.backend import Backend, Dependency, Implementation, Variant
from layerswap.backends import _layer
from layerswap.backends.te_layout import TELayerSpec, te_converter, unexpressible
from layerswap.errors import RequirementError
from layerswap.family import Family
from layerswap.weights import is_extra_state

if TYPE_CHECKING:
    from transformers import PreTrainedConfig

    from layerswap.hf_internals import LayerCache

__all__ = [
    "BACKEND",
    "NOT_INSTALLED",
    "NO_CUDA",
    "TEAttention",
    "TEDecoderLayer",
    "fp8_autocast",
    "fp8_recipe",
    "fp8_unmet_requirement",
    "layer_class",
    "rotate",
    "te_mask",
    "unmet_requirement",
    "unsupported",
]

NOT_INSTALLED = "TransformerEngine is not installed (pip install 'layerswap[te]')"
NO_CUDA = "needs CUDA (no CUDA device visible)"

# recipe name -> (TransformerEngine class in transformer_engine.common.recipe, minimum
# compute capability); FP8 tensor cores start with Ada (8.9), block scaling needs Hopper,
# MX formats need Blackwell
_RECIPES: dict[str, tuple[str, tuple[int, int]]] = {
    "delayed": ("DelayedScaling", (8, 9)),
    "current": ("Float8CurrentScaling", (8, 9)),
    "block": ("Float8BlockScaling", (9, 0)),
    "mxfp8": ("MXFP8BlockScaling", (10, 0)),
    "nvfp4": ("NVFP4BlockScaling", (10, 0)),
}


# --- requirements ------------------------------------------------------------------------


def _installed() -> bool:
    try:
        return importlib.util.find_spec("transformer_engine") is not None
    except (ImportError, ValueError):  # a broken or half-imported package
        return False


def unmet_requirement() -> str | None:
    """Why the ``te`` layers cannot run here, or ``None`` when they can.

    Checked in order: TransformerEngine installed, a CUDA device visible, and
    ``transformer_engine.pytorch`` importable (a CUDA build of torch and TE's
    extension matching it).

    Example::

        from layerswap.backends import te
        te.unmet_requirement()    # "TransformerEngine is not installed (pip install ...)"
    """
    if not _installed():
        return NOT_INSTALLED
    if not torch.cuda.is_available():
        return NO_CUDA
    try:
        importlib.import_module("transformer_engine.pytorch")
    except Exception as exc:  # an ABI mismatch raises OSError or RuntimeError, not ImportError
        return f"TransformerEngine is installed but cannot be imported: {exc}{_import_hint(exc)}"
    return None


def _import_hint(exc: BaseException) -> str:
    """What to do about a known import failure of ``transformer_engine.pytorch``."""
    message = str(exc)
    if "undefined symbol" in message and "cudnn" in message.lower():
        # Seen on a GPU machine with a system cuDNN beside torch's nvidia-cudnn wheel: once
        # torch had run a cuDNN kernel (SDPA's cuDNN attention), TE's import bound the
        # system's libcudnn_cnn to torch's already loaded libcudnn_graph.
        return (
            " (two cuDNN builds were mixed: import transformer_engine.pytorch before the "
            "first model runs on the GPU, or put torch's nvidia/cudnn/lib first on "
            "LD_LIBRARY_PATH)"
        )
    return ""


def _te() -> Any:
    """``transformer_engine.pytorch``, or :class:`RequirementError` with the reason."""
    reason = unmet_requirement()
    if reason is not None:
        raise RequirementError(f"the te backend cannot run here: {reason}")
    return importlib.import_module("transformer_engine.pytorch")


def _recipe_kind(recipe: Any) -> str:
    """The :data:`_RECIPES` key of a recipe given by name or as a TE recipe object."""
    if isinstance(recipe, str):
        return recipe
    class_name = type(recipe).__name__
    for kind, (name, _) in _RECIPES.items():
        if name == class_name:
            return kind
    return "current"  # an unknown (custom) recipe needs at least FP8 tensor cores


def fp8_unmet_requirement(recipe: Any = None) -> str | None:
    """Why FP8 (with ``recipe``, a name or a TE recipe) cannot run here, or ``None``.

    Example::

        te.fp8_unmet_requirement("mxfp8")   # "FP8 recipe 'mxfp8' needs compute capability ..."
    """
    reason = unmet_requirement()
    if reason is not None:
        return reason
    kind = "auto" if recipe is None else _recipe_kind(recipe)
    needed = _RECIPES.get(kind, _RECIPES["current"])[1]
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) >= needed:
        return None
    if needed == (8, 9):
        return f"FP8 needs compute capability >= 8.9 (found {major}.{minor})"
    return (
        f"FP8 recipe {kind!r} needs compute capability >= {needed[0]}.{needed[1]} "
        f"(found {major}.{minor})"
    )


# --- FP8 ----------------------------------------------------------------------------------


def fp8_recipe(name: str = "auto", **options: Any) -> Any:
    """A TransformerEngine FP8 recipe by short name; ``options`` go to its constructor.

    Names: ``"current"`` (``Float8CurrentScaling``: scales from each tensor as it is
    quantized; no warm-up, the default below Blackwell), ``"delayed"``
    (``DelayedScaling``: scales from an amax history, so the first iterations run with
    scale 1), ``"block"`` (``Float8BlockScaling``, Hopper+), ``"mxfp8"``
    (``MXFP8BlockScaling``, Blackwell, the default there), ``"nvfp4"`` (Blackwell), and
    ``"auto"``. ``fp8_format`` may be given as a string (``"hybrid"``, ``"e4m3"``).

    Example::

        recipe = te.fp8_recipe("delayed", amax_history_len=16, fp8_format="hybrid")
    """
    _te()
    from transformer_engine.common import recipe as te_recipe

    if name == "auto":
        major, _ = torch.cuda.get_device_capability()
        name = "mxfp8" if major == 10 else "current"
    if name not in _RECIPES:
        raise ValueError(f"unknown FP8 recipe {name!r}; choose one of {sorted(_RECIPES)} or 'auto'")
    class_name = _RECIPES[name][0]
    recipe_class = getattr(te_recipe, class_name, None)
    if recipe_class is None:
        raise RequirementError(
            f"the installed TransformerEngine has no {class_name} (FP8 recipe {name!r})"
        )
    if isinstance(options.get("fp8_format"), str):
        options["fp8_format"] = te_recipe.Format[options["fp8_format"].upper()]
    return recipe_class(**options)


def fp8_autocast(
    recipe: Any = None, *, enabled: bool = True, **options: Any
) -> AbstractContextManager[Any]:
    """Run the TE layers' GEMMs in FP8 inside the block.

    ``recipe`` is a name for :func:`fp8_recipe` (``options`` go there) or a
    TransformerEngine recipe object; ``None`` picks the device's default. Raises
    :class:`RequirementError` when FP8 cannot run here ("FP8 needs compute capability
    >= 8.9 (found 8.0)"). TE's FP8 GEMMs need the token count to be a multiple of 16
    (32 for MXFP8); a layer call that is not (a decode step of ``generate()``) runs in
    BF16 instead. Run the backward pass after the block ends, as TransformerEngine
    requires.

    Example::

        with te.fp8_autocast("delayed", amax_history_len=16):
            loss = model(**batch, use_cache=False).loss
        loss.backward()
    """
    if not enabled:
        if not _installed():
            return contextlib.nullcontext()
        return _autocast(_te(), enabled=False, recipe=None)
    reason = unmet_requirement()
    if reason is not None:
        raise RequirementError(f"fp8_autocast cannot run here: {reason}")
    if recipe is None or isinstance(recipe, str):
        recipe = fp8_recipe(recipe or "auto", **options)
    elif options:
        raise TypeError("recipe options apply to a recipe given by name, not to a recipe object")
    reason = fp8_unmet_requirement(recipe)
    if reason is not None:
        raise RequirementError(f"fp8_autocast cannot run here: {reason}")
    return _autocast(_te(), enabled=True, recipe=recipe)


def _autocast(te: Any, *, enabled: bool, recipe: Any) -> AbstractContextManager[Any]:
    # TE >= 2.8 names it autocast(recipe=...); older releases only have fp8_autocast
    if hasattr(te, "autocast"):
        return te.autocast(enabled=enabled, recipe=recipe)  # type: ignore[no-any-return]
    return te.fp8_autocast(enabled=enabled, fp8_recipe=recipe)  # type: ignore[no-any-return]


# --- the layer ----------------------------------------------------------------------------


@functools.cache
def _rope_kernel() -> Callable[..., torch.Tensor] | None:
    """TE's ``apply_rotary_pos_emb`` (its module moved between releases), or ``None``."""
    for module_name in (
        "transformer_engine.pytorch.attention.rope",
        "transformer_engine.pytorch.attention",
    ):
        try:
            kernel = getattr(importlib.import_module(module_name), "apply_rotary_pos_emb", None)
        except ImportError:
            continue
        if kernel is not None:
            return kernel  # type: ignore[no-any-return]
    return None


@functools.cache
def _fp8_state() -> Any:
    """TE's FP8 global state manager (its module moved between releases), or ``None``."""
    for module_name in (
        "transformer_engine.pytorch.quantization",
        "transformer_engine.pytorch.fp8",
    ):
        try:
            return importlib.import_module(module_name).FP8GlobalStateManager
        except (ImportError, AttributeError):
            continue
    return None


def _fp8_alignment(recipe: Any) -> int:
    """The token-count multiple TE's FP8 GEMMs need under ``recipe``."""
    for predicate, size in (("nvfp4", 128), ("mxfp8", 32)):
        check = getattr(recipe, predicate, None)
        if callable(check) and check():
            return size
    return 16


def _precision_for(tokens: int) -> AbstractContextManager[Any]:
    """BF16 for this call when FP8 is on but ``tokens`` cannot be quantized.

    TE refuses FP8 GEMMs whose token count is not a multiple of the recipe's block
    (16; 32 for MXFP8). Decode steps of ``generate()`` feed one token per sequence, so
    inside :func:`fp8_autocast` they run in BF16 instead of failing; prefill and
    training steps (long, aligned sequences) keep FP8. Running only aligned calls in
    FP8 also keeps delayed scaling's rule of one FP8 call per module per region.
    """
    state = _fp8_state()
    if state is None or not state.is_fp8_enabled():
        return contextlib.nullcontext()
    recipe = state.get_fp8_recipe()
    if tokens % _fp8_alignment(recipe) == 0:
        return contextlib.nullcontext()
    # the active recipe, not None: TE would build its default recipe object on every call
    te = importlib.import_module("transformer_engine.pytorch")
    return _autocast(te, enabled=False, recipe=recipe)


def rotate(
    query: torch.Tensor,
    key: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    fused: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding of bshd ``query``/``key`` from the model's ``(cos, sin)`` (batch, seq, dim).

    transformers gives cos(angle) and sin(angle), the angles repeated over the two
    halves of the head (rotate-half convention: TE's non-interleaved one). TE's fused
    kernel takes the angles themselves, one row for the whole batch. ``atan2(sin, cos)``
    recovers each angle up to a multiple of 2*pi, which cos and sin do not see, so the
    kernel rotates by exactly the model's angles. Recovering them, rather than
    recomputing them from ``rope_theta``, keeps every variant the model's rotary module
    implements (linear, dynamic, llama3). With ``fused=False`` (cos/sin scaled by an
    attention factor, as yarn and longrope do: no longer a pure rotation), per-row
    positions, or no TE kernel, the elementwise formula runs on the model's tensors.

    Example::

        query, key = rotate(query, key, cos, sin)   # query: (batch, seq, heads, head_dim)
    """
    kernel = _rope_kernel() if fused else None
    if kernel is not None and cos.shape[0] == 1:
        length, dim = cos.shape[1], cos.shape[2]
        angle = torch.atan2(sin[0].float(), cos[0].float()).view(length, 1, 1, dim)
        return (
            kernel(query, angle, tensor_format="bshd", fused=True),
            kernel(key, angle, tensor_format="bshd", fused=True),
        )
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)  # broadcast over the heads of bshd
    return query * cos + _layer.rotate_half(query) * sin, key * cos + _layer.rotate_half(key) * sin


def te_mask(
    attention_mask: torch.Tensor | None, query_length: int, spec: TELayerSpec
) -> tuple[str, torch.Tensor | None, tuple[int, int] | None]:
    """transformers' attention mask -> TE's ``(attn_mask_type, attention_mask, window_size)``.

    No mask: with SDPA the model drops the mask exactly when plain causal attention is
    right, and SDPA then runs ``is_causal=query_length > 1``, top-left aligned (a static
    cache's prefill relies on the alignment): TE's ``"causal"`` is the same. A single
    query attends to every key it is given (bottom-right causal). The layer's sliding
    window goes along for the case where the model left it to the kernel.

    A 4-D mask (SDPA: bool, True keeps; eager: additive, negative masks) already holds
    causality, padding and the window; TE wants True where a position is masked out,
    as an ``"arbitrary"`` mask. Other masks (2-D from flash attention, flex block
    masks) raise :class:`RequirementError`.

    Example::

        te_mask(None, 16, spec)            # ("causal", None, None)
        te_mask(sdpa_mask, 16, spec)       # ("arbitrary", ~sdpa_mask, None)
    """
    window = spec.window_size
    if attention_mask is None:
        if not spec.causal:
            return "no_mask", None, None
        if query_length > 1:
            return "causal", None, window
        return ("causal_bottom_right", None, window) if window else ("no_mask", None, None)
    if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 4:
        if attention_mask.dtype == torch.bool:
            return "arbitrary", ~attention_mask, None
        return "arbitrary", attention_mask < 0, None
    raise RequirementError(
        "the te layer reads 4-D attention masks (attn_implementation 'sdpa' or 'eager'); "
        f"it got {type(attention_mask).__name__} {tuple(getattr(attention_mask, 'shape', ()))}"
    )


def _require_cuda(hidden_states: torch.Tensor, layer: nn.Module) -> None:
    # TE's own failure on CPU tensors is an assertion deep in attention or a GEMM error
    if not hidden_states.is_cuda:
        raise RequirementError(
            f"{type(layer).__name__} runs on CUDA tensors; move the model to the GPU (model.cuda())"
        )


def _te_device() -> str | torch.device:
    device = torch.get_default_device()
    # TE defers parameter initialisation only for the string "meta"
    return "meta" if device.type == "meta" else device


class TEAttention(nn.Module):
    """Self-attention from TE modules: ``layernorm_qkv`` -> RoPE -> cache -> ``core_attention`` -> ``proj``.

    The input RMSNorm lives in ``layernorm_qkv`` (fused with the q/k/v GEMM), as in
    TransformerEngine's own layer.
    """

    def __init__(self, spec: TELayerSpec, layer_idx: int, te: Any, **factory: Any) -> None:
        super().__init__()
        self.spec = spec
        self.layer_idx = layer_idx
        norm = {"eps": spec.norm_eps, "zero_centered_gamma": spec.zero_centered_norm}
        self.layernorm_qkv = te.LayerNormLinear(
            spec.hidden_size,
            spec.q_size + 2 * spec.kv_size,
            bias=spec.qkv_bias,
            normalization="RMSNorm",
            **norm,
            **factory,
        )
        self.q_norm: nn.Module | None = None
        self.k_norm: nn.Module | None = None
        if spec.qk_norm:
            device, dtype = factory["device"], factory["params_dtype"]
            self.q_norm = te.RMSNorm(spec.head_dim, **norm, params_dtype=dtype, device=device)
            self.k_norm = te.RMSNorm(spec.head_dim, **norm, params_dtype=dtype, device=device)
        self.core_attention = te.DotProductAttention(
            spec.num_heads,
            spec.head_dim,
            num_gqa_groups=spec.num_kv_heads,
            attention_dropout=spec.attention_dropout,
            qkv_format="bshd",
            attn_mask_type="causal",
            layer_number=layer_idx + 1,
            softmax_scale=spec.softmax_scale,
        )
        self.proj = te.Linear(spec.q_size, spec.hidden_size, bias=spec.o_bias, **factory)

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None,
        cache: LayerCache | None = None,
    ) -> torch.Tensor:
        spec = self.spec
        batch, length, _ = hidden_states.shape
        query, key, value = _layer.split_heads(
            self.layernorm_qkv(hidden_states),
            (spec.q_size, spec.kv_size, spec.kv_size),
            spec.head_dim,
        )
        if self.q_norm is not None and self.k_norm is not None:
            query, key = self.q_norm(query), self.k_norm(key)  # before RoPE, as Qwen3 does
        query, key = rotate(query, key, *position_embeddings, fused=spec.unit_rope)
        key, value = _layer.update_cache(
            cache,
            key,
            value,
            self.layer_idx,
            layout="bshd",
            position_embeddings=position_embeddings,
        )
        mask_type, mask, window = te_mask(attention_mask, length, spec)
        # separate contiguous q/k/v: TE then reads them as bshd_bshd_bshd instead of
        # guessing a packed layout from data pointers (which torch.compile forbids)
        context = self.core_attention(
            query.contiguous(),
            key.contiguous(),
            value.contiguous(),
            attention_mask=mask,
            attn_mask_type=mask_type,
            window_size=window,
            qkv_format="bshd",
        )
        return self.proj(context.reshape(batch, length, spec.q_size))  # type: ignore[no-any-return]


class TEDecoderLayer(_layer.DecoderLayer):
    """The TransformerEngine decoder layer; use the per-family subclass from :func:`layer_class`.

    Constructed like the original, ``Layer(config, layer_idx)``, on the current default
    device (``meta`` defers initialisation), with parameters in the default dtype;
    called like it. Parameters are initialised as transformers would (normal with
    ``initializer_range``, norms at their neutral value, biases zero) and marked as
    initialised, so transformers' name-based init (which would take TE's
    ``LayerNormLinear.weight`` for a norm weight) leaves them alone.
    """

    backend = "te"
    summary = "TransformerEngine decoder layer"

    def __init__(self, config: PreTrainedConfig, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        te = _te()
        self.spec = spec = TELayerSpec.for_layer(self.declared_family(), config, layer_idx)
        factory = {
            "params_dtype": torch.get_default_dtype(),
            "device": _te_device(),
            "init_method": functools.partial(nn.init.normal_, mean=0.0, std=spec.initializer_range),
        }
        self.self_attention = TEAttention(spec, layer_idx, te, **factory)
        self.layernorm_mlp = te.LayerNormMLP(
            spec.hidden_size,
            spec.intermediate_size,
            eps=spec.norm_eps,
            bias=spec.mlp_bias,
            normalization="RMSNorm",
            activation=spec.activation,
            zero_centered_gamma=spec.zero_centered_norm,
            output_layer_init_method=factory["init_method"],
            **factory,
        )
        for module in self.modules():
            module._is_hf_initialized = True
        self.register_state_dict_post_hook(_drop_empty_extra_state)

    def _call_context(self, hidden_states: torch.Tensor) -> AbstractContextManager[Any]:
        _require_cuda(hidden_states, self)
        return _precision_for(hidden_states.shape[0] * hidden_states.shape[1])

    def _attention(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None,
        cache: LayerCache,
        *,
        output_attentions: bool = False,  # TE computes no weights: the skeleton warns
    ) -> torch.Tensor:
        # the input RMSNorm is fused into self_attention.layernorm_qkv
        attended: torch.Tensor = self.self_attention(
            hidden_states, position_embeddings, attention_mask, cache
        )
        return self._scaled(attended)

    def _feed_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        mixed: torch.Tensor = self.layernorm_mlp(hidden_states)  # RMSNorm fused in
        return self._scaled(mixed)

    def _scaled(self, branch: torch.Tensor) -> torch.Tensor:
        # Granite scales each branch before the residual sum
        multiplier = self.spec.residual_multiplier
        return branch * multiplier if multiplier != 1.0 else branch

    def _load_from_state_dict(
        self, state_dict: dict[str, Any], prefix: str, *args: Any, **kwargs: Any
    ) -> None:
        # The counterpart of _drop_empty_extra_state: an entry left out (or never there,
        # as in converted original-layout weights) is TE's own "no FP8 state", so strict
        # loading works and TE starts its FP8 scaling state afresh.
        for name, module in self.named_modules():
            if type(module).get_extra_state is not nn.Module.get_extra_state:
                key = f"{prefix}{name}.{nn.modules.module._EXTRA_STATE_KEY_SUFFIX}"
                state_dict.setdefault(key, torch.empty(0, dtype=torch.uint8))
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def extra_repr(self) -> str:
        window = f", sliding_window={self.spec.sliding_window}" if self.spec.sliding_window else ""
        return super().extra_repr() + window


def _drop_empty_extra_state(
    module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any
) -> None:
    """Leave TE's empty ``*._extra_state`` entries out of a TE layer's state dict.

    TE writes an empty tensor when a module holds no FP8 scaling state (always, outside
    delayed scaling). Without them the state dict is the layer's weights only, so
    ``save_pretrained`` of a swapped model writes exactly the original layout, and
    transformers' loader expects no tensor a checkpoint cannot have. FP8 scaling
    history (delayed scaling) is kept.
    """
    for key in [key for key in state_dict if key.startswith(prefix) and is_extra_state(key)]:
        value = state_dict[key]
        if isinstance(value, torch.Tensor) and value.numel() == 0:
            del state_dict[key]


def layer_class(family: Family) -> type[TEDecoderLayer]:
    """The TE decoder layer class for ``family`` (made once, then cached).

    Builtin families' classes are importable from this module by name
    (``layerswap.backends.te:TELlamaDecoderLayer``), so pickled models load. Making the
    class needs no TransformerEngine; building a layer does.
    """
    return _layer.family_layer_class(TEDecoderLayer, family)


def unsupported(family: Family) -> str | None:
    """Why TransformerEngine's modules cannot express ``family``'s layer, or ``None``.

    TE's RMSNorm scales by ``weight`` or ``1 + weight`` (``zero_centered_gamma``), so a
    family with another norm offset has no TE layer; the rest is :func:`unexpressible`.
    Everything else the builtin families declare (q/k/v-only biases, q/k norm, GQA,
    sliding windows, tanh-GELU) maps onto TE modules.

    Example::

        te.unsupported(layerswap.get_family("olmo2"))   # "... q/k norm across heads ..."
    """
    if family.norm_offset not in (0.0, 1.0):
        return (
            f"TransformerEngine's RMSNorm scales by weight or 1 + weight; this family's "
            f"norm offset is {family.norm_offset}"
        )
    if family.residual_dropout is not None:
        # judged on the family's default configuration; a config you bring is checked
        # again when a layer is built (TELayerSpec.for_layer)
        try:
            dropout = family.residual_dropout_p(family.tiny_config())
        except Exception:  # no tiny config here: judged per layer
            dropout = 0.0
        if dropout:
            return (
                "the te layer applies no dropout after the output projections (this "
                f"family's default {family.residual_dropout}={dropout}; set it to 0 to use te)"
            )
    return unexpressible(family)


#: the ``te`` backend: TransformerEngine decoder layers in BF16, and the ``fp8`` variant:
#: the same layers and weights inside :func:`fp8_autocast` (``llama.decoder.te_fp8``;
#: ``sub.with_options(recipe="delayed")`` picks the recipe)
BACKEND = Backend(
    name="te",
    description="NVIDIA TransformerEngine decoder layers, BF16 and FP8, GPU only",
    slots={
        "decoder": Implementation(
            replacement=layer_class,
            converter=te_converter,
            supports=unsupported,
            description=(
                "NVIDIA TransformerEngine, GPU only: RMSNorm fused into the q/k/v and gate/up "
                "GEMMs, cuDNN/flash attention with GQA; BF16, and FP8 inside te.fp8_autocast"
            ),
        ),
    },
    requirement=unmet_requirement,
    devices=("cuda",),
    tensor_parallel=(
        "TransformerEngine layers shard with TransformerEngine's own tensor parallelism "
        "(tp_group, sequence_parallel), which transformers' plan does not drive"
    ),
    dependencies=(
        Dependency(
            label="TransformerEngine",
            module="transformer_engine",
            distribution="transformer-engine",
            install="pip install 'layerswap[te]' on a CUDA machine",
        ),
    ),
    variants=(
        Variant(
            name="fp8",
            context=fp8_autocast,
            requirement=fp8_unmet_requirement,
            options={"recipe": "auto"},
            precision="fp8",
            description=(
                "NVIDIA TransformerEngine, GPU only: RMSNorm fused into the q/k/v and gate/up "
                "GEMMs, cuDNN/flash attention with GQA; FP8"
            ),
        ),
    ),
)


def __getattr__(name: str) -> Any:
    # a pickled model names its layer class; make it on demand in a fresh process
    return _layer.family_layer_class_named(TEDecoderLayer, name)
