"""What every replacement decoder layer shares: the transformers 5 decoder-layer contract.

A backend's layer subclasses :class:`DecoderLayer` and states only what is its own:
the modules it builds (in ``__init__``, after ``super().__init__``) and its two residual
branches, :meth:`~DecoderLayer._attention` and :meth:`~DecoderLayer._feed_forward`.
Everything the original layer's callers rely on is here once:

- construction like the original, ``Layer(config, layer_idx)``, refusing a config whose
  attention masks are not 4-D tensors;
- ``forward`` with the original's signature: it receives ``position_embeddings=(cos, sin)``,
  the mask the model built (which already holds padding and any sliding window) and the
  cache, and returns the hidden-states tensor, ``h + attention(h)`` then ``+ mlp(...)``;
- the attention steps both layouts share: one q/k/v projection split into heads, the
  rotate-half and interleaved conventions of the rotary embedding, the cache update as
  the calling transformers release does it (:mod:`layerswap.hf_internals` reads the
  call, whether it names the cache ``cache`` or ``past_key_values``);
- one subclass per family (:func:`family_layer_class`), set in the backend's module under
  its name, and pickled as how to make it again (any family, registered or not, loads
  in a fresh process); a backend's declaration names it as its ``decoder``
  implementation.

Example::

    class PlainDecoderLayer(DecoderLayer):
        backend = "plain"
        summary = "Plain decoder layer"

        def __init__(self, config, layer_idx):
            super().__init__(config, layer_idx)
            ...                                    # this backend's modules

        def _attention(self, hidden_states, position_embeddings, attention_mask, cache):
            ...

        def _feed_forward(self, hidden_states):
            ...

    def layer_class(family):
        return family_layer_class(PlainDecoderLayer, family)

    BACKEND = Backend(name="plain", slots={"decoder": Implementation(layer_class, converter)})
"""

from __future__ import annotations

import contextlib
import re
import warnings
from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, ClassVar, Literal, TypeVar

import torch
from transformers.modeling_layers import GradientCheckpointingLayer

from layerswap import hf_internals
from layerswap.backends.per_family import class_named, family_class
from layerswap.errors import RequirementError, SwapWarning, UpstreamDriftError
from layerswap.family import Family
from layerswap.rotary import rotate_half, rotate_interleaved
from layerswap.state import LAYER_COPIED

if TYPE_CHECKING:
    from transformers import PreTrainedConfig
    from transformers.cache_utils import Cache

    from layerswap.hf_internals import LayerCache

__all__ = [
    "SUPPORTED_ATTENTION",
    "DecoderLayer",
    "Layout",
    "attention_weights_sink",
    "causal_call",
    "causal_keys",
    "check_mask",
    "sdpa",
    "family_layer_class",
    "layer_class_named",
    "rotate_half",
    "rotate_interleaved",
    "local_sizes",
    "split_heads",
    "update_cache",
]

#: the attention implementations whose masks are 4-D tensors (or None), the only kind read
SUPPORTED_ATTENTION = (None, "sdpa", "eager")

#: where the heads axis is: (batch, heads, seq, head_dim) or (batch, seq, heads, head_dim)
Layout = Literal["bhsd", "bshd"]

LayerT = TypeVar("LayerT", bound="DecoderLayer")


