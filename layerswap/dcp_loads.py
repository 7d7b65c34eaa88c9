"""``torch.distributed.checkpoint`` loads of an original-layout checkpoint into a swapped
model: each joined tensor read part by part from the checkpoint, or refused.

``dcp.load(state, checkpoint_id=...)`` reads into the tensors of ``state`` (a swapped
model's ``state_dict()``) by their names, before any ``load_state_dict`` runs, where a
swapped layer converts q/k/v and gate/up. A checkpoint written from the original model
has no ``qkv_proj`` or ``gate_up_proj``: DCP raised about the missing key, or, with
``DefaultLoadPlanner(allow_partial_load=True)``, skipped every joined tensor without a
word, and the swapped model kept its own while the rest loaded.

Around DCP's load plan (``create_default_local_load_plan``, which every
``DefaultLoadPlanner`` builds its reads with), a key of the state that the checkpoint
lacks is read in the original layout instead where it names a joined tensor of a swapped
layer alive in this process (a rule target of its converter, under the same prefix, or
followed by an optimizer's ``.exp_avg``) and the checkpoint's metadata lists its original
parts there: each part is read straight into its rows of the joined tensor (a view:
nothing is copied twice, and the state's tensor holds the joined values when
``load_state_dict`` is called, as torch's documentation asks). A number for the whole
tensor (an optimizer's ``step``) is read from the first part, and so is an entry of
its optimizer state that is no tensor (a flattened optimizer state's
``param_groups.<name>.lr``, from which torch rebuilds the group): read whole, into the
joined tensor's entry. The lists of parameter names in a nested optimizer state's
``param_groups`` are read with the joined tensor's name in place of its parts' (torch
matches the checkpoint's groups to the optimizer's by these names); a checkpoint whose
optimizer puts the parts of one joined tensor in groups of different settings is refused
first, its groups read alone: the joined tensor has one group. A part the checkpoint lacks
is what any missing key is: DCP raises naming it, or, with ``allow_partial_load``, its
rows keep the tensor's own values. A joined tensor that cannot be read that way is
refused with a :class:`~layerswap.errors.ConversionError` before any tensor is read, the
model and the state unchanged: a sharded one (a ``DTensor``: a rank's rows of a part are
no view of its shard), one a rule computes (``Custom``), parts of another shape than its
rows. DCP reports a planning error inside its own ``CheckpointException``; around its load
(``_load_state_dict``) the refusal is raised as itself, on every rank.

The other way round, a key of the state that the checkpoint lacks, an original part of a
live swapped layer's joined tensor which the checkpoint holds (a swapped model's checkpoint
loaded into an original model), is refused the same way: DCP would skip it.

A state without such keys, a checkpoint in the swapped layout, a checkpoint lacking a
whole layer or the ``lm_head`` and a model without swapped layers load as they did. A
layer whose converter has no rules (converted as a whole) is not recognised.

Example::

    layerswap.swap(model, "llama.decoder.fused")
    state = model.state_dict()
    dcp.load(state, checkpoint_id="original-dcp")   # q/k/v read into qkv_proj
    model.load_state_dict(state)
"""

from __future__ import annotations

import contextvars
import dataclasses
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from layerswap.errors import ConversionError
from layerswap.patching.wrap import bound_arguments
from layerswap.state import live_layout_hooks
from layerswap.weights import Concat, Converter, Rename, describe, is_extra_state

__all__ = ["ADVICE", "DCP_LOAD_TARGET", "DCP_PLAN_TARGET"]

#: where every ``DefaultLoadPlanner`` matches the state's names against the checkpoint's
#: metadata and makes its reads (called with ``state_dict``, ``metadata``, ``strict``)
DCP_PLAN_TARGET = "torch.distributed.checkpoint.default_planner:create_default_local_load_plan"
#: what ``dcp.load`` plans and reads with: a planning error comes out of it inside a
#: ``CheckpointException``
DCP_LOAD_TARGET = "torch.distributed.checkpoint.state_dict_loader:_load_state_dict"

_TO_DO = (
    "Load it into the original model and swap that (layerswap.swap), or into a model "
    "built inside layerswap.use() with from_pretrained from a save_pretrained checkpoint"
)


@dataclass(frozen=True)
class _Joined:
    """One rule of a live swapped layer that makes a tensor the original layout lacks."""

    rule: Any
    sizes: tuple[int, ...] | None
    """Each part's extent along the rule's dim (a ``Concat``), for that layer's config."""
    substitution: str


