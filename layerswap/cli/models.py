"""Choosing the family and the substitution, and building the model a command runs on.

``--config`` says where the model comes from: ``tiny`` (the family's embedded config,
random weights), a config JSON file (that shape, random weights) or a local checkpoint
directory (its own weights, loaded the transformers way).
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from layerswap.cli.options import ModelChoice
from layerswap.cli.output import Progress
from layerswap.cli.problems import UsageProblem, one_line
from layerswap.suggestions import did_you_mean

if TYPE_CHECKING:
    import torch

    from layerswap.family import Family
    from layerswap.substitution import Substitution

__all__ = ["Setup", "build", "coverage_target", "family_of_adapter", "find_family"]


@dataclass
class Setup:
    """The model built for a command, the substitution chosen for it, and where it runs."""

    family: Family
    substitution: Substitution
    model: torch.nn.Module
    source: str
    device: torch.device
    dtype: torch.dtype
    #: the dtype of the checkpoint the model was loaded from (None: random weights)
    checkpoint_dtype: torch.dtype | None = None

    def describe(self) -> dict[str, Any]:
        """The model's family, source and shape, as the header and ``--json`` show it."""
        from layerswap.comparison.inputs import text_config

        config = text_config(self.model)
        return {
            "family": self.family.name,
            "source": self.source,
            "layers": getattr(config, "num_hidden_layers", None),
            "hidden_size": getattr(config, "hidden_size", None),
            "attention_heads": getattr(config, "num_attention_heads", None),
            "kv_heads": getattr(config, "num_key_value_heads", None),
            "vocab_size": getattr(config, "vocab_size", None),
            "parameters": sum(p.numel() for p in self.model.parameters()),
        }


def find_family(name: str, option: str = "--model") -> Family:
    """The registered family ``name`` (or the one covering model type ``name``).

    Anything else is a usage problem that says what to pass: a path (``option`` takes a
    family name), a transformers model type no family covers (and why), a typo (close
    names).
    """
    from layerswap.registry import families

    known = families()
    key = name.strip().lower()
    if key not in known:
        by_type = [f for f in known.values() if f.model_type == key]
        if by_type:
            return by_type[0]
        _refuse_path(name, option)
        _refuse_model_type(key)
        hint = did_you_mean(key, known, quote="")
        raise UsageProblem(
            f"unknown model family {name!r}{'; ' + hint if hint else ''} "
            f"(known: {', '.join(sorted(known))})"
        )
    return known[key]


def coverage_target(name: str) -> str:
    """What ``layerswap coverage NAME`` reads: a registered family's name (or the family
    covering model type ``name``), or a transformers model type no family covers (its
    slots below the decoder layer may take it); anything else is a usage problem, as for
    :func:`find_family`."""
    key = name.strip().lower()
    if key in _model_types() and not any(f.model_type == key for f in _families().values()):
        from layerswap.families.infer import decoder_model_types

        if key in set(decoder_model_types()):
            return key  # else find_family says transformers has no causal LM for it
    return find_family(name, option="coverage").name


def _families() -> dict[str, Family]:
    from layerswap.registry import families

    return families()


def _refuse_path(name: str, option: str) -> None:
    """A path where a family name was expected: say what to pass instead."""
    path = Path(name).expanduser()
    if option == "coverage":  # takes a path as well: this one does not exist
        if os.sep in name or name.endswith(".json"):
            raise UsageProblem(f"{name}: no such file or directory")
        return
    if path.is_dir():
        raise UsageProblem(
            f"{option} takes a family name; {name} is a directory: pass it as --config {name}"
        )
    if path.exists() or os.sep in name or name.endswith(".json"):
        where = "" if path.exists() else ": no such file or directory"
        raise UsageProblem(
            f"{option} takes a family name, not a path ({name}{where}); a config file or "
            "checkpoint directory goes to --config"
        )


def _refuse_model_type(model_type: str) -> None:
    """A transformers model type no family covers: why, as coverage says it."""
    if model_type not in _model_types():
        return
    from layerswap.coverage import (
        slots_below_decoder,
        slots_refusal,
        why_not_covered,
        wrapper_family,
    )

    found = wrapper_family(model_type)
    wrapped = None if found is None else found[0].name
    if wrapped is not None and wrapped != model_type:
        raise UsageProblem(
            f"{model_type} is a multimodal wrapper whose language model the {wrapped} family "
            f"covers; the command line builds causal LMs: pass --model {wrapped} (or "
            f"--substitution {wrapped}.decoder.fused), or swap a {model_type} model in "
            "Python (layerswap.swap, use and verify take the wrapper: its language model's "
            "layers are swapped, its tower kept)"
        )
    taken = slots_below_decoder(model_type)
    if not taken:
        held = slots_refusal(model_type)
        raise UsageProblem(
            f"{model_type} is a transformers model type that layerswap does not cover: "
            f"{why_not_covered(model_type)}"
            + (f"; the slots below its decoder layers: {held}" if held else "")
        )
    names = ", ".join(f"{model_type}.{slot}.{backends[0]}" for slot, backends in taken.items())
    raise UsageProblem(
        f"no family covers {model_type}'s decoder layers ({why_not_covered(model_type)}); "
        f"the slots below them take it: pass --substitution with one of {names} "
        f"(layerswap coverage {model_type} says what each replaces)"
    )


