"""What layerswap covers: every decoder family transformers ships, and one model's modules.

:func:`coverage` answers, for every causal-LM model type of the installed transformers
and every multimodal wrapper proven on image or audio prompts, which registered family covers it
and, per backend, whether that backend's decoder layer does and why not; a model type no
family covers says why (refused by inference, or inferred and verified but not builtin). :func:`model_coverage` answers, for one model
(a family name, a config file or a checkpoint directory), which of its modules each
substitution replaces and which stay the original's (embeddings, final norm, rotary,
``lm_head``).

Example::

    layerswap.coverage()["olmo2"].backends["te"]     # "TransformerEngine ... across heads"
    model_coverage("qwen3").rows[0].replaces           # ("model.layers.0-1 (Qwen3DecoderLayer)",)
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import json
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, as_completed
from concurrent.futures.process import BrokenProcessPool
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from layerswap import verdicts
from layerswap.errors import CheckpointError, UnknownSubstitutionError, UnsupportedFamilyError
from layerswap.families.infer import decoder_model_types
from layerswap.family import Family
from layerswap.forking import fork_jobs, forked_pool
from layerswap.inference import infer_family
from layerswap.model_parts import model_parts
from layerswap.registry import backends, families, get, get_family
from layerswap.slots import get_slot, slot_names, takes_any_model_type
from layerswap.trials import not_built

if TYPE_CHECKING:
    from transformers import PreTrainedConfig

    from layerswap.backend import Backend

__all__ = [
    "Coverage",
    "ModelCoverage",
    "SlotCoverage",
    "coverage",
    "infer_in_processes",
    "inferring",
    "model_coverage",
    "slots_below_decoder",
    "slots_refusal",
    "wrapper_family",
]


@dataclass(frozen=True)
class Coverage:
    """One model type: the family covering it (or why none does) and each backend's answer."""

    model_type: str
    #: the registered family covering it, ``None`` when none does
    family: str | None
    #: why no family covers it (``None`` when one does)
    reason: str | None
    #: every registered backend: ``None`` when its decoder layer covers the family, else why not
    backends: Mapping[str, str | None]
    #: for a multimodal wrapper, what stays the original's (its vision tower); ``None``
    #: for a text decoder
    wrapper: str | None = None
    #: the decoder layers of another kind that stay the original's (Mllama's
    #: cross-attention layers); ``None``: every decoder layer is swapped
    kept: str | None = None
    #: the slots beside the decoder layer that take any model type (``head``, ``norm``):
    #: per slot, every backend implementing it, ``None`` when it swaps some of the model's
    #: modules, else why not
    slots: Mapping[str, Mapping[str, str | None]] = field(default_factory=dict)

    @property
    def covered(self) -> bool:
        """Whether a registered family covers the model type."""
        return self.family is not None

    @property
    def below_decoder(self) -> dict[str, list[str]]:
        """The slots beside the decoder layer (its norms, the head) that swap some of the
        model's modules, and with which backends (``{"norm": ["fused"]}``)."""
        found: dict[str, list[str]] = {}
        for slot, answers in self.slots.items():
            usable = [backend for backend, why in answers.items() if why is None]
            if usable:
                found[slot] = usable
        return found

    @property
    def slots_refusal(self) -> str | None:
        """Why no slot below the decoder layer takes the model type, where every slot and
        backend gives the same reason (its tiny model does not build here: a library this
        machine lacks); ``None`` where one takes it, or their reasons differ (``coverage
        MODEL_TYPE`` gives each)."""
        if self.below_decoder:
            return None
        reasons = {why for answers in self.slots.values() for why in answers.values()}
        return next(iter(reasons)) if len(reasons) == 1 else None

    @property
    def swapped(self) -> bool:
        """Whether anything of the model type is swapped: its decoder layers (a family
        covers it) or a slot below them."""
        return self.covered or bool(self.below_decoder)


def coverage(
    on_step: Callable[[int, int, str], None] | None = None, *, jobs: int | None = None
) -> dict[str, Coverage]:
    """Every causal-LM model type of the installed transformers, by name.

    A model type a registered family covers lists every backend's answer for the family's
    decoder layer (``None``: covered, else the backend's reason); one no family covers
    says why (inference refused it, or it was inferred and verified but is not builtin),
    and every backend gives that reason. What is not answered yet on this release (each
    answer is kept) is asked in ``jobs`` processes (default: one per CPU; see
    :func:`inferring`); ``on_step(done, total, model_type)`` is called before each.

    Example::

        report = layerswap.coverage()
        sorted(t for t, c in report.items() if c.backends.get("te") is None)
    """
    # every backend's answers kept on disk together: one write per table, not per answer
    with verdicts.kept_together():
        return _coverage(on_step, jobs)