class DecoderLayer(GradientCheckpointingLayer):  # type: ignore[misc]
    """A replacement decoder layer; a backend subclasses it, a family gets a subclass of that.

    Constructed like the original, ``Layer(config, layer_idx)``, and called like it.
    The generic backend class cannot be built: :func:`family_layer_class` sets ``family``.
    """

    #: the family this class is made for (set on the per-family subclasses)
    family: ClassVar[Family | None] = None
    #: the backend's name, the last part of its substitutions' names ("fused")
    backend: ClassVar[str] = ""
    #: what the layer is, opening the per-family classes' docstrings ("Fused decoder layer")
    summary: ClassVar[str] = ""
    #: the parameters of the original layer's (and attention's) ``forward`` this layer
    #: handles: the upstream check refuses an original that takes one outside this set
    handles: ClassVar[frozenset[str]] = hf_internals.LAYER_CALL_PARAMETERS
    #: the call-time options (:data:`~layerswap.hf_internals.CALL_OPTIONS`, ``is_causal``)
    #: this layer handles as the original does; a call with another is refused
    call_options: ClassVar[frozenset[str]] = frozenset()
    #: the layer computes attention itself, so the original attention's parameters count too
    replaces_attention: ClassVar[bool] = True
    #: whether the layer records attention weights when ``output_attentions=True`` asks
    #: (through :func:`attention_weights_sink`); a layer that cannot warns instead
    records_attention_weights: ClassVar[bool] = False
    #: what each branch is scaled by before the residual sum (Granite's
    #: ``residual_multiplier``; 1 elsewhere)
    residual_multiplier: float = 1.0

    @classmethod
    def declared_family(cls) -> Family:
        """The family this class is made for; :class:`TypeError` on the generic class."""
        if cls.family is None:
            raise TypeError(
                f"{cls.__name__} is made per family: use layer_class(family), e.g. "
                f"layerswap.get('llama.decoder.{cls.backend}').replacement_class()"
            )
        return cls.family

    def __setstate__(self, state: dict[str, Any]) -> None:
        """A copy (``copy.deepcopy``, unpickling) is a swapped layer too, outliving the
        swap it was copied from: it holds PEFT's layout advice and target check armed
        while it lives, as a swap does."""
        super().__setstate__(state)
        for made in LAYER_COPIED:
            made(self)

    def __init__(self, config: PreTrainedConfig, layer_idx: int) -> None:
        self.declared_family()
        implementation = getattr(config, "_attn_implementation", None)
        if implementation not in SUPPORTED_ATTENTION:
            raise RequirementError(
                f"the {self.backend} layer reads 4-D attention masks; this config uses "
                f"attn_implementation={implementation!r}. Build or load the model with "
                "attn_implementation='sdpa' (the layer computes attention itself, so only "
                "the mask format matters)"
            )
        super().__init__()
        self.hidden_size = int(config.hidden_size)
        self.layer_idx = layer_idx
        # transformers up to 5.3 picks each layer's mask by its attention_type attribute
        self.attention_type = hf_internals.layer_attention_type(config, layer_idx)
        # M-RoPE (Qwen2-VL): cos/sin may come per axis on older releases
        self._rotary_sections = hf_internals.rotary_sections(config)
        # the call-time keywords this layer takes besides the contract's: its call options
        # and what the family's original ignores (Mllama's cross-attention inputs)
        self._accepted = self.call_options | frozenset(
            self.declared_family().layer.ignored_arguments
        )

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        use_cache: bool | None = False,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        # the cache under either name, cache_position where the release passes it:
        # every release's call is read by hf_internals, nowhere else
        call = hf_internals.read_layer_call(
            kwargs,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            use_cache=use_cache,
            position_embeddings=position_embeddings,
            accepted=self._accepted,
            layer=type(self).__name__,
        )
        if position_embeddings is None:
            raise UpstreamDriftError(
                f"{type(self).__name__} needs position_embeddings=(cos, sin), which "
                f"transformers 5 models pass to every decoder layer; transformers "
                f"{hf_internals.transformers_version()} passed none"
            )
        if self._rotary_sections is not None:
            position_embeddings = hf_internals.merge_rotary_sections(
                position_embeddings, self._rotary_sections
            )
        weights_asked = call.output_attentions
        if not self.records_attention_weights and _attention_weights_asked(weights_asked):
            _warn_no_attention_weights(type(self))
        with self._call_context(hidden_states):
            attended = self._attention(
                hidden_states,
                position_embeddings,
                attention_mask,
                call.cache,
                output_attentions=weights_asked,
            )
            if self.declared_family().layer.parallel:
                # both branches read the layer's input (Cohere): x + attn(...) + mlp(...)
                return hidden_states + attended + self._feed_forward(hidden_states)
            hidden_states = hidden_states + attended
            return hidden_states + self._feed_forward(hidden_states)

    def _attention(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None,
        cache: LayerCache,
        *,
        output_attentions: bool = False,
    ) -> torch.Tensor:
        """The attention branch, input norm included, without the residual.

        ``cache`` is the call's cache, read for the calling release
        (:class:`~layerswap.hf_internals.LayerCache`; its ``cache`` is ``None`` when there
        is none). ``output_attentions`` is the call's own ``output_attentions=True`` (the
        config's and the model's request are found by :func:`attention_weights_sink`).

        By default: the norms the family puts around attention (:meth:`_norm`, under the
        original's names) around ``self.self_attn(normed, position_embeddings, mask,
        cache)``, which also gets ``output_attentions`` where the layer
        :attr:`records_attention_weights`. A backend whose attention holds its input norm
        (TransformerEngine's ``LayerNormLinear``) writes its own.
        """
        asked = {"output_attentions": output_attentions} if self.records_attention_weights else {}
        attended: torch.Tensor = self.self_attn(
            self._norm("attn_in", hidden_states),
            position_embeddings,
            attention_mask,
            cache,
            **asked,
        )
        return self._branch_out("attn_out", attended)

    def _feed_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The MLP branch, its norm included, without the residual.

        By default: the family's MLP module (under the original's name, ``mlp`` or
        GraniteMoE's ``block_sparse_moe``) between the norms the family puts around it. A
        kept mixture-of-experts block may return (output, router scores): the output is
        taken, as the original layer takes it.
        """
        mlp = self.get_submodule(self.declared_family().feed_forward.attribute)
        mixed = mlp(self._norm("mlp_in", hidden_states))
        if isinstance(mixed, tuple):
            mixed = mixed[0]
        return self._branch_out("mlp_out", mixed)

    def _norm(self, place: str, hidden_states: torch.Tensor) -> torch.Tensor:
        """The family's norm at ``place`` (``attn_in``, ``attn_out``, ``mlp_in``,
        ``mlp_out``), a submodule under the original's name, or nothing there."""
        name = self.declared_family().normalization.at(place)
        return hidden_states if name is None else self.get_submodule(name)(hidden_states)

    def _branch_out(self, place: str, hidden_states: torch.Tensor) -> torch.Tensor:
        """A branch's output before the residual sum: the norm at ``place``, then
        ``residual_multiplier`` (Granite scales each branch)."""
        out = self._norm(place, hidden_states)
        return out * self.residual_multiplier if self.residual_multiplier != 1.0 else out

    def _call_context(self, hidden_states: torch.Tensor) -> AbstractContextManager[Any]:
        """The context one call runs in, after checking its input (none by default)."""
        return contextlib.nullcontext()

    def extra_repr(self) -> str:
        family = self.declared_family()
        sub = getattr(self, "_layerswap_substitution", None)
        name = sub.name if sub is not None else f"{family.name}.decoder.{self.backend}"
        return f"replaces={family.decoder}, substitution={name}"


