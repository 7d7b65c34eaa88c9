"""The behaviour check: a tiny model of the family, original against replacement, once per versions.

The static checks (:func:`layerswap.substitution.check_structure`) see what the original
layer holds and what it is called with; they cannot see what it does. So at first use of
a substitution on a (transformers, torch, layerswap) combination, and for a kind of config,
not yet proven, :func:`ensure_proven` builds a tiny model from the user's own config, only
its sizes shrunk (every other field kept: a field that switches a feature on must be
proven with it on), and runs it with original layers and with replacement layers holding
the same weights:

1. forward on a left-padded batch (the logits at every real token),
2. prefill and greedy decoding with a dynamic cache (every step's logits),
3. the same with a static cache,
4. a backward pass (the loss and the gradients of the embeddings and the head).

The verdict is stored (:mod:`layerswap.verdicts`), so the cost, well under a second per
family on a laptop CPU, is paid once. A failed check raises
:class:`~layerswap.errors.UpstreamDriftError` naming the versions and the first check that
differs, before the model is changed.

Example::

    from layerswap import proof

    verdict = proof.prove(layerswap.get("llama.decoder.fused"), model.config)
    verdict.passed, verdict.check, verdict.seconds      # (True, None, 0.4)
"""

from __future__ import annotations

import contextvars
import copy
import dataclasses
import hashlib
import json
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from layerswap import verdicts
from layerswap.errors import SwapWarning, UnsupportedFamilyError, UpstreamDriftError
from layerswap.layers import convert_layer, layer_index, normal_tensors
from layerswap.model import decoder_layers, layer_config, locate
from layerswap.registry import backend_of, get, get_family
from layerswap.slots import get_slot
from layerswap.tokens import avoid_tokens, media_tokens

if TYPE_CHECKING:
    from transformers import PreTrainedConfig

    from layerswap.family import Family
    from layerswap.substitution import Substitution

