"""Substitutions as data: model families, the registry, and class-level swaps.

A :class:`Family` is a short declaration of a transformers model family (where its
classes live and the structural features a backend needs). A :class:`Substitution`
names an original decoder layer, its replacement, the weight layout converter
between them, a requirement check and an upstream-structure check. Builtin
substitutions come from looping over families x backends (each backend module
offers ``substitution_for(family)``); other packages add theirs through the
entry-point group ``layerswap.substitutions``.

Example::

    import layerswap

    sub = layerswap.get("llama.decoder.fused")
    with layerswap.use(sub):
        model = LlamaForCausalLM(config)          # layers are FusedLlamaDecoderLayer
    with layerswap.replace_decoder(MyLayer):      # any class with the decoder-layer contract
        model = LlamaForCausalLM(config)
"""

from __future__ import annotations

import difflib
import importlib
import importlib.metadata
import inspect
import re
import threading
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from types import ModuleType
from typing import TYPE_CHECKING, Any

import torch

from layerswap.errors import (
    ConversionError,
    RequirementError,
    SubstitutionError,
    UnknownSubstitutionError,
    UpstreamDriftError,
)
from layerswap.patching import PatchGroup, Scoped
from layerswap.weights import LayoutConverter, is_extra_state

if TYPE_CHECKING:
    from transformers import PreTrainedConfig, PreTrainedModel

__all__ = [
    "ENTRY_POINT_GROUP",
    "Family",
    "Substitution",
    "SubstitutionUse",
    "applied",
    "check_signature",
    "check_structure",
    "families",
    "get",
    "get_family",
    "load_entry_points",
    "register",
    "register_family",
    "replace_decoder",
    "substitutions",
    "unregister",
    "unregister_family",
    "use",
]

ENTRY_POINT_GROUP = "layerswap.substitutions"


# "module:Class" -> the real original class while use() shows a replacement under that name
_SHADOWED: dict[str, type] = {}


def _resolve(spec: str) -> Any:
    """``"pkg.mod:Qual.name"`` -> the object (imports the module)."""
    shadowed = _SHADOWED.get(spec)
    if shadowed is not None:
        return shadowed
    module_name, _, qualname = spec.partition(":")
    obj: Any = importlib.import_module(module_name)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _transformers_version() -> str:
    import transformers

    return str(transformers.__version__)


def _suggest(name: str, known: Iterable[str]) -> str:
    known = sorted(known)
    close = difflib.get_close_matches(name, known, n=3, cutoff=0.5)
    hint = f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""
    return f"{hint} Known: {', '.join(known) or '(none)'}."


# --- families -----------------------------------------------------------------------

