"""The ``te`` backend's decoder layers: NVIDIA TransformerEngine, BF16 and FP8, GPU only.

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

import functools
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from layerswap.backends import _layer
from layerswap.backends.te.declaration import BACKEND, unsupported
from layerswap.backends.te.layout import TELayerSpec
from layerswap.backends.te.runtime import (
    NO_CUDA,
    NOT_INSTALLED,
    _precision_for,
    _rope_kernel,
    _te,
    fp8_autocast,
    fp8_recipe,
    fp8_unmet_requirement,
    unmet_requirement,
)
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

# --- the layer ----------------------------------------------------------------------------


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
        # the model's config, read at each call: its attention implementation decides how
        # a mask is read
        self._config = config
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
        _layer.check_mask(attention_mask, "te", self._config)
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
    (``layerswap.backends.te.decoder:TELlamaDecoderLayer``, and from its package,
    ``layerswap.backends.te``); a pickle holds how to make it again. Making the class needs
    no TransformerEngine; building a layer does.
    """
    return _layer.family_layer_class(TEDecoderLayer, family)


def __getattr__(name: str) -> Any:
    # a per-family class imported by its name (``from layerswap.backends.te import ...``)
    # before this process made it: made now
    return _layer.layer_class_named(TEDecoderLayer, name)
