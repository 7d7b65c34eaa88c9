"""Model families derived from the installed transformers, not written by hand.

:func:`infer_declaration` reads a family's declaration off its modeling module: the causal
LM, config and decoder-layer classes from transformers' auto mappings, and the layer's
structure from one layer built for a tiny config -- which projections (separate or
already fused, a gated or a plain MLP) and norms it has and where the norms sit (by
their names), q/k norms per head (one weight, or a weight per head) or across heads and
the config field that switches them on, which biases follow which config switch. Probed
numerically: the norm's kind (RMSNorm, LayerNorm with or without a bias) and whether it
scales by ``weight`` or ``1 + weight``; the rotary layout (rotate-half or interleaved
pairs, from the module's ``apply_rotary_pos_emb``); whether attention and MLP run in
parallel (the MLP's input does not change when the attention's output does). Also which
config field names the activation. What the layer computes with beyond structure
(softmax scale, Granite's residual multiplier) the replacement reads off the original
layer itself (:mod:`layerswap.backends._original`). An MLP that is a block of the modeling
module's own (mixture of experts: Mixtral, Qwen2-MoE) is kept as it is (``mlp="original"``).

A family whose layer has anything else -- another module, a parameter of its own, absent
rotary embeddings -- is refused with the reason
(:class:`~layerswap.errors.UnsupportedFamilyError`), never declared half-right.

Inference sees structure, not every detail of a forward pass, so a family becomes
builtin only once the generated tests verify it (:data:`VERIFIED`): the fused layer
against the original in float32 on padded inputs, a training step, greedy generation,
save and plain reload, undo. :func:`layerswap.coverage.coverage` reports every decoder family the installed
transformers ships.

This module sits below the registry: it imports no backend and registers nothing. A
declaration is proven (its fused layer against the original) by
:func:`layerswap.inference.infer_family`, which passes that proof in as ``prove``.

Example::

    family = infer_declaration("olmo2")     # Family(name="olmo2", norms=(("attn_out", ...
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch import nn

from layerswap.errors import UnsupportedFamilyError
from layerswap.families._inferred import INFERRED
from layerswap.families._tiny import TINY
from layerswap.family import (
    GATED_MLP,
    PRE_NORMS,
    ROTARY_LAYERS,
    SEPARATE_QKV,
    Family,
    probed_eps,
    stateless,
)
from layerswap.rotary import ROTARY_LAYOUTS, rotate
from layerswap.spans import index_spans

__all__ = [
    "CLAMP_THAT_BITES",
    "PROBES",
    "VERIFIED",
    "Prove",
    "decoder_model_types",
    "infer_declaration",
    "seeded_layer",
    "tiny_config_for",
    "training_output",
]

#: model types whose inferred declaration the generated tests verify in CI: the builtin
#: families beyond the hand-written ones, read off their one list,
#: ``layerswap/families/_inferred.py`` (``python scripts/gen_families.py --add TYPE``)
VERIFIED: tuple[str, ...] = tuple(family.model_type for family in INFERRED)

# the layouts of norms a decoder layer can have, by the names transformers gives them
_NORM_LAYOUTS: dict[frozenset[str], tuple[tuple[str, str], ...]] = {
    frozenset({"input_layernorm", "post_attention_layernorm"}): PRE_NORMS,
    frozenset(
        {
            "input_layernorm",
            "post_attention_layernorm",
            "pre_feedforward_layernorm",
            "post_feedforward_layernorm",
        }
    ): (  # Gemma 2/3: a norm on each side of attention and of the MLP
        ("attn_in", "input_layernorm"),
        ("attn_out", "post_attention_layernorm"),
        ("mlp_in", "pre_feedforward_layernorm"),
        ("mlp_out", "post_feedforward_layernorm"),
    ),
    frozenset({"post_attention_layernorm", "post_feedforward_layernorm"}): (  # OLMo 2
        ("attn_out", "post_attention_layernorm"),
        ("mlp_out", "post_feedforward_layernorm"),
    ),
    frozenset({"input_layernorm", "pre_feedforward_layernorm"}): (  # VaultGemma
        ("attn_in", "input_layernorm"),
        ("mlp_in", "pre_feedforward_layernorm"),
    ),
    frozenset({"attention_layernorm", "feedforward_layernorm"}): (  # Apertus
        ("attn_in", "attention_layernorm"),
        ("mlp_in", "feedforward_layernorm"),
    ),
    frozenset(
        {
            "input_layernorm",
            "post_self_attn_layernorm",
            "post_attention_layernorm",
            "post_mlp_layernorm",
        }
    ): (  # GLM-4: Gemma 2's placement, other names
        ("attn_in", "input_layernorm"),
        ("attn_out", "post_self_attn_layernorm"),
        ("mlp_in", "post_attention_layernorm"),
        ("mlp_out", "post_mlp_layernorm"),
    ),
    # one norm whose output both branches read (parallel blocks: Cohere)
    frozenset({"input_layernorm"}): (("attn_in", "input_layernorm"), ("mlp_in", "input_layernorm")),
}
_ONE_NORM = _NORM_LAYOUTS[frozenset({"input_layernorm"})]
# the projections a layer can have, by their names: q/k/v separate or fused (Phi-3), and
# the MLPs, (kind, modules): gated, gated with gate/up fused (Phi-3), plain
_QKV = (SEPARATE_QKV, ("qkv_proj",))
#: the attention's q and k norm modules, in the order looked for (HunYuan's second)
_QK_NORM_NAMES = (("q_norm", "k_norm"), ("query_layernorm", "key_layernorm"))

#: the decoder layer's attribute holding the MLP, in the order looked for
_MLP_NAMES = ("mlp", "block_sparse_moe")

#: a ``clip_qkv`` bound small enough to clamp most of a tiny model's q, k and v
CLAMP_THAT_BITES = 0.05

_MLPS = (
    ("gated", GATED_MLP),
    ("gated", ("gate_up_proj", "down_proj")),
    ("plain", ("up_proj", "down_proj")),
    ("plain", ("c_fc", "c_proj")),  # Starcoder 2
    ("plain", ("fc1", "fc2")),  # nanochat
)


def _first_with(module: Any, layouts: Any) -> Any:
    """The first of ``layouts`` whose every name is an ``nn.Linear`` of ``module``."""
    return next(
        (
            layout
            for layout in layouts
            if all(isinstance(getattr(module, n, None), nn.Linear) for n in layout[-1])
        ),
        None,
    )


def _has(layer: nn.Module, name: str) -> str:
    """``"self_attn (Cls) has a, b"`` or ``"the layer has no self_attn (it has a, b)"``:
    what a layer's module has where the replacement looks for other modules."""
    module = getattr(layer, name, None)
    if not isinstance(module, nn.Module):
        children = ", ".join(n for n, _ in layer.named_children())
        return f"the layer has no {name} (it has {children})"
    children = ", ".join(n for n, _ in module.named_children()) or "no submodules"
    return f"its {name} ({type(module).__name__}) has {children}"


