"""Tensor parallelism and sharded loading for models holding replacement layers.

transformers shards a model by a plan naming its modules (``config.base_model_tp_plan``:
``"layers.*.self_attn.q_proj": "colwise"``). A replacement layer has other modules (one
``qkv_proj`` for three projections), so a swapped model gets its plan translated from
the original's (:func:`translate_tp_plan`), derived from the substitution's converter:

- parts concatenated into one module (``q``/``k``/``v`` into ``qkv_proj``) that the
  original shards ``colwise`` are sharded ``colwise`` as one: transformers slices each
  checkpoint tensor for its rank when it reads it (shard-on-read), so each rank
  concatenates *its* heads of q, of k and of v — a packed column shard, as Megatron
  lays out its fused QKV, with no gather (the fused layer splits its local output by
  the same proportions: :func:`layerswap.backends._layer.local_sizes`);
- parts the original shards ``colwise_gather_output`` (its attention needs every head
  on every rank: OLMo 2's norm over all heads) are left whole on every rank, which is
  what the gather gave the original; the rowwise module after them keeps its style;
- a renamed module keeps its style; a module the replacement keeps keeps its entry;
- anything else (parts sharded in different styles, a style the converter cannot
  follow) is refused when transformers applies the plan, with the reason
  (:class:`~layerswap.errors.ParallelismError`), never sharded wrongly.

Loading converts per rank (:func:`local_part_sizes`, :func:`gather_parts`): under
tensor parallelism the concatenated parts arrive sliced (packed shard); under FSDP
loading (``DistributedConfig(fsdp_size=...)``) the slices of each part are gathered
from the ranks and the rank keeps its contiguous share of the concatenation, which is
what FSDP expects of a parameter. Saving gathers to whole tensors and writes the
original layout (:func:`unpack_gathered`).

Example::

    translate_tp_plan({"layers.*.self_attn.q_proj": "colwise", ...}, sub)
    # {"layers.*.self_attn.qkv_proj": "colwise", ...}
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from layerswap.errors import ParallelismError
from layerswap.shards import (
    Shard,
    gather_parts,
    local_part_sizes,
    parameter_shard,
    stretch,
    unpack_gathered,
)

if TYPE_CHECKING:
    from torch import nn

    from layerswap.substitution import Substitution

__all__ = [
    "REFUSED_STYLE",
    "Shard",
    "gather_parts",
    "local_part_sizes",
    "parameter_shard",
    "refuse_foreign_styles",
    "stretch",
    "tp_plan_of",
    "translate_tp_plan",
    "unpack_gathered",
]

#: the style given to a plan entry layerswap cannot translate: applying it raises
#: :class:`~layerswap.errors.ParallelismError` with the reason (registered with
#: transformers' parallel styles when such a plan is made)
REFUSED_STYLE = "layerswap_refused"

# styles whose per-rank share of a concatenation is the concatenation of each part's
# share, given that every part is sliced the same way when it is read
_PACKABLE = frozenset({"colwise"})
# styles that leave the module's output whole on every rank: a concatenation of such
# parts is kept whole (replicated), which is what the gather produced
_GATHERED = frozenset({"colwise_gather_output", "colwise_rep"})

#: the attribute on a module naming why its plan entry was refused
_REASON = "_layerswap_tp_refusal"

_LAYER_NUMBER = re.compile(r"\.\d+(\.|$)")


def _module_of(key: str) -> str:
    return key.rpartition(".")[0]


def _wildcard(name: str) -> str:
    return _LAYER_NUMBER.sub(r".*\1", name)


def translate_tp_plan(
    plan: Mapping[str, str], sub: Substitution, model: nn.Module, layer_names: Iterable[str]
) -> tuple[dict[str, str], dict[str, str]]:
    """The TP plan of ``model`` (holding ``sub``'s layers) and the entries refused, by name.

    ``plan`` is the original's (keys with ``*`` for the layer number, relative to the
    model that holds the plan); ``layer_names`` the paths of the layers ``sub`` made in
    ``model``. Returns ``(plan, refused)``: ``refused`` maps each key given
    :data:`REFUSED_STYLE` to the reason, and is empty when the whole plan translates.

    Example::

        plan, refused = translate_tp_plan(model.config.base_model_tp_plan, sub, model,
                                          ["model.layers.0", "model.layers.1"])
    """
    layer_prefixes = _layer_prefixes(layer_names)
    if not layer_prefixes:
        return dict(plan), {}
    names = {_wildcard(name) for name, _ in model.named_modules()}
    names |= {_wildcard(name) for name, _ in model.named_parameters()}
    rules = getattr(sub.converter, "rules", None)
    reason = _untranslatable(sub, rules)
    if reason is not None or rules is None:
        # layers the plan must not shard: refused whole, with the reason
        reason = f"{sub.name}: {reason}"
        whole = {prefix: reason for prefix in layer_prefixes if prefix in names}
        kept = {
            key: style for key, style in plan.items() if not key.startswith(tuple(layer_prefixes))
        }
        return {**kept, **dict.fromkeys(whole, REFUSED_STYLE)}, whole
    concatenated, renamed = _moves(rules)
    translated, groups = _followed(plan, layer_prefixes, concatenated, renamed)
    packed, refused = _packed(groups, concatenated, sub.name)
    translated.update(packed)
    # an entry naming nothing shards nothing (the original's plan has such entries: the
    # dense layers of a model whose tiny config has none); dropped, so the plan names
    # only what the model has
    translated = {key: style for key, style in translated.items() if key in names}
    refused = {key: reason for key, reason in refused.items() if key in translated}
    return translated, refused


def _untranslatable(sub: Substitution, rules: Any) -> str | None:
    """Why the original's plan cannot be followed into ``sub``'s layers (the reason it
    declares, or a converter without ``rules``), else ``None``."""
    reason = sub.tensor_parallel
    if reason is None and rules is None:
        reason = (
            f"its converter ({type(sub.converter).__name__}) declares no rules, so the "
            "original's plan cannot be followed to its modules"
        )
    return reason


def _moves(rules: Iterable[Any]) -> tuple[dict[str, tuple[str, int]], dict[str, str]]:
    """Where a converter's ``rules`` take each layer-relative source module: (source ->
    (the module it is concatenated into, number of parts), source -> its new name)."""
    concatenated: dict[str, tuple[str, int]] = {}
    renamed: dict[str, str] = {}
    for rule in rules:
        sources = [_module_of(key) for key in rule.sources]
        targets = [_module_of(key) for key in rule.targets]
        if len(targets) == 1 and len(set(sources)) > 1:
            for source in sources:
                concatenated[source] = (targets[0], len(set(sources)))
        elif len(sources) == len(targets):
            for source, target in zip(sources, targets, strict=True):
                if source != target:
                    renamed[source] = target
    return concatenated, renamed


def _followed(
    plan: Mapping[str, str],
    layer_prefixes: list[str],
    concatenated: Mapping[str, tuple[str, int]],
    renamed: Mapping[str, str],
) -> tuple[dict[str, str], dict[str, dict[str, str]]]:
    """``plan`` with its keys in the layers renamed as the converter renames them, and the
    entries of modules concatenated into one, grouped by that one module's key."""
    translated: dict[str, str] = {}
    groups: dict[str, dict[str, str]] = {}
    for key, style in plan.items():
        prefix = next((p for p in layer_prefixes if key.startswith(p + ".")), None)
        if prefix is None:
            translated[key] = style
            continue
        relative = key[len(prefix) + 1 :]
        if relative in concatenated:
            target, _ = concatenated[relative]
            groups.setdefault(f"{prefix}.{target}", {})[relative] = style
        elif relative in renamed:
            translated[f"{prefix}.{renamed[relative]}"] = style
        else:
            translated[key] = style
    return translated, groups