def _joined_by_target() -> dict[str, list[_Joined]]:
    """Layer-relative key -> the rules of live swapped layers that make it."""
    from layerswap import hf_internals

    found: dict[str, list[_Joined]] = {}
    for hook in live_layout_hooks():
        converter = hook.substitution.converter
        if not isinstance(converter, Converter):
            continue  # a layer converted as a whole: its keys are not known here
        config = hf_internals.text_config_of(hook.config)
        for rule in converter.rules:
            if tuple(rule.sources) == tuple(rule.targets):
                continue
            sizes = tuple(rule.part_sizes(config)) if isinstance(rule, Concat) else None
            joined = _Joined(rule, sizes, hook.substitution.name)
            for target in rule.targets:
                if joined not in found.setdefault(target, []):
                    found[target].append(joined)
    return found


def _plain(value: Any) -> bool:
    return type(value) in (torch.Tensor, nn.Parameter)


def _at(key: str, target: str) -> tuple[str, str] | None:
    """``(prefix, suffix)`` where ``key`` is ``prefix + target + suffix`` along dotted
    names (the suffix an optimizer's: ``.exp_avg``), or None."""
    if key == target or key.startswith(target + "."):
        return "", key[len(target) :]
    at = key.rfind("." + target)
    end = at + 1 + len(target)
    if at < 0 or (end < len(key) and key[end] != "."):
        return None
    return key[: at + 1], key[end:]


def _part_views(
    key: str, value: Any, place: tuple[str, str], joined: _Joined, saved: Mapping[str, Any]
) -> dict[str, torch.Tensor] | str:
    """Each original part's key -> its rows of ``value`` (the joined tensor ``key``), or
    why the checkpoint's parts (``saved``: its metadata) do not fill them."""
    rule = joined.rule
    sources = [place[0] + source + place[1] for source in rule.sources]
    if value.dim() == 0 and place[1]:
        # one number for the joined tensor (an optimizer's step count): the first part's
        sources = [next(source for source in sources if source in saved)]
        parts: list[torch.Tensor] = [value]
    elif isinstance(rule, Rename):
        parts = [value]
    elif joined.sizes is not None and value.dim() > rule.dim:
        if value.shape[rule.dim] != sum(joined.sizes):
            return (
                f"{key!r} is {tuple(value.shape)}, and {joined.substitution} joins "
                f"{' + '.join(map(str, joined.sizes))} rows into it"
            )
        parts = list(torch.split(value, list(joined.sizes), dim=rule.dim))
    else:
        return f"{key!r} is {tuple(value.shape)}"
    views: dict[str, torch.Tensor] = {}
    for source, part in zip(sources, parts, strict=True):
        size = getattr(saved.get(source), "size", None)
        if source in saved and (size is None or tuple(size) != tuple(part.shape)):
            shown = "not a tensor" if size is None else f"{tuple(size)}"
            return (
                f"the checkpoint's {source!r} is {shown}, where {key!r} "
                f"{tuple(value.shape)} takes {tuple(part.shape)}"
            )
        views[source] = part
    return views


def _refusal(key: str, value: Any, joined: _Joined, held: list[str]) -> str:
    """Why ``key``'s original parts (``held`` by the checkpoint) cannot be read into it."""
    start = (
        f"dcp.load: the checkpoint holds {held[0]!r}, in the original layout, which "
        f"{joined.substitution} joins into {key!r}"
    )
    if not isinstance(joined.rule, (Concat, Rename)):
        return (
            f"{start} with {describe(joined.rule)}, a computation: DCP reads each tensor "
            f"into place and cannot run it. Nothing was read. {_TO_DO}"
        )
    placements = getattr(value, "placements", None)
    shown = f"a DTensor {tuple(placements)}" if placements is not None else type(value).__name__
    return (
        f"{start}; here that tensor is {shown}, whose rows DCP cannot read part by part. "
        "Nothing was read. Load the checkpoint into an unsharded swapped model "
        "(state = model.state_dict(); dcp.load(state, ...); model.load_state_dict(state)) "
        "and dcp.save that, then load the swapped-layout checkpoint here; or "
        f"{_TO_DO[0].lower()}{_TO_DO[1:]}"
    )


def _parts_to_read(
    state: Mapping[str, Any], saved: Mapping[str, Any]
) -> dict[str, dict[str, torch.Tensor]]:
    """Joined key of ``state`` the checkpoint (``saved``: its metadata) lacks -> its
    original parts' keys and views (see the module docstring)."""
    skipped = [key for key in state if key not in saved and not is_extra_state(key)]
    by_target = _joined_by_target() if skipped else {}
    found = {}
    for key in skipped:
        views = _parts_of(key, state[key], saved, by_target)
        if views is not None:
            found[key] = views
        else:
            _refuse_swapped_layout(key, saved, by_target)
    return found