def _built_in_dtype(activation: nn.Module, config: Any) -> bool:
    """Whether :func:`~layerswap.hf_internals.activation_in_dtype` (what the fused MLP
    builds) gives ``activation`` from the config: the same class, parameters and buffers,
    each in the same dtype."""
    from layerswap.hf_internals import activation_in_dtype

    name = getattr(config, "hidden_act", None) or getattr(config, "hidden_activation", None)
    try:
        built = activation_in_dtype(str(name), config)
    except Exception:  # not an activation class taking a dtype
        return False

    def tensors(module: nn.Module) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        found = {**dict(module.named_parameters()), **dict(module.named_buffers())}
        return {key: (value.dtype, tuple(value.shape)) for key, value in found.items()}

    return type(built) is type(activation) and tensors(built) == tensors(activation)


def _wrapper_reason(model_type: str, config_class: Any, prove: Prove | None) -> str | None:
    """Why a multimodal wrapper (Gemma 4: no ``model.layers``, or a tower that cannot be
    built here) is not covered: its language model's reason. ``None``: not a wrapper."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    text = getattr(config_class, "sub_configs", {}).get("text_config")
    text_type = getattr(text, "model_type", None)
    if (
        not text_type
        or text_type == model_type
        or text_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    ):
        return None
    try:
        infer_declaration(text_type, prove=prove)
    except UnsupportedFamilyError as exc:
        return f"{model_type}: a multimodal wrapper whose language model is {exc}"
    return (
        f"{model_type}: a multimodal wrapper whose language model ({text_type}) fits the fused "
        "layer, but the wrapper is not proven on its media inputs (layerswap.verify.multimodal)"
    )


def _different_layers(model_type: str, layers: Any) -> str:
    """Why a model whose decoder layers differ is not covered, naming the differences:
    the modules (two levels deep, with their classes) that only some layers have."""

    def parts(layer: nn.Module) -> set[tuple[str, str]]:
        found = {("", type(layer).__name__)}
        found |= {(n, type(m).__name__) for n, m in layer.named_modules() if n and n.count(".") < 2}
        return found

    kinds = [parts(layer) for layer in layers]
    common = set.intersection(*kinds)
    groups: dict[tuple[tuple[str, str], ...], list[int]] = {}
    for index, kind in enumerate(kinds):
        own = kind - common
        names = {n for n, _ in own}
        # the top-most differing modules: a child of a differing module is not repeated
        top = sorted((n, c) for n, c in own if not any(n.startswith(p + ".") for p in names if p))
        groups.setdefault(tuple(top), []).append(index)
    described = "; ".join(
        f"layer{'s' if len(idx) > 1 else ''} {index_spans(idx)}: "
        + (", ".join(f"{n} ({c})" if n else c for n, c in diff) or "none of those")
        for diff, idx in groups.items()
    )
    return (
        f"{model_type}: decoder layers of different structure ({described}); a replacement "
        "takes the place of every decoder layer alike, so layers that differ are not swapped"
    )


def _auto_names(model_type: str) -> tuple[str, str, str]:
    """(modeling module, causal LM class name, config class name) from the auto mappings."""
    from transformers.models.auto.configuration_auto import (
        CONFIG_MAPPING_NAMES,
        model_type_to_module_name,
    )
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    causal_lm = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    config = CONFIG_MAPPING_NAMES.get(model_type)
    if not causal_lm or not config:
        raise UnsupportedFamilyError(
            f"{model_type}: transformers has no causal LM for this model type"
        )
    package = model_type_to_module_name(model_type)
    return f"transformers.models.{package}.modeling_{package}", causal_lm, config


def _gist(exc: BaseException) -> str:
    """The first sentence of an error message, on one line."""
    return " ".join(str(exc).split()).split(". ")[0]


def decoder_model_types() -> Iterator[str]:
    """Every model type with a causal LM in the installed transformers, sorted."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    yield from sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


#: mixture-of-experts sizes, by config field name, given to a config that has the field:
#: few small experts, two per token
_TINY_MOE: dict[str, Any] = {
    "num_local_experts": 4,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 64,
    "shared_expert_intermediate_size": 128,
}


#: fields a model type's config leaves unset by default although its model cannot be built
#: without them (transformers' own default config does not build either): the tiny
#: values that let inference read the layers and give its real reason
_TINY_FIXES: dict[str, dict[str, Any]] = {
    "dbrx": {"attn_config": {"rope_theta": 10000.0, "kv_n_heads": 2}},
    "gemma3n_text": {"num_kv_shared_layers": 2},
    "dots1": {"n_routed_experts": 4, "n_shared_experts": 1, "n_group": 1, "topk_group": 1},
    "lfm2_moe": {"layer_types": ["conv", "full_attention"] * 2, "num_dense_layers": 1},
    # its causal LM holds the image and audio encoders: at their default sizes 870M
    # parameters, which take a minute and a half to verify
    "phi4_multimodal": {
        "vision_config": {
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
        },
        "audio_config": {
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_blocks": 1,
            "num_attention_heads": 2,
            "ext_pw_out_channel": 32,
            "depthwise_separable_out_channel": 32,
            "nemo_conv_channels": 32,
        },
    },
    "qwen4_exp_text": {
        "indexer_budget": 8,
        "indexer_compress_ratio": 4,
        "indexer_n_heads": 2,
        "indexer_kv_heads": 1,
        "indexer_head_dim": 16,
    },
}

_PLAIN_ROPE = {"rope_type": "default", "rope_theta": 10000.0}


def _read_only(config_class: type, name: str) -> bool:
    """Whether ``name`` is a property of ``config_class`` that cannot be set."""
    found = inspect.getattr_static(config_class, name, None)
    return isinstance(found, property) and found.fset is None


def _keyed_rope(config_class: type) -> dict[str, Any] | None:
    """The plain rotary parameters per layer type, where the config's default keys them so
    (Gemma 4: ``{"sliding_attention": {...}, "full_attention": {...}}``); ``None``: it
    does not."""
    try:
        default = config_class()
    except Exception:  # a config that needs arguments: nothing to read
        return None
    rope = getattr(default, "rope_parameters", None)
    if not isinstance(rope, Mapping):
        return None
    if rope and all(isinstance(v, Mapping) for v in rope.values()):
        keys: Any = rope
    elif not rope:  # empty: keyed by the layer types it has (Cohere Compass)
        keys = dict.fromkeys(getattr(default, "layer_types", None) or ())
    else:
        return None
    return {key: dict(_PLAIN_ROPE) for key in keys} or None