def _packed(
    groups: Mapping[str, Mapping[str, str]],
    concatenated: Mapping[str, tuple[str, int]],
    sub_name: str,
) -> tuple[dict[str, str], dict[str, str]]:
    """The style of each module the converter concatenates, from its parts' (``groups``:
    the module's key -> its parts' styles): packed where every part is sharded colwise,
    left out where every part is gathered, else refused. Returns (styles, refused:
    the reason for each key given :data:`REFUSED_STYLE`)."""
    styles_of: dict[str, str] = {}
    refused: dict[str, str] = {}
    for target_key, styles in groups.items():
        relative = target_key.rpartition(".")[2]
        parts = sorted(
            source for source, (target, _) in concatenated.items() if target.endswith(relative)
        )
        kinds = set(styles.values())
        if len(styles) == len(parts) and kinds <= _PACKABLE and len(kinds) == 1:
            styles_of[target_key] = next(iter(kinds))
        elif len(styles) == len(parts) and kinds <= _GATHERED:
            continue  # whole on every rank, as the original's gather left its output
        else:
            shown = ", ".join(f"{part}: {style}" for part, style in sorted(styles.items()))
            unplanned = sorted(set(parts) - set(styles))
            reason = (
                f"the original shards the parts of {target_key} as {shown}"
                + (f" and leaves {', '.join(unplanned)} whole" if unplanned else "")
                + f"; {sub_name} concatenates them into one module, which layerswap "
                "shards only when every part is sharded colwise (packed) or gathered"
            )
            styles_of[target_key] = REFUSED_STYLE
            refused[target_key] = reason
    return styles_of, refused


