"""The config a behaviour proof runs: the user's, shrunk in size and nothing else.

A proof (:mod:`layerswap.proof`) builds a tiny model from the user's own config and
compares original and replacement layers on it. Only sizes shrink; what the proof must
still reach is kept:

- **every kind of layer** the config selects (``layer_types``, ``no_rope_layers``, a
  sliding-window or chunked-attention pattern, dense and mixture-of-experts layers, an
  index threshold such as ``first_k_dense_replace``): the layers are built once at the
  config's full depth on the meta device (no memory, no init), each described by its
  modules, their tensors' shapes and their plain attributes (:func:`layer_kinds`), and
  the tiny model keeps the shortest prefix of layers in which every kind occurs;
- **every position threshold** (:data:`POSITION_FIELDS`: sliding windows, attention
  chunks, attention-temperature floors, the span a rotary or query scaling starts past),
  shrunk to :data:`PROOF_WINDOW` tokens so that the proof's prompt runs past each;
- every other field, the attention and experts implementations included.

Example::

    from layerswap import shrink

    tiny = shrink.shrunk_config(get_family("llama"), LlamaConfig.from_pretrained(path))
    shrink.position_thresholds(config)   # {'sliding_window': 4096}
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from layerswap import zero3
from layerswap.hf_internals import text_config_of

if TYPE_CHECKING:
    from transformers import PreTrainedConfig

    from layerswap.family import Family

__all__ = [
    "CODE_PATHS",
    "POSITION_FIELDS",
    "PROOF_WINDOW",
    "SIZE_FIELDS",
    "config_kind",
    "family_like",
    "layer_kinds",
    "position_thresholds",
    "proof_config",
    "shrunk_config",
]

#: config fields that set sizes only; the proof takes the family's tiny values for them
SIZE_FIELDS = frozenset(
    {
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "vocab_size",
        "moe_intermediate_size",
        "shared_expert_intermediate_size",
        "num_experts",
        "num_local_experts",
        "num_experts_per_tok",
        "n_routed_experts",
        "n_shared_experts",
    }
)
#: config fields (top level, or in ``rope_parameters``, per layer type too) that name a
#: position past which a layer computes differently: a window, a chunk of attention or of
#: a state-space scan (Mamba 2's chunked scan carries its state from chunk to chunk past
#: it: Falcon-H1, Bamba, Granite 4 hybrid, Nemotron-H, Zamba 2; xLSTM's chunkwise mLSTM),
#: the span after which Llama 4's attention temperature or Ministral 3's query scaling
#: starts to grow
POSITION_FIELDS = (
    "sliding_window",
    "attention_chunk_size",
    "chunk_size",
    "mamba_chunk_size",
    "floor_scale",
    "original_max_position_embeddings",
)
#: what each position threshold shrinks to: the proof's prompt (8 tokens, then 3 decoded)
#: runs past it
PROOF_WINDOW = 4
#: private config fields that select which code runs (transformers' attention and experts
#: implementations): part of a config's kind
CODE_PATHS = ("_attn_implementation", "_experts_implementation")
#: config fields that say nothing about what the model computes
_METADATA = frozenset(
    {
        "_name_or_path",
        "_commit_hash",
        "architectures",
        "transformers_version",
        "dtype",
        "torch_dtype",
        "id2label",
        "label2id",
        "output_attentions",
        "output_hidden_states",
        "return_dict",
        "use_cache",
        "_attn_implementation_autoset",
    }
)
#: metadata fields that switch what a forward pass returns, set to these for the proof
_SWITCHES = {"output_attentions": False, "output_hidden_states": False, "return_dict": True}
#: a layer's attributes that only number it: every layer has its own, none is a kind
_INDEX_NAMES = frozenset({"layer_idx", "layer_id", "layer_index", "layer_number", "idx"})


def shrunk_config(
    family: Family, config: PreTrainedConfig, *, keep_layers: bool = False
) -> PreTrainedConfig:
    """``config`` with its sizes set to ``family``'s tiny values and every other field kept.

    The layers kept are the shortest prefix holding every kind of layer the config selects
    (at least the family's tiny count; lists with one entry per layer are cut to it); with
    ``keep_layers``, every one of them (an adopted patch may change a model's layers by
    their index: the proof's copy has each layer the user's model has);
    position thresholds shrink to :data:`PROOF_WINDOW` tokens, so the proof's prompt
    crosses them; special token ids outside the tiny vocabulary are dropped. Example::

        tiny = shrunk_config(get_family("llama"), LlamaConfig.from_pretrained(path))

    For a :attr:`~layerswap.family.Family.composite` family, ``config`` (the wrapper's, or
    the text config its layers read) gives the text config, shrunk so; the rest (the
    vision tower, its tokens) is the family's tiny config.
    """
    # what the shrink reads of the family, resolved once
    original = _decoder_class(family)
    tiny_config = family.tiny_config()
    if family.composite:
        wrapper = family.config_type()
        text = _shrunk_text(
            original, tiny_config.get_text_config(), text_config_of(config), keep_layers
        )
        return wrapper(**{**family.tiny, "text_config": text.to_dict()})
    return _shrunk_text(original, tiny_config, config, keep_layers)


def _decoder_class(family: Family) -> type[nn.Module] | None:
    """``family``'s decoder layer class, ``None`` where it cannot be resolved (the shrink
    then keeps every layer)."""
    try:
        return family.decoder_class()
    except Exception:
        return None


def _shrunk_text(
    original: type[nn.Module] | None,
    tiny_config: PreTrainedConfig,
    config: PreTrainedConfig,
    keep_layers: bool = False,
) -> PreTrainedConfig:
    values = config.to_dict()
    layers = values.get("num_hidden_layers")
    tiny = tiny_config.to_dict()
    for name in SIZE_FIELDS:
        if name in values and name in tiny:
            values[name] = tiny[name]
    was = _head_dim(config.to_dict())
    if "head_dim" in values and "head_dim" not in tiny:
        values["head_dim"] = tiny["hidden_size"] // tiny["num_attention_heads"]
    _keep_shape(config.to_dict(), values)
    _shrink_positions(values)
    now = _head_dim(values)
    if was and now and now != was:
        _rescale_rotary(values, now / was)
    vocab = values.get("vocab_size")
    for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
        token = values.get(name)
        if isinstance(token, int) and vocab is not None and token >= vocab:
            values[name] = None
        elif isinstance(token, list) and vocab is not None:
            values[name] = [t for t in token if t < vocab] or None
    values.pop("transformers_version", None)
    # call-time switches, not the model: the proof runs (and its key holds) without them
    for name, default in _SWITCHES.items():
        if name in values:
            values[name] = default
    if isinstance(layers, int) and keep_layers:
        values["num_hidden_layers"] = layers
    elif isinstance(layers, int):
        at_least = min(int(tiny.get("num_hidden_layers") or layers), layers)
        values["num_hidden_layers"] = _layers_kept(original, config, values, layers, at_least)
        kept = values["num_hidden_layers"]
        for name, value in list(values.items()):
            if isinstance(value, list) and len(value) == layers and name != "architectures":
                values[name] = value[:kept]
    return _built(config, values)


def shape_of(values: Mapping[str, Any]) -> dict[str, Any]:
    """The relations of a config's attention sizes that select what its layers compute,
    where sizes alone do not: a head size apart from ``hidden_size / heads`` (Qwen3-0.6B,
    Gemma, Mistral-Nemo: the output projection is not square), and keys and values shared
    by no heads (multi-head attention), by all (one key-value head) or by groups."""
    hidden, heads = values.get("hidden_size"), values.get("num_attention_heads")
    head, kv = values.get("head_dim"), values.get("num_key_value_heads")
    found: dict[str, Any] = {}
    sizes = [v for v in (hidden, heads, head) if isinstance(v, int) and v > 0]
    if len(sizes) == 3:
        found["head_dim_apart"] = sizes[2] * sizes[1] != sizes[0]
    if isinstance(kv, int) and isinstance(heads, int) and kv > 0:
        found["kv_heads"] = "all" if kv == heads else "one" if kv == 1 else "groups"
    return found


def _keep_shape(original: Mapping[str, Any], values: dict[str, Any]) -> None:
    """Give the tiny sizes in ``values`` the relations :func:`shape_of` finds in
    ``original``'s (a config with multi-latent attention keeps the tiny ones: its head
    sizes are its own)."""
    if "kv_lora_rank" in values:
        return
    wanted, now = shape_of(original), shape_of(values)
    heads = values.get("num_attention_heads")
    if wanted.get("head_dim_apart") is not None and wanted["head_dim_apart"] != now.get(
        "head_dim_apart"
    ):
        square = int(values["hidden_size"]) // int(values["num_attention_heads"])
        values["head_dim"] = 2 * square if wanted["head_dim_apart"] else square
    if wanted.get("kv_heads") != now.get("kv_heads") and isinstance(heads, int):
        values["num_key_value_heads"] = {"all": heads, "one": 1}.get(
            wanted.get("kv_heads", ""), max(1, heads // 4)
        )


def _head_dim(values: Mapping[str, Any]) -> int | None:
    head = values.get("head_dim")
    if isinstance(head, int) and head > 0:
        return head
    hidden, heads = values.get("hidden_size"), values.get("num_attention_heads")
    return hidden // heads if isinstance(hidden, int) and isinstance(heads, int) and heads else None


#: rotary parameters sized by the rotary dimension: one entry per frequency (LongRoPE's
#: factors), or sections summing to the frequencies (Qwen2-VL's multimodal rotary)
_PER_FREQUENCY = ("short_factor", "long_factor")
_SECTIONS = ("mrope_section",)


def _rescale_rotary(values: dict[str, Any], ratio: float) -> None:
    """The rotary parameters sized by the head dimension, resized to the shrunk one, in
    place: a factor per frequency sampled evenly (so that they still differ as the user's
    do), sections scaled to the same shares. Else the tiny model would not build (a
    LongRoPE factor list of the wrong length) or crash (sections that do not sum to its
    frequencies)."""
    rope = values.get("rope_parameters")
    if not isinstance(rope, dict):
        return
    tables = [rope, *(p for p in rope.values() if isinstance(p, dict))]
    for table in tables:
        for name in _PER_FREQUENCY:
            factors = table.get(name)
            if isinstance(factors, list) and factors:
                size = max(1, round(len(factors) * ratio))
                step = (len(factors) - 1) / max(1, size - 1)
                table[name] = [factors[round(i * step)] for i in range(size)]
        for name in _SECTIONS:
            sections = table.get(name)
            if (
                isinstance(sections, list)
                and sections
                and all(isinstance(s, int) for s in sections)
            ):
                table[name] = _scaled_sections(sections, round(sum(sections) * ratio))


def _scaled_sections(sections: list[int], total: int) -> list[int]:
    """``sections`` scaled to sum to ``total``, each at least 1 (largest remainders)."""
    whole = sum(sections)
    exact = [s * total / whole for s in sections]
    scaled = [max(1, int(x)) for x in exact]
    by_remainder = sorted(
        range(len(sections)), key=lambda i: exact[i] - int(exact[i]), reverse=True
    )
    for i in by_remainder[: max(0, total - sum(scaled))]:
        scaled[i] += 1
    return scaled


def _built(config: PreTrainedConfig, values: dict[str, Any]) -> PreTrainedConfig:
    shrunk = type(config).from_dict(values)
    for name in CODE_PATHS:
        chosen = getattr(config, name, None)
        if chosen is not None:
            setattr(shrunk, name, chosen)
    return shrunk


def _shrink_positions(values: dict[str, Any]) -> None:
    """Every position threshold in ``values`` (and its rotary parameters) at most
    :data:`PROOF_WINDOW`, in place."""
    _shrink_fields(values)
    rope = values.get("rope_parameters")
    if isinstance(rope, dict):
        values["rope_parameters"] = rope = dict(rope)
        _shrink_fields(rope)
        for layer_type, parameters in list(rope.items()):  # per layer type (Gemma 3)
            if isinstance(parameters, dict):
                rope[layer_type] = dict(parameters)
                _shrink_fields(rope[layer_type])


def _shrink_fields(values: dict[str, Any]) -> None:
    for name in POSITION_FIELDS:
        value = values.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value > PROOF_WINDOW:
            values[name] = PROOF_WINDOW


def position_thresholds(config: PreTrainedConfig) -> dict[str, int]:
    """The position thresholds ``config`` sets (:data:`POSITION_FIELDS`), by field name
    (``rope_parameters.`` before the rotary ones): a comparison that stops short of one
    has not seen what the layers compute past it.

    Example::

        position_thresholds(MistralConfig(sliding_window=4096))   # {'sliding_window': 4096}
    """
    text = text_config_of(config)
    found: dict[str, int] = {}
    for name in POSITION_FIELDS:
        value = getattr(text, name, None)
        if isinstance(value, int) and not isinstance(value, bool):
            found[name] = value
    rope = getattr(text, "rope_parameters", None)
    tables = [("rope_parameters", rope)] if isinstance(rope, Mapping) else []
    if isinstance(rope, Mapping):
        tables += [(f"rope_parameters.{k}", v) for k, v in rope.items() if isinstance(v, Mapping)]
    for where, table in tables:
        for name in POSITION_FIELDS:
            value = table.get(name)
            if isinstance(value, int) and not isinstance(value, bool):
                found[f"{where}.{name}"] = value
    return found


# --- layer kinds ---------------------------------------------------------------------------


def _plain(value: Any) -> Any:
    """``value`` if it is plain data (what a layer's behaviour may switch on), else a
    marker that it is not."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (tuple, list)) and all(
        v is None or isinstance(v, (bool, int, float, str)) for v in value
    ):
        return tuple(value)
    return ...


