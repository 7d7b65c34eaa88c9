"""Every place layerswap reaches into transformers below its public API, in one module.

transformers exposes no public way to do some of what a swap needs: hook the hidden-state
capture onto a layer class the model did not declare, give ``from_pretrained`` and
``save_pretrained`` per-layer weight transforms, read the attention weights an
``output_attentions=True`` call collects. Each function here names the transformers
internal it touches and why, so an upstream change breaks one module, and a reader sees
the whole surface at once. Imports of transformers happen inside the functions: this
module costs nothing to import.

Example::

    from layerswap import hf_internals

    hf_internals.output_capture_installed(model)   # has transformers hooked it yet?
    call = hf_internals.read_layer_call(kwargs, cache=cache)   # in a replacement layer
"""

from __future__ import annotations

import contextlib
import copy
import os
import sys
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from layerswap.versions import transformers_version

if TYPE_CHECKING:
    from collections.abc import Sequence

__all__ = [
    "activation_in_dtype",
    "CACHE_ARGUMENTS",
    "refuse_unread",
    "CONVERSION_MAPPING_TARGET",
    "LAYER_CALL_PARAMETERS",
    "IGNORED_CALL_KEYWORDS",
    "CALL_OPTIONS",
    "SHARED_SOURCES",
    "POST_INIT_TARGET",
    "SAVE_PRETRAINED_TARGET",
    "WEIGHT_CONVERSIONS_ATTRIBUTE",
    "LOWEST_TRANSFORMERS",
    "ROTARY_LAYOUT_CHANGES",
    "SWEPT_TRANSFORMERS",
    "TP_PLAN_ATTRIBUTE",
    "CaptureHook",
    "LayerCache",
    "LayerCall",
    "attention_collector",
    "base_weight_conversions",
    "capture_like_original",
    "capture_subtree",
    "conversion_ops_class",
    "layer_attention_type",
    "loads_sharded_on_read",
    "output_capture_installed",
    "output_capture_tasks",
    "quantization_kind",
    "quantized_checkpoint",
    "quantizer_of",
    "quantizer_of_conversion_call",
    "read_layer_call",
    "register_tp_style",
    "merge_rotary_sections",
    "rotary_layout",
    "rotary_sections",
    "text_config_of",
    "torch_dtype_of",
    "transformers_support",
    "transformers_version",
    "weight_converter",
    "weight_renaming",
    "hf_deepspeed_config",
    "zero3_switch_off",
]

#: ``layerswap.wrap`` target run when a ``PreTrainedModel`` finishes ``__init__``: the one
#: moment every construction path (``Model(config)``, ``Auto*``, ``from_pretrained``)
#: passes through before weights load, so ``use()`` finishes models there.
POST_INIT_TARGET = "transformers.modeling_utils:PreTrainedModel.post_init"

#: ``layerswap.wrap`` target giving ``from_pretrained`` its list of weight transforms, as
#: ``modeling_utils`` imported it from ``transformers.conversion_mapping``; ``use()`` adds
#: the replacement layers' transforms to that list.
CONVERSION_MAPPING_TARGET = "transformers.modeling_utils:get_model_conversion_mapping"

#: ``layerswap.wrap`` target writing a checkpoint (config, generation config, weight
#: shards); layerswap's advice stages it and checks the names written (``layerswap.saving``)
SAVE_PRETRAINED_TARGET = "transformers.modeling_utils:PreTrainedModel.save_pretrained"

#: the instance attribute where ``from_pretrained`` keeps the transforms it applied and
#: ``save_pretrained`` reads them back (reversed) to write the checkpoint's own layout
WEIGHT_CONVERSIONS_ATTRIBUTE = "_weight_conversions"


# --- hidden-state (output) capture ---------------------------------------------------------
# transformers records hidden states with forward hooks that it installs lazily, on the
# first output_hidden_states call, on modules whose class is listed in the model's
# _can_record_outputs: the original classes. A replacement layer would be missed, so
# layerswap installs on it the hooks its original would get, with transformers' own code.


