"""A user's checkpoint directory, loaded whole or refused with one line that says why.

transformers loads a checkpoint that lacks a tensor and initialises the tensor at random
with a log note; it raises tracebacks several screens long for a truncated file or a
tensor of the wrong shape. :func:`load_checkpoint` reads the files' headers first (a
truncated or corrupt safetensors file, a shard the index names but the directory lacks),
loads with transformers' own loading report, and refuses a model that would be partly
random or shaped unlike its config, with a :class:`~layerswap.errors.CheckpointError`
naming the tensors and the file. A model it returns holds exactly the checkpoint.

Example::

    model = load_checkpoint(LlamaForCausalLM, "my-checkpoint")
    # CheckpointError: checkpoint my-checkpoint lacks 1 tensor the model needs, so it would
    # be partly random: model.layers.1.mlp.down_proj.weight (model.safetensors)
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from layerswap.errors import CheckpointError

if TYPE_CHECKING:
    from torch import nn

__all__ = ["load_checkpoint", "weight_files"]

_SAFETENSORS_INDEX = "model.safetensors.index.json"
_SINGLE_FILES = ("model.safetensors", "pytorch_model.bin")
_BIN_INDEX = "pytorch_model.bin.index.json"
#: tensors named in a message before "and N more"
_NAMED = 3


def weight_files(directory: str | Path) -> list[Path]:
    """The weight files of a checkpoint directory, as its index (or single file) names them.

    Raises :class:`CheckpointError` when there are none, when the index cannot be read, or
    when it names a file the directory lacks.
    """
    root = Path(directory)
    for index_name in (_SAFETENSORS_INDEX, _BIN_INDEX):
        index = root / index_name
        if index.is_file():
            return _indexed_files(root, index)
    found = [root / name for name in _SINGLE_FILES if (root / name).is_file()]
    if not found:
        raise CheckpointError(
            f"checkpoint {root} has no weights: no {_SAFETENSORS_INDEX}, "
            f"{' or '.join(_SINGLE_FILES)}"
        )
    return found[:1]


def _indexed_files(root: Path, index: Path) -> list[Path]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        names = sorted(set(weight_map.values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        raise CheckpointError(f"cannot read {index}: {_one_line(error)}") from error
    absent = [name for name in names if not (root / name).is_file()]
    if absent:
        raise CheckpointError(f"{index} names {_listed(absent)}, which {root} does not have")
    return [root / name for name in names]


def _check_file(path: Path) -> dict[str, tuple[int, ...]]:
    """The tensor shapes a safetensors file declares, or why it cannot be read."""
    if path.suffix != ".safetensors":
        return {}
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as handle:
            return {key: tuple(handle.get_slice(key).get_shape()) for key in handle.keys()}  # noqa: SIM118
    except Exception as error:  # safetensors raises its own error type, or OSError
        raise CheckpointError(
            f"{path} is not a readable safetensors file (truncated or corrupt?): {_one_line(error)}"
        ) from error


def load_checkpoint(model_class: Any, directory: str | Path, **kwargs: Any) -> nn.Module:
    """``model_class.from_pretrained(directory)``, refused unless it loads every tensor.

    The checkpoint's own dtype is kept (``dtype="auto"``) unless ``kwargs`` says another.
    Refused with a :class:`CheckpointError` naming the tensors and files: a file that
    cannot be read, a tensor the model needs that no file holds (the model would be
    partly random), a tensor of another shape than the config gives, a tensor the model
    has no place for (a checkpoint of another configuration).
    """
    root = Path(directory)
    if not root.is_dir():
        raise CheckpointError(f"checkpoint {root}: no such directory")
    located: dict[str, str] = {}
    for path in weight_files(root):
        for key in _check_file(path):
            located[key] = path.name
    kwargs.setdefault("dtype", "auto")
    try:
        with _loading_report_quiet():
            model, info = model_class.from_pretrained(
                str(root),
                local_files_only=True,
                output_loading_info=True,
                ignore_mismatched_sizes=True,  # reported below, in one line
                **kwargs,
            )
    except (OSError, ValueError, RuntimeError) as error:
        raise CheckpointError(f"cannot load checkpoint {root}: {_one_line(error)}") from error
    except Exception as error:
        if type(error).__module__.startswith("huggingface_hub"):  # its config's own validation
            raise CheckpointError(f"cannot load checkpoint {root}: {_one_line(error)}") from error
        raise
    _refuse_faults(root, info, located)
    return model  # type: ignore[no-any-return]


@contextlib.contextmanager
def _loading_report_quiet() -> Iterator[None]:
    """transformers' loading report off: every fault it lists is refused in one line."""
    from transformers.utils import logging as transformers_logging

    level = transformers_logging.get_verbosity()
    transformers_logging.set_verbosity_error()
    try:
        yield
    finally:
        transformers_logging.set_verbosity(level)


def _refuse_faults(root: Path, info: dict[str, Any], located: dict[str, str]) -> None:
    files = sorted(set(located.values())) or [p.name for p in weight_files(root)]
    where = ", ".join(files)
    mismatched = sorted(info.get("mismatched_keys") or ())
    if mismatched:
        key, found, expected = mismatched[0]
        more = f" (and {len(mismatched) - 1} more)" if len(mismatched) > 1 else ""
        raise CheckpointError(
            f"checkpoint {root}: tensor {key} has shape {_shape(found)} in "
            f"{located.get(key, where)}, but the config gives {_shape(expected)}{more}"
        )
    missing = sorted(info.get("missing_keys") or ())
    if missing:
        raise CheckpointError(
            f"checkpoint {root} lacks {_count(missing, 'tensor')} the model needs, so the "
            f"model would be partly random: {_listed(missing)} (not in {where})"
        )
    unexpected = sorted(info.get("unexpected_keys") or ())
    if unexpected:
        raise CheckpointError(
            f"checkpoint {root} holds {_count(unexpected, 'tensor')} the model has no place "
            f"for (a checkpoint of another configuration?): {_listed(unexpected)} "
            f"(in {located.get(unexpected[0], where)})"
        )
    errors = list(info.get("error_msgs") or ())
    if errors:
        raise CheckpointError(f"cannot load checkpoint {root}: {_one_line(errors[0])}")


def _shape(shape: Any) -> str:
    return "(" + ", ".join(str(int(d)) for d in shape) + ")"


def _count(items: list[str], noun: str) -> str:
    return f"{len(items)} {noun}{'' if len(items) == 1 else 's'}"


def _listed(items: list[str]) -> str:
    named = ", ".join(items[:_NAMED])
    return named + (f" and {len(items) - _NAMED} more" if len(items) > _NAMED else "")


def _one_line(message: object) -> str:
    return " ".join(str(message).split())