def _kind(layer: nn.Module) -> str:
    """What distinguishes ``layer`` from a layer of another kind: its modules' classes,
    tensor shapes and plain attributes (its index left out)."""
    parts = []
    for name, module in layer.named_modules():
        attributes = sorted(
            (key, _plain(value))
            for key, value in vars(module).items()
            if not key.startswith("_")
            and key not in _INDEX_NAMES
            and key != "training"
            and _plain(value) is not ...
        )
        tensors = [
            (key, tuple(tensor.shape))
            for key, tensor in [*module._parameters.items(), *module._buffers.items()]
            if tensor is not None
        ]
        parts.append([name, type(module).__qualname__, attributes, tensors])
    encoded = json.dumps(parts, default=repr).encode()
    return hashlib.sha256(encoded).hexdigest()[:16]


def layer_kinds(family: Family, config: PreTrainedConfig) -> list[str] | None:
    """The kind of each of ``config``'s decoder layers (equal strings: the same kind),
    built on the meta device; ``None`` when they cannot be built so.

    Example::

        layer_kinds(smollm3, config)   # ['9b..', '9b..', '9b..', '41..']: layer 3 is NoPE
    """
    return _kinds(_decoder_class(family), config)


def _kinds(original: type[nn.Module] | None, config: PreTrainedConfig) -> list[str] | None:
    if original is None:
        return None
    try:
        text = text_config_of(config)
        with zero3.outside_partitioning(), torch.device("meta"):
            return [_kind(original(text, index)) for index in range(text.num_hidden_layers)]
    except Exception:  # a layer that cannot be built on meta: the caller keeps every layer
        return None