def output_capture_tasks(owner: nn.Module) -> list[tuple[str, Any]]:
    """``(output name, OutputRecorder)`` pairs of ``owner``, as transformers builds them.

    Touches ``transformers.utils.output_capturing._CAN_RECORD_REGISTRY`` (the per-class
    ``_can_record_outputs`` after transformers' normalisation: a dict keyed by
    ``str(class)`` up to 5.22, a registry keyed on the model from 5.23) and
    ``OutputRecorder``.
    Empty on a transformers without output capturing.
    """
    try:
        from transformers.utils.output_capturing import _CAN_RECORD_REGISTRY, OutputRecorder
    except ImportError:  # pragma: no cover - older or newer transformers
        return []
    if type(_CAN_RECORD_REGISTRY) is dict:  # up to 5.22: a plain dict keyed by str(class)
        flags = _CAN_RECORD_REGISTRY.get(str(owner.__class__)) or {}
    else:  # from 5.23: a registry keyed on the model
        flags = _CAN_RECORD_REGISTRY.get(owner) or {}
    tasks = []
    for key, specs in flags.items():
        for spec in specs if isinstance(specs, list) else [specs]:
            if isinstance(spec, OutputRecorder):
                tasks.append((key, spec))
            elif isinstance(spec, (type, str)):  # a class, or (5.22) a class's name
                index = 0 if "hidden_states" in key else 1
                named = {"class_name": spec} if isinstance(spec, str) else {"target_class": spec}
                tasks.append((key, OutputRecorder(index=index, **named)))
    return tasks


def output_capture_installed(owner: nn.Module | None) -> bool:
    """Whether transformers has installed its capture hooks on ``owner`` already.

    Reads the instance flag ``_output_capturing_hooks_installed`` that transformers sets
    on the first ``output_hidden_states`` call.
    """
    return owner is not None and bool(owner.__dict__.get("_output_capturing_hooks_installed"))


class CaptureHook:
    """transformers' output-capture hook, picklable (transformers' own is a closure).

    The real hook is made by ``transformers.utils.output_capturing.
    install_output_capuring_hook`` (sic) on a throwaway module, so the capture logic
    stays transformers'; pickling keeps the arguments. Example::

        layer.register_forward_hook(CaptureHook("hidden_states", 0, True))
    """

    def __init__(self, key: str, index: int, initial: bool) -> None:
        from transformers.utils.output_capturing import install_output_capuring_hook

        self.key, self.index, self.initial = key, index, initial
        # made now, not on first call: a hook that changes its own state while
        # torch.compile traces it breaks the graph on every layer
        holder = nn.Module()
        install_output_capuring_hook(holder, key, index, initial)
        (self._hook,) = holder._forward_hooks.values()

    def __call__(self, module: nn.Module, args: Any, output: Any) -> Any:
        return self._hook(module, args, output)

    def __getstate__(self) -> dict[str, Any]:
        return {"key": self.key, "index": self.index, "initial": self.initial}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["key"], state["index"], state["initial"])  # type: ignore[misc]


def capture_like_original(layer: nn.Module, owner: nn.Module, original_cls: type) -> None:
    """Give a replacement ``layer`` the capture hooks an ``original_cls`` layer would get.

    Reads ``OutputRecorder``'s fields (``target_class``, or ``class_name`` where a release
    names the class, ``layer_name``, ``index``, ``capture_initial_hidden_state``) the way
    transformers matches them to modules.
    """
    names = {klass.__name__ for klass in original_cls.__mro__}
    for key, spec in output_capture_tasks(owner):
        target = spec.target_class
        matches = (target is not None and issubclass(original_cls, target)) or (
            getattr(spec, "class_name", None) in names
        )
        if spec.layer_name is None and matches:
            hook = CaptureHook(key, spec.index, spec.capture_initial_hidden_state)
            layer.register_forward_hook(hook)