def tiny_config_for(config_class: type, **overrides: Any) -> Any:
    """A tiny config of ``config_class``: the builtin families' sizes, nothing family-specific.

    Head size is given explicitly (some configs default it to a large constant), special
    tokens fall inside the small vocabulary, and rotary embeddings use the plain default
    (given per layer type where the config would keep it flat but its layers read it per
    layer type). A mixture-of-experts config gets four
    small experts, two per token (:data:`_TINY_MOE`, those of its fields its constructor
    names); a config whose defaults cannot build its model gets :data:`_TINY_FIXES`.
    """
    sizes = {**TINY, "head_dim": TINY["hidden_size"] // TINY["num_attention_heads"]}
    # a size the config computes (Falcon's head_dim: a property without a setter) is not given
    sizes = {key: value for key, value in sizes.items() if not _read_only(config_class, key)}
    fields = inspect.signature(config_class).parameters
    sizes.update({key: value for key, value in _TINY_MOE.items() if key in fields})
    sizes.update(pad_token_id=0, bos_token_id=1, eos_token_id=2)
    sizes["rope_parameters"] = dict(_PLAIN_ROPE)
    sizes.update(_TINY_FIXES.get(getattr(config_class, "model_type", ""), {}))
    sizes.update(overrides)
    config = config_class(**sizes)
    rope = getattr(config, "rope_parameters", None)
    if "rope_parameters" not in overrides and not (
        isinstance(rope, Mapping) and any(isinstance(v, Mapping) for v in rope.values())
    ):
        # a config that keeps the plain parameters flat where its layers read them per
        # layer type: the plain parameters for each
        keyed = _keyed_rope(config_class)
        if keyed is not None:
            config = config_class(**{**sizes, "rope_parameters": keyed})
    return config


def _flag(build: Any, config: Any, probe: Any) -> bool | str:
    """A bias as the config field that switches it (``"attention_bias"``), else a constant.

    Every boolean config field with "bias" in its name is tried: the first whose value
    decides whether ``probe`` finds the bias is the switch.
    """
    switches = [
        key for key, value in config.to_dict().items() if isinstance(value, bool) and "bias" in key
    ]
    for switch in switches:
        on, off = (probe(build(_with(config, switch, value))) for value in (True, False))
        if on and not off:
            return str(switch)
    return bool(probe(build(config)))


def _no_dropout(module: nn.Module) -> bool:
    return isinstance(module, nn.Dropout) and not module.p


def _biased(module: nn.Module, name: str) -> bool:
    return getattr(module, name).bias is not None


def _with(config: Any, name: str, value: Any) -> Any:
    clone = type(config).from_dict(config.to_dict())
    setattr(clone, name, value)
    clone._attn_implementation = config._attn_implementation
    return clone


def _norm_kind(norm: nn.Module, shape: tuple[int, ...], where: str) -> tuple[str, float, bool]:
    """(kind, offset, scale) of a norm over the last axis, probed numerically, else refused.

    Kind ``"rms"`` (RMSNorm), ``"layer"`` (LayerNorm with a bias) or ``"layer_nobias"``
    (mean-centred, no bias: Cohere); offset 0 (scales by ``weight``) or 1 (``1 + weight``).
    With its parameters zeroed a norm of offset 0 gives zeros; the unit-weight output
    (weight 1, or 0 at offset 1) is then compared with RMSNorm and with LayerNorm, since
    a bias-free LayerNorm looks like an RMSNorm from its parameters alone. A norm without
    any parameter (OLMo's LayerNorm, nanochat's RMSNorm) has ``scale`` ``False``; its
    output alone is compared.
    """
    weight = getattr(norm, "weight", None)
    if weight is None and stateless(norm):
        eps = getattr(norm, "eps", None) or getattr(norm, "variance_epsilon", None)
        eps = probed_eps(norm, shape[-1]) if eps is None else eps
        sample = torch.randn(3, *shape, generator=torch.Generator().manual_seed(0)) + 0.5
        with torch.no_grad():
            out = norm(sample).float()
        return _compared(out, sample, float(eps), bias=False, where=where), 0.0, False
    if not isinstance(weight, torch.Tensor) or tuple(weight.shape) != shape:
        raise UnsupportedFamilyError(f"{where}: a norm without a weight of shape {shape}")
    bias = getattr(norm, "bias", None)
    if bias is not None and (not isinstance(bias, torch.Tensor) or tuple(bias.shape) != shape):
        raise UnsupportedFamilyError(f"{where}: a norm whose bias is not of shape {shape}")
    eps = getattr(norm, "eps", None) or getattr(norm, "variance_epsilon", None) or 1e-6
    sample = torch.randn(3, *shape, generator=torch.Generator().manual_seed(0)) + 0.5
    params = [weight] if bias is None else [weight, bias]
    with torch.no_grad():
        saved = [p.detach().clone() for p in params]
        try:
            for p in params:
                p.zero_()
            out = norm(sample).float()
            offset = 0.0 if torch.allclose(out, torch.zeros_like(out)) else 1.0
            if not offset:
                weight.fill_(1.0)
                out = norm(sample).float()
        finally:
            for p, value in zip(params, saved, strict=True):
                p.copy_(value)
    return _compared(out, sample, float(eps), bias=bias is not None, where=where), offset, True


def _compared(
    out: torch.Tensor, sample: torch.Tensor, eps: float, *, bias: bool, where: str
) -> str:
    """The norm kind whose unit-scale output on ``sample`` is ``out``, else refused."""
    rms = sample * torch.rsqrt(sample.pow(2).mean(-1, keepdim=True) + eps)
    centred = sample - sample.mean(-1, keepdim=True)
    layer = centred * torch.rsqrt(centred.pow(2).mean(-1, keepdim=True) + eps)
    if torch.allclose(out, rms, atol=1e-4) and not bias:
        return "rms"
    if torch.allclose(out, layer, atol=1e-4):
        return "layer" if bias else "layer_nobias"
    raise UnsupportedFamilyError(f"{where}: a norm that is neither RMSNorm nor LayerNorm")


def _rotary_layout(module: Any, head_dim: int, where: str) -> str:
    """How the modeling module's ``apply_rotary_pos_emb`` rotates, probed numerically.

    Random cos/sin (not the model's, whose repeated halves hide the difference) tell the
    pairing of dims and the layout cos/sin are read in apart.
    """
    apply = getattr(module, "apply_rotary_pos_emb", None)
    if not callable(apply):
        raise UnsupportedFamilyError(f"{where}: no apply_rotary_pos_emb to read the rotary from")
    generator = torch.Generator().manual_seed(0)
    query, key = (torch.randn(1, 2, 3, head_dim, generator=generator) for _ in range(2))
    failure: Exception | None = None
    # cos/sin as wide as a head, then as wide as half of one (the model's rotary module
    # decides which; a mismatched width fails or matches no layout)
    for width, layouts in ((head_dim, ROTARY_LAYOUTS[:-1]), (head_dim // 2, ROTARY_LAYOUTS[-1:])):
        cos, sin = (torch.randn(1, 3, width, generator=generator) for _ in range(2))
        try:
            rotated = apply(query, key, cos, sin)[0]
        except Exception as exc:
            failure = failure or exc
            continue
        for layout in layouts:
            expected = rotate(query, cos, sin, layout)
            if isinstance(rotated, torch.Tensor) and torch.allclose(rotated, expected, atol=1e-5):
                return layout
    if failure is not None:
        raise UnsupportedFamilyError(
            f"{where}: its apply_rotary_pos_emb cannot be probed ({_gist(failure)})"
        ) from failure
    raise UnsupportedFamilyError(
        f"{where}: a rotary embedding that rotates neither halves nor interleaved pairs"
    )


def _rotary_width(attention: nn.Module, config: Any, rotary: str) -> int:
    """How wide the model's cos/sin are: the dims of a head the rotary embedding covers
    (partial rotary: fewer), or half of them where the layout takes one half's
    (``"half_narrow"``)."""
    head_dim = int(getattr(attention, "head_dim", None) or config.head_dim)
    rope = getattr(config, "rope_parameters", None) or {}
    factor = rope.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
    width = int(head_dim * (factor or 1.0))
    return width // 2 if rotary == "half_narrow" else width


def seeded_layer(decoder: Any, config: Any, index: int) -> nn.Module:
    """Layer ``index`` of ``config`` with every parameter drawn from a fixed seed, so a
    probe gives the same answer on every call.

    A bare decoder layer is not initialised by transformers (that happens in the
    model's ``post_init``): parameters made with ``torch.empty`` (experts of a
    mixture-of-experts block) hold whatever memory they got, zeros or NaNs included.
    """
    generator = torch.Generator().manual_seed(1000 + index)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1000 + index)
        layer: nn.Module = decoder(config, index)
    with torch.no_grad():  # buffers (rotary frequencies) are computed, not learned: kept
        for param in layer.parameters():
            if param.is_floating_point():
                param.copy_(torch.randn(param.shape, generator=generator) * 0.5)
    return layer


def _rotates(layer: nn.Module, config: Any, rotary: str) -> bool:
    """Whether ``layer`` applies the rotary embedding: its output changes with the angles."""
    width = _rotary_width(layer.get_submodule("self_attn"), config, rotary)
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(1, 5, config.hidden_size, generator=generator)
    angles = torch.randn(1, 5, width, generator=generator)
    outputs = []
    with torch.no_grad():
        for cos, sin in (
            (torch.ones_like(angles), torch.zeros_like(angles)),
            (angles.cos(), angles.sin()),
        ):
            output = layer(
                hidden,
                attention_mask=None,
                position_ids=torch.arange(5)[None],
                position_embeddings=(cos, sin),
            )
            outputs.append(output[0] if isinstance(output, tuple) else output)
    return not torch.equal(outputs[0], outputs[1])


def _rotary_layers(decoder: Any, config: Any, where: str, rotary: str) -> str:
    """The rule of :data:`~layerswap.family.ROTARY_LAYERS` that says, for every layer of
    ``config``, whether the original applies the rotary embedding, probed layer by layer."""
    layers = [seeded_layer(decoder, config, index) for index in range(config.num_hidden_layers)]
    truth = [_rotates(layer, config, rotary) for layer in layers]
    attentions = [layer.get_submodule("self_attn") for layer in layers]
    for name, rule in ROTARY_LAYERS.items():
        if all(
            rule(attention, config) == rotates
            for attention, rotates in zip(attentions, truth, strict=True)
        ):
            return name
    skipped = [index for index, rotates in enumerate(truth) if not rotates]
    raise UnsupportedFamilyError(
        f"{where}: layers {skipped} skip the rotary embedding by a rule layerswap does not know"
    )


def _branch_inputs(
    layer: nn.Module, config: Any, rotary: str, mlp_name: str = "mlp"
) -> tuple[Any, Any, Any]:
    """One forward pass of ``layer``: (attention input, MLP input, MLP input with the
    attention's output projection zeroed). The MLP reads the attention's output unless
    zeroing it leaves the MLP's input as it was: then the two run in parallel."""
    inputs: dict[str, torch.Tensor] = {}

    def recorder(name: str) -> Any:
        def hook(module: nn.Module, args: Any, kwargs: Any) -> None:
            inputs[name] = (args[0] if args else kwargs["hidden_states"]).detach().clone()

        return hook

    attention, mlp = layer.get_submodule("self_attn"), layer.get_submodule(mlp_name)
    hooks = [
        attention.register_forward_pre_hook(recorder("attention"), with_kwargs=True),
        mlp.register_forward_pre_hook(recorder("mlp"), with_kwargs=True),
    ]
    hidden = torch.randn(1, 5, config.hidden_size, generator=torch.Generator().manual_seed(0))
    positions = torch.arange(5)[None]
    # no rotation (cos 1, sin 0): which tensor reaches which branch does not depend on it
    width = _rotary_width(attention, config, rotary)
    cos_sin = (torch.ones(1, 5, width), torch.zeros(1, 5, width))
    found = []
    try:
        with torch.no_grad():
            for zeroed in (False, True):
                if zeroed:
                    attention.get_parameter("o_proj.weight").zero_()
                layer(
                    hidden, attention_mask=None, position_ids=positions, position_embeddings=cos_sin
                )
                found.append(dict(inputs))
    finally:
        for hook in hooks:
            hook.remove()
    return found[0]["attention"], found[0]["mlp"], found[1]["mlp"]


def _norm_switch(
    decoder: Any,
    config: Any,
    layout: tuple[tuple[str, str], ...],
    found: tuple[str, float, bool],
    where: str,
) -> tuple[str, str] | None:
    """``(field, norm)`` where unsetting a ``*norm_eps`` field of the config builds norms of
    another kind (Cohere 2 MoE: ``rms_norm_eps=None``, its default, builds a bias-free
    LayerNorm); ``None`` where no such field changes them (or the layer cannot be built
    or run without it)."""
    fields = sorted(
        key
        for key, value in config.to_dict().items()
        if key.endswith("norm_eps") and isinstance(value, float)
    )
    for field_name in fields:
        try:
            unset = seeded_layer(decoder, _with(config, field_name, None), 0)
            kinds = {
                _norm_kind(unset.get_submodule(n), (config.hidden_size,), f"{where} {n}")
                for _, n in layout
            }
        except Exception:  # the layer needs the field: not a switch
            continue
        if len(kinds) == 1:
            kind, offset, scale = kinds.pop()
            if kind != found[0] and (offset, scale) == found[1:]:
                return field_name, kind
    return None


def _qk_norm_switch(build: Any, config: Any) -> str | None:
    """The boolean config field with "norm" in its name that adds ``self_attn.q_norm``."""
    for key, value in config.to_dict().items():
        if isinstance(value, bool) and "norm" in key:
            try:
                on, off = (
                    hasattr(build(_with(config, key, flag)).self_attn, "q_norm")
                    for flag in (True, False)
                )
            except Exception:  # a field other code ties to other settings: not the switch
                continue
            if on and not off:
                return str(key)
    return None


def _modules_a_size_adds(build: Any, config: Any) -> tuple[str, list[str]] | None:
    """``(field, modules)`` where setting a ``*_size`` field the tiny config leaves at 0
    builds modules the declaration never saw (GraniteMoE-Shared's
    ``shared_intermediate_size`` adds ``shared_mlp``), else ``None``."""
    seen = {n for n, _ in build(config).named_modules()}
    for key, value in config.to_dict().items():
        if key.endswith("_size") and value == 0 and not isinstance(value, bool):
            try:
                added = sorted({n for n, _ in build(_with(config, key, 16)).named_modules()} - seen)
            except Exception:  # a size other code ties to other settings: not a switch
                continue
            if added:  # the outermost ones
                return str(key), [n for n in added if not any(n.startswith(f"{m}.") for m in added)]
    return None


def _dropout_fields(config: Any) -> list[str]:
    """The config's dropout probabilities besides the attention's (SDPA's ``dropout_p``)."""
    return [
        key
        for key, value in config.to_dict().items()
        if ("dropout" in key or key.endswith("pdrop"))
        and key != "attention_dropout"
        and isinstance(value, float)
    ]


def training_output(
    layer: nn.Module, config: Any, seed: int = 0, *, training: bool = True
) -> torch.Tensor:
    """``layer``'s output in training mode on fixed inputs, dropout drawn from ``seed``
    (random rotary angles: the rotation is not the identity)."""
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 5, config.hidden_size, generator=generator)
    width = int(
        getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    )
    angles = torch.randn(1, 5, width, generator=generator)
    layer.train(training)
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        out = layer(
            hidden,
            attention_mask=None,
            position_ids=torch.arange(5)[None],
            position_embeddings=(angles.cos(), angles.sin()),
        )
    result: torch.Tensor = out[0] if isinstance(out, tuple) else out
    return result


def _qk_norm_after_rotary(
    layer: nn.Module, config: Any, names: tuple[str, str], q_proj: str
) -> bool:
    """Whether the q norm reads the rotated queries (HunYuan), not the projection's output
    (Qwen3): a reshape of the projection keeps its values, a rotation does not."""
    attention = layer.get_submodule("self_attn")
    seen: dict[str, torch.Tensor] = {}
    hooks = [
        attention.get_submodule(q_proj).register_forward_hook(
            lambda _m, _a, out: seen.setdefault("projected", out.detach().clone())
        ),
        attention.get_submodule(names[0]).register_forward_pre_hook(
            lambda _m, args: seen.setdefault("normed", args[0].detach().clone())
        ),
    ]
    try:
        training_output(layer, config, training=False)
    except Exception:  # the behavioural check decides
        return False
    finally:
        for hook in hooks:
            hook.remove()
    projected, normed = seen.get("projected"), seen.get("normed")
    if projected is None or normed is None or projected.numel() != normed.numel():
        return False
    values = [t.flatten().sort().values for t in (projected, normed)]
    return not torch.allclose(values[0], values[1], atol=1e-6)


def _residual_dropout(decoder: Any, config: Any, where: str) -> str | None:
    """The config field of a dropout the layer applies in training (Seed-OSS's
    ``residual_dropout``, Phi-3's ``resid_pdrop``), found by setting each dropout field
    with attention dropout off; ``None`` when none changes the layer's training output.
    Its place (after the output projections) is proven in training by
    :func:`layerswap.inference.prove_inferred`; a second field is refused."""
    quiet = (
        _with(config, "attention_dropout", 0.0)
        if "attention_dropout" in config.to_dict()
        else config
    )
    fields = _dropout_fields(quiet)
    if not fields:
        return None
    off = quiet
    for field_name in fields:
        off = _with(off, field_name, 0.0)
    try:
        reference = training_output(seeded_layer(decoder, off, 0), off)
    except Exception:  # the layer cannot run bare here: the behavioural check decides
        return None
    found = []
    for field_name in fields:
        try:
            out = training_output(seeded_layer(decoder, _with(off, field_name, 0.5), 0), off)
        except Exception:
            continue
        if not torch.equal(out, reference):
            found.append(field_name)
    if len(found) > 1:
        raise UnsupportedFamilyError(
            f"{where}: dropout the fused layer does not apply ({', '.join(found)} each drop "
            "in training; it applies one, after the output projections)"
        )
    return found[0] if found else None


@dataclass
class _Subject:
    """One model type under inference: what the probes read, and what they have found.

    :func:`_subject` builds it (the classes from transformers' auto mappings, a tiny config,
    the model on the meta device); each probe of :data:`PROBES` reads it, refuses the
    model type with the reason (:class:`~layerswap.errors.UnsupportedFamilyError`), or
    adds what it learnt -- ``fields`` of the :class:`~layerswap.Family`, and the modules
    and layouts later probes read.
    """

    model_type: str
    module_name: str
    module: Any
    causal_lm_name: str
    config_class: type
    config: Any
    model: nn.Module
    layers: Any  # the decoder layers (an nn.ModuleList)
    decoder: type
    where: str  # "olmo2 (Olmo2DecoderLayer)", for messages
    fields: dict[str, Any] = field(default_factory=dict)  # the Family's, as found
    layer: Any = None  # layers[0]
    attention: Any = None
    mlp: Any = None
    qkv_modules: tuple[str, ...] = ()
    mlp_modules: tuple[str, ...] = ()
    original_mlp: bool = False
    norm_names: frozenset[str] = frozenset()  # the layer's other children: its norms
    layout: tuple[tuple[str, str], ...] = ()  # where those norms sit
    head_dim: int = 0
    real: Any = None  # one layer on real tensors, seeded
    q_norm: Any = None  # the q norm module (of a layer with q/k norms switched on)
    q_norm_shape: tuple[int, ...] = ()

    def build(self, config: Any) -> nn.Module:
        """One decoder layer for ``config`` on the meta device."""
        with torch.device("meta"):
            layer: nn.Module = self.decoder(config, 0)
        return layer


class _Classes(NamedTuple):
    """What transformers has for a model type, imported (:func:`_classes`)."""

    module_name: str  # the modeling module's
    module: Any
    causal_lm_name: str  # as the auto mapping names it
    causal_lm: Any
    config_class: type  # the class that builds the causal LM's config


def _classes(model_type: str) -> _Classes:
    """The modeling module, causal LM and config class of ``model_type``; a model type
    they cannot be imported for is refused."""
    module_name, causal_lm_name, config_name = _auto_names(model_type)
    try:
        module = importlib.import_module(module_name)
        causal_lm = getattr(module, causal_lm_name)
        config_class = getattr(
            importlib.import_module(module_name.replace("modeling_", "configuration_")), config_name
        )
    except (ImportError, AttributeError) as exc:
        raise UnsupportedFamilyError(f"{model_type}: {exc}") from exc
    # a multimodal wrapper's causal LM is its language model alone (Gemma 4, Llama 4,
    # Qwen3.5): built from the text config class it declares
    own_config = getattr(causal_lm, "config_class", None)
    if isinstance(own_config, type) and own_config is not config_class:
        config_class = own_config
    return _Classes(module_name, module, causal_lm_name, causal_lm, config_class)


def _tiny_config(model_type: str, causal_lm: Any, config_class: type) -> tuple[Any, str | None]:
    """The tiny config the layers are probed on, and the family's ``query_scale``."""
    try:
        config = tiny_config_for(config_class)
    except Exception as exc:
        raise UnsupportedFamilyError(f"{model_type}: no tiny config ({_gist(exc)})") from exc
    # the fused layer reads the 4-D masks of both; eager where the model refuses SDPA
    # (Gemma 2: soft-capped attention)
    config._attn_implementation = "sdpa" if getattr(causal_lm, "_supports_sdpa", True) else "eager"
    # Llama 4's attention temperature (Ministral 3): queries scaled by a function of the
    # position, read from the default rotary parameters the tiny config leaves out
    try:
        default_rope = getattr(config_class(), "rope_parameters", None) or {}
    except Exception:  # a config that needs arguments: nothing to read here
        default_rope = {}
    query_scale = (
        "llama4"
        if isinstance(default_rope, dict) and default_rope.get("llama_4_scaling_beta") is not None
        else None
    )
    if query_scale is not None:  # the layer reads both fields: the tiny config keeps them
        config.rope_parameters = _scaled_rope(config.rope_parameters, default_rope)
    return config, query_scale


def _decoder_layers(
    model_type: str, causal_lm: Any, config_class: type, config: Any, prove: Prove | None
) -> tuple[nn.Module, Any]:
    """The tiny model, built on the meta device, and its decoder layers (one class), else
    the reason: a multimodal wrapper's, or what stops the model building."""
    with torch.device("meta"):
        try:
            model = causal_lm(config)
        except Exception as exc:
            raise UnsupportedFamilyError(
                _wrapper_reason(model_type, config_class, prove)
                or f"{model_type}: cannot build a tiny model ({_gist(exc)})"
            ) from exc
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, nn.ModuleList) or not len(layers):
        raise UnsupportedFamilyError(
            _wrapper_reason(model_type, config_class, prove)
            or f"{model_type}: no model.layers of decoder layers"
        )
    if len({type(layer) for layer in layers}) != 1:
        raise UnsupportedFamilyError(_different_layers(model_type, layers))
    return model, layers


