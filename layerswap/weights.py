"""Weight layout converters between an original decoder layer and its replacement.

A converter works on **one decoder layer's** state dict with layer-relative keys
(``"self_attn.q_proj.weight"``) and runs in both directions. It is a list of
declarative rules:

- :class:`Rename` -- one tensor changes its name;
- :class:`Concat` -- several tensors become one, concatenated along a dimension,
  with the part sizes taken from the model config so the way back can split;
- :class:`Custom` -- a pair of functions, for anything else.

Keys that no rule mentions pass through unchanged, so a rule list only names what
differs. Concatenation and splitting are exact, so a round trip is bitwise.

The same rules also produce ``transformers``' own weight transforms
(:meth:`Converter.weight_transforms`), which ``from_pretrained`` applies when it
loads an original-layout checkpoint into replacement layers, and which
``save_pretrained`` reverses to write the original layout again.

Example::

    from layerswap.weights import Converter, qkv_concat, gate_up_concat

    converter = Converter((qkv_concat("self_attn.qkv_proj"), gate_up_concat("mlp.gate_up_proj")))
    fused = converter.to_replacement(layer.state_dict(), config)
    back = converter.to_original(fused, config)   # bitwise equal to layer.state_dict()
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

from layerswap import hf_internals
from layerswap.errors import ConversionError

if TYPE_CHECKING:
    from transformers import PreTrainedConfig

__all__ = [
    "Concat",
    "row_concats",
    "Converter",
    "Custom",
    "LayoutConverter",
    "Rename",
    "Rule",
    "describe",
    "gate_up_concat",
    "gate_up_sizes",
    "head_dim",
    "is_extra_state",
    "layout_problems",
    "qkv_concat",
    "qkv_sizes",
]

Tensors = Mapping[str, torch.Tensor]
SizesFn = Callable[["PreTrainedConfig"], Sequence[int]]
TensorFn = Callable[[list[torch.Tensor], "PreTrainedConfig"], Sequence[torch.Tensor]]


def is_extra_state(key: str) -> bool:
    """Whether ``key`` names a module's ``get_extra_state`` entry rather than a tensor."""
    return key.endswith("_extra_state")


# --- sizes read from a config ---------------------------------------------------------


def layout_problems(converted: Mapping[str, Any], expected: Mapping[str, Any]) -> list[str]:
    """How the tensors a converter ``converted`` differ from the state ``expected`` of the
    module they are for (names and shapes; extra state left out): empty where they fit.

    Example::

        layout_problems({"w": torch.empty(2)}, {"w": torch.empty(3)})
        # ["'w' converts to (2,), replacement has (3,)"]
    """
    want = {key: tuple(value.shape) for key, value in expected.items() if not is_extra_state(key)}
    got = {key: tuple(value.shape) for key, value in converted.items()}
    problems = [
        f"{key!r} {got[key]} has no place in the replacement"
        for key in sorted(got.keys() - want.keys())
    ]
    problems += [
        f"the replacement's {key!r} {want[key]} gets no tensor"
        for key in sorted(want.keys() - got.keys())
    ]
    problems += [
        f"{key!r} converts to {got[key]}, replacement has {want[key]}"
        for key in sorted(want.keys() & got.keys())
        if want[key] != got[key]
    ]
    return problems