def capture_subtree(layer: nn.Module, name: str, owner: nn.Module) -> None:
    """Install on ``layer`` (named ``name`` in ``owner``) the hooks ``owner`` got meanwhile.

    For an original layer put back by undo after transformers hooked the model: calls
    ``transformers.utils.output_capturing.recursively_install_hooks``, the function
    transformers itself installs with.
    """
    try:
        from transformers.utils.output_capturing import recursively_install_hooks
    except ImportError:  # pragma: no cover - older or newer transformers
        return
    recursively_install_hooks(layer, f".{name}", output_capture_tasks(owner))


def attention_collector() -> Any | None:
    """transformers' collector of this call's outputs, ``None`` without output capturing.

    ``transformers.utils.output_capturing._active_collector``: where an
    ``output_attentions=True`` call collects attention weights. A replacement layer that
    computes them appends there (see ``layerswap.backends._layer.attention_weights_sink``).
    """
    try:
        from transformers.utils.output_capturing import _active_collector
    except ImportError:  # pragma: no cover - a transformers without output capturing
        return None
    return _active_collector


# --- weight transforms for from_pretrained / save_pretrained --------------------------------


def base_weight_conversions(model: nn.Module) -> list[Any]:
    """The weight transforms ``save_pretrained`` reverses for ``model``, before layerswap's.

    Those ``from_pretrained`` recorded on the model (``_weight_conversions``), else what
    it would have used: ``transformers.conversion_mapping.get_model_conversion_mapping``
    without ``transformers.core_model_loading.PrefixChange`` entries (which only apply
    when loading).
    """
    existing = model.__dict__.get(WEIGHT_CONVERSIONS_ATTRIBUTE)
    if existing is not None:
        return list(existing)
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import PrefixChange

    return [
        transform
        for transform in get_model_conversion_mapping(model, add_legacy=False)
        if not isinstance(transform, PrefixChange)
    ]


def weight_renaming(sources: Sequence[str], targets: Sequence[str]) -> Any:
    """A ``transformers.core_model_loading.WeightRenaming`` (keys renamed, values kept)."""
    from transformers.core_model_loading import WeightRenaming

    return WeightRenaming(list(sources), list(targets))


def weight_converter(sources: Sequence[str], targets: Sequence[str], operation: Any) -> Any:
    """A ``transformers.core_model_loading.WeightConverter`` applying one ``operation``."""
    from transformers.core_model_loading import WeightConverter

    return WeightConverter(list(sources), list(targets), operations=[operation])


def conversion_ops_class() -> type:
    """``transformers.core_model_loading.ConversionOps``, the base of a converter operation."""
    from transformers.core_model_loading import ConversionOps

    base: type = ConversionOps
    return base


# --- quantized models --------------------------------------------------------------------
# ``from_pretrained(..., quantization_config=...)`` hands its ``HfQuantizer`` to
# ``get_model_conversion_mapping`` (third parameter) and then keeps it on the model as
# ``hf_quantizer``; ``save_pretrained`` asks it for the state dict to write.


def quantizer_of_conversion_call(args: Sequence[Any], kwargs: Mapping[str, Any]) -> Any:
    """The ``hf_quantizer`` a ``get_model_conversion_mapping(model, key_mapping,
    hf_quantizer, add_legacy)`` call was given, or ``None``."""
    if "hf_quantizer" in kwargs:
        return kwargs["hf_quantizer"]
    return args[2] if len(args) > 2 else None


def quantizer_of(model: nn.Module) -> Any:
    """The ``HfQuantizer`` ``from_pretrained`` left on ``model`` (``hf_quantizer``), or ``None``."""
    return getattr(model, "hf_quantizer", None)


def quantized_checkpoint(hf_quantizer: Any) -> bool:
    """Whether ``hf_quantizer`` reads a checkpoint already quantized (``pre_quantized``),
    rather than quantizing an unquantized one as it loads."""
    return bool(getattr(hf_quantizer, "pre_quantized", False))