def _model_types() -> set[str]:
    """The installed transformers' model types, read once per release (importing its
    config mapping takes seconds; a typo is answered without it)."""
    from layerswap import verdicts

    names = verdicts.remembered(
        "model-types",
        "config-mapping",
        _read_model_types,
        module="transformers.models.auto.configuration_auto",
    )
    return set((names or "").split())


def _read_model_types() -> str:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    return " ".join(sorted(CONFIG_MAPPING_NAMES))


def _choose_substitution(choice: ModelChoice) -> tuple[Family, Substitution]:
    from layerswap.registry import get, get_backend

    model, backend, substitution = choice.model, choice.backend, choice.substitution
    if choice.fp8_recipe != "auto" and not choice.fp8:
        raise UsageProblem("--fp8-recipe chooses the recipe of --fp8; add --fp8 to use it")
    if substitution is not None:
        if choice.fp8:
            raise UsageProblem(_fp8_usage())
        if backend != "fused":
            raise UsageProblem(
                f"--substitution {substitution} names its backend; --backend {backend} "
                "chooses one for --model instead: pass one of them"
            )
        sub = get(substitution)
        if sub.parts.slot.takes_any_model_type and sub.parts.family.name not in _families():
            # a slot that takes any model type (the norm slot): the model type's own family
            family = sub.parts.family
            if model is not None and model.strip().lower() != family.name:
                raise UsageProblem(
                    f"--substitution {sub.name} is for {family.name}, not --model {model}"
                )
            return family, sub
        family = find_family(sub.family)
        if model is not None and find_family(model).name != family.name:
            raise UsageProblem(
                f"--substitution {sub.name} is for {family.name}, not --model {model}"
            )
        return family, sub
    family = find_family(model if model is not None else _family_of_config(choice.config))
    name, _, variant = backend.partition("_")
    if choice.fp8:
        if variant not in ("", "fp8"):
            raise UsageProblem(_fp8_usage())
        variant = "fp8"
    try:
        declared = get_backend(name)
    except LookupError:
        raise UsageProblem(_no_backend(backend, family)) from None
    if variant and not any(v.name == variant for v in declared.variants):
        raise UsageProblem(_fp8_usage() if choice.fp8 else _no_backend(backend, family))
    reason = declared.unsupported(family)
    if reason is not None:
        raise UsageProblem(f"the {name} backend cannot express the {family.name} family: {reason}")
    sub = get(f"{family.name}.decoder.{declared.name}{'_' + variant if variant else ''}")
    if variant and choice.fp8:
        sub = sub.with_options(recipe=choice.fp8_recipe)
    return family, sub


def _no_backend(backend: str, family: Family) -> str:
    from layerswap.registry import substitutions

    names = sorted({s.backend for s in substitutions(family=family.name, slot="decoder")})
    return (
        f"no {backend!r} substitution for {family.name} "
        f"(backends for {family.name}: {', '.join(names) or 'none'})"
    )


def _fp8_usage() -> str:
    """What --fp8 needs, from the backends that declare an ``fp8`` variant."""
    from layerswap.registry import backends

    with_fp8 = [b for b in backends().values() if any(v.name == "fp8" for v in b.variants)]
    labels = " or ".join(b.dependencies[0].label if b.dependencies else b.name for b in with_fp8)
    names = " or ".join(b.name for b in with_fp8)
    return f"--fp8 runs {labels or 'FP8'} layers: use it with --backend {names or '(none)'}"


def family_of_adapter(directory: Path) -> str:
    """The family of an adapter's base model, read from ``base_model_name_or_path`` when
    that is a local checkpoint; else a usage problem asking for ``--model``."""
    base = _read_json(directory / "adapter_config.json").get("base_model_name_or_path")
    if isinstance(base, str) and (Path(base) / "config.json").is_file():
        return find_family(_family_of_config(base)).name
    raise UsageProblem(
        f"{directory}: the adapter's base model ({base!r}) is not a local checkpoint; "
        "name its family with --model"
    )