def _refuse_swapped_layout(
    key: str, saved: Mapping[str, Any], by_target: Mapping[str, list[_Joined]]
) -> None:
    """:class:`ConversionError` where ``key``, an original part the checkpoint lacks, is
    there joined in a live swapped layer's layout: a swapped model's checkpoint loaded into
    an original model, whose parts DCP would skip (``allow_partial_load``) or miss."""
    for target, candidates in by_target.items():
        for joined in candidates:
            for source in joined.rule.sources:
                place = _at(key, source)
                held = None if place is None else place[0] + target + place[1]
                if held is not None and held in saved:
                    raise ConversionError(
                        f"dcp.load: this state names {key!r}, in the original layout, and the "
                        f"checkpoint holds {held!r}, {joined.substitution}'s layout: DCP would "
                        "miss the part (or skip it, with allow_partial_load). Nothing was read. "
                        f"Load the checkpoint into a model swapped by {joined.substitution} "
                        "(layerswap.swap; its undo gives back original layers holding the "
                        "weights), or write it from that model with save_pretrained"
                    )


def _parts_of(
    key: str, value: Any, saved: Mapping[str, Any], by_target: Mapping[str, list[_Joined]]
) -> dict[str, torch.Tensor] | None:
    """``key``'s original parts' keys and views, where the checkpoint holds any; raises
    :class:`ConversionError` where it holds some that cannot be read into ``value``."""
    if not isinstance(value, torch.Tensor):
        return _entry_of(key, saved, by_target)
    misfit = None
    for target, candidates in by_target.items():
        place = _at(key, target)
        if place is None:
            continue
        for joined in candidates:
            sources = [place[0] + source + place[1] for source in joined.rule.sources]
            held = [source for source in sources if source in saved]
            if not held:
                continue
            if not isinstance(joined.rule, (Concat, Rename)) or not _plain(value):
                raise ConversionError(_refusal(key, value, joined, held))
            views = _part_views(key, value, place, joined, saved)
            if isinstance(views, dict):
                return views
            misfit = misfit or (held[0], views)
    if misfit is not None:
        raise ConversionError(
            f"dcp.load: the checkpoint holds {misfit[0]!r}, an original-layout part of "
            f"{key!r}, but its parts do not make that tensor: {misfit[1]}. Nothing was "
            "read; is the checkpoint of another configuration?"
        )
    return None


def _entry_of(
    key: str, saved: Mapping[str, Any], by_target: Mapping[str, list[_Joined]]
) -> dict[str, Any] | None:
    """For a value of ``key`` that is no tensor, an entry of a joined tensor's optimizer
    state (a flattened optimizer state's ``param_groups.<name>.lr``, a ``step`` kept as a
    number): the first original part's entry the checkpoint holds, which is read in its
    place (:func:`_parts_planned`); or None."""
    for target, candidates in by_target.items():
        place = _at(key, target)
        if place is None or not place[1]:
            continue  # the joined tensor itself, not an entry of its optimizer state
        for joined in candidates:
            for source in joined.rule.sources:
                name = place[0] + source + place[1]
                if name in saved and getattr(saved[name], "size", None) is None:
                    return {name: None}
    return None


def _parts_planned(wrapped: Callable[..., Any], instance: Any, args: Any, kwargs: Any) -> Any:
    """Around DCP's ``create_default_local_load_plan`` (see the module docstring): the
    state's joined tensors the checkpoint lacks planned as their original parts."""
    arguments = bound_arguments(wrapped, args, kwargs)
    if arguments is None:
        return wrapped(*args, **kwargs)
    state, metadata = arguments.get("state_dict"), arguments.get("metadata")
    saved = getattr(metadata, "state_dict_metadata", None)
    if not isinstance(state, MutableMapping) or not isinstance(saved, Mapping):
        return wrapped(*args, **kwargs)
    parts = _parts_to_read(state, saved)
    if not parts:
        return wrapped(*args, **kwargs)
    planned = {key: value for key, value in state.items() if key not in parts}
    # an entry that is no tensor is read whole, by the planner's load_bytes, into the
    # destination its read names: the joined tensor's entry, where the part's was read
    entries = {
        source: key
        for key, views in parts.items()
        if not isinstance(state[key], torch.Tensor)
        for source in views
    }
    for key, views in parts.items():
        planned.update(
            views if isinstance(state[key], torch.Tensor) else dict.fromkeys(views, state[key])
        )
    arguments["state_dict"] = planned
    plan = wrapped(**arguments)
    if entries:
        plan = dataclasses.replace(
            plan,
            items=[
                dataclasses.replace(
                    item,
                    dest_index=dataclasses.replace(
                        item.dest_index, fqn=entries[item.dest_index.fqn]
                    ),
                )
                if item.dest_index.fqn in entries
                else item
                for item in plan.items
            ],
        )
    # the planner looks each read's destination up in its own state, by the part's name
    for key, views in parts.items():
        if isinstance(state[key], torch.Tensor):
            state.update(views)
    return plan