# --- attention steps ------------------------------------------------------------------


def attention_weights_sink(asked: bool = False) -> list[Any] | None:
    """The list this forward pass collects attention weights in, ``None`` when none is asked.

    transformers' ``output_attentions=True`` (argument or config) makes the model collect
    the attention weights of every layer, in call order, through hooks on its original
    attention class, which a replacement layer is not. A replacement that computes the
    weights appends them here instead.

    torch.compile traces the lookup when it compiles the whole model (transformers made
    its collector traceable for its own hooks). A layer compiled on its own cannot read
    the collector without a graph break, so there it is read only when ``asked`` (the
    call's or the config's ``output_attentions``) says weights may be wanted.

    Example::

        sink = attention_weights_sink(output_attentions or config.output_attentions)
        if sink is not None:
            sink.append(weights)          # (batch, heads, query, key)
    """
    collector = hf_internals.attention_collector()
    if collector is None:  # pragma: no cover - a transformers without output capturing
        return None
    if not asked and torch.compiler.is_compiling() and not collector.compiling:
        return None
    collected = collector.get()
    if collected is None or "attentions" not in collected:
        return None
    sink: list[Any] = collected["attentions"]
    return sink


def _attention_weights_asked(asked: bool) -> bool:
    return asked or attention_weights_sink() is not None


_WARNED_NO_WEIGHTS: set[type] = set()