def _family_of_config(config: str) -> str:
    """The family named by a config file's ``model_type``, when --model is left out."""
    path = _config_file(config)
    if path is None:
        raise UsageProblem("--model is required with --config tiny (e.g. --model llama)")
    from layerswap.registry import families

    model_type = _read_json(path).get("model_type")
    if not isinstance(model_type, str):
        raise UsageProblem(f"{path} has no model_type; pass --model")
    for family in families().values():
        if family.model_type == model_type:
            return family.name
    return model_type  # unknown: find_family() reports it with suggestions


def _config_file(config: str) -> Path | None:
    if config == "tiny":
        return None
    path = Path(config)
    if not path.exists():
        raise UsageProblem(f"--config {config}: no such file or directory")
    if path.is_dir():
        path = path / "config.json"
        if not path.is_file():
            raise UsageProblem(f"--config {config}: directory has no config.json")
    return path


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise UsageProblem(f"cannot read {path}: {one_line(error)}") from error
    if not isinstance(data, dict):
        raise UsageProblem(f"{path} does not hold a JSON object")
    return data


def _placement(device: str, dtype: str) -> tuple[torch.device, torch.dtype]:
    from layerswap.comparison.placement import resolve_device, resolve_dtype

    try:
        resolved_dtype = resolve_dtype(dtype)
    except ValueError as error:
        raise UsageProblem(error) from error
    wanted = device.strip().lower()
    if wanted not in ("auto", "cpu", "cuda") and not wanted.startswith("cuda:"):
        raise UsageProblem(f"unknown device {device!r}; choose auto, cpu or cuda")
    try:
        resolved_device = resolve_device(wanted)
    except RuntimeError as error:  # cuda:x
        raise UsageProblem(f"unknown device {device!r}: {error}") from error
    assert resolved_device is not None and resolved_dtype is not None
    return resolved_device, resolved_dtype


def build(choice: ModelChoice, progress: Progress) -> Setup:
    """Validate everything cheap first, then build the original model."""
    from layerswap.registry import backend_of

    if choice.model is not None and choice.config == "tiny" and Path(choice.model).is_dir():
        # a checkpoint directory given to --model is what --config takes
        choice = dataclasses.replace(choice, model=None, config=choice.model)
    # the family first: a typo is answered before torch and transformers are imported
    family, sub = _choose_substitution(choice)
    target_device, target_dtype = _placement(choice.device, choice.dtype)
    _quiet_transformers()
    reason = sub.unmet_requirement()
    if reason is not None:
        raise UsageProblem(f"{sub.name} cannot run here: {reason}")
    declared = backend_of(sub)
    if declared is not None and target_device.type not in declared.devices:
        raise UsageProblem(
            f"{sub.name} runs on {' or '.join(declared.devices)}, not {target_device.type}; "
            f"pass --device {declared.devices[0]}"
        )
    config_file = _config_file(choice.config)
    progress.step(f"building {family.name} model")
    built, source = _build_model(family, choice.config, config_file, choice.seed)
    loaded_dtype = next(built.parameters()).dtype if source.startswith("checkpoint") else None
    built.to(device=target_device, dtype=target_dtype)
    built.eval()
    return Setup(family, sub, built, source, target_device, target_dtype, loaded_dtype)


def _quiet_transformers() -> None:
    """No tqdm bars from transformers: progress is ours (and only on a terminal)."""
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()


def _build_model(
    family: Family, config: str, config_file: Path | None, seed: int
) -> tuple[torch.nn.Module, str]:
    config_class = family.config_type()
    if config_file is not None:
        declared = _read_json(config_file).get("model_type")
        if declared is not None and declared != family.model_type:
            raise UsageProblem(
                f"{config_file} describes a {declared!r} model, not {family.name} "
                f"({family.model_type!r})"
            )
    if config_file is not None and config_file.parent == Path(config):
        # a checkpoint directory: every tensor loaded, or refused naming the fault
        from layerswap.checkpoint import load_checkpoint

        return load_checkpoint(family.causal_lm_class(), config), f"checkpoint {config}"
    if config_file is None:
        model_config = family.tiny_config()
        source = "tiny config, random weights"
    else:
        try:
            model_config = config_class.from_json_file(str(config_file))
        except Exception as error:  # unreadable, or refused by the config's own validation
            raise UsageProblem(f"cannot read config {config_file}: {one_line(error)}") from error
        source = f"config {config_file}, random weights"
    return family.build(model_config, seed=seed), f"{source} (seed {seed})"
