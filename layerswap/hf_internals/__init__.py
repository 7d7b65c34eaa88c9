"""Every place layerswap reaches into transformers below its public API, in one package.

transformers exposes no public way to do some of what a swap needs: hook the hidden-state
capture onto a layer class the model did not declare, give ``from_pretrained`` and
``save_pretrained`` per-layer weight transforms, read the attention weights an
``output_attentions=True`` call collects. Each function here names the transformers
internal it touches and why, so an upstream change breaks one package, and a reader sees
the whole surface at once: here, the hidden-state capture (:mod:`.capture`), the
decoder layer's call contract (:mod:`.layer_call`) and the experts of mixture-of-experts
blocks (:mod:`.experts`), every name re-exported here.
Imports of transformers happen inside the functions.

Example::

    from layerswap import hf_internals

    hf_internals.output_capture_installed(model)   # has transformers hooked it yet?
    call = hf_internals.read_layer_call(kwargs, cache=cache)   # in a replacement layer
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from torch import nn

from layerswap.versions import transformers_version

if TYPE_CHECKING:
    from collections.abc import Sequence

__all__ = [
    "built_inside_another",
    "EAGER_EXPERTS",
    "EXPERTS_FLAGS",
    "experts_flags",
    "experts_implementation",
    "activation_in_dtype",
    "CACHE_ARGUMENTS",
    "refuse_unread",
    "CONVERSION_MAPPING_TARGET",
    "LOAD_STATE_TARGET",
    "ZERO3_LOAD_STATE_TARGET",
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
    "landings",
    "layer_attention_type",
    "load_call_parts",
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
    "text_config_object",
    "torch_dtyped",
    "ATTENTION_FIELD",
    "attention_function",
    "attention_implementation",
    "torch_dtype_of",
    "transformers_support",
    "transformers_version",
    "weight_converter",
    "weight_renaming",
    "hf_deepspeed_config",
    "zero3_switch_off",
]

from layerswap.hf_internals.capture import (
    CaptureHook,
    attention_collector,
    capture_like_original,
    capture_subtree,
    output_capture_installed,
    output_capture_tasks,
)
from layerswap.hf_internals.experts import (
    EAGER_EXPERTS,
    EXPERTS_FLAGS,
    experts_flags,
    experts_implementation,
)
from layerswap.hf_internals.layer_call import (
    ATTENTION_FIELD,
    CACHE_ARGUMENTS,
    CALL_OPTIONS,
    IGNORED_CALL_KEYWORDS,
    LAYER_CALL_PARAMETERS,
    LayerCache,
    LayerCall,
    activation_in_dtype,
    attention_function,
    attention_implementation,
    layer_attention_type,
    merge_rotary_sections,
    read_layer_call,
    refuse_unread,
    rotary_sections,
    text_config_object,
    text_config_of,
    torch_dtype_of,
    torch_dtyped,
)

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

#: ``layerswap.wrap`` target loading a checkpoint's tensors into a built model
#: (``from_pretrained``), called ``(model=, state_dict=, load_config=, ...)`` with the
#: checkpoint's own key names and the weight transforms in ``load_config.weight_mapping``;
#: ``use()`` reads the names before anything loads (:func:`landings`)
LOAD_STATE_TARGET = "transformers.modeling_utils:convert_and_load_state_dict_in_model"

#: the same under DeepSpeed ZeRO-3 (``HfDeepSpeedConfig``): ``from_pretrained`` loads the
#: checkpoint into the partitioned model here instead, called ``(model, state_dict,
#: load_config)`` with the same names and transforms
ZERO3_LOAD_STATE_TARGET = "transformers.modeling_utils:_load_state_dict_into_zero3_model"

#: the instance attribute where ``from_pretrained`` keeps the transforms it applied and
#: ``save_pretrained`` reads them back (reversed) to write the checkpoint's own layout
WEIGHT_CONVERSIONS_ATTRIBUTE = "_weight_conversions"


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


def load_call_parts(args: Sequence[Any], kwargs: Mapping[str, Any]) -> tuple[Any, Any, list[Any]]:
    """The model, the checkpoint's state (name -> tensor or lazy slice) and the weight
    transforms of a :data:`LOAD_STATE_TARGET` or :data:`ZERO3_LOAD_STATE_TARGET` call."""
    model = kwargs["model"] if "model" in kwargs else args[0]
    state = kwargs["state_dict"] if "state_dict" in kwargs else args[1]
    config = kwargs["load_config"] if "load_config" in kwargs else args[2]
    return model, state, list(getattr(config, "weight_mapping", None) or [])


def landings(model: nn.Module, keys: Iterable[str], transforms: Sequence[Any]) -> list[Any]:
    """Where each checkpoint key lands in ``model``, as ``from_pretrained`` renames it:
    ``(key, model key, converter)`` with the ``WeightConverter`` that takes it there, or
    ``None`` for a key loaded as it is (after the renamings and the base-model prefix)."""
    from transformers.core_model_loading import (
        WeightConverter,
        WeightRenaming,
        rename_source_key,
    )

    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    by_pattern = {pattern: c for c in converters for pattern in c.source_patterns}
    prefix = getattr(model, "base_model_prefix", None)
    meta = model.state_dict()
    found = []
    for key in keys:
        renamed, pattern = rename_source_key(key, renamings, converters, prefix, meta)
        if renamed not in meta and key in meta:  # as transformers falls back
            renamed, pattern = key, None
        found.append((key, renamed, None if pattern is None else by_pattern.get(pattern)))
    return found


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
def built_inside_another(model: nn.Module) -> bool:
    """Whether ``model``'s ``post_init`` runs while another ``PreTrainedModel``'s
    ``__init__`` is still running: a causal LM builds its base model, a multimodal wrapper
    its towers, and each of those calls ``post_init`` before the outer one does. The
    outermost model's own ``post_init`` then answers for the whole (read off the call
    stack: transformers marks no such nesting)."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "__init__":
            owner = frame.f_locals.get("self")
            if (
                owner is not model
                and isinstance(owner, nn.Module)
                and callable(getattr(owner, "post_init", None))
                and hasattr(owner, "config")
            ):
                return True
        frame = frame.f_back  # type: ignore[assignment]
    return False


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


#: the rotary layout a family's layers receive, where a release changed it: family ->
#: (the first release of the layout the family declares, the layout before it)
ROTARY_LAYOUT_CHANGES: Mapping[str, tuple[tuple[int, ...], str]] = {
    # GLM-4V: up to 5.16 its rotary embedding returns cat(freqs, freqs) and the attention
    # repeats the first half pairwise (GLM-4's layout); from 5.17 the rotary embedding
    # hands over the pairwise cos/sin and the attention applies them as they come
    "glm4v": ((5, 17), "interleaved_from_half"),
}


def rotary_layout(family: str, declared: str) -> str:
    """The rotary layout (:attr:`Rope.layout <layerswap.decoder_shape.Rope.layout>`) ``family``'s layers receive on
    the installed transformers: ``declared``, or the earlier one of
    :data:`ROTARY_LAYOUT_CHANGES` on a release before the change."""
    change = ROTARY_LAYOUT_CHANGES.get(family)
    if change is None:
        return declared
    first, before = change
    return declared if _release(transformers_version()) >= first else before


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