def _warn_no_attention_weights(layer: type) -> None:
    # once per class, as transformers warns once for its own sdpa attention
    if layer in _WARNED_NO_WEIGHTS:
        return
    _WARNED_NO_WEIGHTS.add(layer)
    warnings.warn(
        f"{layer.__name__} does not compute attention weights: output_attentions=True "
        "returns none for its layers. Verify or inspect attention with the fused "
        "backend, which computes them, or with the original layers",
        SwapWarning,
        stacklevel=3,
    )


def causal_call(default: bool, cache: LayerCache | None) -> bool:
    """Whether this call's attention is causal where the model dropped the mask: the call's
    ``is_causal`` when it gives one, else the layer's ``default`` -- as transformers' sdpa
    attention decides (``kwargs["is_causal"]``, else ``module.is_causal``). Where the model
    passes a mask, the mask decides, as it does for the original.

    Example::

        causal = causal_call(self.is_causal, cache)   # False for model(ids, is_causal=False)
    """
    asked = None if cache is None else cache.is_causal
    return default if asked is None else asked


# enable_gqa arrived in torch 2.5
_SDPA_GQA = tuple(int(part) for part in torch.__version__.split(".")[:2]) >= (2, 5)


def check_mask(mask: Any, backend: str, config: Any) -> None:
    """:class:`RequirementError` unless ``mask`` is what the layers read: a 4-D tensor
    (sdpa or eager attention) or ``None``."""
    if mask is not None and not (isinstance(mask, torch.Tensor) and mask.dim() == 4):
        raise RequirementError(
            f"the {backend} layer reads 4-D attention masks (attn_implementation 'sdpa' or "
            f"'eager'); it got {type(mask).__name__} from attn_implementation "
            f"{getattr(config, '_attn_implementation', None)!r}"
        )
    if (
        mask is not None
        and mask.dtype == torch.bool
        and getattr(config, "_attn_implementation", None) == "eager"
    ):
        # transformers' eager attention adds the mask to the scores: a True/False mask
        # masks nothing there, where the layer would mask with it
        raise RequirementError(
            f"the {backend} layer got a boolean 4-D attention mask under eager attention, "
            "where the original adds the mask to the scores (True adds 1, False 0: nothing "
            "is masked); pass an additive float mask (0 where attended, a large negative "
            "number elsewhere), or use attn_implementation 'sdpa'"
        )


def causal_keys(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    causal: bool,
) -> tuple[bool, torch.Tensor, torch.Tensor]:
    """SDPA's ``is_causal`` for this call, and the keys and values it attends to.

    No mask means plain causal attention where ``causal`` (the model drops the mask when
    that is exact); SDPA's flag is top-left aligned, so a static cache's unused slots are
    dropped. (batch, heads, seq, head_dim) tensors.
    """
    query_length = query.shape[2]
    is_causal = causal and mask is None and query_length > 1
    if isinstance(is_causal, torch.Tensor):
        # torch.jit.trace records shapes as tensors; SDPA takes a bool (as transformers
        # does, the trace keeps the flag of the traced length)
        is_causal = bool(is_causal)
    if is_causal and key.shape[2] > query_length:
        key, value = key[:, :, :query_length], value[:, :, :query_length]
    return is_causal, key, value


def sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    *,
    is_causal: bool,
    scale: float,
    dropout: float = 0.0,
) -> torch.Tensor:
    """``scaled_dot_product_attention`` over (batch, heads, seq, head_dim), grouped keys and
    values (fewer heads than the queries) expanded the fastest way the call allows."""
    extra: dict[str, Any] = {}
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        # measured: on CPU enable_gqa beats expanding k/v with or without a mask; on
        # GPUs a mask with enable_gqa falls back to the slow math kernel;
        # the TorchScript ONNX exporter cannot convert enable_gqa
        native = _SDPA_GQA and not torch.onnx.is_in_onnx_export()
        if native and (mask is None or query.device.type == "cpu"):
            extra["enable_gqa"] = True
        else:
            key = key.repeat_interleave(groups, dim=1)
            value = value.repeat_interleave(groups, dim=1)
    output: torch.Tensor = torch.nn.functional.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=mask,
        dropout_p=dropout,
        is_causal=is_causal,
        scale=scale,
        **extra,
    )
    return output