def _layer_prefixes(layer_names: Iterable[str]) -> list[str]:
    """The replaced layers' paths with ``*`` for the layer number, longest first."""
    return sorted({_wildcard(name) for name in layer_names if name}, key=len, reverse=True)


# --- loading and saving, per rank ----------------------------------------------------------


def tp_plan_of(
    model: nn.Module, sub: Substitution, layer_names: Iterable[str]
) -> dict[str, str] | None:
    """``model``'s own TP plan translated for ``sub``'s layers (at ``layer_names``), or ``None``.

    ``None`` when the model has no plan.

    Entries that do not translate get :data:`REFUSED_STYLE`, and the modules they name
    the reason, which transformers raises (as :class:`ParallelismError`) if it is asked
    to shard the model; a model that is never sharded is unaffected.
    """
    from layerswap import hf_internals

    plan = getattr(model, hf_internals.TP_PLAN_ATTRIBUTE, None)
    if not plan:
        return None
    translated, refused = translate_tp_plan(plan, sub, model, layer_names)
    if refused:
        hf_internals.register_tp_style(REFUSED_STYLE, _refuse)
        for name, module in model.named_modules():
            reason = refused.get(_wildcard(name))
            if reason is not None:
                setattr(module, _REASON, reason)
    return translated


def refuse_foreign_styles(model: nn.Module, sub: Substitution, layer_names: Iterable[str]) -> None:
    """:class:`ParallelismError` where ``model``'s TP plan, as transformers resolved it
    before loading (an override given in ``DistributedConfig(tp_plan=...)`` merged in),
    shards a module ``sub`` concatenates (``qkv_proj``) in a style other than the packed
    ``colwise`` :func:`translate_tp_plan` gives it: the parts' rows arrive per rank, and
    a gathered or replicated style would read them as whole, computing something else."""
    from layerswap import hf_internals

    plan = getattr(model, hf_internals.TP_PLAN_ATTRIBUTE, None) or {}
    rules = getattr(sub.converter, "rules", None)
    if not plan or rules is None:
        return
    concatenated, _ = _moves(rules)
    joined = {
        target: sorted(s for s, (t, _) in concatenated.items() if t == target)
        for target, _ in concatenated.values()
    }
    prefixes = _layer_prefixes(layer_names)
    for key, style in plan.items():
        prefix = next((p for p in prefixes if key.startswith(p + ".")), None)
        parts = None if prefix is None else joined.get(key[len(prefix) + 1 :])
        if parts and style not in _PACKABLE and style != REFUSED_STYLE:
            raise ParallelismError(
                f"tensor parallelism refused: the plan shards {key} {style!r}, but "
                f"{sub.name} concatenates {', '.join(parts)} into that module, which "
                "layerswap shards only 'colwise' (each rank its share of every part); "
                "give the original's plan for it, or load without the substitution"
            )


def _refuse(module: Any) -> None:
    reason = getattr(module, _REASON, None) or "layerswap cannot shard this module"
    raise ParallelismError(f"tensor parallelism refused: {reason}")