def _subject(model_type: str, prove: Prove | None) -> _Subject:
    """The classes of ``model_type``, a tiny config, and the model built on the meta device."""
    module_name, module, causal_lm_name, causal_lm, config_class = _classes(model_type)
    config, query_scale = _tiny_config(model_type, causal_lm, config_class)
    model, layers = _decoder_layers(model_type, causal_lm, config_class, config, prove)
    decoder = type(layers[0])
    if decoder.__module__ != module_name:
        raise UnsupportedFamilyError(
            f"{model_type}: its decoder layer lives in {decoder.__module__}"
        )
    subject = _Subject(
        model_type,
        module_name,
        module,
        causal_lm_name,
        config_class,
        config,
        model,
        layers,
        decoder,
        where=f"{model_type} ({decoder.__name__})",
        layer=layers[0],
    )
    subject.fields.update(
        model_type=model_type,
        module=module_name,
        decoder=decoder.__name__,
        config_class=config_class.__name__,
        causal_lm=causal_lm_name,
        query_scale=query_scale,
        description=f"inferred from {module_name}",
    )
    return subject


def _probe_projections(s: _Subject) -> None:
    """q/k/v/o and the MLP: separate or fused projections, gated or plain, or a block of
    the modeling module's own (mixture of experts) kept as it is."""
    layer, layers, where = s.layer, s.layers, s.where
    s.attention = getattr(layer, "self_attn", None)
    # the MLP's attribute: "mlp", or a mixture-of-experts block's own (GraniteMoE)
    mlp_name = next(
        (n for n in _MLP_NAMES if isinstance(getattr(layer, n, None), nn.Module)), "mlp"
    )
    s.mlp = getattr(layer, mlp_name, None)
    qkv = _first_with(s.attention, [(names,) for names in _QKV])
    mlp_layout = _first_with(s.mlp, _MLPS)
    # a block of the modeling module's own in any layer (mixture of experts, maybe after
    # dense first layers): every layer keeps the original's MLP as it is
    block = next(
        (
            m
            for m in (getattr(lyr, mlp_name, None) for lyr in layers)
            if isinstance(m, nn.Module)
            and type(m).__module__ == s.module_name
            and not _first_with(m, _MLPS)
        ),
        None,
    )
    if block is not None:
        s.mlp, mlp_layout = block, ("original", ())
    # the original MLP may differ per layer (Qwen2-MoE's dense layers): it is built per layer
    skipped = (f"{mlp_name}.",) if mlp_layout and mlp_layout[0] == "original" else ()
    shapes = {
        tuple(n for n, _ in lyr.named_modules() if not n.startswith(skipped)) for lyr in layers
    }
    if len(shapes) != 1:  # one decoder class, some layers dense and some MoE
        raise UnsupportedFamilyError(_different_layers(s.model_type, layers))
    if s.attention is not None and isinstance(
        getattr(s.attention, "kv_a_proj_with_mqa", None), nn.Module
    ):
        raise UnsupportedFamilyError(
            f"{where}: multi-head latent attention (self_attn.kv_a_proj_with_mqa, kv_b_proj: "
            "keys and values from a compressed latent); the replacement layers compute "
            "attention from q/k/v projections of the hidden state"
        )
    missing = [] if qkv else ["self_attn.q_proj, k_proj, v_proj (or qkv_proj)"]
    if not isinstance(getattr(s.attention, "o_proj", None), nn.Linear):
        missing.append("self_attn.o_proj")
    if not mlp_layout:
        missing.append("mlp.gate_proj, up_proj, down_proj (or up_proj, down_proj)")
    elif mlp_name != "mlp" and mlp_layout[0] != "original":  # the fused MLP is "mlp"
        missing.append(f"mlp (a dense MLP under {mlp_name})")
    if missing:
        found = [_has(layer, "self_attn")] if not qkv or "self_attn.o_proj" in missing else []
        if not mlp_layout or (mlp_name != "mlp" and mlp_layout[0] != "original"):
            found.append(_has(layer, mlp_name))
        raise UnsupportedFamilyError(
            f"{where}: no {', '.join(missing)} ({'; '.join(found)}): the "
            "replacement layers read q/k/v/o attention and a dense MLP or a mixture-of-experts "
            "block of the model's own"
        )
    (s.qkv_modules,), (mlp_kind, s.mlp_modules) = qkv, mlp_layout
    s.original_mlp = mlp_kind == "original"
    s.fields.update(
        mlp=mlp_kind,
        mlp_modules=s.mlp_modules,
        mlp_class=type(s.mlp).__name__ if s.original_mlp else None,
        mlp_name=mlp_name,
        qkv_modules=s.qkv_modules,
    )


