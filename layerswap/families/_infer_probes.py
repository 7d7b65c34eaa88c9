"""What family inference asks of a model type's decoder layer: the probes of :data:`PROBES`,
each reading a :class:`Subject` (the layer, its config, what earlier probes found) and
adding to the :class:`~layerswap.Family` fields it declares, or refusing the model type
with the reason."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from layerswap.errors import UnsupportedFamilyError
from layerswap.families._infer_layer import (
    branch_inputs,
    gist,
    norm_kind,
    qk_norm_after_rotary,
    rotary_layer_rule,
    rotary_layout,
    seeded_layer,
)
from layerswap.families._infer_switches import (
    bias_flag,
    modules_a_size_adds,
    norm_switch,
    qk_norm_switch,
    residual_dropout,
)
from layerswap.families._infer_tiny import config_with
from layerswap.family import GATED_MLP, PRE_NORMS, SEPARATE_QKV
from layerswap.spans import index_spans

__all__ = ["CLAMP_THAT_BITES", "PROBES", "Subject", "different_layers"]


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


def different_layers(model_type: str, layers: Any) -> str:
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


def _no_dropout(module: nn.Module) -> bool:
    return isinstance(module, nn.Dropout) and not module.p


def _biased(module: nn.Module, name: str) -> bool:
    return getattr(module, name).bias is not None


@dataclass
class Subject:
    """One model type under inference: what the probes read, and what they have found.

    ``layerswap.families.infer._subject`` builds it (the classes from transformers' auto
    mappings, a tiny config, the model on the meta device); each probe of :data:`PROBES`
    reads it, refuses the model type with the reason (:class:`~layerswap.errors.UnsupportedFamilyError`), or
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


def _probe_projections(s: Subject) -> None:
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
        raise UnsupportedFamilyError(different_layers(s.model_type, layers))
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


def _probe_nothing_else(s: Subject) -> None:
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


def _probe_config_switches(s: Subject) -> None:
    """What config fields switch on: residual dropout, modules a size adds (refused), q/k
    norms (Cohere)."""
    s.fields["residual_dropout"] = residual_dropout(s.decoder, s.config, s.where)
    added = modules_a_size_adds(s.build, s.config)
    if added is not None:
        raise UnsupportedFamilyError(
            f"{s.where}: a config with {added[0]} > 0 adds {', '.join(added[1])}, which the "
            "fused layer has no counterpart for"
        )
    s.fields["qk_norm_switch"] = qk_norm_switch(s.build, s.config)


def _probe_qk_norms(s: Subject) -> None:
    """q/k norms: their names, over what they normalise, before or after the rotary."""
    config, head_dim = s.config, s.head_dim
    switch = s.fields["qk_norm_switch"]
    qk_config = config if switch is None else config_with(config, switch, True)
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
        qk_after_rotary = qk_norm_after_rotary(real_qk, qk_config, qk_names, s.qkv_modules[0])
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


def _probe_norm_kind(s: Subject) -> None:
    """The norms' kind (RMSNorm or LayerNorm), offset and scale, one for all, probed
    numerically, and the config field that switches them (if any)."""
    config, where = s.config, s.where
    offsets = {
        norm_kind(s.real.get_submodule(n), (config.hidden_size,), f"{where} {n}")
        for _, n in s.layout
    }
    if s.fields["qk_norm"]:
        offsets.add(norm_kind(s.q_norm, s.q_norm_shape, f"{where} self_attn.q_norm"))
    if len(offsets) != 1:
        raise UnsupportedFamilyError(
            f"{where}: norms of different kinds, offsets, or with and without a weight"
        )
    kind = offsets.pop()
    s.fields.update(
        norm=kind[0],
        norm_offset=kind[1],
        norm_scale=kind[2],
        norm_switch=norm_switch(s.decoder, config, s.layout, kind, where),
    )


def _probe_rotary_and_branches(s: Subject) -> None:
    """The rotary layout and the layers it applies to; whether attention and MLP run in
    parallel, and what a single norm feeds."""
    config, where = s.config, s.where
    rotary = rotary_layout(s.module, s.head_dim, where)
    try:
        attention_in, mlp_in, mlp_in_unattended = branch_inputs(
            s.real, config, rotary, s.fields["mlp_name"]
        )
    except Exception as exc:
        raise UnsupportedFamilyError(f"{where}: one layer cannot run ({gist(exc)})") from exc
    parallel = torch.equal(mlp_in, mlp_in_unattended)
    try:
        rotary_layers = rotary_layer_rule(s.decoder, config, where, rotary)
    except UnsupportedFamilyError:
        raise
    except Exception as exc:
        raise UnsupportedFamilyError(f"{where}: one layer cannot run ({gist(exc)})") from exc
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


def _probe_activation(s: Subject) -> None:
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


def _probe_biases_and_clamp(s: Subject) -> None:
    """Which biases the projections have (or which config field switches them), and
    whether q/k/v are clamped (OLMo: ``clip_qkv``, proven with a bound that bites)."""
    qkv, build, config = s.qkv_modules[0], s.build, s.config
    s.fields.update(
        qkv_bias=bias_flag(build, config, lambda lyr: _biased(lyr.self_attn, qkv)),
        o_bias=bias_flag(build, config, lambda lyr: _biased(lyr.self_attn, "o_proj")),
        mlp_bias=False
        if s.original_mlp
        else bias_flag(build, config, lambda lyr: _biased(lyr.mlp, s.mlp_modules[0])),
        clip_qkv="clip_qkv" if "clip_qkv" in config.to_dict() else None,
    )


#: what :func:`~layerswap.families.infer.infer_declaration` asks of a model type's decoder layer, in order: each probe
#: refuses the model type with the reason, or adds to what is known of it (a
#: :class:`Subject`); a new structural feature is one more probe here
PROBES: tuple[Callable[[Subject], None], ...] = (
    _probe_projections,
    _probe_nothing_else,
    _probe_config_switches,
    _probe_qk_norms,
    _probe_norm_kind,
    _probe_rotary_and_branches,
    _probe_activation,
    _probe_biases_and_clamp,
)