def _coverage(
    on_step: Callable[[int, int, str], None] | None, jobs: int | None
) -> dict[str, Coverage]:
    by_type = {family.model_type: family for family in families().values()}
    declared = backends()
    report: dict[str, Coverage] = {}
    model_types = list(decoder_model_types())
    # a model type whose causal LM is a family's language model (Mllama) is among these:
    # inferred for nothing, its answer never read, but finding them reads every config
    unanswered = [t for t in model_types if t not in by_type and _stored(t) is None]
    own = tuple(t for t in model_types if t in by_type)  # their slots: in the processes too
    with inferring(unanswered, jobs, on_step, family_types=own) as below:
        # meanwhile, in this process: the family covering each model type, and its answers
        covering = {
            model_type: by_type.get(model_type)
            or by_type.get(_language_model_type(model_type) or "")
            for model_type in model_types
        }
        answered = {
            model_type: {name: backend.unsupported(family) for name, backend in declared.items()}
            for model_type, family in covering.items()
            if family is not None
        }
    for done, model_type in enumerate(model_types):
        if on_step is not None:
            on_step(done, len(model_types), model_type)
        family = covering[model_type]
        if family is not None:
            report[model_type] = Coverage(
                model_type, family.name, None, answered[model_type], kept=_kept(family)
            )
            continue
        reason = why_not_covered(model_type)
        report[model_type] = Coverage(model_type, None, reason, dict.fromkeys(declared, reason))
    for model_type, row in report.items():
        slots = below.get(model_type)  # no processes (or one failed): asked here
        if slots is None:
            slots = _below_decoder(model_type, by_type.get(model_type), declared)
        report[model_type] = dataclasses.replace(row, slots=slots)
    for model_type, (family, media) in _wrapped().items():
        answers = {name: backend.unsupported(family) for name, backend in declared.items()}
        tower = "audio" if media == "audio" else "vision"
        kept = f"the {tower} tower and projector stay the original's; verified on {media} prompts"
        report[model_type] = Coverage(
            model_type, family.name, None, answers, wrapper=kept, kept=_kept(family)
        )
    return report


def _below_decoder(
    model_type: str, family: Family | None, declared: Mapping[str, Backend]
) -> dict[str, dict[str, str | None]]:
    """Per slot that takes any model type (``norm``), each backend implementing it: ``None``
    when it swaps some of ``model_type``'s modules, else why not. A model type no family
    covers is asked through its bare family (:mod:`layerswap.model_types`), once per
    transformers release (:func:`~layerswap.verdicts.remembered`)."""
    answers: dict[str, dict[str, str | None]] = {}
    for slot, name, backend in _below_decoder_slots(declared):
        if family is not None:
            why = backend.unsupported(family, slot)
        else:
            why = verdicts.remembered(
                _SLOT_KIND.format(slot=slot),
                f"{name}|{model_type}",
                functools.partial(_bare_refusal, model_type, backend, slot),
                module=_module_of(model_type),
            )
        answers.setdefault(slot, {})[name] = why
    return answers


def slots_below_decoder(model_type: str) -> dict[str, list[str]]:
    """The slots below the decoder layer that swap some of ``model_type``'s modules, with
    their backends (``{"norm": ["fused", "liger"], "head": [...]}``), for a model type no
    family covers; answered once per transformers release.

    Example::

        slots_below_decoder("qwen3_next")["experts"]   # ["fused", "liger"]
    """
    answers = _below_decoder(model_type, None, backends())
    return Coverage(model_type, None, None, {}, slots=answers).below_decoder


def slots_refusal(model_type: str) -> str | None:
    """Why no slot below the decoder layer takes ``model_type``, where all give one reason
    (:attr:`Coverage.slots_refusal`); ``None`` where one takes it or their reasons differ."""
    answers = _below_decoder(model_type, None, backends())
    return Coverage(model_type, None, None, {}, slots=answers).slots_refusal


def _below_decoder_slots(declared: Mapping[str, Backend]) -> Iterator[tuple[str, str, Backend]]:
    """(slot, backend name, backend) for every slot below the decoder layer that takes any
    model type (``norm``) and every backend implementing it."""
    for name, backend in declared.items():
        for slot in backend.slots:
            if takes_any_model_type(slot):
                yield slot, name, backend


