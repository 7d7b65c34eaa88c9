"""``save_pretrained`` of a swapped model: the original layout written whole, or nothing.

transformers writes ``config.json`` first, then the weights its revert step produced;
nothing checks that step undid every fused name (a quantizer's own tensors, such as
``qkv_proj._weight_qdata`` or ``qkv_proj.SCB``, escape the exact names layerswap's
rules give it). So, on a model with swapped layers, ``PreTrainedModel.save_pretrained``
runs under around-advice that:

- refuses first a quantized model whose fused tensors do not split back
  (:func:`layerswap.quantized.check_quantized_save`);
- saves into a temporary directory inside the target, with quantized layers answering
  ``state_dict`` in the original layout (:func:`layerswap.quantized.original_layout_state`);
- reads back the names written and raises :class:`~layerswap.errors.ConversionError`
  on a name of the replacement's layout (:func:`fused_names_written`), leaving the
  target as it was;
- moves the files into the target, removing stale shards as transformers does.

It is armed with PEFT's target check while a swapped model exists (see
:mod:`layerswap.peft_targets`), and passes a model without swapped layers straight
through. ``push_to_hub=True`` saves once into the staging directory to check, then
once more as asked. ``distributed_checkpoint=True`` (a DCP directory, not safetensors)
is not checked here.

accelerate's ``Accelerator.save_model`` exports a model for loading elsewhere, but
writes ``model.state_dict()`` as it is: on swapped layers, their own layout. It runs
under the same kind of advice: each swapped layer answers ``state_dict`` in the original
layout while it saves (:func:`original_layout_state`: the converter's ``to_original``, or
the quantized split), into a staging directory, and the names written (safetensors or
``.bin``) are checked the same way before the files move into the target. A model sharded
by FSDP is refused first (FSDP's own state-dict hooks expect the swapped names); a state
gathered past the layers' ``state_dict`` (DeepSpeed ZeRO-3's consolidated one, an
offloaded model's) is refused by the check. Either writes nothing. ``save_state`` (a
checkpoint to resume from) keeps the swapped layout: ``load_state`` reads either.

The staging directory is made inside the target, so the files move on one filesystem;
saves of models whose layers are hooked wait for each other.

Example::

    layerswap.swap(model, backend="fused")
    model.save_pretrained("out")      # q_proj, k_proj, ... or ConversionError, "out" untouched
    accelerator.save_model(model, "exported")                 # the same original names
"""

from __future__ import annotations

import contextlib
import inspect
import os
import re
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, MutableMapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from layerswap import hf_internals
from layerswap.errors import ConversionError
from layerswap.quantized import check_quantized_save
from layerswap.quantized import original_layout_state as quantized_original_layout
from layerswap.state import fused_modules, layer_state_hooks, layout_hooks
from layerswap.weights import is_extra_state

__all__ = ["ADVICE", "fused_names", "fused_names_written", "original_layout_state"]

#: held while a save hooks a model's layers (:func:`original_layout_state`), and the ids of
#: the models hooked
_SAVING = threading.RLock()
_HOOKED: set[int] = set()

_SHARD = re.compile(r"(.*?)-\d{5}-of-\d{5}\.(safetensors|bin)")
_SUFFIX = re.compile(r"\.(safetensors|bin)$")


def fused_names(model: nn.Module, names: Iterable[str]) -> list[str]:
    """Those of ``names`` (checkpoint keys) that belong to a swapped layer's own layout.

    A key under a fused module of a swapped layer (``...layers.0.self_attn.qkv_proj.*``)
    or a key only the replacement layout has. Layer paths are matched without the
    model's ``base_model_prefix``, so a checkpoint's own prefix does not hide them.

    Example::

        fused_names(model, ["model.layers.0.self_attn.qkv_proj.SCB"])   # that key
    """
    base = getattr(model, "base_model_prefix", "") or ""
    # (".layers.0.self_attn.qkv_proj.", the other parts of the layer's path): a key holding
    # the needle and every one of those parts, in any order (a wrapper's checkpoint writes
    # "language_model.model.layers.0..." for "model.language_model.layers.0...")
    under: list[tuple[str, frozenset[str]]] = []
    exact: list[tuple[str, frozenset[str]]] = []  # a key only the replacement has
    for name, _, hook in layout_hooks(model):
        parts = name.split(".")
        tail = ".".join(parts[-2:])  # "layers.0"
        context = frozenset(parts[:-2]) - {base, "model"}
        converter = hook.substitution.converter
        rules = getattr(converter, "rules", ())  # a converter that is not a rule list: none
        sources = {key for rule in rules for key in rule.sources}
        targets = {key for rule in rules for key in rule.targets}
        under += [(f".{tail}.{fused}.", context) for fused in fused_modules(converter)]
        exact += [(f".{tail}.{key}", context) for key in targets - sources]

    def among(key: str, context: frozenset[str]) -> bool:
        return context <= set(key.split("."))

    return [
        key
        for key in names
        if any(needle in f".{key}" and among(key, context) for needle, context in under)
        or any(f".{key}".endswith(needle) and among(key, context) for needle, context in exact)
    ]