def _probe_nothing_else(s: _Subject) -> None:
    """Every other module and parameter of the layer is a norm in a known layout, q/k
    norms, attention sinks, or an activation the fused MLP builds alike."""
    layer, attention, mlp, config = s.layer, s.attention, s.mlp, s.config
    mlp_name = s.fields["mlp_name"]
    # a dropout module of probability 0 (Phi-3's residual dropouts by default) is no step
    s.norm_names = frozenset(
        n
        for n, child in layer.named_children()
        if n not in ("self_attn", mlp_name) and not _no_dropout(child)
    )
    known_attention = {
        *s.qkv_modules,
        "o_proj",
        *(n for p in _QK_NORM_NAMES for n in p),
        "rotary_emb",
    }
    activations = ("act_fn", "act", "activation_fn")
    # gpt-oss's attention sinks: one logit per head (what they do is proven below, by the
    # behavioural check, like every other declaration)
    sinks = getattr(attention, "sinks", None)
    attention_sinks = isinstance(sinks, nn.Parameter) and tuple(sinks.shape) == (
        config.num_attention_heads,
    )
    extra = sorted(
        [f"self_attn.{n}" for n, _ in attention.named_children() if n not in known_attention]
        + [
            f"mlp.{n}"
            for n, _ in mlp.named_children()
            if not s.original_mlp and n not in (*s.mlp_modules, *activations)
        ]
        + [n for n, _ in layer.named_parameters(recurse=False)]
        + [
            f"self_attn.{n}"
            for n, _ in attention.named_parameters(recurse=False)
            if not (attention_sinks and n == "sinks")
        ]
    )
    # an activation with learned parameters (Apertus's xIELU): the fused MLP builds it in
    # the config's dtype under the same name, where that gives the same class and tensors
    activation_dtype = False
    for n in activations if not s.original_mlp else ():
        held = getattr(mlp, n, None)
        if not isinstance(held, nn.Module):
            continue
        tensors = [t for t, _ in (*held.named_parameters(), *held.named_buffers())]
        if tensors and n == "act_fn" and _built_in_dtype(held, config):
            activation_dtype = True
        else:
            extra += [f"mlp.{n}.{t}" for t in tensors]
    layout = _NORM_LAYOUTS.get(s.norm_names)
    if layout is None:
        extra += sorted(s.norm_names)
    if extra:
        raise UnsupportedFamilyError(
            f"{s.where}: modules or parameters the fused layer has no counterpart for: "
            f"{', '.join(extra)}"
        )
    assert layout is not None
    s.layout = layout
    s.head_dim = int(getattr(attention, "head_dim", config.head_dim))
    s.fields.update(attention_sinks=attention_sinks, activation_dtype=activation_dtype)