#: the most layers a proof keeps when their kinds cannot be told apart (it then keeps all)
_MOST_LAYERS = 128


def _layers_kept(
    original: type[nn.Module] | None,
    config: PreTrainedConfig,
    values: dict[str, Any],
    layers: int,
    at_least: int,
) -> int:
    """How many layers the tiny model keeps: the shortest prefix holding every kind of
    layer the config selects, at least ``at_least`` (the family's tiny count), at most
    ``layers``."""
    full = _built(config, {**values, "num_hidden_layers": layers})
    kinds = _kinds(original, full)
    if kinds is None:
        return max(at_least, min(layers, _MOST_LAYERS))
    first: dict[str, int] = {}
    for index, kind in enumerate(kinds):
        first.setdefault(kind, index)
    return max(at_least, max(first.values()) + 1)


def config_kind(config: PreTrainedConfig) -> str:
    """A digest of ``config``'s fields that are neither sizes nor metadata, and the code
    paths it selects (:data:`CODE_PATHS`): its kind."""
    values = {
        key: value
        for key, value in config.to_dict().items()
        if key not in SIZE_FIELDS and key not in _METADATA and not key.startswith("_")
    }
    values["model_type"] = getattr(config, "model_type", "")
    # relations of the sizes that select what the layers compute (a non-square output
    # projection, multi-head or one-key-value-head attention): kept by the shrink
    values["shape"] = shape_of(config.to_dict())
    # private fields that select a code path: proven under one, not under another
    for name in CODE_PATHS:
        values[name] = str(getattr(config, name, None))
    encoded = json.dumps(values, sort_keys=True, default=repr).encode()
    return hashlib.sha256(encoded).hexdigest()[:16]