def fused_names_written(model: nn.Module, directory: Path) -> list[str]:
    """The fused names (:func:`fused_names`) in the weight files of ``directory``
    (safetensors, and the ``.bin`` files of ``safe_serialization=False``)."""
    from safetensors import safe_open

    written: list[str] = []
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as handle:
            written.extend(handle.keys())
    for path in sorted(directory.glob("*.bin")):
        state = torch.load(path, map_location="meta", weights_only=True)
        written.extend(state if isinstance(state, dict) else ())
    return fused_names(model, written)


@contextlib.contextmanager
def original_layout_state(model: nn.Module) -> Iterator[None]:
    """While inside, every swapped layer of ``model`` answers ``state_dict`` in the
    original layout: its converter's ``to_original`` (the quantized split for a quantized
    model, :func:`layerswap.quantized.original_layout_state`), each tensor a split gives
    copied into a storage of its own (savers take slices of one storage for tied weights
    and drop them), and the replacement's extra state (TransformerEngine's) left out.

    The hooks sit on the model's own layers, so saves in other threads wait for this one
    (layerswap's save advice holds the same lock), and a ``state_dict()`` another thread
    takes meanwhile is in the original layout too, its split tensors copies.

    Example::

        with original_layout_state(model):
            model.state_dict()            # q_proj, k_proj, ... as the original's
    """
    with _SAVING:
        if id(model) in _HOOKED:  # inside a save of it already: hooked once
            yield
            return
        _HOOKED.add(id(model))
        try:
            if hf_internals.quantizer_of(model) is not None:
                with quantized_original_layout(model):
                    yield
            else:
                hooks = layer_state_hooks(
                    model, lambda hook: _ToOriginal(hook.substitution, hook.config)
                )
                with hooks:
                    yield
        finally:
            _HOOKED.discard(id(model))


class _ToOriginal:
    """``state_dict`` post-hook of one replacement layer: its entries, converted back."""

    def __init__(self, substitution: Any, config: Any) -> None:
        self.converter = substitution.converter
        self.config = hf_internals.text_config_of(config)

    def __call__(
        self,
        module: nn.Module,
        state_dict: MutableMapping[str, Any],
        prefix: str,
        local_metadata: Mapping[str, Any],
    ) -> None:
        local = {
            key[len(prefix) :]: value for key, value in state_dict.items() if key.startswith(prefix)
        }
        for key in local:
            del state_dict[prefix + key]
        own = {key: value for key, value in local.items() if not is_extra_state(key)}
        given = {id(value) for value in own.values()}
        for key, value in self.converter.to_original(own, self.config).items():
            state_dict[prefix + key] = value if id(value) in given else value.clone()


def _bind(wrapped: Callable[..., Any], args: Any, kwargs: Any) -> dict[str, Any] | None:
    signature = inspect.signature(wrapped)
    parameters = list(signature.parameters.values())
    if parameters and parameters[0].name == "self":  # called through the class: self is bound
        signature = signature.replace(parameters=parameters[1:])
    try:
        arguments = dict(signature.bind(*args, **kwargs).arguments)
    except TypeError:
        return None  # a call transformers itself refuses: its error, not ours
    arguments.update(arguments.pop("kwargs", None) or {})
    # something else in save_pretrained's place (a test's stand-in): not ours to stage
    return arguments if "save_directory" in arguments else None