__all__ = [
    "CHECKS",
    "SIZE_FIELDS",
    "Verdict",
    "comparing",
    "ensure_proven",
    "prove",
    "proven_here",
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
#: window sizes shrunk so the tiny prompt crosses them, as a long one would
_WINDOW_FIELDS = ("sliding_window", "attention_chunk_size")
_PROOF_WINDOW = 4
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
#: the checks, in the order they run
CHECKS = (
    "forward on a left-padded batch",
    "prefill and decode with a dynamic cache",
    "prefill and decode with a static cache",
    "backward",
)
_NEW_TOKENS = 3
_SEQUENCE = 8
_PADDING = 3

# a proof builds models: the use() hooks it passes through must not prove again
_PROVING: contextvars.ContextVar[bool] = contextvars.ContextVar("layerswap_proving", default=False)
_LOCK = threading.RLock()
#: verdicts of this process by key, so an unwritable cache directory costs one proof each
_MEMO: dict[str, Verdict] = {}


@dataclass(frozen=True)
class Verdict:
    """What a proof found: ``passed``, else the first ``check`` that differs and how."""

    substitution: str
    passed: bool
    check: str | None
    detail: str
    seconds: float
    versions: dict[str, str]
    #: which config was proven: ``"shrunk"`` (the user's) or ``"family"`` (the family's tiny)
    config: str = "shrunk"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Verdict:
        fields = {field.name for field in dataclasses.fields(cls)}
        return cls(**{key: value for key, value in data.items() if key in fields})

    def config_message(self) -> str:
        """One line for a verdict that failed on a config although the family's tiny
        config passes: the config selects structure the family does not describe."""
        return (
            f"{self.substitution} does not compute what the original does for this model's "
            f"config: {self.check} differs ({self.detail}), while the family's own tiny "
            "config is proven equal on these versions. A field of this "
            "config selects structure the family does not describe (another norm, "
            "activation or attention variant): this model cannot take the substitution"
        )

    def message(self) -> str:
        """One line: what was proven, on which versions, and the first difference."""
        on = ", ".join(f"{name} {version}" for name, version in self.versions.items())
        if self.passed:
            return f"{self.substitution}: proven equal to the original on {on}"
        return (
            f"{self.substitution} does not behave like the original on {on}: "
            f"{self.check} differs ({self.detail}). The layer contract changed in a way "
            "this layerswap does not follow; upgrade layerswap, or install a transformers "
            "release it supports (docs/compatibility.md)"
        )


# --- the config proven ------------------------------------------------------------------


def shrunk_config(family: Family, config: PreTrainedConfig) -> PreTrainedConfig:
    """``config`` with its sizes set to ``family``'s tiny values and every other field kept.

    Lists with one entry per layer (``layer_types``) are cut to the tiny layer count;
    sliding windows shrink to 4 tokens, so the proof's prompt crosses them; special token
    ids outside the tiny vocabulary are dropped. Example::

        tiny = shrunk_config(get_family("llama"), LlamaConfig.from_pretrained(path))

    For a :attr:`~layerswap.family.Family.composite` family, ``config`` (the wrapper's, or
    the text config its layers read) gives the text config, shrunk so; the rest (the
    vision tower, its tokens) is the family's tiny config.
    """
    if family.composite:
        tiny_wrapper = family.tiny_config()
        text = _shrunk_text(tiny_wrapper.get_text_config(), layer_config(config))
        return family.config_type()(**{**family.tiny, "text_config": text.to_dict()})
    return _shrunk_text(family.tiny_config(), config)


def _shrunk_text(tiny_config: PreTrainedConfig, config: PreTrainedConfig) -> PreTrainedConfig:
    values = config.to_dict()
    layers = values.get("num_hidden_layers")
    tiny = tiny_config.to_dict()
    for name in SIZE_FIELDS:
        if name in values and name in tiny:
            values[name] = tiny[name]
    if isinstance(layers, int) and layers < values["num_hidden_layers"]:
        values["num_hidden_layers"] = layers  # fewer layers than the tiny config: kept
    if "head_dim" in values and "head_dim" not in tiny:
        values["head_dim"] = tiny["hidden_size"] // tiny["num_attention_heads"]
    new_layers = values.get("num_hidden_layers")
    for name, value in list(values.items()):
        if isinstance(value, list) and layers and len(value) == layers and name != "architectures":
            values[name] = value[:new_layers]
    for name in _WINDOW_FIELDS:
        if isinstance(values.get(name), int) and values[name] > _PROOF_WINDOW:
            values[name] = _PROOF_WINDOW
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
    shrunk = type(config).from_dict(values)
    shrunk._attn_implementation = getattr(config, "_attn_implementation", None)
    return shrunk


def config_kind(config: PreTrainedConfig) -> str:
    """A digest of ``config``'s fields that are neither sizes nor metadata: its kind."""
    values = {
        key: value
        for key, value in config.to_dict().items()
        if key not in SIZE_FIELDS and key not in _METADATA and not key.startswith("_")
    }
    values["model_type"] = getattr(config, "model_type", "")
    encoded = json.dumps(values, sort_keys=True, default=repr).encode()
    return hashlib.sha256(encoded).hexdigest()[:16]


def proof_key(sub: Substitution, config: PreTrainedConfig | None) -> str:
    """The verdict's key: versions, substitution, replacement class, config kind."""
    replacement = sub.replacement
    named = replacement if isinstance(replacement, str) else replacement.__qualname__
    parts = {
        **verdicts.versions(),
        "substitution": sub.name,
        "replacement": named,
        "config": "family" if config is None else config_kind(config),
    }
    encoded = json.dumps(parts, sort_keys=True).encode()
    safe = sub.name.replace("/", "_")
    return f"{safe}-{hashlib.sha256(encoded).hexdigest()[:20]}"


# --- the proof --------------------------------------------------------------------------


@contextmanager
def comparing() -> Iterator[None]:
    """Inside, :func:`ensure_proven` proves nothing: for a proof's own models, and for a
    comparison that is itself the proof (:func:`layerswap.verify` compares the user's
    model, its decoding included, and names the first divergent layer).

    Example::

        with comparing():
            swap(copy_of_model, sub)       # verify's candidate: its report is the verdict
    """
    token = _PROVING.set(True)
    try:
        yield
    finally:
        _PROVING.reset(token)


def _device(sub: Substitution) -> torch.device:
    backend = backend_of(sub)
    on_cpu = backend is None or "cpu" in backend.devices
    return torch.device("cpu" if on_cpu or not torch.cuda.is_available() else "cuda")


def _randomize(model: nn.Module) -> None:
    """Every tensor from the seeded generator: norms near their identity, biases small."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() >= 2:
                param.normal_(0.0, 0.05)
            elif "norm" in name:
                param.add_(torch.randn_like(param), alpha=0.1)
            else:
                param.normal_(0.0, 0.1)


def _original_model(
    family: Family, sub: Substitution, config: PreTrainedConfig, device: torch.device
) -> nn.Module:
    """A causal LM of ``config`` with original decoder layers, random from the seed."""
    model = family.causal_lm_class()(config)
    original = sub.original_class()
    for position, (name, layer) in enumerate(decoder_layers(model)):
        if type(layer) is not original:  # built inside use(): put an original there
            parent, key = locate(model, name)
            parent._modules[key] = original(layer_config(config), layer_index(layer, position))
    _randomize(model)
    placed: nn.Module = model.to(device=device, dtype=torch.float32)
    return placed.eval()


def _swapped_copy(model: nn.Module, sub: Substitution, config: PreTrainedConfig) -> nn.Module:
    candidate = copy.deepcopy(model)
    for position, (name, layer) in enumerate(decoder_layers(candidate)):
        replacement = convert_layer(
            layer, sub, config, layer_idx=layer_index(layer, position), detach=True
        )
        parent, key = locate(candidate, name)
        parent._modules[key] = replacement
    return candidate


def _batch(config: PreTrainedConfig, device: torch.device) -> dict[str, torch.Tensor]:
    text = layer_config(config)
    vocab = int(text.vocab_size)
    ids = torch.randint(3, vocab, (2, _SEQUENCE), device=device)
    # a wrapper's image or video token would ask for features the text prompt lacks
    ids = avoid_tokens(ids, media_tokens(config), vocab)
    mask = torch.ones_like(ids)
    mask[1, :_PADDING] = 0
    pad = getattr(text, "pad_token_id", None)
    ids[1, :_PADDING] = pad if isinstance(pad, int) else 0
    return {"input_ids": ids, "attention_mask": mask}


def _differs(reference: torch.Tensor, candidate: torch.Tensor, tolerance: float) -> str | None:
    if reference.shape != candidate.shape:
        return f"shapes {tuple(reference.shape)} and {tuple(candidate.shape)}"
    error = float((reference - candidate).abs().max()) if reference.numel() else 0.0
    scale = float(reference.abs().max()) if reference.numel() else 0.0
    if not error <= tolerance * (1.0 + scale):  # NaN fails too
        return f"max abs difference {error:.3g}"
    return None


def _forward(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(**batch).logits
    real: torch.Tensor = logits[batch["attention_mask"].bool()]
    return real


def _decode(model: nn.Module, batch: dict[str, torch.Tensor], cache: str | None) -> Any:
    # disable_compile: on a GPU, generate() with a static cache compiles the forward
    # (transformers' auto-compile); the proof compares what the layers compute, eagerly, the
    # same on every device (TransformerEngine 2.20's attention cannot be traced by torch
    # 2.11's dynamo: compiling would refuse te for a reason that is not the layer contract)
    options: dict[str, Any] = {"disable_compile": True}
    if cache:
        options["cache_implementation"] = cache
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return model.generate(  # type: ignore[operator]
            **batch,
            max_new_tokens=_NEW_TOKENS,
            min_new_tokens=_NEW_TOKENS,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=int(batch["input_ids"][1, 0]),
            **options,
        )


def _compare_decoding(
    reference: nn.Module, candidate: nn.Module, batch: dict[str, torch.Tensor], cache: str | None
) -> str | None:
    try:
        expected = _decode(reference, batch, cache)
    except Exception:  # the original cannot decode this way: nothing to compare
        return None
    try:
        actual = _decode(candidate, batch, cache)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    for step, (want, got) in enumerate(zip(expected.logits, actual.logits, strict=False)):
        problem = _differs(want, got, _tolerance(want))
        if problem:
            return f"new token {step + 1}: {problem}"
    if not torch.equal(expected.sequences, actual.sequences):
        return "different tokens generated"
    return None


def _gradients(model: nn.Module, batch: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    # no loss term predicted from a padded position (the one before the first real token
    # included): what a layer computes there is unspecified
    mask = batch["attention_mask"]
    before = torch.cat((torch.ones_like(mask[:, :1]), mask[:, :-1]), dim=1)
    labels = batch["input_ids"].masked_fill((mask == 0) | (before == 0), -100)
    loss = model(**batch, labels=labels).loss
    loss.backward()
    found = [loss.detach().reshape(1)]
    for module in (model.get_input_embeddings(), model.get_output_embeddings()):  # type: ignore[operator]
        grad = None if module is None else module.weight.grad
        if grad is not None:
            found.append(grad.detach().clone())
    model.zero_grad(set_to_none=True)
    return found


def _tolerance(reference: torch.Tensor) -> float:
    return 1e-4 if reference.device.type == "cpu" else 2e-3


def _compare_forward(
    reference: nn.Module, candidate: nn.Module, batch: dict[str, torch.Tensor]
) -> str | None:
    expected = _forward(reference, batch)
    return _differs(expected, _forward(candidate, batch), _tolerance(expected))


def _compare_backward(
    reference: nn.Module, candidate: nn.Module, batch: dict[str, torch.Tensor]
) -> str | None:
    names = ("loss", "embedding gradient", "head gradient")
    pairs = zip(_gradients(reference, batch), _gradients(candidate, batch), strict=True)
    for name, (want, got) in zip(names, pairs, strict=False):
        problem = _differs(want, got, _tolerance(want))
        if problem is not None:
            return f"{name}: {problem}"
    return None


def _run_checks(
    reference: nn.Module, candidate: nn.Module, batch: dict[str, torch.Tensor]
) -> tuple[str | None, str]:
    steps: tuple[Callable[[], str | None], ...] = (
        lambda: _compare_forward(reference, candidate, batch),
        lambda: _compare_decoding(reference, candidate, batch, None),
        lambda: _compare_decoding(reference, candidate, batch, "static"),
        lambda: _compare_backward(reference, candidate, batch),
    )
    for check, step in zip(CHECKS, steps, strict=True):
        try:
            problem = step()
        except Exception as exc:
            problem = f"{type(exc).__name__}: {exc}"
        if problem is not None:
            return check, problem
    return None, f"{len(CHECKS)} checks equal"


@normal_tensors
def _prove(sub: Substitution, family: Family, config: PreTrainedConfig | None) -> Verdict:
    started = time.perf_counter()
    device = _device(sub)
    kind = "shrunk"
    proven: PreTrainedConfig | None = None
    if config is not None:
        try:
            proven = shrunk_config(family, layer_config(config))
        except Exception:
            proven = None
    if proven is None:
        proven, kind = family.tiny_config(), "family"
    # on ``device`` even inside from_pretrained, which builds under torch.device("meta"):
    # the proof's models, and every tensor their forward passes create
    with (
        torch.random.fork_rng(devices=[device] if device.type == "cuda" else []),
        torch.device(device),
        comparing(),
    ):
        torch.manual_seed(0)
        check: str | None
        reference: nn.Module | None
        try:
            reference = _original_model(family, sub, proven, device)
        except Exception:
            # the shrunk config does not build (a size the shrink broke): the family's tiny
            proven, kind = family.tiny_config(), "family"
            reference = None
        try:
            if reference is None:
                reference = _original_model(family, sub, proven, device)
        except Exception as exc:  # nothing can be proven here: refused, with the reason
            check, detail = "building the tiny original model", f"{type(exc).__name__}: {exc}"
        else:
            candidate = _swapped_copy(reference, sub, proven)
            batch = _batch(proven, device)
            check, detail = _run_checks(reference, candidate, batch)
    return Verdict(
        substitution=sub.name,
        passed=check is None,
        check=check,
        detail=detail,
        seconds=round(time.perf_counter() - started, 3),
        versions=verdicts.versions(),
        config=kind,
    )


def prove(
    substitution: str | Substitution,
    config: PreTrainedConfig | None = None,
    *,
    force: bool = False,
) -> Verdict:
    """The verdict for ``substitution`` and ``config``'s kind: stored, else proven now.

    ``config`` is the user's (its sizes are shrunk); ``None`` proves the family's tiny
    config. ``force`` proves again whatever is stored. Example::

        verdict = prove("qwen3.decoder.fused", model.config)
        assert verdict.passed, verdict.message()
    """
    sub = get(substitution)
    key = proof_key(sub, config)
    with _LOCK:
        if not force:
            known = _MEMO.get(key)
            if known is None:
                stored = verdicts.read(key)
                known = Verdict.from_dict(stored) if stored is not None else None
            if known is not None:
                _MEMO[key] = known
                return known
        verdict = _prove(sub, get_family(sub.family), config)
        if verdict.config == "family" and config is not None:
            warnings.warn(
                f"{sub.name}: the proof could not build a tiny model from this config's "
                "fields, so it proved the family's tiny config instead",
                SwapWarning,
                stacklevel=3,
            )
        _MEMO[key] = verdict
        verdicts.write(key, verdict.to_dict())
        return verdict


def proven_here() -> dict[str, Verdict]:
    """The stored verdicts for the installed versions, by substitution name (a failed one
    wins over a passed one for another config kind).

    Example::

        {name: v.passed for name, v in proven_here().items()}   # {"llama.decoder.fused": True}
    """
    current = verdicts.versions()
    found: dict[str, Verdict] = {}
    for data in verdicts.stored():
        verdict = Verdict.from_dict(data)
        if verdict.versions != current:
            continue
        known = found.get(verdict.substitution)
        if known is None or (known.passed and not verdict.passed):
            found[verdict.substitution] = verdict
    return found


def ensure_proven(sub: Substitution, config: PreTrainedConfig | None) -> None:
    """Raise :class:`UpstreamDriftError` unless ``sub`` is proven for ``config``'s kind;
    :class:`UnsupportedFamilyError` when only ``config`` fails (the family's tiny config
    holds: a field of this config selects structure the family does not describe).

    Decoder-slot substitutions with an upstream check (the head's contract is read off its
    source; ``replace_decoder`` classes get no converted weights to compare). Runs
    the proof at first use on these versions (:func:`prove`); nothing inside a proof.

    Example::

        ensure_proven(layerswap.get("llama.decoder.fused"), model.config)
    """
    if not get_slot(sub.slot).proven_at_first_use or sub.upstream is None or _PROVING.get():
        return  # replace_decoder's classes take no converted weights: nothing to compare
    verdict = prove(sub, config)
    if verdict.passed:
        return
    if config is not None and verdict.config != "family" and prove(sub, None).passed:
        # the family's own tiny config holds: a field of this config is what differs
        raise UnsupportedFamilyError(verdict.config_message())
    raise UpstreamDriftError(verdict.message())