def _probe_config_switches(s: _Subject) -> None:
    """What config fields switch on: residual dropout, modules a size adds (refused), q/k
    norms (Cohere)."""
    s.fields["residual_dropout"] = _residual_dropout(s.decoder, s.config, s.where)
    added = _modules_a_size_adds(s.build, s.config)
    if added is not None:
        raise UnsupportedFamilyError(
            f"{s.where}: a config with {added[0]} > 0 adds {', '.join(added[1])}, which the "
            "fused layer has no counterpart for"
        )
    s.fields["qk_norm_switch"] = _qk_norm_switch(s.build, s.config)


def _probe_qk_norms(s: _Subject) -> None:
    """q/k norms: their names, over what they normalise, before or after the rotary."""
    config, head_dim = s.config, s.head_dim
    switch = s.fields["qk_norm_switch"]
    qk_config = config if switch is None else _with(config, switch, True)
    # norms on real tensors: the kind and offset are probed numerically
    s.real = seeded_layer(s.decoder, config, 0)
    real_qk: nn.Module = s.real if switch is None else seeded_layer(s.decoder, qk_config, 0)
    qk_names = next(
        (
            names
            for names in _QK_NORM_NAMES
            if isinstance(getattr(real_qk.get_submodule("self_attn"), names[0], None), nn.Module)
        ),
        _QK_NORM_NAMES[0],
    )
    s.q_norm = getattr(real_qk.get_submodule("self_attn"), qk_names[0], None)
    qk_norm: bool | str = False
    qk_after_rotary = False
    if s.q_norm is not None:
        qk_after_rotary = _qk_norm_after_rotary(real_qk, qk_config, qk_names, s.qkv_modules[0])
        per_head: dict[tuple[int, ...], bool | str] = {
            (head_dim,): True,
            (config.num_attention_heads, head_dim): "head_weights",
            (config.num_attention_heads * head_dim,): "across",
        }
        weight = getattr(s.q_norm, "weight", None)
        # a q norm without parameters (nanochat) normalises each head: the behavioural
        # check proves it
        shape = tuple(weight.shape) if isinstance(weight, torch.Tensor) else (head_dim,)
        if shape not in per_head:
            raise UnsupportedFamilyError(f"{s.where}: a q norm of shape {shape}")
        qk_norm = per_head[shape]
        s.q_norm_shape = shape
    s.fields.update(qk_norm=qk_norm, qk_norm_modules=qk_names, qk_norm_after_rotary=qk_after_rotary)