@contextlib.contextmanager
def _staging(target: Path) -> Iterator[Path]:
    """A directory for a save into ``target``, made inside it: on the filesystem the files
    will stay on (a target that is a mount point, or a link to another filesystem, too).
    Removed on leaving, and ``target`` with it where the save made it and failed."""
    made = not target.exists()
    target.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".layerswap-partial-", dir=target))
    umask = os.umask(0)
    os.umask(umask)
    staging.chmod(0o777 & ~umask)  # mkdtemp's 0700 would become the saved files' directory mode
    try:
        yield staging
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        if made:
            with contextlib.suppress(OSError):
                target.rmdir()  # only if nothing else came into it meanwhile
        raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _move(staging: Path, target: Path) -> None:
    """The staged files into ``target``; its shards from an earlier save not rewritten go."""
    target.mkdir(parents=True, exist_ok=True)
    written = {path.name for path in staging.iterdir()}
    stems = {_SUFFIX.sub("", _SHARD.sub(r"\1", name)) for name in written}
    for name in written:
        os.replace(staging / name, target / name)
    for old in target.iterdir():
        shard = _SHARD.fullmatch(old.name)
        if shard and old.name not in written and shard.group(1) in stems and old.is_file():
            old.unlink()


def _refuse_fused_names(model: nn.Module, staging: Path, target: Path, saver: str) -> None:
    """Raise where ``saver`` wrote a name of the swapped layers' layout into ``staging``."""
    stranded = fused_names_written(model, staging)
    if stranded:
        raise ConversionError(
            f"{saver} would write {len(stranded)} tensors under the swapped layers' own "
            f"names ({stranded[0]!r} first), which plain transformers does not load; "
            f"nothing was written to {str(target)!r}"
        )


def _save_checked(
    wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """Around ``PreTrainedModel.save_pretrained`` (see the module docstring)."""
    arguments = _bind(wrapped, args, kwargs)
    if not isinstance(instance, nn.Module) or arguments is None or not layout_hooks(instance):
        return wrapped(*args, **kwargs)
    target = Path(os.fspath(arguments["save_directory"]))
    if target.is_file():
        return wrapped(*args, **kwargs)  # transformers logs its own error and writes nothing
    check_quantized_save(instance)
    with _SAVING, _staging(target) as staging:
        with quantized_original_layout(instance):
            result = wrapped(**{**arguments, "save_directory": staging, "push_to_hub": False})
        _refuse_fused_names(instance, staging, target, "save_pretrained")
        if arguments.get("push_to_hub"):
            with quantized_original_layout(instance):
                return wrapped(*args, **kwargs)  # the save just checked, now as asked
        _move(staging, target)
    return result


def _save_model_checked(
    wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """Around accelerate's ``Accelerator.save_model`` (see the module docstring)."""
    arguments = _bind(wrapped, args, kwargs)
    model = None if arguments is None else arguments.get("model")
    unwrap = getattr(instance, "unwrap_model", None)
    if isinstance(model, nn.Module) and callable(unwrap):
        model = unwrap(model)
    if arguments is None or not isinstance(model, nn.Module) or not layout_hooks(model):
        return wrapped(*args, **kwargs)
    target = Path(os.fspath(arguments["save_directory"]))
    if target.is_file():
        return wrapped(*args, **kwargs)  # accelerate logs its own error and writes nothing
    if _sharded_by_fsdp(arguments["model"]):
        raise ConversionError(
            "Accelerator.save_model of a swapped model sharded by FSDP: FSDP gathers its "
            "state past the swapped layers' own state_dict, so the file would hold their "
            "layout, which plain transformers does not load; nothing was written to "
            f"{str(target)!r}. Save with save_pretrained, or undo() the swap first"
        )
    check_quantized_save(model)
    with _staging(target) as staging:
        with original_layout_state(model):
            result = wrapped(**{**arguments, "save_directory": staging})
        _refuse_fused_names(model, staging, target, "Accelerator.save_model")
        if any(staging.iterdir()):  # a process that writes nothing (not the main one)
            _move(staging, target)
    return result


def _sharded_by_fsdp(model: nn.Module) -> bool:
    """Whether a module of ``model`` is sharded by FSDP (``FullyShardedDataParallel`` or
    ``fully_shard``)."""
    try:
        from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
    except ImportError:  # a torch built without distributed
        return False
    return any(isinstance(m, (FSDPModule, FullyShardedDataParallel)) for m in model.modules())


#: (target, advice) armed while a swapped model exists
ADVICE = (
    (hf_internals.SAVE_PRETRAINED_TARGET, _save_checked),
    ("accelerate.accelerator:Accelerator.save_model", _save_model_checked),
)