def split_heads(
    projected: torch.Tensor, sizes: Sequence[int], head_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Query, key and value, (batch, seq, heads, head_dim), from one ``[q | k | v]`` projection.

    Example::

        query, key, value = split_heads(qkv_proj(hidden), (256, 64, 64), head_dim=32)
    """
    query, key, value = (
        part.view(*part.shape[:-1], -1, head_dim)
        for part in torch.split(projected, local_sizes(sizes, projected.shape[-1]), dim=-1)
    )
    return query, key, value


def local_sizes(sizes: Sequence[int], width: int) -> list[int]:
    """The parts ``sizes`` of a packed projection whose output here is ``width`` wide.

    ``width`` is ``sum(sizes)`` on one process. Under tensor parallelism each rank holds
    its share of every part (its heads of q, of k and of v: a packed column shard), so
    each part is ``size * width / sum(sizes)`` wide.

    Example::

        local_sizes((256, 64, 64), 384)   # [256, 64, 64]
        local_sizes((256, 64, 64), 192)   # [128, 32, 32]: one rank of two
    """
    whole = sum(sizes)
    if width == whole:
        return list(sizes)
    if whole % width or any(size * width % whole for size in sizes):
        raise ValueError(
            f"a packed projection of parts {list(sizes)} is {width} wide here: not an equal "
            "share of every part (tensor parallelism needs every part, the key/value heads "
            "included, to divide by the number of ranks)"
        )
    return [size * width // whole for size in sizes]


def update_cache(
    cache: LayerCache | None,
    key: torch.Tensor,
    value: torch.Tensor,
    layer_idx: int,
    *,
    layout: Layout,
    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Store this call's keys/values in the cache; all of the layer's so far, in ``layout``.

    Called between the rotary embedding and attention, where the original updates its
    cache, so every transformers cache (dynamic, static, sliding) works, updated the way
    the calling release does (:class:`~layerswap.hf_internals.LayerCache`). The cache
    holds (batch, heads, seq, head_dim).

    Example::

        key, value = update_cache(cache, key, value, self.layer_idx, layout="bshd")
    """
    if cache is None or cache.cache is None:
        return key, value
    if layout == "bhsd":
        return cache.update(key, value, layer_idx, position_embeddings)
    cached_key, cached_value = cache.update(
        key.transpose(1, 2), value.transpose(1, 2), layer_idx, position_embeddings
    )
    return cached_key.transpose(1, 2), cached_value.transpose(1, 2)


# --- per-family classes and substitutions ---------------------------------------------


def _class_name(base: type[DecoderLayer], family: Family) -> str:
    camel = "".join(part[:1].upper() + part[1:] for part in re.split(r"[^0-9A-Za-z]+", family.name))
    return f"{base.__name__.removesuffix('DecoderLayer')}{camel}DecoderLayer"


def family_layer_class(base: type[LayerT], family: Family) -> type[LayerT]:
    """``base`` made for ``family`` (once, then cached), named after both.

    ``FusedDecoderLayer`` and llama give ``FusedLlamaDecoderLayer``, a class of
    ``base``'s module that is set there as a module attribute; a pickle holds how to
    make it again (:mod:`layerswap.backends.per_family`).

    Example::

        family_layer_class(FusedDecoderLayer, layerswap.families()["llama"])
    """
    name = _class_name(base, family)

    def make(meta: type[type]) -> type[LayerT]:
        made: type[LayerT] = meta(
            name,
            (base,),
            {
                "family": family,
                "__module__": base.__module__,
                "__qualname__": name,
                "__doc__": f"{base.summary} replacing {family.decoder} ({family.name}).",
            },
        )
        return made

    return family_class(base, family, make, factory=family_layer_class, export=name)


def layer_class_named(base: type[LayerT], name: str) -> type[LayerT]:
    """The per-family class of ``base`` called ``name`` (``FusedQwen3DecoderLayer``), made
    on demand: a backend module's ``__getattr__``, so the class imports by its name in a
    process that has not made it yet (:class:`AttributeError` when no family's is so named).

    Example::

        def __getattr__(name):
            return layer_class_named(FusedDecoderLayer, name)
    """
    return class_named(
        base,
        name,
        lambda family: _class_name(base, family),
        lambda family: family_layer_class(base, family),
    )
