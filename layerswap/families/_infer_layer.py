"""One decoder layer run on fixed inputs, and what its outputs tell family inference: the
norms' kind, the rotary layout and the layers it applies to, which tensor reaches which
branch, where the q norm reads."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from layerswap.errors import UnsupportedFamilyError
from layerswap.family import ROTARY_LAYERS, probed_eps, stateless
from layerswap.rotary import ROTARY_LAYOUTS, rotate

__all__ = [
    "branch_inputs",
    "gist",
    "norm_kind",
    "qk_norm_after_rotary",
    "rotary_layer_rule",
    "rotary_layout",
    "seeded_layer",
    "training_output",
]


def gist(exc: BaseException) -> str:
    """The first sentence of an error message, on one line."""
    return " ".join(str(exc).split()).split(". ")[0]


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


def norm_kind(norm: nn.Module, shape: tuple[int, ...], where: str) -> tuple[str, float, bool]:
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


def rotary_layout(module: Any, head_dim: int, where: str) -> str:
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
            f"{where}: its apply_rotary_pos_emb cannot be probed ({gist(failure)})"
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


def rotary_layer_rule(decoder: Any, config: Any, where: str, rotary: str) -> str:
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


def branch_inputs(
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


def qk_norm_after_rotary(
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
