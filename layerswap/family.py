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

import dataclasses
import importlib
import inspect
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import ModuleType
from typing import TYPE_CHECKING, Any

from layerswap.decoder_shape import (
    FLAT,
    GATED_MLP,
    GROUPS,
    NORM_PLACES,
    PRE_NORMS,
    ROTARY_LAYERS,
    SEPARATE_QKV,
    Attention,
    FeedForward,
    LayerShape,
    Normalization,
    Rope,
    switched,
)
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


@dataclass(frozen=True, init=False)
class Family:
    """A transformers model family, declared as data.

    Class names are resolved lazily from ``module``. The decoder layer's structure is
    grouped (:mod:`layerswap.decoder_shape`): :attr:`attention`, :attr:`normalization`,
    :attr:`feed_forward`, :attr:`rope` and :attr:`layer`. A declaration gives its features
    flat, each landing in its group (:data:`~layerswap.decoder_shape.FLAT`), or gives a
    group whole; a structural feature given as a string names the config attribute that
    switches it (``qkv_bias="attention_bias"``), a bool means the modeling code fixes it.

    Example::

        qwen2 = Family(
            name="qwen2", model_type="qwen2",
            module="transformers.models.qwen2.modeling_qwen2",
            decoder="Qwen2DecoderLayer", config_class="Qwen2Config",
            causal_lm="Qwen2ForCausalLM",
            qkv_bias=True, o_bias=False, mlp_bias=False,
        )
        qwen2.attention.qkv_bias        # True
        dataclasses.replace(qwen2, name="qwen2-biased", mlp_bias=True)  # flat here too
    """

    name: str
    model_type: str
    module: str
    decoder: str
    config_class: str
    causal_lm: str
    attention: Attention = field(default_factory=Attention)
    normalization: Normalization = field(default_factory=Normalization)
    feed_forward: FeedForward = field(default_factory=FeedForward)
    rope: Rope = field(default_factory=Rope)
    layer: LayerShape = field(default_factory=LayerShape)
    tiny: Mapping[str, Any] = field(default_factory=dict, compare=False, hash=False)
    description: str = field(default="", compare=False)

    def __init__(
        self,
        name: str,
        model_type: str,
        module: str,
        decoder: str,
        config_class: str,
        causal_lm: str,
        *,
        attention: Attention | None = None,
        normalization: Normalization | None = None,
        feed_forward: FeedForward | None = None,
        rope: Rope | None = None,
        layer: LayerShape | None = None,
        tiny: Mapping[str, Any] | None = None,
        description: str = "",
        **features: Any,
    ) -> None:
        given = {
            "attention": attention,
            "normalization": normalization,
            "feed_forward": feed_forward,
            "rope": rope,
            "layer": layer,
        }
        unknown = sorted(set(features) - set(FLAT))
        if unknown:
            raise TypeError(
                f"Family() got unexpected keyword arguments {', '.join(unknown)} (a feature "
                f"is one of {', '.join(sorted(FLAT))}, or a group: {', '.join(GROUPS)})"
            )
        for group, cls in GROUPS.items():
            value = given[group]
            if value is not None and not isinstance(value, cls):
                raise TypeError(f"Family({group}=...) takes a {cls.__name__}, not {value!r}")
            changes = {
                attr: features[flat]
                for flat, (place, attr) in FLAT.items()
                if place == group and flat in features
            }
            value = cls() if value is None else value
            object.__setattr__(self, group, dataclasses.replace(value, **changes))
        for key, own in (
            ("name", name),
            ("model_type", model_type),
            ("module", module),
            ("decoder", decoder),
            ("config_class", config_class),
            ("causal_lm", causal_lm),
            ("tiny", {} if tiny is None else tiny),
            ("description", description),
        ):
            object.__setattr__(self, key, own)

    def replace(self, **changes: Any) -> Family:
        """A copy with ``changes``: fields, groups, or features by their flat names
        (``dataclasses.replace`` takes the same).

        Example::

            llama.replace(name="llama-no-bias", qkv_bias=False)
        """
        return dataclasses.replace(self, **changes)

    # the groups' questions asked of the family, as before the grouping (the package
    # asks the groups: family.rope.rotates, family.normalization.kind_for ...)
    def rotates(self, attention: Any, config: PreTrainedConfig) -> bool:
        """Whether the original layer with this ``attention`` applies the rotary embedding."""
        return self.rope.rotates(attention, config)

    def norm_for(self, config: PreTrainedConfig) -> str:
        """The norm kind of ``config``'s layers (:meth:`Normalization.kind_for`)."""
        return self.normalization.kind_for(config)

    def qkv_bound(self, config: PreTrainedConfig) -> float | None:
        """The bound q, k and v are clamped to in ``config``'s layers, or ``None``."""
        return self.attention.bound(config)

    def residual_dropout_p(self, config: PreTrainedConfig) -> float:
        """The probability of the branch-output dropout in ``config``'s layers (0: none)."""
        return self.layer.residual_dropout_p(config)

    def query_scaling(self, config: PreTrainedConfig) -> tuple[float, float] | None:
        """``(beta, span)`` of the attention's query scaling in ``config``, or ``None``."""
        return self.attention.query_scaling(config)

    def norm_at(self, place: str) -> str | None:
        """The name of the norm at ``place`` (``"attn_in"`` ...), or ``None``."""
        return self.normalization.at(place)

    def flag(self, feature: str, config: PreTrainedConfig) -> bool:
        """Whether ``feature`` (a flat name: ``"qkv_bias"``, ``"qk_norm"``) is on for
        ``config``."""
        if feature == "qk_norm":
            return self.attention.has_qk_norm(config)
        if feature not in FLAT:
            raise AttributeError(
                f"Family has no feature {feature!r} (its features: {sorted(FLAT)})"
            )
        group, attr = FLAT[feature]
        return switched(getattr(getattr(self, group), attr), config)

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


def _flat_reader(flat: str, group: str, attr: str) -> property:
    def read(self: Family) -> Any:
        warnings.warn(
            f"Family.{flat} is deprecated: read family.{group}.{attr}",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(getattr(self, group), attr)

    return property(read, doc=f"Deprecated: ``family.{group}.{attr}``.")


# the features as Family held them flat before they were grouped, still read (warning)
for _flat, (_group, _attr) in FLAT.items():
    setattr(Family, _flat, _flat_reader(_flat, _group, _attr))
del _flat, _group, _attr


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