def quantization_kind(hf_quantizer: Any) -> str:
    """What ``hf_quantizer`` quantizes with, as ``AutoQuantizationConfig`` names it.

    ``quantization_config.quant_method`` (a ``QuantizationMethod`` string enum), with
    bitsandbytes told apart by ``load_in_4bit``: ``"bitsandbytes_4bit"``/``"_8bit"``.
    """
    config = getattr(hf_quantizer, "quantization_config", None)
    method = getattr(config, "quant_method", None)
    kind = str(getattr(method, "value", method))
    if kind == "bitsandbytes":
        return (
            "bitsandbytes_4bit" if getattr(config, "load_in_4bit", False) else "bitsandbytes_8bit"
        )
    return kind


# --- tensor parallelism and sharded loading -------------------------------------------------
# transformers shards a model by a plan of module names and styles (``_tp_plan``, from
# ``config.base_model_tp_plan`` and the class), applies it before loading, and slices
# each checkpoint tensor for the rank as it reads it (``DtensorShardOperation``): the
# weight transforms then see the rank's slice of each original tensor.

#: the instance attribute holding a ``PreTrainedModel``'s tensor-parallel plan, which
#: ``from_pretrained(..., distributed_config=...)`` reads to shard the model
TP_PLAN_ATTRIBUTE = "_tp_plan"


def loads_sharded_on_read() -> bool:
    """Whether this transformers slices each checkpoint tensor per rank as it reads it.

    ``transformers.distributed.sharding_utils.DtensorShardOperation``: from it on, the
    weight transforms of a sharded load see each original tensor's slice for the rank,
    which :mod:`layerswap.parallel` is written (and tested) for.
    """
    try:
        from transformers.distributed.sharding_utils import DtensorShardOperation  # noqa: F401
    except ImportError:
        return False
    return True


def register_tp_style(name: str, on_apply: Any) -> None:
    """Register a tensor-parallel style ``name`` whose every use calls ``on_apply(module)``.

    ``transformers.integrations.tensor_parallel.ALL_PARALLEL_STYLES`` is transformers'
    public registry of styles a plan may name; ``TensorParallelLayer`` its base.
    ``on_apply`` is called when the style would shard a parameter or hook a module
    (layerswap's refusal raises there). Nothing happens where the registry is absent.
    """
    try:
        from transformers.integrations.tensor_parallel import (
            ALL_PARALLEL_STYLES,
            TensorParallelLayer,
        )
    except ImportError:
        return
    if name in ALL_PARALLEL_STYLES:
        return

    class Refused(TensorParallelLayer):  # type: ignore[misc, valid-type]
        def shard_param(self, module: Any, param: Any, mesh: Any) -> None:
            on_apply(module)

        def install_forward(self, module: Any, mesh: Any) -> Any:
            on_apply(module)

        # older releases name the hooks differently; refuse there too
        def partition_tensor(self, *args: Any, **kwargs: Any) -> Any:
            on_apply(args[0] if args else None)

        def prepare_module_tp(self, module: Any, *args: Any, **kwargs: Any) -> Any:
            on_apply(module)

    ALL_PARALLEL_STYLES.register(name, Refused())


# --- which releases --------------------------------------------------------------------------

#: the lowest transformers release layerswap supports: pyproject.toml's lower bound, the
#: lowest from which every release the sweep (scripts/compat_sweep.py) ran passes
LOWEST_TRANSFORMERS = "5.12.1"
#: the newest release the sweep proved (docs/compatibility.md); a newer one is proven
#: family by family at first use (layerswap.proof)
SWEPT_TRANSFORMERS = "5.24.0"


#: set by the release sweep, which proves releases below the lowest to find the lowest
SWEEPING = "LAYERSWAP_SWEEP"


def _release(version: str) -> tuple[int, ...]:
    numbers = []
    for part in version.split("+")[0].split("."):
        digits = "".join(ch for ch in part if ch.isdigit())
        if not digits:
            break
        numbers.append(int(digits))
        if digits != part:  # "0rc1": a pre-release of that number
            break
    return tuple(numbers)