def _probe_norm_kind(s: _Subject) -> None:
    """The norms' kind (RMSNorm or LayerNorm), offset and scale, one for all, probed
    numerically, and the config field that switches them (if any)."""
    config, where = s.config, s.where
    offsets = {
        _norm_kind(s.real.get_submodule(n), (config.hidden_size,), f"{where} {n}")
        for _, n in s.layout
    }
    if s.fields["qk_norm"]:
        offsets.add(_norm_kind(s.q_norm, s.q_norm_shape, f"{where} self_attn.q_norm"))
    if len(offsets) != 1:
        raise UnsupportedFamilyError(
            f"{where}: norms of different kinds, offsets, or with and without a weight"
        )
    kind = offsets.pop()
    s.fields.update(
        norm=kind[0],
        norm_offset=kind[1],
        norm_scale=kind[2],
        norm_switch=_norm_switch(s.decoder, config, s.layout, kind, where),
    )


def _probe_rotary_and_branches(s: _Subject) -> None:
    """The rotary layout and the layers it applies to; whether attention and MLP run in
    parallel, and what a single norm feeds."""
    config, where = s.config, s.where
    rotary = _rotary_layout(s.module, s.head_dim, where)
    try:
        attention_in, mlp_in, mlp_in_unattended = _branch_inputs(
            s.real, config, rotary, s.fields["mlp_name"]
        )
    except Exception as exc:
        raise UnsupportedFamilyError(f"{where}: one layer cannot run ({_gist(exc)})") from exc
    parallel = torch.equal(mlp_in, mlp_in_unattended)
    try:
        rotary_layers = _rotary_layers(s.decoder, config, where, rotary)
    except UnsupportedFamilyError:
        raise
    except Exception as exc:
        raise UnsupportedFamilyError(f"{where}: one layer cannot run ({_gist(exc)})") from exc
    layout = s.layout
    if layout == _ONE_NORM:
        # one norm: the MLP shares the attention's normalised input (Cohere), or has none
        if not parallel:
            raise UnsupportedFamilyError(
                f"{where}: one norm, and the MLP reads the attention's output"
            )
        if not torch.equal(mlp_in, attention_in):
            layout = layout[:1]
    s.fields.update(norms=layout, parallel=parallel, rotary=rotary, rotary_layers=rotary_layers)


