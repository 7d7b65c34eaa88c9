"""What a model family is: a short declaration of a transformers model family, as data.

A :class:`Family` says where transformers keeps a family's classes (its ``model_type``
is its name) and which structural features its decoder layer has; every backend builds
its replacement from that. Builtin declarations live in :mod:`layerswap.families`, one
short (or derived) module each; the registry (:mod:`layerswap.registry`) holds them.

Example::

    family = layerswap.get_family("qwen3")
    model = family.build(seed=1)            # tiny config, random weights, eval mode
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import ModuleType
from typing import TYPE_CHECKING, Any

from layerswap.errors import UpstreamDriftError
from layerswap.patching import unpatched
from layerswap.versions import ships, transformers_version

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedConfig, PreTrainedModel

__all__ = [
    "GATED_MLP",
    "NORM_PLACES",
    "PRE_NORMS",
    "ROTARY_LAYERS",
    "SEPARATE_QKV",
    "Family",
    "probed_eps",
    "resolve",
    "stateless",
    "transformers_version",
]


def resolve(spec: str) -> Any:
    """``"pkg.mod:Qual.name"`` -> the object (imports the module).

    A module attribute that a live patch shows under another value resolves to the
    real one (:func:`~layerswap.patching.unpatched`): inside ``use()`` the original
    decoder class name shows the replacement, and checks must still find the original.

    Example::

        resolve("transformers.models.llama.modeling_llama:LlamaDecoderLayer")
    """
    module_name, _, qualname = spec.partition(":")
    obj: Any = importlib.import_module(module_name)
    for part in qualname.split("."):
        obj = unpatched(obj, part)
    return obj


#: Llama's norms: one before attention, one before the MLP
PRE_NORMS: tuple[tuple[str, str], ...] = (
    ("attn_in", "input_layernorm"),
    ("mlp_in", "post_attention_layernorm"),
)
#: the places a norm can have in a decoder layer, in the order they apply
NORM_PLACES = ("attn_in", "attn_out", "mlp_in", "mlp_out")
#: Llama's projections, the ones the fused layer concatenates
SEPARATE_QKV = ("q_proj", "k_proj", "v_proj")
GATED_MLP = ("gate_proj", "up_proj", "down_proj")


def _sliding(attention: Any, config: Any) -> bool:
    return getattr(attention, "sliding_window", None) is not None


def _sliding_or_unwindowed(attention: Any, config: Any) -> bool:
    return getattr(config, "sliding_window", None) is None or bool(
        getattr(attention, "is_sliding", False)
    )


def _sliding_or_forced(attention: Any, config: Any) -> bool:
    return _sliding(attention, config) or bool(getattr(attention, "force_rope", False))


#: the rules of :attr:`Family.rotary_layers`: (the original layer's attention, config) ->
#: whether that layer applies the rotary embedding
ROTARY_LAYERS: dict[str, Callable[[Any, Any], bool]] = {
    "all": lambda attention, config: True,
    # SmolLM3: config.no_rope_layers[layer_idx], kept by the attention as use_rope
    "use_rope": lambda attention, config: bool(getattr(attention, "use_rope", True)),
    # Cohere 2: only layers with a sliding window rotate
    "sliding": _sliding,
    # EXAONE 4: sliding layers rotate, and every layer does when there is no window at all
    "sliding_or_unwindowed": _sliding_or_unwindowed,
    # Cohere 2 MoE: sliding layers rotate, and so do its dense first layers where
    # prefix_dense_sliding_window_pattern is 1 (kept by the attention as force_rope)
    "sliding_or_forced": _sliding_or_forced,
}


@dataclass(frozen=True)
class Family:
    """A transformers model family, declared as data.

    Class names are resolved lazily from ``module``. A structural feature given as a
    string names the config attribute that switches it (``qkv_bias="attention_bias"``);
    a bool means the modeling code fixes it.

    Example::

        Family(
            name="qwen2", model_type="qwen2",
            module="transformers.models.qwen2.modeling_qwen2",
            decoder="Qwen2DecoderLayer", config_class="Qwen2Config",
            causal_lm="Qwen2ForCausalLM",
            qkv_bias=True, o_bias=False, mlp_bias=False,
        )
    """

    name: str
    model_type: str
    module: str
    decoder: str
    config_class: str
    causal_lm: str
    qkv_bias: bool | str = "attention_bias"
    o_bias: bool | str = "attention_bias"
    mlp_bias: bool | str = False
    #: q/k norms: ``True`` over each head with one weight for all heads (Qwen3),
    #: ``"head_weights"`` over each head with a weight per head (Cohere), ``"across"`` over
    #: all heads before they are split (OLMo 2), ``False`` none
    qk_norm: bool | str = False
    norm_offset: float = 0.0
    #: the norm: ``"rms"`` (RMSNorm), ``"layer"`` (LayerNorm with a bias: StarCoder2) or
    #: ``"layer_nobias"`` (mean-centred LayerNorm without a bias: Cohere)
    norm: str = "rms"
    activation: str = "hidden_act"
    #: the MLP: ``"gated"``, ``down(act(gate(x)) * up(x))``, ``"plain"``, ``down(act(up(x)))``,
    #: or ``"original"``: the original's own MLP module, kept as it is (mixture-of-experts
    #: blocks: Mixtral, Qwen2-MoE), with its class and parameter names
    mlp: str = "gated"
    #: the original's MLP modules in that order: gated (gate, up, down), or (gate_up, down)
    #: where the original fuses them already (Phi-3); plain (up, down), Starcoder 2's
    #: ``("c_fc", "c_proj")``; none for ``mlp="original"``
    mlp_modules: tuple[str, ...] = GATED_MLP
    #: for ``mlp="original"``: the class of the original's MLP module in ``module``
    #: (``"MixtralSparseMoeBlock"``); ``None`` otherwise
    mlp_class: str | None = None
    #: the decoder layer's attribute holding the MLP: ``"mlp"``, or for a kept
    #: mixture-of-experts block another name (GraniteMoE's ``"block_sparse_moe"``)
    mlp_name: str = "mlp"
    #: the original's q/k/v projections, or ``("qkv_proj",)`` where it fuses them (Phi-3)
    qkv_modules: tuple[str, ...] = SEPARATE_QKV
    #: where the decoder layer's norms sit: (place, module name) pairs, places
    #: ``attn_in`` / ``attn_out`` (around attention) and ``mlp_in`` / ``mlp_out``
    norms: tuple[tuple[str, str], ...] = PRE_NORMS
    #: the config field that switches the q/k norms on (Cohere's ``use_qk_norm``); ``None``:
    #: ``qk_norm`` alone decides
    qk_norm_switch: str | None = None
    #: attention and MLP in parallel, both reading the layer's input:
    #: ``x + attn(attn_in(x)) + mlp(mlp_in(x))`` (Cohere: both places name one norm)
    parallel: bool = False
    #: the rotary pairing of a head's dims: ``"half"`` (i, i + d/2), Llama's rotate-half, or
    #: ``"interleaved"`` (2i, 2i + 1) with the model's cos/sin applied as they come (Cohere),
    #: or ``"interleaved_from_half"``, (2i, 2i + 1) with the first half of cos/sin
    #: repeated pairwise, as GLM applies the rotate-half layout it is given, or
    #: ``"half_narrow"``: rotate-half with cos/sin given for one half only (gpt-oss), or
    #: ``"half_reversed"``: rotate-half by the negative angle (nanochat's ``rotate_half``
    #: is ``(x2, -x1)``)
    rotary: str = "half"
    #: ``(config field, norm)``: where that field is ``None`` in a config, the norms are
    #: ``norm`` instead (Cohere 2 MoE: ``("rms_norm_eps", "layer_nobias")``, a bias-free
    #: LayerNorm with ``layer_norm_eps`` when ``rms_norm_eps`` is unset, as by default)
    norm_switch: tuple[str, str] | None = None
    #: a learned logit per head joining every softmax as one more key whose value is zero
    #: (gpt-oss's ``self_attn.sinks``): attention may rest there instead of on a token
    attention_sinks: bool = False
    #: which layers apply the rotary embedding, a key of :data:`ROTARY_LAYERS`: ``"all"``,
    #: or a rule read off the original attention (Cohere 2 rotates on sliding-window
    #: layers only, SmolLM3 where ``no_rope_layers`` says so)
    rotary_layers: str = "all"
    #: the norms (the layer's and q/k norms) scale by a learned weight; ``False``: they
    #: have no parameters at all (OLMo's LayerNorm, nanochat's RMSNorm)
    norm_scale: bool = True
    #: the config field bounding q, k and v after their projections (and q/k norms):
    #: ``clamp(-bound, bound)`` where the config sets it (OLMo's, OLMoE's ``clip_qkv``);
    #: ``None``: no such field
    clip_qkv: str | None = None
    #: the config field of the dropout the original applies in training to the attention's
    #: and the MLP's outputs (after ``o_proj`` and ``down_proj``: Seed-OSS's
    #: ``residual_dropout``); ``None``: no such dropout
    residual_dropout: str | None = None
    #: queries scaled by their position after the rotary embedding: ``"llama4"``, Llama 4's
    #: attention temperature ``1 + beta * log(1 + floor(position / original max))`` with
    #: ``llama_4_scaling_beta`` and ``original_max_position_embeddings`` from the config's
    #: ``rope_parameters`` (Ministral 3); ``None``: no such scaling
    query_scale: str | None = None
    #: the original attention's q and k norm modules (HunYuan's ``query_layernorm``,
    #: ``key_layernorm``); the replacement keeps them under these names
    qk_norm_modules: tuple[str, str] = ("q_norm", "k_norm")
    #: the q/k norms apply to the rotated queries and keys (HunYuan), not before the
    #: rotary embedding (Qwen3)
    qk_norm_after_rotary: bool = False
    #: the MLP's activation is a module with learned parameters, built as the original
    #: MLP builds it, in the config's ``dtype`` (Apertus's xIELU; built from its name
    #: alone it would hold them in bfloat16 and round what is loaded into it)
    activation_dtype: bool = False
    #: call parameters the original decoder layer takes and never reads (Mllama's
    #: self-attention layers are called with the cross-attention inputs every layer of
    #: the model gets): the call contract accepts them, the behavioural proof shows the
    #: swapped model computes the same with them given
    ignored_arguments: tuple[str, ...] = ()
    #: the decoder layers of another kind the model interleaves with this family's, which a
    #: swap leaves the original's, described (Mllama's cross-attention layers); ``""``: none
    kept_layers: str = ""
    tiny: Mapping[str, Any] = field(default_factory=dict, compare=False, hash=False)
    description: str = field(default="", compare=False)

    def rotates(self, attention: Any, config: PreTrainedConfig) -> bool:
        """Whether the original layer with this ``attention`` applies the rotary embedding."""
        return ROTARY_LAYERS[self.rotary_layers](attention, config)

    def norm_for(self, config: PreTrainedConfig) -> str:
        """The norm kind of ``config``'s layers: :attr:`norm`, or the switched one."""
        if self.norm_switch is not None and getattr(config, self.norm_switch[0], None) is None:
            return self.norm_switch[1]
        return self.norm

    def qkv_bound(self, config: PreTrainedConfig) -> float | None:
        """The bound q, k and v are clamped to in ``config``'s layers, or ``None``."""
        bound = None if self.clip_qkv is None else getattr(config, self.clip_qkv, None)
        return None if bound is None else float(bound)

    def residual_dropout_p(self, config: PreTrainedConfig) -> float:
        """The probability of the branch-output dropout in ``config``'s layers (0: none)."""
        field = self.residual_dropout
        return 0.0 if field is None else float(getattr(config, field, 0.0) or 0.0)

    def query_scaling(self, config: PreTrainedConfig) -> tuple[float, float] | None:
        """``(beta, span)`` of :attr:`query_scale` in ``config``, or ``None`` (no scaling)."""
        if self.query_scale != "llama4":
            return None
        rope = getattr(config, "rope_parameters", None) or {}
        beta = rope.get("llama_4_scaling_beta")
        span = rope.get("original_max_position_embeddings")
        if beta is None:
            return None
        if span is None:
            span = getattr(config, "max_position_embeddings", None)
        if span is None:
            return None
        return float(beta), float(span)

    def norm_at(self, place: str) -> str | None:
        """The name of the norm at ``place`` (``"attn_in"`` ...), or ``None``."""
        return dict(self.norms).get(place)

    def flag(self, feature: str, config: PreTrainedConfig) -> bool:
        """Whether ``feature`` (e.g. ``"qkv_bias"``) is on for ``config``."""
        value = getattr(self, feature)
        if feature == "qk_norm":
            switch = self.qk_norm_switch
            return bool(value) and (switch is None or bool(getattr(config, switch, False)))
        if isinstance(value, str):
            return bool(getattr(config, value, False))
        return bool(value)

    def modeling_module(self) -> ModuleType:
        """The family's modeling module (imported on first use)."""
        return importlib.import_module(self.module)

    def absence(self) -> str | None:
        """Why the installed transformers has no such family (a release from before it
        arrived: its modeling module is not there), or ``None`` when it has. Read from
        the disk, without importing transformers.

        Example::

            layerswap.get_family("flint").absence()
            # on 5.18.0: "transformers 5.18.0 has no flint model (no transformers.models...)"
        """
        if ships(self.module):
            return None
        return f"transformers {transformers_version()} has no {self.name} model (no {self.module})"

    def _class(self, name: str) -> type:
        # a name of the modeling module, or "module:Class" (a config another module keeps:
        # a model type that reuses another's causal LM with a config class of its own)
        try:
            cls = resolve(name if ":" in name else f"{self.module}:{name}")
        except (ImportError, AttributeError) as exc:
            raise UpstreamDriftError(
                f"{self.name}: transformers {transformers_version()} has no {name} in "
                f"{self.module} ({exc})"
            ) from exc
        return cls  # type: ignore[no-any-return]

    def decoder_class(self) -> type[torch.nn.Module]:
        """The original decoder layer class."""
        return self._class(self.decoder)

    def config_type(self) -> type[PreTrainedConfig]:
        """The family's config class."""
        return self._class(self.config_class)

    def causal_lm_class(self) -> type[PreTrainedModel]:
        """The family's causal LM class."""
        return self._class(self.causal_lm)

    @property
    def composite(self) -> bool:
        """Whether the family's model is a multimodal wrapper whose decoder layers read its
        ``text_config`` (Qwen2-VL: the text decoder has no causal LM of its own, so the
        family builds the ``*ForConditionalGeneration`` model)."""
        return "text_config" in self.tiny

    def tiny_config(self, **overrides: Any) -> PreTrainedConfig:
        """A tiny config of this family (several layers, grouped-query attention).

        For a :attr:`composite` family, overrides the wrapper's config does not take
        (``num_hidden_layers``, ``vocab_size``...) go to its text config.

        Example::

            config = layerswap.families()["llama"].tiny_config(num_hidden_layers=2)
        """
        if not self.composite:
            return self.config_type()(**{**self.tiny, **overrides})
        own = inspect.signature(self.config_type()).parameters
        text = {**self.tiny["text_config"]}
        text.update({key: value for key, value in overrides.items() if key not in own})
        top = {key: value for key, value in overrides.items() if key in own}
        return self.config_type()(**{**self.tiny, **top, "text_config": text})

    def build(self, config: PreTrainedConfig | None = None, *, seed: int = 0) -> PreTrainedModel:
        """A causal LM with random weights from ``seed``, in eval mode.

        Norm weights and biases are perturbed away from their 1/0 initialisation, so a
        converter or layer that drops a bias or ignores a norm shows in a comparison.
        The global RNG state is left as it was.

        Example::

            model = layerswap.families()["qwen3"].build(seed=1)
        """
        import torch

        config = self.tiny_config() if config is None else config
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = self.causal_lm_class()(config)
            with torch.no_grad():
                for name, param in model.named_parameters():
                    if param.dim() != 1 or param.is_meta:
                        continue
                    if "norm" in name:
                        param.add_(torch.randn_like(param), alpha=0.1)
                    elif name.endswith("bias"):
                        param.normal_(0.0, 0.1)
        return model.eval()


def stateless(module: torch.nn.Module) -> bool:
    """Whether ``module`` holds no parameter and no buffer (a norm without a weight)."""
    return next(module.parameters(), None) is None and next(module.buffers(), None) is None


def probed_eps(norm: torch.nn.Module, width: int = 64) -> float:
    """The epsilon a norm without parameters adds to the variance, read off its output.

    On a zero-mean input of mean square ``m`` both RMSNorm and LayerNorm return
    ``x / sqrt(m + eps)``; an input with ``m`` near 3e-7 makes ``eps`` (1e-5, 1e-6) the
    larger term; ``width`` is the normalised axis' size, and the estimate is rounded to two significant digits.

    Example::

        probed_eps(OlmoLayerNorm(64), 64)   # 1e-05
    """
    import torch

    sample = torch.linspace(-1.0, 1.0, width, dtype=torch.float64) * 1e-3
    with torch.no_grad():
        out = norm(sample.float().unsqueeze(0)).double().squeeze(0)
    root = float(sample.dot(sample) / sample.dot(out))  # sqrt(m + eps)
    eps = root * root - float(sample.pow(2).mean())
    return float(f"{eps:.2g}")