def transformers_support(version: str) -> tuple[bool, str]:
    """Whether layerswap supports transformers ``version``, and how it knows.

    Example::

        transformers_support("5.24.0")   # (True, "proven by the release sweep ...")
    """
    if _release(version) < _release(LOWEST_TRANSFORMERS) and not os.environ.get(SWEEPING):
        return False, (
            f"older than the lowest release layerswap supports ({LOWEST_TRANSFORMERS}): "
            f"pip install 'transformers>={LOWEST_TRANSFORMERS}'"
        )
    if _release(version) <= _release(SWEPT_TRANSFORMERS):
        return True, "proven by the release sweep (docs/compatibility.md)"
    return True, (
        f"newer than the last release swept ({SWEPT_TRANSFORMERS}): each family is proven "
        "at first use"
    )


# --- the source a decoder layer runs -------------------------------------------------------
#: transformers modules (relative to the package) whose code every decoder layer's
#: computation reaches at run time besides its own modeling module and what that imports
#: by name: the masks it is given, the caches it updates, the rotary tables, the attention
#: functions ``ALL_ATTENTION_FUNCTIONS`` dispatches to, the base classes, generation. A
#: verdict is keyed by their content (:mod:`layerswap.sources`)
SHARED_SOURCES = (
    "masking_utils",
    "cache_utils",
    "modeling_rope_utils",
    "modeling_layers",
    "modeling_utils",
    "modeling_flash_attention_utils",
    "activations",
    "pytorch_utils",
    "integrations.sdpa_attention",
    "integrations.moe",
    "integrations.hub_kernels",
    "generation.utils",
    "utils.generic",
    "utils.output_capturing",
)


# --- the decoder layer's call contract -----------------------------------------------------
# How a transformers model calls its decoder layers, and a layer its cache, changed over
# releases. Until 5.3 the cache came as ``past_key_values`` with a ``cache_position``,
# which the static cache needs in ``cache.update``'s ``cache_kwargs`` to know where to
# write; from 5.4 ``cache_position`` is gone; from 5.24 the cache comes as ``cache`` (the old
# name deprecated until 5.40) and ``cache.update`` receives the layer's keyword arguments
# as ``kwargs=``. A replacement layer reads its call here, and nowhere else, so every
# release it supports is read the same way; the upstream check refuses an original that
# takes a parameter outside :data:`LAYER_CALL_PARAMETERS`.

#: the names by which transformers releases pass the KV cache to a layer, newest first
CACHE_ARGUMENTS = ("cache", "past_key_values")

#: every parameter of a decoder layer's (or its attention's) ``forward``, on the supported
#: releases, that :func:`read_layer_call` reads: a replacement that reads its call here
#: handles all of them
LAYER_CALL_PARAMETERS = frozenset(
    {
        "hidden_states",
        "attention_mask",
        "position_ids",
        "position_embeddings",
        *CACHE_ARGUMENTS,
        "cache_position",
        "use_cache",
        "output_attentions",
    }
)


#: keywords transformers models pass their decoder layers at call time (through
#: ``**kwargs``, typed ``TransformersKwargs``) that an original layer under sdpa or eager
#: attention never reads: the loss's item count (Trainer), the output-capture switches
#: (transformers' hooks read them, not the layer), and the packed-sequence metadata only
#: flash-attention and Mamba kernels read, and what a vision wrapper hands its language
#: model along with the prompt (Aya Vision's and InternVL's ``image_sizes``). A
#: replacement may take them and do nothing
IGNORED_CALL_KEYWORDS = frozenset(
    {
        "num_items_in_batch",
        "image_sizes",
        "output_hidden_states",
        "output_router_logits",
        "cu_seq_lens_q",
        "cu_seq_lens_k",
        "max_length_q",
        "max_length_k",
        "seq_idx",
    }
)
#: call-time keywords the original's attention reads (sdpa's ``is_causal``: ``False``
#: attends both ways where the model dropped the mask): a replacement layer handles each
#: as the original does (it says so: ``DecoderLayer.call_options``) or refuses the call
CALL_OPTIONS = frozenset({"is_causal"})