#: the table of answers a backend gives a slot below the decoder layer for model types no
#: family covers (:func:`~layerswap.verdicts.remembered`)
_SLOT_KIND = "{slot}-model-type"


def _module_of(model_type: str) -> str | None:
    from transformers.models.auto.configuration_auto import model_type_to_module_name

    package = model_type_to_module_name(model_type)
    return f"transformers.models.{package}.modeling_{package}"


@functools.lru_cache(maxsize=4)
def _bare(model_type: str) -> Family | str:
    """``model_type``'s bare family, or why there is none: made once for every slot and
    backend that asks in turn."""
    from layerswap.model_types import bare_family

    try:
        return bare_family(model_type)
    except UnsupportedFamilyError as exc:
        return str(exc)
    except Exception as exc:  # a modeling module that fails to import or build here
        return f"{model_type}: {type(exc).__name__}: {exc}"


def _bare_refusal(model_type: str, backend: Backend, slot: str) -> str | None:
    family = _bare(model_type)
    if isinstance(family, str):
        return family
    try:
        return backend.unsupported(family, slot)
    except UnsupportedFamilyError as exc:
        return str(exc)
    except Exception as exc:  # a modeling module that fails to import or build here
        return f"{model_type}: {type(exc).__name__}: {exc}"


def _kept(family: Family) -> str | None:
    return f"{family.layer.kept_layers} stay the original's" if family.layer.kept_layers else None