def _group_lists(node: Any) -> Iterator[list[Any]]:
    """Every ``params`` list of an optimizer state's ``param_groups`` (names of parameters)
    in a nested state, in place."""
    if not isinstance(node, Mapping):
        return
    groups = node.get("param_groups")
    if isinstance(groups, list):
        for group in groups:
            if isinstance(group, MutableMapping) and isinstance(group.get("params"), list):
                yield group["params"]
    for value in node.values():
        if isinstance(value, Mapping):
            yield from _group_lists(value)


def _joined_name(name: str, known: set[str], by_target: Mapping[str, list[_Joined]]) -> str:
    """``name``, or the joined tensor's name where ``name`` is an original part of a live
    swapped layer's joined tensor that ``known`` (the state's own names) holds."""
    for target, candidates in by_target.items():
        for joined in candidates:
            for source in joined.rule.sources:
                place = _at(name, source)
                if place is not None and not place[1] and place[0] + target in known:
                    return place[0] + target
    return name


def _groups_renamed(state: Any, known: set[str]) -> None:
    """The ``param_groups`` a nested optimizer state read from the checkpoint name, put in
    the swapped layout: torch matches a group to the optimizer's by these names, and a
    group of joined tensors alone matched none (``KeyError: 'lr'``)."""
    by_target: dict[str, list[_Joined]] | None = None
    for names in _group_lists(state):
        if all(name in known or not isinstance(name, str) for name in names):
            continue
        by_target = _joined_by_target() if by_target is None else by_target
        renamed = [
            _joined_name(name, known, by_target) if isinstance(name, str) else name
            for name in names
        ]
        names[:] = list(dict.fromkeys(renamed))


#: a read of the checkpoint's param group settings, made by :func:`_refuse_split_groups`
#: itself: not checked again
_READING_GROUPS: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "layerswap_dcp_reading_groups", default=False
)


def _group_settings(storage_reader: Any, by_target: Mapping[str, list[_Joined]]) -> dict[str, Any]:
    """The checkpoint's optimizer param group entries (numbers and lists, no tensors),
    read alone from ``storage_reader``; empty where it has none or no joined tensor's part
    is among their names."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata
    from torch.distributed.checkpoint.state_dict_loader import load

    saved = storage_reader.read_metadata().state_dict_metadata
    entries = [
        key
        for key, value in saved.items()
        if ".param_groups." in f".{key}"
        and isinstance(value, (BytesStorageMetadata, TensorStorageMetadata))
    ]
    sources = {
        source
        for candidates in by_target.values()
        for joined in candidates
        for source in joined.rule.sources
    }
    # a nested state's groups name their parameters in a list; a flattened one's, in keys
    if not any(
        key.endswith(".params") or any(source in key for source in sources) for key in entries
    ):
        return {}
    read: dict[str, Any] = {
        key: (
            torch.empty(saved[key].size, dtype=saved[key].properties.dtype)
            if isinstance(saved[key], TensorStorageMetadata)
            else None
        )
        for key in entries
    }
    token = _READING_GROUPS.set(True)
    try:
        load(read, storage_reader=storage_reader, no_dist=True)
    finally:
        _READING_GROUPS.reset(token)
    return read


def _part_groups(read: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Parameter name -> its group's settings, from the entries :func:`_group_settings`
    read: a nested state's (``...param_groups.<i>.params`` and ``.<setting>``) or a
    flattened one's (``...param_groups.<name>.<setting>``)."""
    found: dict[str, dict[str, Any]] = {}
    for key, names in read.items():
        if not key.endswith(".params") or not isinstance(names, list):
            continue
        group = key[: -len("params")]
        settings = {k[len(group) :]: v for k, v in read.items() if k.startswith(group) and k != key}
        for name in names:
            found[str(name)] = settings
    for key, value in read.items():
        head, _, setting = key.rpartition(".")
        at = head.find("param_groups.")
        if at < 0 or setting == "params" or head[at + len("param_groups.") :].isdigit():
            continue
        found.setdefault(head[at + len("param_groups.") :], {})[setting] = value
    return found