#: Llama's norms: one before attention, one before the MLP
PRE_NORMS: tuple[tuple[str, str], ...] = (
    ("attn_in", "input_layernorm"),
    ("mlp_in", "post_attention_layernorm"),
)
#: the places a norm can have in a decoder layer, in the order they apply
NORM_PLACES = ("attn_in", "attn_out", "mlp_in", "mlp_out")
#: Llama's projections, the ones the fused layer concatenates
SEPARATE_QKV = ("q_proj", "k_proj", "v_proj")
GATED_MLP = ("gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class Family:
    """A transformers model family, declared as data.

    Class names are resolved lazily from ``module``. A structural feature given as a
    string names the config attribute that switches it (``qkv_bias="attention_bias"``);
    a bool means the modeling code fixes it.

    Example::

        Family(
            name="qwen2", model_type="qwen2",
            module="transformers.models.qwen2.modeling_qwen2",
            decoder="Qwen2DecoderLayer", config_class="Qwen2Config",
            causal_lm="Qwen2ForCausalLM",
            qkv_bias=True, o_bias=False, mlp_bias=False,
        )
    """

    name: str
    model_type: str
    module: str
    decoder: str
    config_class: str
    causal_lm: str
    qkv_bias: bool | str = "attention_bias"
    o_bias: bool | str = "attention_bias"
    mlp_bias: bool | str = False
    #: q/k norms: ``True`` over each head with one weight for all heads (Qwen3),
    #: ``"head_weights"`` over each head with a weight per head (Cohere), ``"across"`` over
    #: all heads before they are split (OLMo 2), ``False`` none
    qk_norm: bool | str = False
    norm_offset: float = 0.0
    #: the norm: ``"rms"`` (RMSNorm), ``"layer"`` (LayerNorm with a bias: StarCoder2) or
    #: ``"layer_nobias"`` (mean-centred LayerNorm without a bias: Cohere)
    norm: str = "rms"
    activation: str = "hidden_act"
    #: the MLP: ``"gated"``, ``down(act(gate(x)) * up(x))``, or ``"plain"``, ``down(act(up(x)))``
    mlp: str = "gated"
    #: the original's MLP modules in that order: gated (gate, up, down), or (gate_up, down)
    #: where the original fuses them already (Phi-3); plain (up, down), Starcoder 2's
    #: ``("c_fc", "c_proj")``
    mlp_modules: tuple[str, ...] = GATED_MLP
    #: the original's q/k/v projections, or ``("qkv_proj",)`` where it fuses them (Phi-3)
    qkv_modules: tuple[str, ...] = SEPARATE_QKV
    #: where the decoder layer's norms sit: (place, module name) pairs, places
    #: ``attn_in`` / ``attn_out`` (around attention) and ``mlp_in`` / ``mlp_out``
    norms: tuple[tuple[str, str], ...] = PRE_NORMS
    #: the config field that switches the q/k norms on (Cohere's ``use_qk_norm``); ``None``:
    #: ``qk_norm`` alone decides
    qk_norm_switch: str | None = None
    #: attention and MLP in parallel, both reading the layer's input:
    #: ``x + attn(attn_in(x)) + mlp(mlp_in(x))`` (Cohere: both places name one norm)
    parallel: bool = False
    #: the rotary pairing of a head's dims: ``"half"`` (i, i + d/2), Llama's rotate-half, or
    #: ``"interleaved"`` (2i, 2i + 1) with the model's cos/sin applied as they come (Cohere),
    #: or ``"interleaved_from_half"``, (2i, 2i + 1) with the first half of cos/sin
    #: repeated pairwise, as GLM applies the rotate-half layout it is given
    rotary: str = "half"
    tiny: Mapping[str, Any] = field(default_factory=dict, compare=False, hash=False)
    description: str = field(default="", compare=False)

    def norm_at(self, place: str) -> str | None:
        """The name of the norm at ``place`` (``"attn_in"`` ...), or ``None``."""
        return dict(self.norms).get(place)

    def flag(self, feature: str, config: PreTrainedConfig) -> bool:
        """Whether ``feature`` (e.g. ``"qkv_bias"``) is on for ``config``."""
        value = getattr(self, feature)
        if feature == "qk_norm":
            switch = self.qk_norm_switch
            return bool(value) and (switch is None or bool(getattr(config, switch, False)))
        if isinstance(value, str):
            return bool(getattr(config, value, False))
        return bool(value)

    def modeling_module(self) -> ModuleType:
        """The family's modeling module (imported on first use)."""
        return importlib.import_module(self.module)

    def _class(self, name: str) -> type:
        try:
            cls = _resolve(f"{self.module}:{name}")
        except (ImportError, AttributeError) as exc:
            raise UpstreamDriftError(
                f"{self.name}: transformers {_transformers_version()} has no {name} in "
                f"{self.module} ({exc})"
            ) from exc
        return cls  # type: ignore[no-any-return]

    def decoder_class(self) -> type[torch.nn.Module]:
        """The original decoder layer class."""
        return self._class(self.decoder)

    def config_type(self) -> type[PreTrainedConfig]:
        """The family's config class."""
        return self._class(self.config_class)

    def causal_lm_class(self) -> type[PreTrainedModel]:
        """The family's causal LM class."""
        return self._class(self.causal_lm)

    def tiny_config(self, **overrides: Any) -> PreTrainedConfig:
        """A tiny config of this family (several layers, grouped-query attention).

        Example::

            config = layerswap.families()["llama"].tiny_config(num_hidden_layers=2)
        """
        return self.config_type()(**{**self.tiny, **overrides})

    def build(self, config: PreTrainedConfig | None = None, *, seed: int = 0) -> PreTrainedModel:
        """A causal LM with random weights from ``seed``, in eval mode.

        Norm weights and biases are perturbed away from their 1/0 initialisation, so a
        converter or layer that drops a bias or ignores a norm shows in a comparison.
        The global RNG state is left as it was.

        Example::

            model = layerswap.families()["qwen3"].build(seed=1)
        """
        config = self.tiny_config() if config is None else config
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = self.causal_lm_class()(config)
            with torch.no_grad():
                for name, param in model.named_parameters():
                    if param.dim() != 1 or param.is_meta:
                        continue
                    if "norm" in name:
                        param.add_(torch.randn_like(param), alpha=0.1)
                    elif name.endswith("bias"):
                        param.normal_(0.0, 0.1)
        return model.eval()


_FAMILIES: dict[str, Family] = {}
_LOCK = threading.RLock()


def families() -> dict[str, Family]:
    """All known families by name (builtin ones and those added by :func:`register_family`)."""
    _ensure_loaded()
    return dict(_FAMILIES)


def get_family(name: str | Family) -> Family:
    """The family called ``name``; unknown names raise :class:`UnknownSubstitutionError`."""
    if isinstance(name, Family):
        return name
    _ensure_loaded()
    try:
        return _FAMILIES[name]
    except KeyError:
        raise UnknownSubstitutionError(
            f"no model family named {name!r}{_suggest(name, _FAMILIES)}"
        ) from None


def register_family(family: Family, *, replace: bool = False) -> list[Substitution]:
    """Add a family and register every builtin backend's substitution for it.

    Returns the substitutions registered. Example::

        register_family(Family(name="ministral", model_type="ministral", ...))
        layerswap.swap(model, backend="fused")
    """
    _ensure_loaded()
    with _LOCK:
        if family.name in _FAMILIES and not replace and _FAMILIES[family.name] != family:
            raise SubstitutionError(
                f"a family named {family.name!r} is already registered; pass replace=True"
            )
        _FAMILIES[family.name] = family
        added = []
        for sub in _backend_substitutions(family):
            register(sub, replace=replace)
            added.append(sub)
        return added


def unregister_family(name: str) -> Family:
    """Remove the family called ``name`` and every substitution registered for it.

    Example::

        unregister_family("ministral")
    """
    _ensure_loaded()
    with _LOCK:
        family = get_family(name)
        for sub_name in [key for key, sub in _REGISTRY.items() if sub.family == family.name]:
            del _REGISTRY[sub_name]
        del _FAMILIES[family.name]
        return family


# --- substitutions ------------------------------------------------------------------


def _runs_anywhere() -> str | None:
    return None


def check_signature(sub: Substitution, config: PreTrainedConfig) -> None:
    """The original layer still takes ``position_embeddings`` (the transformers 5 contract)."""
    original = sub.original_class()
    parameters = inspect.signature(original.forward).parameters
    if "position_embeddings" not in parameters:
        raise UpstreamDriftError(
            f"{sub.family}: {original.__name__}.forward in transformers "
            f"{_transformers_version()} no longer takes position_embeddings "
            f"(it takes {list(parameters)}); {sub.name} follows the older contract"
        )


def check_structure(sub: Substitution, config: PreTrainedConfig) -> None:
    """The original layer's tensors are those the converter maps onto the replacement's.

    Builds both layers for ``config`` on the meta device (no memory, no init), runs
    the converter over the original's tensors, and compares names and shapes with
    the replacement's; then converts back. Raises :class:`UpstreamDriftError`
    naming the family, what differs and the transformers version.
    """
    check_signature(sub, config)
    version = _transformers_version()
    original_cls = sub.original_class()
    where = f"{sub.family}: {original_cls.__name__} in transformers {version}"
    with torch.device("meta"):
        original = original_cls(config, 0)
    original_state = original.state_dict()
    try:
        converted = sub.converter.to_replacement(original_state, config)
    except ConversionError as exc:
        raise UpstreamDriftError(
            f"{where} does not have the structure {sub.name} assumes: {exc}"
        ) from exc
    try:
        with torch.device("meta"):
            replacement = sub.replacement_class()(config, 0)
    except RequirementError:
        raise
    except Exception:
        # some replacements cannot be built on the meta device; the converter check stands
        return
    expected = {
        key: tuple(value.shape)
        for key, value in replacement.state_dict().items()
        if not is_extra_state(key)
    }
    produced = {key: tuple(value.shape) for key, value in converted.items()}
    problems = []
    for key in sorted(set(produced) - set(expected)):
        problems.append(f"{key!r} {produced[key]} has no place in the replacement")
    for key in sorted(set(expected) - set(produced)):
        problems.append(f"the replacement's {key!r} {expected[key]} gets no tensor")
    for key in sorted(set(expected) & set(produced)):
        if expected[key] != produced[key]:
            problems.append(f"{key!r} converts to {produced[key]}, replacement has {expected[key]}")
    if problems:
        raise UpstreamDriftError(
            f"{where} does not have the structure {sub.name} assumes: " + "; ".join(problems)
        )
    try:
        back = sub.converter.to_original(converted, config)
    except ConversionError as exc:
        raise UpstreamDriftError(f"{where}: {sub.name} cannot convert back: {exc}") from exc
    if {k: tuple(v.shape) for k, v in back.items()} != {
        k: tuple(v.shape) for k, v in original_state.items()
    }:
        raise UpstreamDriftError(
            f"{where}: {sub.name} does not convert back to the original layout"
        )


@dataclass(frozen=True)
class Substitution:
    """One reversible layer substitution, as data. Derive variants with ``dataclasses.replace``.

    ``converter`` maps one decoder layer's state dict (layer-relative keys) between
    the original and the replacement layout, both ways. ``requirement()`` returns a
    human reason when the replacement cannot run here, else ``None``. ``upstream``
    checks that the installed transformers still has the structure the converter
    assumes (:func:`check_structure` by default).

    Example::

        sub = layerswap.get("llama.decoder.fused")
        mine = dataclasses.replace(sub, name="llama.decoder.mine", replacement=MyLayer)
        layerswap.register(mine)
    """

    name: str
    family: str
    backend: str
    original: str
    replacement: type[torch.nn.Module] | str
    converter: LayoutConverter
    requirement: Callable[[], str | None] = _runs_anywhere
    upstream: Callable[[Substitution, PreTrainedConfig], None] | None = check_structure
    description: str = ""
    #: what it replaces: ``"decoder"`` (every decoder layer) or ``"head"`` (the causal LM's
    #: head and loss, a class swap of the model: :mod:`layerswap.heads`)
    slot: str = "decoder"

    def unmet_requirement(self) -> str | None:
        """Why this substitution cannot run here, or ``None`` when it can."""
        return self.requirement()

    def original_class(self) -> type[torch.nn.Module]:
        """The original layer class; :class:`UpstreamDriftError` if transformers lost it."""
        try:
            return _resolve(self.original)  # type: ignore[no-any-return]
        except (ImportError, AttributeError) as exc:
            raise UpstreamDriftError(
                f"{self.family}: {self.original} cannot be found in transformers "
                f"{_transformers_version()} ({exc}); {self.name} needs it"
            ) from exc

    def replacement_class(self) -> type[torch.nn.Module]:
        """The replacement layer class; :class:`RequirementError` if it cannot run here."""
        reason = self.unmet_requirement()
        if reason is not None:
            raise RequirementError(f"{self.name} cannot run here: {reason}")
        if not isinstance(self.replacement, str):
            return self.replacement
        try:
            return _resolve(self.replacement)  # type: ignore[no-any-return]
        except (ImportError, AttributeError) as exc:
            raise RequirementError(
                f"{self.name} cannot run here: {self.replacement} cannot be imported ({exc})"
            ) from exc

    def check_upstream(self, config: PreTrainedConfig) -> None:
        """Raise :class:`UpstreamDriftError` if the original no longer fits the converter."""
        if self.upstream is None:
            check_signature(self, config)
        else:
            self.upstream(self, config)

    def family_spec(self) -> Family:
        """The :class:`Family` this substitution applies to."""
        return get_family(self.family)

    def __str__(self) -> str:
        return self.name


_REGISTRY: dict[str, Substitution] = {}
_LOADED = False


def _backend_substitutions(family: Family) -> list[Substitution]:
    from layerswap.backends import BUILTIN_BACKENDS, backend_module, backend_substitutions

    found: list[Substitution] = []
    for backend in BUILTIN_BACKENDS:
        module = backend_module(backend)
        if module is not None:
            found.extend(backend_substitutions(module, family))
    return found


def _ensure_loaded() -> None:
    global _LOADED
    if _LOADED:
        return
    with _LOCK:
        if _LOADED:
            return
        from layerswap.families import BUILTIN_FAMILIES

        builtin = BUILTIN_FAMILIES
        for family in builtin:
            _FAMILIES.setdefault(family.name, family)
        # set before the loops below: they call register(), which calls back here
        _LOADED = True
        for family in builtin:
            for sub in _backend_substitutions(family):
                _REGISTRY.setdefault(sub.name, sub)
        load_entry_points()


def register(sub: Substitution, *, replace: bool = False) -> Substitution:
    """Add ``sub`` to the registry under ``sub.name`` and return it.

    Registering a different substitution under a taken name raises
    :class:`SubstitutionError` unless ``replace=True``. Example::

        layerswap.register(dataclasses.replace(layerswap.get("llama.decoder.fused"),
                                               name="llama.decoder.mine", replacement=MyLayer))
    """
    if not isinstance(sub, Substitution):
        raise TypeError(f"register() takes a Substitution, not {type(sub).__name__}")
    if not re.fullmatch(r"[\w.\-]+", sub.name):
        raise SubstitutionError(
            f"substitution name {sub.name!r} must be letters, digits, '_', '-' and '.'"
        )
    _ensure_loaded()
    with _LOCK:
        existing = _REGISTRY.get(sub.name)
        if existing is not None and existing != sub and not replace:
            raise SubstitutionError(
                f"a different substitution is already registered as {sub.name!r}; "
                "pass replace=True to replace it"
            )
        _REGISTRY[sub.name] = sub
    return sub


def unregister(name: str) -> Substitution:
    """Remove a substitution from the registry and return it."""
    _ensure_loaded()
    with _LOCK:
        if name not in _REGISTRY:
            raise UnknownSubstitutionError(
                f"no substitution named {name!r}{_suggest(name, _REGISTRY)}"
            )
        return _REGISTRY.pop(name)


def get(name: str | Substitution) -> Substitution:
    """The registered substitution called ``name`` (a :class:`Substitution` is returned as is).

    Unknown names raise :class:`UnknownSubstitutionError` listing the closest names.
    Example::

        sub = layerswap.get("llama.decoder.fused")
    """
    if isinstance(name, Substitution):
        return name
    if not isinstance(name, str):
        raise TypeError(f"get() takes a name or a Substitution, not {type(name).__name__}")
    _ensure_loaded()
    try:
        return _REGISTRY[name]
    except KeyError:
        raise UnknownSubstitutionError(
            f"no substitution named {name!r}{_suggest(name, _REGISTRY)}"
        ) from None


def substitutions(family: str | None = None, backend: str | None = None) -> list[Substitution]:
    """Registered substitutions, sorted by name, optionally filtered by family and backend.

    Example::

        [s.name for s in layerswap.substitutions(backend="fused")]
    """
    _ensure_loaded()
    with _LOCK:
        found = list(_REGISTRY.values())
    return sorted(
        (
            sub
            for sub in found
            if (family is None or sub.family == family)
            and (backend is None or sub.backend == backend)
        ),
        key=lambda sub: sub.name,
    )


def _as_substitutions(obj: Any, origin: str) -> list[Substitution]:
    if isinstance(obj, Substitution):
        return [obj]
    if callable(obj) and not isinstance(obj, Iterable):
        return _as_substitutions(obj(), origin)
    if isinstance(obj, Iterable) and not isinstance(obj, (str, bytes)):
        items = list(obj)
        if all(isinstance(item, Substitution) for item in items):
            return items
    raise SubstitutionError(
        f"entry point {origin} must give a Substitution, an iterable of them, or a "
        f"zero-argument callable returning either; it gave {type(obj).__name__}"
    )


def load_entry_points() -> list[Substitution]:
    """Register substitutions from the ``layerswap.substitutions`` entry points.

    Called on first use of the registry; call it again after installing a plugin in
    a running process. A plugin that fails to load is skipped with a warning naming
    it, so one broken package does not take the registry down. Returns what was
    registered.

    A plugin declares, e.g. in ``pyproject.toml``::

        [project.entry-points."layerswap.substitutions"]
        mine = "my_pkg.layers:substitutions"   # a Substitution, an iterable, or a callable
    """
    added = []
    for entry_point in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        origin = f"{entry_point.name!r} ({entry_point.value})"
        try:
            subs = _as_substitutions(entry_point.load(), origin)
            for sub in subs:
                if _REGISTRY.get(sub.name) == sub:
                    continue
                register(sub)
                added.append(sub)
        except Exception as exc:
            warnings.warn(
                f"layerswap: skipping the substitution plugin {origin}: {exc}",
                RuntimeWarning,
                stacklevel=2,
            )
    return added


# --- class-level swaps for construction --------------------------------------------


class SubstitutionUse(PatchGroup):
    """The patches :func:`use` starts for one substitution; ``repr`` says which."""

    def __init__(self, substitution: Substitution, members: Iterable[Scoped]) -> None:
        super().__init__(members)
        self.substitution = substitution

    def _label(self) -> str:
        return f"use({self.substitution.name!r})"

    def _copy(self) -> SubstitutionUse:
        return SubstitutionUse(self.substitution, (m._copy() for m in self.members))


def applied() -> tuple[Substitution, ...]:
    """The substitutions whose :func:`use` (or :func:`replace_decoder`) is live here, oldest first.

    Example::

        with layerswap.use("llama.decoder.fused"):
            [s.name for s in applied()]   # ["llama.decoder.fused"]
    """
    from layerswap.patching import active_patches

    found: list[Substitution] = []
    for info in active_patches():
        if isinstance(info.patch, SubstitutionUse) and info.patch.substitution not in found:
            found.append(info.patch.substitution)
    return tuple(found)


def use(substitution: str | Substitution) -> SubstitutionUse:
    """Construct models with the replacement layer: a scoped, class-level swap.

    Inside the block the family's original decoder class name is patched to the
    replacement, so ``Model(config)`` and ``from_pretrained`` build replacement
    layers directly (no second copy of the weights). ``from_pretrained`` converts an
    original-layout checkpoint while loading; ``save_pretrained`` of such a model
    writes the original layout again, at any later time. Hidden-state capture
    (``output_hidden_states``) and ``device_map`` splitting keep working.

    Example::

        with layerswap.use("llama.decoder.fused"):
            model = LlamaForCausalLM.from_pretrained(path)
        model.save_pretrained(out)      # loadable by plain transformers
    """
    from layerswap.patching import patch, patch_dict, wrap
    from layerswap.swap import adopt_constructed, loading_transforms

    sub = get(substitution)
    if sub.slot == "head":
        from layerswap.heads import head_use

        return SubstitutionUse(sub, head_use(sub))
    replacement = sub.replacement_class()
    original = sub.original_class()  # fails now, not at construction, if transformers lost it

    def adopt(wrapped: Callable[..., Any], instance: Any, args: Any, kwargs: Any) -> Any:
        result = wrapped(*args, **kwargs)
        adopt_constructed(instance, sub, replacement)
        return result

    def with_conversions(wrapped: Callable[..., Any], instance: Any, args: Any, kwargs: Any) -> Any:
        transforms = list(wrapped(*args, **kwargs))
        model = args[0] if args else kwargs["model"]
        return transforms + loading_transforms(model, sub, replacement, transforms)

    return SubstitutionUse(
        sub,
        (
            # checks and swap() inside the block still find the real original class
            patch_dict(_SHADOWED, {sub.original: original}),
            patch(sub.original, replacement),
            wrap("transformers.modeling_utils:PreTrainedModel.post_init", adopt),
            wrap("transformers.modeling_utils:get_model_conversion_mapping", with_conversions),
        ),
    )


def _infer_family(decoder_cls: type) -> str:
    known = families()
    for klass in decoder_cls.__mro__:
        for family in known.values():
            if klass.__name__ == family.decoder:
                return family.name
    lowered = decoder_cls.__name__.lower()
    # longest first: "qwen3" before "qwen2" never matters, "ministral" before "mistral" does
    for name in sorted(known, key=len, reverse=True):
        if re.sub(r"[^0-9a-z]", "", name) in lowered:
            return name
    return "llama"


def replace_decoder(
    decoder_cls: type[torch.nn.Module], family: str | None = None
) -> SubstitutionUse:
    """Build every decoder layer of ``family`` as ``decoder_cls`` inside the block.

    ``decoder_cls(config, layer_idx)`` must follow the transformers decoder-layer
    contract. The family is inferred from the class's bases or name when not
    given (default ``"llama"``). Weights are not converted: checkpoint keys must
    match the class's own parameter names.

    Example::

        with layerswap.replace_decoder(TELlamaDecoderLayer):
            model = LlamaForCausalLM(config)   # layers are TELlamaDecoderLayer
        # LlamaDecoderLayer is back here, also if the block raised
    """
    from layerswap.weights import Converter

    spec = get_family(family if family is not None else _infer_family(decoder_cls))
    sub = Substitution(
        name=f"{spec.name}.decoder.{decoder_cls.__qualname__}",
        family=spec.name,
        backend="custom",
        original=f"{spec.module}:{spec.decoder}",
        replacement=decoder_cls,
        converter=Converter(),
        upstream=None,
        description=f"{decoder_cls.__module__}.{decoder_cls.__qualname__} via replace_decoder",
    )
    return use(sub)