def refuse_unread(kwargs: Mapping[str, Any], accepted: Collection[str], layer: str) -> None:
    """Raise :class:`~layerswap.errors.UpstreamDriftError` naming the first keyword of
    ``kwargs`` a layer does not handle: neither :data:`LAYER_CALL_PARAMETERS`, nor
    :data:`IGNORED_CALL_KEYWORDS`, nor in ``accepted`` (the call options the layer handles,
    the arguments its family's original ignores). One set lookup per keyword: a call
    passes two or three.

    Example::

        refuse_unread({"is_causal": False}, frozenset(), "TELlamaDecoderLayer")   # raises
    """
    for name in kwargs:
        if name in LAYER_CALL_PARAMETERS or name in IGNORED_CALL_KEYWORDS or name in accepted:
            continue
        from layerswap.errors import UpstreamDriftError

        what = (
            "an attention option of the original layer"
            if name in CALL_OPTIONS
            else "a keyword this layerswap does not know"
        )
        raise UpstreamDriftError(
            f"{layer} was called with {name}={kwargs[name]!r} ({what}), which it does not "
            "handle the way the original does: the swapped model would compute something "
            f"else. Call the model without {name}, use a backend that handles it, or "
            "upgrade layerswap"
        )


@dataclass(frozen=True)
class LayerCache:
    """The KV cache a layer was called with, updated the way the calling release does.

    ``cache`` is ``None`` when the call has none (training, ``use_cache=False``).
    ``cache_position`` is set by the releases that pass it (up to 5.3): their static
    cache writes at those positions, read from ``cache_kwargs``. ``passed`` is the rest of
    the call's keyword arguments, which releases from 5.24 hand to ``cache.update`` as
    ``kwargs=`` (``by_name``: the call named the cache ``cache``, as those releases do).
    """

    cache: Any | None = None
    cache_position: torch.Tensor | None = None
    passed: Mapping[str, Any] = field(default_factory=dict)
    by_name: str = "cache"

    @property
    def is_causal(self) -> bool | None:
        """The call's ``is_causal`` (``None``: not given; the layer's own default holds)."""
        causal = self.passed.get("is_causal")
        return None if causal is None else bool(causal)

    @property
    def position_ids(self) -> torch.Tensor | None:
        """The call's ``position_ids`` (Ministral 3 scales its queries by position)."""
        positions = self.passed.get("position_ids")
        return None if positions is None else positions

    def update(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        layer_idx: int,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``key``/``value`` (batch, heads, seq, head_dim); all of the layer's so far.

        Example::

            key, value = call.cache.update(key, value, self.layer_idx, (cos, sin))
        """
        if self.cache is None:
            return key, value
        if self.cache_position is not None:
            # transformers up to 5.3: Cache.update(key, value, layer_idx, cache_kwargs)
            cos, sin = position_embeddings if position_embeddings is not None else (None, None)
            cache_kwargs = {"sin": sin, "cos": cos, "cache_position": self.cache_position}
            updated = self.cache.update(key, value, layer_idx, cache_kwargs)
        elif self.by_name == "cache":
            # transformers from 5.24: Cache.update(key, value, layer_idx, kwargs=kwargs)
            updated = self.cache.update(key, value, layer_idx, kwargs=dict(self.passed))
        else:
            updated = self.cache.update(key, value, layer_idx)
        cached_key, cached_value = updated
        return cached_key, cached_value


@dataclass(frozen=True)
class LayerCall:
    """What a decoder layer was called with, read the same way on every supported release.

    Example::

        call = read_layer_call(kwargs, attention_mask=attention_mask, cache=cache)
        call.cache.update(key, value, layer_idx, call.position_embeddings)
    """

    attention_mask: torch.Tensor | None
    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None
    cache: LayerCache
    #: whether this call asks for attention weights (``output_attentions=True``)
    output_attentions: bool


#: the rotary layout a family's layers receive, where a release changed it: family ->
#: (the first release of the layout the family declares, the layout before it)
ROTARY_LAYOUT_CHANGES: Mapping[str, tuple[tuple[int, ...], str]] = {
    # GLM-4V: up to 5.16 its rotary embedding returns cat(freqs, freqs) and the attention
    # repeats the first half pairwise (GLM-4's layout); from 5.17 the rotary embedding
    # hands over the pairwise cos/sin and the attention applies them as they come
    "glm4v": ((5, 17), "interleaved_from_half"),
}


def rotary_layout(family: str, declared: str) -> str:
    """The rotary layout (:attr:`~layerswap.Family.rotary`) ``family``'s layers receive on
    the installed transformers: ``declared``, or the earlier one of
    :data:`ROTARY_LAYOUT_CHANGES` on a release before the change."""
    change = ROTARY_LAYOUT_CHANGES.get(family)
    if change is None:
        return declared
    first, before = change
    return declared if _release(transformers_version()) >= first else before


def rotary_sections(config: Any) -> tuple[int, ...] | None:
    """The M-RoPE sections of ``config`` (Qwen2-VL: how many of a head's frequency pairs
    rotate by the temporal, height and width position), ``None`` for plain RoPE."""
    parameters = getattr(config, "rope_parameters", None)
    sections = parameters.get("mrope_section") if isinstance(parameters, dict) else None
    return tuple(int(size) for size in sections) if sections else None


def merge_rotary_sections(
    position_embeddings: tuple[torch.Tensor, torch.Tensor], sections: Sequence[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin as one position per token, where the model passes one per M-RoPE axis.

    Up to transformers 5.2x, Qwen2-VL's and Qwen2.5-VL's rotary embedding returns cos/sin
    of shape ``(3, batch, seq, head_dim)`` (temporal, height, width) and the attention
    takes each section of the head's dims from its axis; later releases merge them in the
    rotary embedding and pass ``(batch, seq, head_dim)``, as every other model does. The
    same merge here gives layerswap's layers the later form on every release.
    """
    cos, sin = position_embeddings
    if cos.dim() != 4 or cos.shape[0] != 3:
        return position_embeddings
    split = [int(size) for size in sections] * 2  # the halves of rotate-half's layout

    def merge(table: torch.Tensor) -> torch.Tensor:
        parts = torch.split(table, split, dim=-1)
        return torch.cat([part[index % 3] for index, part in enumerate(parts)], dim=-1)

    return merge(cos), merge(sin)


def text_config_of(config: Any) -> Any:
    """The config a decoder layer reads: a composite (multimodal) config's text config,
    by transformers' ``get_text_config()``, else ``config`` itself.

    The user's config is never changed. Where its ``dtype`` is a name
    (``save_pretrained`` leaves ``"float32"`` in the model's own config), a shallow copy
    whose ``dtype`` is the torch dtype it names is returned instead: a layer that builds
    tensors in ``config.dtype`` (Apertus's xIELU) cannot be built from a name -- by
    transformers or by layerswap's checks (:func:`torch_dtype_of`).
    """
    get_text_config = getattr(config, "get_text_config", None)
    text = get_text_config() if callable(get_text_config) else config
    named = getattr(text, "dtype", None)
    dtype = torch_dtype_of(text)
    if isinstance(named, str) and dtype is not None:
        text = copy.copy(text)
        text.dtype = dtype
    return text


def torch_dtype_of(config: Any) -> torch.dtype | None:
    """``config.dtype`` as a torch dtype (``"float32"`` -> ``torch.float32``), ``None``
    where it is unset or names none."""
    dtype = getattr(config, "dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype.removeprefix("torch."), None)
    return dtype if isinstance(dtype, torch.dtype) else None


def layer_attention_type(config: Any, layer_idx: int) -> str:
    """The ``attention_type`` an original layer has (``"sliding_attention"`` ...).

    transformers up to 5.3 reads it off each decoder layer to pick that layer's mask
    (``causal_mask_mapping[decoder_layer.attention_type]``); later releases ignore it.
    """
    layer_types = getattr(config, "layer_types", None)
    if layer_types and 0 <= layer_idx < len(layer_types):
        return str(layer_types[layer_idx])
    return "full_attention"


def read_layer_call(
    kwargs: Mapping[str, Any],
    *,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    cache: Any | None = None,
    use_cache: bool | None = None,
    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
    accepted: Collection[str] = frozenset(),
    layer: str = "the replacement layer",
) -> LayerCall:
    """A layer's call, from its named arguments and the rest (``kwargs``).

    The cache is found under either name (``cache``, or ``past_key_values`` as releases
    before 5.24 and deprecated callers name it); ``cache_position`` where the release
    passes it. A keyword in ``kwargs`` that the layer (``layer``, for the message) does
    not handle is refused (:func:`refuse_unread`; ``accepted``: the call options it
    handles, as :data:`CALL_OPTIONS` names them, and arguments its original ignores),
    never swallowed. Example::

        def forward(self, hidden_states, attention_mask=None, position_ids=None,
                    cache=None, use_cache=False, position_embeddings=None, **kwargs):
            call = read_layer_call(kwargs, attention_mask=attention_mask, cache=cache,
                                   position_ids=position_ids, use_cache=use_cache,
                                   position_embeddings=position_embeddings)
    """
    if kwargs:
        refuse_unread(kwargs, accepted, layer)
    by_name = "cache"
    rest = dict(kwargs)
    legacy = rest.pop("past_key_values", None)
    if cache is None and legacy is not None:
        cache, by_name = legacy, "past_key_values"
    cache_position = rest.pop("cache_position", None)
    # what the original's attention receives besides its named arguments, as
    # transformers hands it on to Cache.update
    passed = {**rest, "position_ids": position_ids, "use_cache": use_cache}
    return LayerCall(
        attention_mask=attention_mask,
        position_embeddings=position_embeddings,
        cache=LayerCache(cache, cache_position, passed, by_name),
        output_attentions=bool(rest.get("output_attentions")),
    )


def activation_in_dtype(name: str, config: Any) -> nn.Module:
    """The activation ``name`` of transformers' ``ACT2CLS`` built with the config's
    ``dtype``, as Apertus's MLP builds xIELU (``ACT2CLS["xielu"](dtype=config.dtype)``):
    its learned parameters in the model's precision, not the class's default."""
    from transformers.activations import ACT2CLS

    entry = ACT2CLS[name]
    cls, options = entry if isinstance(entry, tuple) else (entry, {})
    # None too, as Apertus passes it: torch's default dtype, not the class's bfloat16
    built: nn.Module = cls(**options, dtype=torch_dtype_of(config))
    return built


# --- DeepSpeed ZeRO-3: transformers' switch ------------------------------------------------


def hf_deepspeed_config() -> Any | None:
    """transformers' live ``HfDeepSpeedConfig``, if any: the object behind
    ``is_deepspeed_zero3_enabled()``, held by transformers through a weak reference
    (``integrations.deepspeed._hf_deepspeed_config_weak_ref``, no public getter)."""
    module = sys.modules.get("transformers.integrations.deepspeed")
    reference = getattr(module, "_hf_deepspeed_config_weak_ref", None)
    return reference() if reference is not None else None


@contextlib.contextmanager
def zero3_switch_off() -> Iterator[None]:
    """``is_deepspeed_zero3_enabled()`` is false inside the block, and as it was after it.

    ``PreTrainedModel`` construction reads that switch (``_from_config`` enters
    ``deepspeed.zero.Init``); layerswap's own tiny models must be whole. Uses
    ``unset_hf_deepspeed_config``/``set_hf_deepspeed_config`` (the pair transformers
    offers tests) and restores the same object, on an exception too.
    """
    config = hf_deepspeed_config()
    if config is None:
        yield
        return
    from transformers.integrations import deepspeed as hf_deepspeed

    hf_deepspeed.unset_hf_deepspeed_config()
    try:
        yield
    finally:
        hf_deepspeed.set_hf_deepspeed_config(config)