def _group_names(node: Any, path: str = "") -> Iterator[str]:
    """The parameter names the ``param_groups`` of an optimizer state in ``node`` (the
    state being loaded) name: a nested state's lists, a flattened one's keys
    (``param_groups.<name>.<setting>``)."""
    if not isinstance(node, Mapping):
        return
    for names in _group_lists(node) if not path else ():
        yield from (name for name in names if isinstance(name, str))
    for key, value in node.items():
        full = f"{path}.{key}" if path else str(key)
        at = full.find("param_groups.")
        if at >= 0 and (at == 0 or full[at - 1] == "."):
            name = full[at + len("param_groups.") :].rpartition(".")[0]
            if name and not name.split(".")[0].isdigit():
                yield name
        if isinstance(value, Mapping):
            yield from _group_names(value, full)


def _same(one: Any, other: Any) -> bool:
    """Whether two param group settings are equal: tensors by value, lists and tuples
    item by item."""
    if isinstance(one, torch.Tensor) or isinstance(other, torch.Tensor):
        return (
            isinstance(one, torch.Tensor)
            and isinstance(other, torch.Tensor)
            and torch.equal(one.detach().cpu(), other.detach().cpu())
        )
    if isinstance(one, (list, tuple)) and isinstance(other, (list, tuple)):
        return len(one) == len(other) and all(map(_same, one, other))
    return bool(one == other)


def _refuse_split_groups(storage_reader: Any, state: Any) -> None:
    """:class:`ConversionError`, before anything is read, where the checkpoint's optimizer
    puts the original parts of one joined tensor (q and k/v) in groups of different
    settings (another ``lr``) and ``state`` (the state being loaded) has an optimizer
    group of that joined tensor: it has one group, so it could only resume with one
    part's settings. A state without one (a model's alone, or an original model's
    optimizer) reads nothing here."""
    by_target = _joined_by_target()
    if not by_target:
        return
    wanted = set(_group_names(state))
    if not any(_at(name, target) for name in wanted for target in by_target):
        return
    groups = _part_groups(_group_settings(storage_reader, by_target))
    if not groups:
        return
    for target, candidates in by_target.items():
        for joined in candidates:
            for name, settings in groups.items():
                place = _at(name, joined.rule.sources[0])
                if place is None or place[1] or place[0] + target not in wanted:
                    continue
                for source in joined.rule.sources[1:]:
                    other = groups.get(place[0] + source)
                    differ = sorted(
                        k
                        for k in {*settings, *(other or {})}
                        if other is not None and not _same(settings.get(k), other.get(k))
                    )
                    if differ:
                        raise ConversionError(
                            f"dcp.load: the checkpoint's optimizer puts {name!r} and "
                            f"{place[0] + source!r} in param groups of different settings "
                            f"({', '.join(differ)}), and {joined.substitution} joins them into "
                            f"{place[0] + target!r}, which has one group: it could resume with "
                            "one part's settings only. Nothing was read. Resume the original "
                            "model, or give the parts one group before saving"
                        )


def _refusal_raised(wrapped: Callable[..., Any], instance: Any, args: Any, kwargs: Any) -> Any:
    """Around DCP's ``_load_state_dict``: a refusal of :func:`_parts_planned`, which DCP
    wraps in a ``CheckpointException`` with the rank it came from, raised as itself; parts
    of one joined tensor in optimizer groups of different settings refused first
    (:func:`_refuse_split_groups`); the optimizer param groups read named in the swapped
    layout (:func:`_groups_renamed`)."""
    from torch.distributed.checkpoint.api import CheckpointException

    if _READING_GROUPS.get():
        return wrapped(*args, **kwargs)
    arguments = bound_arguments(wrapped, args, kwargs) or {}
    state = arguments.get("state_dict")
    if arguments.get("storage_reader") is not None:
        _refuse_split_groups(arguments["storage_reader"], state)
    known = {name for names in _group_lists(state) for name in names if isinstance(name, str)}
    try:
        result = wrapped(*args, **kwargs)
        if known:
            _groups_renamed(state, known)
        return result
    except CheckpointException as exc:
        failures = getattr(exc, "failures", None) or {}
        for rank in sorted(failures):
            failure = failures[rank][0] if isinstance(failures[rank], tuple) else None
            if isinstance(failure, ConversionError) and str(failure).startswith("dcp.load: "):
                raise ConversionError(str(failure)) from exc
        raise


#: (target, advice) armed while a swapped model exists
ADVICE = (
    (DCP_PLAN_TARGET, _parts_planned),
    (DCP_LOAD_TARGET, _refusal_raised),
)