def _probe_activation(s: _Subject) -> None:
    """The config field naming the MLP's activation."""
    activation = next(
        (
            name
            for name in ("hidden_act", "hidden_activation")
            if isinstance(getattr(s.config, name, None), str)
        ),
        None,
    )
    if activation is None and s.original_mlp:
        activation = "hidden_act"  # the original MLP reads its own
    if activation is None:
        raise UnsupportedFamilyError(f"{s.where}: no hidden_act in its config")
    s.fields["activation"] = activation


def _probe_biases_and_clamp(s: _Subject) -> None:
    """Which biases the projections have (or which config field switches them), and
    whether q/k/v are clamped (OLMo: ``clip_qkv``, proven with a bound that bites)."""
    qkv, build, config = s.qkv_modules[0], s.build, s.config
    s.fields.update(
        qkv_bias=_flag(build, config, lambda lyr: _biased(lyr.self_attn, qkv)),
        o_bias=_flag(build, config, lambda lyr: _biased(lyr.self_attn, "o_proj")),
        mlp_bias=False
        if s.original_mlp
        else _flag(build, config, lambda lyr: _biased(lyr.mlp, s.mlp_modules[0])),
        clip_qkv="clip_qkv" if "clip_qkv" in config.to_dict() else None,
    )


#: what :func:`infer_declaration` asks of a model type's decoder layer, in order: each probe
#: refuses the model type with the reason, or adds to what is known of it (a
#: :class:`_Subject`); a new structural feature is one more probe here
PROBES: tuple[Callable[[_Subject], None], ...] = (
    _probe_projections,
    _probe_nothing_else,
    _probe_config_switches,
    _probe_qk_norms,
    _probe_norm_kind,
    _probe_rotary_and_branches,
    _probe_activation,
    _probe_biases_and_clamp,
)


#: ``prove(family, where)``: raises :class:`~layerswap.errors.UnsupportedFamilyError`
#: when an inferred declaration does not compute what the original does
#: (:func:`layerswap.inference.prove_inferred`, above the registry, passes itself in)
Prove = Callable[[Family, str], None]


def infer_declaration(
    model_type: str, *, name: str | None = None, prove: Prove | None = None
) -> Family:
    """The :class:`~layerswap.Family` of ``model_type``, read off the installed transformers.

    Raises :class:`~layerswap.errors.UnsupportedFamilyError` with the reason when the
    decoder layer has structure the replacement layers cannot express, or when ``prove``
    refuses the declaration (structure can fit while the forward pass differs: rotary
    applied to some layers only, another rotary convention). Each step is one probe of
    :data:`PROBES`. :func:`layerswap.inference.infer_family` is this, proven.
    """
    subject = _subject(model_type, prove)
    for probe in PROBES:
        probe(subject)
    scaled_rope = subject.config.rope_parameters if subject.fields["query_scale"] else None
    family = Family(
        name=name or model_type.removesuffix("_text"),
        tiny=_tiny_of(subject.config_class, scaled_rope),
        **subject.fields,
    )
    if prove is not None:
        prove(family, subject.where)
    return family


def _scaled_rope(tiny_rope: Any, default_rope: Mapping[str, Any]) -> dict[str, Any]:
    """The tiny rotary parameters of a family scaling queries by position: its default
    ``llama_4_scaling_beta`` and an original maximum of 4 positions, so that the tiny
    inputs (8 tokens and more) are scaled, as long prompts are."""
    return {
        **(tiny_rope or {}),
        "llama_4_scaling_beta": default_rope["llama_4_scaling_beta"],
        "original_max_position_embeddings": 4,
    }


def _tiny_of(config_class: type, scaled_rope: Any = None) -> dict[str, Any]:
    """The tiny config's fields a declaration records (``scaled_rope``: its rotary
    parameters where :func:`_scaled_rope` made them)."""
    tiny = {
        key: value
        for key, value in tiny_config_for(config_class).to_diff_dict().items()
        if key in _TINY_KEYS
    }
    tiny.update(_TINY_FIXES.get(getattr(config_class, "model_type", ""), {}))
    if scaled_rope is not None:
        tiny["rope_parameters"] = dict(scaled_rope)
    return tiny


_TINY_KEYS = {
    *TINY,
    *_TINY_MOE,
    "head_dim",
    "pad_token_id",
    "bos_token_id",
    "eos_token_id",
    "rope_parameters",
}