def proof_config(
    family: Family, config: PreTrainedConfig | None, *, keep_layers: bool = False
) -> tuple[PreTrainedConfig, str]:
    """The config a proof builds its tiny models of, and its kind: ``config`` shrunk
    (``"shrunk"``; with ``keep_layers``, every layer of it kept), else (``None``, or a
    config the shrink cannot take) ``family``'s tiny config (``"family"``).

    Example::

        proof_config(get_family("llama"), model.config)     # (LlamaConfig(...), "shrunk")
    """
    if config is not None:
        try:
            shrunk = shrunk_config(family, text_config_of(config), keep_layers=keep_layers)
            return shrunk, "shrunk"
        except Exception:
            pass
    return family.tiny_config(), "family"


def family_like(family: Family, config: PreTrainedConfig) -> PreTrainedConfig | None:
    """``family``'s tiny config, running the code paths ``config`` selects (its attention
    and experts implementations); ``None`` (the family's own) where it sets none.

    Example::

        family_like(family, model.config)     # the tiny config, attn_implementation="eager"
    """
    text = text_config_of(config)
    chosen = {name: getattr(text, name, None) for name in CODE_PATHS}
    if all(value is None for value in chosen.values()):
        return None
    tiny = family.tiny_config()
    for name, value in chosen.items():
        if value is not None:
            setattr(text_config_of(tiny), name, value)
    return tiny