def head_dim(config: PreTrainedConfig) -> int:
    """The attention head size: ``config.head_dim`` when set, else hidden size / heads."""
    explicit = getattr(config, "head_dim", None)
    if explicit:
        return int(explicit)
    return int(config.hidden_size // config.num_attention_heads)


def qkv_sizes(config: PreTrainedConfig) -> tuple[int, int, int]:
    """Output sizes of the q, k and v projections (grouped-query attention aware)."""
    dim = head_dim(config)
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return (config.num_attention_heads * dim, kv_heads * dim, kv_heads * dim)


def gate_up_sizes(config: PreTrainedConfig) -> tuple[int, int]:
    """Output sizes of the gate and up projections of a gated MLP."""
    return (config.intermediate_size, config.intermediate_size)


# --- rules ------------------------------------------------------------------------------


class Rule(Protocol):
    """One step of a layout conversion: ``sources`` (original) <-> ``targets`` (replacement).

    ``optional`` rules are skipped when none of their inputs is present (a bias that
    the config turns off); a rule whose inputs are only partly present is an error.
    """

    @property
    def sources(self) -> tuple[str, ...]: ...

    @property
    def targets(self) -> tuple[str, ...]: ...

    @property
    def optional(self) -> bool: ...

    def to_replacement(
        self, tensors: list[torch.Tensor], config: PreTrainedConfig
    ) -> Sequence[torch.Tensor]: ...

    def to_original(
        self, tensors: list[torch.Tensor], config: PreTrainedConfig
    ) -> Sequence[torch.Tensor]: ...


def describe(rule: Rule) -> str:
    """A one-line human description of ``rule``, used in error messages."""
    return f"{type(rule).__name__}({', '.join(rule.sources)} -> {', '.join(rule.targets)})"


@dataclass(frozen=True)
class Rename:
    """``source`` in the original layout is ``target`` in the replacement (same tensor).

    Example::

        Rename("input_layernorm.weight", "self_attention.layernorm_qkv.layer_norm_weight")
    """

    source: str
    target: str
    optional: bool = False

    @property
    def sources(self) -> tuple[str, ...]:
        return (self.source,)

    @property
    def targets(self) -> tuple[str, ...]:
        return (self.target,)

    def to_replacement(
        self, tensors: list[torch.Tensor], config: PreTrainedConfig
    ) -> Sequence[torch.Tensor]:
        return tensors

    def to_original(
        self, tensors: list[torch.Tensor], config: PreTrainedConfig
    ) -> Sequence[torch.Tensor]:
        return tensors


@dataclass(frozen=True)
class Concat:
    """Several original tensors are one replacement tensor, concatenated along ``dim``.

    ``sizes(config)`` gives each part's extent along ``dim``; it is checked when
    concatenating and used to split on the way back. Both directions return new
    tensors that share no storage with their inputs.

    Example::

        Concat(("mlp.gate_proj.weight", "mlp.up_proj.weight"), "mlp.gate_up_proj.weight",
               sizes=gate_up_sizes)
    """

    sources: tuple[str, ...]
    target: str
    sizes: SizesFn
    dim: int = 0
    optional: bool = False

    @property
    def targets(self) -> tuple[str, ...]:
        return (self.target,)

    def part_sizes(self, config: PreTrainedConfig) -> list[int]:
        """Each part's extent along ``dim`` for ``config``; checked against the parts' count."""
        return self._expected(config)

    def _expected(self, config: PreTrainedConfig) -> list[int]:
        sizes = [int(size) for size in self.sizes(config)]
        if len(sizes) != len(self.sources):
            raise ConversionError(
                f"{describe(self)}: the config gives {len(sizes)} sizes "
                f"for {len(self.sources)} parts"
            )
        return sizes

    def to_replacement(
        self, tensors: list[torch.Tensor], config: PreTrainedConfig
    ) -> Sequence[torch.Tensor]:
        expected = self._expected(config)
        first = tensors[0]
        for name, tensor, size in zip(self.sources, tensors, expected, strict=True):
            if tensor.dim() <= self.dim or tensor.shape[self.dim] != size:
                raise ConversionError(
                    f"tensor {name!r} has shape {tuple(tensor.shape)}, but the config says its "
                    f"dim {self.dim} is {size} (concatenating into {self.target!r})"
                )
            rest = [s for i, s in enumerate(tensor.shape) if i != self.dim]
            if rest != [s for i, s in enumerate(first.shape) if i != self.dim]:
                raise ConversionError(
                    f"tensor {name!r} has shape {tuple(tensor.shape)}, which does not "
                    f"concatenate with {self.sources[0]!r} {tuple(first.shape)} along dim {self.dim}"
                )
            if tensor.dtype != first.dtype or tensor.device != first.device:
                raise ConversionError(
                    f"tensor {name!r} is {tensor.dtype} on {tensor.device}, but "
                    f"{self.sources[0]!r} is {first.dtype} on {first.device}"
                )
        return [torch.cat(tensors, dim=self.dim)]

    def to_original(
        self, tensors: list[torch.Tensor], config: PreTrainedConfig
    ) -> Sequence[torch.Tensor]:
        expected = self._expected(config)
        (fused,) = tensors
        if fused.dim() <= self.dim or fused.shape[self.dim] != sum(expected):
            raise ConversionError(
                f"tensor {self.target!r} has shape {tuple(fused.shape)}, but the config says its "
                f"dim {self.dim} is {sum(expected)} ({' + '.join(map(str, expected))})"
            )
        # clone: the parts must neither keep the fused storage alive nor alias each other
        # (safetensors refuses to save tensors that share memory)
        return [part.clone() for part in torch.split(fused, expected, dim=self.dim)]


def row_concats(converter: Any) -> list[Concat]:
    """The rules of ``converter`` that pack tensors along rows (dim 0: q/k/v into
    ``qkv_proj``, gate/up into ``gate_up_proj``): what a sharded or quantized fused weight
    holds part by part. Example::

        [rule.target for rule in row_concats(sub.converter)]   # ['self_attn.qkv_proj.weight', ...]
    """
    return [
        rule
        for rule in getattr(converter, "rules", ())
        if isinstance(rule, Concat) and rule.dim == 0
    ]


@dataclass(frozen=True)
class Custom:
    """Any other layout change: a pair of functions, each mapping a list of tensors to a list.

    ``forward(tensors, config)`` receives the ``sources`` in order and returns the
    ``targets`` in order; ``backward`` does the opposite. They should be exact
    inverses; :func:`layerswap.verify` checks what the swapped model computes.

    Example::

        transpose = Custom(("mlp.fc.weight",), ("mlp.fc_t.weight",),
                           forward=lambda ts, cfg: [ts[0].t().contiguous()],
                           backward=lambda ts, cfg: [ts[0].t().contiguous()])
    """

    sources: tuple[str, ...]
    targets: tuple[str, ...]
    forward: TensorFn
    backward: TensorFn
    optional: bool = False

    def to_replacement(
        self, tensors: list[torch.Tensor], config: PreTrainedConfig
    ) -> Sequence[torch.Tensor]:
        return self.forward(tensors, config)

    def to_original(
        self, tensors: list[torch.Tensor], config: PreTrainedConfig
    ) -> Sequence[torch.Tensor]:
        return self.backward(tensors, config)


def qkv_concat(target: str, *, bias: bool = False, prefix: str = "self_attn") -> Concat:
    """The q/k/v projections of ``prefix`` concatenated into ``target`` (``.weight``/``.bias``).

    Example::

        qkv_concat("self_attn.qkv_proj")             # weights
        qkv_concat("self_attn.qkv_proj", bias=True)  # biases, skipped when absent
    """
    leaf = "bias" if bias else "weight"
    parts = tuple(f"{prefix}.{name}_proj.{leaf}" for name in ("q", "k", "v"))
    return Concat(parts, f"{target}.{leaf}", sizes=qkv_sizes, optional=bias)


def gate_up_concat(target: str, *, bias: bool = False, prefix: str = "mlp") -> Concat:
    """The gate and up projections of ``prefix`` concatenated into ``target``, gate first."""
    leaf = "bias" if bias else "weight"
    parts = (f"{prefix}.gate_proj.{leaf}", f"{prefix}.up_proj.{leaf}")
    return Concat(parts, f"{target}.{leaf}", sizes=gate_up_sizes, optional=bias)


# --- converters -------------------------------------------------------------------------


@runtime_checkable
class LayoutConverter(Protocol):
    """What a :class:`~layerswap.Substitution` needs from its converter."""

    def to_replacement(self, state: Tensors, config: PreTrainedConfig) -> dict[str, torch.Tensor]:
        """Original-layout layer state -> replacement layout."""
        ...

    def to_original(self, state: Tensors, config: PreTrainedConfig) -> dict[str, torch.Tensor]:
        """Replacement-layout layer state -> original layout."""
        ...

    def weight_transforms(
        self, config: PreTrainedConfig, *, scope_prefix: str, base_model_prefix: str
    ) -> list[Any]:
        """``transformers`` weight transforms for one layer (original -> replacement)."""
        ...


@dataclass(frozen=True)
class Converter:
    """An ordered list of rules; keys no rule mentions pass through when ``passthrough``.

    Tensors are returned as they come (no copy) wherever a rule does not compute a
    new one, so ``Rename`` and passthrough keep storage (and ``Parameter`` objects).

    Example::

        converter = Converter((qkv_concat("self_attn.qkv_proj"),))
        converter.to_replacement({"self_attn.q_proj.weight": q, ...}, config)
    """

    rules: tuple[Rule, ...] = ()
    passthrough: bool = True

    def derive(self, *rules: Rule) -> Converter:
        """A converter with ``rules`` appended (the original is unchanged)."""
        return Converter((*self.rules, *rules), passthrough=self.passthrough)

    def to_replacement(self, state: Tensors, config: PreTrainedConfig) -> dict[str, torch.Tensor]:
        """Convert one layer's original-layout tensors; raises :class:`ConversionError`."""
        return self._apply(state, config, forward=True)

    def to_original(self, state: Tensors, config: PreTrainedConfig) -> dict[str, torch.Tensor]:
        """Convert one layer's replacement-layout tensors back; raises :class:`ConversionError`."""
        return self._apply(state, config, forward=False)

    def _apply(
        self, state: Tensors, config: PreTrainedConfig, *, forward: bool
    ) -> dict[str, torch.Tensor]:
        config = hf_internals.text_config_of(config)  # a wrapper's layers read its text config
        remaining = {key: value for key, value in state.items() if not is_extra_state(key)}
        produced: dict[str, torch.Tensor] = {}
        for rule in self.rules:
            inputs = rule.sources if forward else rule.targets
            outputs = rule.targets if forward else rule.sources
            present = [key in remaining for key in inputs]
            if not any(present):
                if rule.optional:
                    continue
                raise ConversionError(
                    f"tensor {inputs[0]!r} is missing (needed by rule {describe(rule)}); "
                    f"the layer has {sorted(state)}"
                )
            if not all(present):
                missing = [key for key, ok in zip(inputs, present, strict=True) if not ok]
                raise ConversionError(
                    f"tensor {missing[0]!r} is missing, but {describe(rule)} needs all of "
                    f"{list(inputs)}"
                )
            tensors = [remaining.pop(key) for key in inputs]
            try:
                results = list(
                    rule.to_replacement(tensors, config)
                    if forward
                    else rule.to_original(tensors, config)
                )
            except ConversionError:
                raise
            except Exception as exc:
                raise ConversionError(
                    f"converting tensor {inputs[0]!r} ({describe(rule)}) failed: {exc}"
                ) from exc
            if len(results) != len(outputs):
                raise ConversionError(
                    f"rule {describe(rule)} returned {len(results)} tensors for "
                    f"{len(outputs)} names {list(outputs)}"
                )
            produced.update(zip(outputs, results, strict=True))
        if not self.passthrough and remaining:
            raise ConversionError(f"no rule converts tensor {sorted(remaining)[0]!r}")
        clash = sorted(set(remaining) & set(produced))
        if clash:
            raise ConversionError(
                f"tensor {clash[0]!r} is both produced by a rule and passed through unchanged"
            )
        return {**remaining, **produced}

    def weight_transforms(
        self, config: PreTrainedConfig, *, scope_prefix: str, base_model_prefix: str
    ) -> list[Any]:
        """``transformers`` ``WeightRenaming``/``WeightConverter`` objects for one layer.

        ``scope_prefix`` is the layer's module path without the base model prefix
        (``"layers.3"``), so the transforms touch that layer's keys and nothing else.
        ``from_pretrained`` applies them when loading; ``save_pretrained`` reverses them.
        """
        config = hf_internals.text_config_of(config)
        transforms: list[Any] = []
        for rule in self.rules:
            # anchored and escaped: a rule names one exact layer-relative key
            sources = [f"^{re.escape(key)}" for key in rule.sources]
            targets = [f"^{key}" for key in rule.targets]
            transform: Any
            if isinstance(rule, Rename):
                transform = hf_internals.weight_renaming(sources, targets)
            else:
                transform = hf_internals.weight_converter(sources, targets, _rule_op(rule, config))
            transform.scope_prefix = scope_prefix
            transform.base_model_prefix = base_model_prefix
            transforms.append(transform)
        return transforms


@functools.cache
def _rule_op_class() -> type:
    """A ``transformers`` ``ConversionOps`` running a rule (made on first use: lazy import)."""
    conversion_ops: Any = hf_internals.conversion_ops_class()

    class RuleOp(conversion_ops):  # type: ignore[misc]
        # a Custom rule may map several tensors to several
        supports_many_to_many = True

        def __init__(self, rule: Rule, config: PreTrainedConfig, forward: bool) -> None:
            self.rule = rule
            self.config = config
            self.forward = forward

        def __repr__(self) -> str:
            direction = "to replacement" if self.forward else "to original"
            return f"layerswap {describe(self.rule)} {direction}"

        def __deepcopy__(self, memo: dict[int, Any]) -> Any:
            # stateless; transformers deep-copies a converter per layer, the config need not be
            return self

        def __reduce__(self) -> tuple[Any, ...]:
            # the class is made inside a function: pickle through the module-level factory
            return (_rule_op, (self.rule, self.config, self.forward))

        @torch.no_grad()
        def convert(
            self,
            input_dict: dict[str, Any],
            source_patterns: list[str],
            target_patterns: list[str],
            **kwargs: Any,
        ) -> dict[str, torch.Tensor]:
            tensors = []
            for pattern in source_patterns:
                if pattern not in input_dict:
                    raise ConversionError(
                        f"{describe(self.rule)}: no checkpoint tensor matches {pattern!r}"
                    )
                value = input_dict.pop(pattern)
                tensors.append(value[0] if isinstance(value, list) else value)
            shard = _sharded_target(self.rule, self.forward, kwargs)
            results: Sequence[torch.Tensor]
            if shard is not None:
                results = _convert_sharded(self.rule, tensors, self.config, self.forward, shard)
            elif self.forward:
                results = self.rule.to_replacement(tensors, self.config)
            else:
                results = self.rule.to_original(tensors, self.config)
            return dict(zip(target_patterns, results, strict=True))

        @property
        def reverse_op(self) -> Any:
            return RuleOp(self.rule, self.config, not self.forward)

    return RuleOp


def _rule_op(rule: Rule, config: PreTrainedConfig, forward: bool = True) -> Any:
    """A ``transformers`` ``ConversionOps`` running ``rule`` (to the replacement if ``forward``)."""
    return _rule_op_class()(rule, config, forward)


def _sharded_target(rule: Rule, forward: bool, kwargs: dict[str, Any]) -> Any:
    """How the replacement parameter a rule fills is split across ranks, or ``None``.

    transformers passes the model and the full name of the first tensor made; the
    parameter is a DTensor when ``from_pretrained`` shards the model (tensor parallel,
    FSDP loading).
    """
    from layerswap import shards

    model, name = kwargs.get("model"), kwargs.get("full_layer_name")
    if model is None or not isinstance(name, str):
        return None
    made = rule.targets[0] if forward else rule.sources[0]
    replacement = rule.targets[0]
    if not name.endswith(made):
        return None
    try:
        param = model.get_parameter(name[: len(name) - len(made)] + replacement)
    except AttributeError:
        return None
    if not isinstance(rule, Concat):
        if getattr(param, "placements", None) is not None and any(
            p.is_shard() for p in param.placements
        ):
            raise ConversionError(
                f"{describe(rule)}: layerswap converts a sharded parameter only for "
                "concatenations and renames; load this model whole"
            )
        return None
    return shards.parameter_shard(param, rule.dim)


def _convert_sharded(
    rule: Rule, tensors: list[torch.Tensor], config: PreTrainedConfig, forward: bool, shard: Any
) -> list[torch.Tensor]:
    """A concatenation into (or split from) a parameter split across ranks.

    Loading: transformers read each part sliced for this rank. Tensor parallel: the
    rank's share of every part, concatenated (a packed shard). FSDP: the parts are
    gathered from the ranks and the rank keeps its stretch of the concatenation.
    Saving: the parameter was gathered whole from ``state_dict()``, which gives a packed
    one in the fused layout already (:mod:`layerswap.packed_state`).
    """
    from layerswap import hf_internals, shards

    assert isinstance(rule, Concat)
    sizes = rule.part_sizes(config)
    if not forward:
        return list(rule.to_original(tensors, config))
    if not hf_internals.loads_sharded_on_read():
        raise ConversionError(
            f"{describe(rule)}: this transformers loads a sharded (tensor parallel or FSDP) "
            "model without slicing each checkpoint tensor as it reads it; layerswap converts "
            "sharded loads from transformers 5.24 on. Load the model whole, or upgrade"
        )
    local = shards.local_part_sizes(sizes, shard)
    for name, tensor, size in zip(rule.sources, tensors, local, strict=True):
        if tensor.dim() <= rule.dim or tensor.shape[rule.dim] != size:
            raise ConversionError(
                f"tensor {name!r} arrived with shape {tuple(tensor.shape)} on rank {shard.rank} "
                f"of {shard.ranks}, but its share of dim {rule.dim} is {size} "
                f"(concatenating into {rule.target!r})"
            )
    if shard.packed:
        return [torch.cat(tensors, dim=rule.dim)]
    whole = torch.cat(shards.gather_parts(tensors, sizes, rule.dim, shard), dim=rule.dim)
    start, length = shards.stretch(whole.shape[rule.dim], shard)
    return [whole.narrow(rule.dim, start, length).clone()]