def _language_model_type(model_type: str) -> str | None:
    """The model type of the text config ``model_type``'s causal LM is built from, where
    that causal LM is the language model alone (Mllama's ``MllamaForCausalLM`` takes the
    ``mllama_text_model`` config); ``None`` otherwise. Reads configuration classes only."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    causal_lm = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type, "")
    if not causal_lm.endswith("ForCausalLM"):
        return None
    try:
        text = CONFIG_MAPPING[model_type].sub_configs.get("text_config")
    except (KeyError, AttributeError):
        return None
    own = getattr(text, "model_type", None)
    return own if isinstance(own, str) and own != model_type else None


def _wrapped() -> dict[str, tuple[Family, str]]:
    """The multimodal wrappers proven on image or audio prompts: each one's text decoder
    family, and which medium it takes."""
    from layerswap.comparison.multimodal import WRAPPERS

    return {t: found for t in sorted(WRAPPERS) if (found := wrapper_family(t)) is not None}


def wrapper_family(model_type: str) -> tuple[Family, str] | None:
    """For a multimodal wrapper proven on image or audio prompts, the family covering its
    text decoder and the medium it takes (Llava: the ``llama`` family, ``"image"``);
    ``None`` for any other model type.

    Example::

        family, media = wrapper_family("llava")    # (Family(name="llama", ...), "image")
    """
    from layerswap.comparison.multimodal import WRAPPERS
    from layerswap.model_types import wrapped_model_type

    if model_type not in WRAPPERS:
        return None
    media = "audio" if "audio" in WRAPPERS[model_type] else "image"
    by_type = {family.model_type: family for family in families().values()}
    if model_type in by_type:  # a family of its own: the wrapper is its model (Qwen2-VL)
        return by_type[model_type], media
    text_type = wrapped_model_type(model_type)
    return (by_type[text_type], media) if text_type in by_type else None


def why_not_covered(model_type: str) -> str:
    """Why no registered family covers ``model_type`` (inference's reason), in a sentence.

    Inferring (and verifying, where the structure fits) takes up to a minute for a large
    multimodal config; the answer is stored beside the behaviour proofs
    (:mod:`layerswap.verdicts`), once per transformers, torch and layerswap release.
    """
    stored = _stored(model_type)
    if stored is not None:
        return stored
    reason = _infer_reason(model_type)
    _store(model_type, reason)
    return reason


def _stored(model_type: str) -> str | None:
    stored = verdicts.read(verdicts.key_for("coverage", model_type), kind="coverage")
    return str(stored["reason"]) if stored and isinstance(stored.get("reason"), str) else None


def _store(model_type: str, reason: str) -> None:
    record = {"model_type": model_type, "reason": reason}
    verdicts.write(verdicts.key_for("coverage", model_type), record, kind="coverage")


def infer_in_processes(
    model_types: list[str],
    jobs: int | None = None,
    on_step: Callable[[int, int, str], None] | None = None,
) -> None:
    """Infer ``model_types`` in ``jobs`` processes (default: one per CPU this process may
    use), storing each answer for :func:`why_not_covered` (see :func:`inferring`)."""
    with inferring(model_types, jobs, on_step):
        pass


@contextmanager
def inferring(
    model_types: list[str],
    jobs: int | None = None,
    on_step: Callable[[int, int, str], None] | None = None,
    *,
    family_types: tuple[str, ...] = (),
) -> Iterator[dict[str, dict[str, dict[str, str | None]]]]:
    """Infer ``model_types`` in ``jobs`` processes (default: one per CPU this process may
    use) while the block runs here; on leaving it, store each answer for
    :func:`why_not_covered` (``on_step(done, total, model_type)`` as each comes back). The
    slots below the decoder layer of ``family_types`` (registered families' model types)
    are asked there too: the dictionary yielded holds their answers on leaving
    (``{model_type: {slot: {backend: reason}}}``), empty where no process ran.

    Most of the time goes on importing each model type's modeling module and building its
    model on the meta device, so the work splits across processes. The processes are
    forked on entering, sharing the imports already made; that is safe only from a
    process running one thread, on Linux, that has not initialised CUDA (a forked process
    cannot use it: its answers would be that error). Anywhere else, with one job or a few
    model types, the block just runs and :func:`why_not_covered` infers each model type in
    this process. A process that fails leaves its model types unanswered: they are inferred
    here after, one by one.
    """
    jobs = fork_jobs(jobs, len(model_types))
    below: dict[str, dict[str, dict[str, str | None]]] = {}
    if not jobs:
        yield below
        return
    # what every modeling module imports (transformers' modeling, generation and
    # integrations, seconds): imported once here, before forking, not in each process
    importlib.import_module("transformers.modeling_utils")
    # on an error (or an interrupt) here, the model types not started are dropped; each
    # table of answers is written once, at the end
    with forked_pool(jobs) as pool, verdicts.kept_together():
        # the families' first: fewer model types, each asked of every slot's reading
        asked = {pool.submit(_collected, _family_answers, t): t for t in family_types}
        futures = {pool.submit(_collected, _answers_of, t): t for t in model_types}
        yield below
        for asking in as_completed(asked):
            try:
                below[asked[asking]] = _adopted(asking)
            except BrokenProcessPool:
                break  # what was not answered is asked in this process
        for done, future in enumerate(as_completed(futures)):
            model_type = futures[future]
            if on_step is not None:
                on_step(done, len(model_types), model_type)
            try:
                reason, slots = _adopted(future)
            except BrokenProcessPool:
                break  # what was not answered is inferred in this process
            _store(model_type, reason)
            for (slot, backend), answer in slots.items():
                kind, key = _SLOT_KIND.format(slot=slot), f"{backend}|{model_type}"
                verdicts.remember(kind, key, answer, module=_module_of(model_type))


def _collected(work: Callable[[str], Any], model_type: str) -> tuple[Any, dict[str, Any]]:
    """In a forked process: ``work(model_type)``, and what the declarations kept meanwhile."""
    with verdicts.collected() as found:
        return work(model_type), found


def _adopted(future: Future[tuple[Any, dict[str, Any]]]) -> Any:
    """A forked process's answer, what it kept now kept here too."""
    answer, found = future.result()
    verdicts.adopt(found)
    return answer


def _answers_of(model_type: str) -> tuple[str, dict[tuple[str, str], str | None]]:
    """In a forked process: why no family covers ``model_type``, and each backend's answer
    for each slot below the decoder layer (the modeling module is imported there once)."""
    slots = {
        (slot, name): _bare_refusal(model_type, backend, slot)
        for slot, name, backend in _below_decoder_slots(backends())
    }
    return _infer_reason(model_type), slots


def _family_answers(model_type: str) -> dict[str, dict[str, str | None]]:
    """In a forked process: each backend's answer for each slot below the decoder layer
    of the family covering ``model_type``."""
    family = {f.model_type: f for f in families().values()}[model_type]
    return _below_decoder(model_type, family, backends())


def _infer_reason(model_type: str) -> str:
    try:
        infer_family(model_type)
    except UnsupportedFamilyError as exc:
        return str(exc)
    except Exception as exc:  # a modeling module that fails to import or build here
        return f"{model_type}: {type(exc).__name__}: {exc}"
    return (
        "inferred and verified on a tiny model, but not builtin (the generated tests do not "
        f"run it): register_family(infer_family({model_type!r})), then verify it on your model"
    )


@dataclass(frozen=True)
class SlotCoverage:
    """One backend in one slot of a model: what it replaces and keeps, or why it cannot."""

    substitution: str
    backend: str
    slot: str
    #: why the backend has no substitution for this family and slot (``None``: it has)
    unsupported: str | None
    #: why the substitution cannot run on this machine (``None``: it can)
    unmet_requirement: str | None
    replaces: tuple[str, ...]
    keeps: tuple[str, ...]


@dataclass(frozen=True)
class ModelCoverage:
    """One model's family and, per backend and slot, the modules replaced and kept."""

    family: str
    source: str
    rows: tuple[SlotCoverage, ...]

    def as_dict(self) -> dict[str, Any]:
        """Plain data, as ``layerswap coverage --json`` prints it."""
        return {
            "family": self.family,
            "source": self.source,
            "rows": [
                row.__dict__ | {"replaces": list(row.replaces), "keeps": list(row.keeps)}
                for row in self.rows
            ],
        }


def model_coverage(target: str | Path | Family) -> ModelCoverage:
    """Which modules of a model each substitution replaces and which stay the original's.

    ``target`` is a family (or its name), a config JSON file, or a checkpoint directory
    (its ``config.json``). The model is built on the meta device (no memory, no weights).

    Example::

        for row in model_coverage("llama").rows:
            print(row.substitution, row.replaces, row.keeps)
    """
    family, config, source = _family_and_config(target)
    try:
        with torch.device("meta"):
            model = family.causal_lm_class()(config)
    except Exception as exc:
        if family.decoder:
            raise
        # a model type no family covers whose tiny model does not build: coverage's reason
        raise UnknownSubstitutionError(
            f"{family.model_type} is a transformers model type that layerswap does not "
            f"cover: {why_not_covered(family.model_type)}; the slots below its decoder "
            f"layers: {not_built(exc)}"
        ) from exc
    parts = model_parts(model, family)
    # a model type no family covers: its decoder layers are not, the slots below may be
    uncovered = None if family.decoder else why_not_covered(family.model_type)
    rows = []
    for backend in backends().values():
        for slot in slot_names():
            if slot not in backend.slots:
                continue
            name = f"{family.name}.{slot}.{backend.name}"
            if uncovered is not None and not takes_any_model_type(slot):
                reason: str | None = uncovered
            else:
                reason = _refusal(backend, family, slot)
            unmet = None if reason is not None else get(name).unmet_requirement()
            replaces, keeps = get_slot(slot).coverage(parts) if reason is None else ((), ())
            rows.append(SlotCoverage(name, backend.name, slot, reason, unmet, replaces, keeps))
    return ModelCoverage(family.name, source, tuple(rows))


def _refusal(backend: Backend, family: Family, slot: str) -> str | None:
    try:
        return backend.unsupported(family, slot)
    except UnsupportedFamilyError as exc:  # a bare family's slot that cannot read it
        return str(exc)


def _family_and_config(target: str | Path | Family) -> tuple[Family, PreTrainedConfig, str]:
    if isinstance(target, Family):
        return target, target.tiny_config(), "tiny config"
    path = Path(target)
    config_file = path / "config.json" if path.is_dir() else path
    if path.is_dir() and not config_file.is_file():
        raise CheckpointError(f"{path}: a directory without a config.json (no checkpoint there)")
    if not config_file.is_file():
        family = _family_of_type(str(target))
        return family, family.tiny_config(), "tiny config"
    try:
        read = json.loads(config_file.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as error:
        raise CheckpointError(f"{config_file}: not a readable config JSON ({error})") from error
    if not isinstance(read, dict):
        raise CheckpointError(
            f"{config_file}: a config is a JSON object, not {type(read).__name__}"
        )
    model_type = read.get("model_type")
    known = [f for f in families().values() if f.model_type == model_type]
    if not known and (not isinstance(model_type, str) or model_type not in _causal_lm_types()):
        raise UnknownSubstitutionError(
            f"{config_file} describes a {model_type!r} model, which is no causal-LM model "
            "type of the installed transformers (layerswap list --all lists them)"
        )
    family = known[0] if known else _family_of_type(str(model_type))
    return family, family.config_type().from_json_file(str(config_file)), str(config_file)


def _causal_lm_types() -> set[str]:
    return set(decoder_model_types())


def _family_of_type(name: str) -> Family:
    """The registered family ``name``, or the one covering model type ``name``, or a model
    type's bare family (its decoder layers covered by none: the slots below them may take
    it); a model type transformers has no causal LM for raises with the reason."""
    known = families()
    if name in known:
        return known[name]
    found = [family for family in known.values() if family.model_type == name]
    if found:
        return found[0]
    if name not in _causal_lm_types():
        return get_family(name)  # unknown: the registry's error, with close names
    from layerswap.model_types import bare_family

    return bare_family(name)
