"""The behaviour check: a tiny model of the family, original against replacement, once per versions.

The static checks (:func:`layerswap.substitution.check_structure`) see what the original
layer holds and what it is called with; they cannot see what it does. So at first use of
a substitution on a (transformers, torch, layerswap) combination, and for a kind of config,
not yet proven, :func:`ensure_proven` builds a tiny model from the user's own config, only
its sizes shrunk (every other field kept: a field that switches a feature on must be
proven with it on), and runs it with original layers and with replacement layers holding
the same weights:

1. forward on a left-padded batch (the logits at every real token),
2. forward on the same tokens without padding (the model passes its layers no mask: SDPA's
   causal path, where a layer's own idea of whether it is causal decides),
3. prefill and greedy decoding with a dynamic cache (every step's logits),
4. the same with a static cache,
5. a backward pass (the loss and every parameter's gradient, the replacement's mapped to
   the original's layout), in training mode where the original's training pass is
   deterministic (else in eval mode, once the replacement is seen random in training too,
   each dropout the config sets tried alone),
6. for a model computing in bfloat16 or float16, or run under ``torch.autocast``, the
   padded forward and its backward again in that dtype, held to twice (the gradients:
   eight times) the original's own rounding error against float32
   (:func:`~layerswap.comparison.first_difference.rounding_differs`),

each run and judged as :func:`layerswap.verify` runs and judges
(:mod:`layerswap.comparison.first_difference`), within
:meth:`~layerswap.comparison.tolerance.Tolerance.scaled` ``1e-4`` on a CPU, ``2e-3`` on a GPU.

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
import threading
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from layerswap import sources, verdicts, zero3
from layerswap.comparison.first_difference import (
    CHECKS,
    first_difference,
    random_in_training,
    regime,
    rounding_differs,
)
from layerswap.comparison.gradients import gradients_to_original
from layerswap.comparison.placement import dtype_name
from layerswap.comparison.tolerance import Tolerance
from layerswap.errors import (
    LayerswapError,
    SwapWarning,
    UnsupportedFamilyError,
    UpstreamDriftError,
)
from layerswap.layers import normal_tensors
from layerswap.model import dropout_fields, layer_config
from layerswap.placement import LOW_PRECISION, Placement, without_autocast
from layerswap.proof_key import original_module, proof_device, proof_key
from layerswap.registry import get
from layerswap.shrink import CODE_PATHS, SIZE_FIELDS, shrunk_config
from layerswap.substitution import Substitution
from layerswap.tokens import avoid_tokens, media_tokens
from layerswap.use import applied

if TYPE_CHECKING:
    from transformers import PreTrainedConfig

    from layerswap.family import Family

__all__ = [
    "CHECKS",
    "SIZE_FIELDS",
    "Verdict",
    "comparing",
    "ensure_proven",
    "prove",
    "proving",
    "proven_here",
    "changed_here",
    "proof_key",
    "shrunk_config",
]

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
    #: the transformers module the original layer lives in, and a digest of the source it
    #: runs (:mod:`layerswap.sources`): the verdict vouches for that source only
    module: str = ""
    source: str = ""
    #: the attention implementation the proof ran (``"sdpa"``, ``"eager"``)
    attention: str | None = None
    #: the low-precision dtype the model computes in, proven besides float32
    #: (``"bfloat16"``, ``"float16"``), ``None`` for a float32 model
    dtype: str | None = None
    #: the dtype ``torch.autocast`` runs the model's passes in, proven besides float32
    #: (Trainer's ``bf16=True``), ``None`` where the model runs without autocast
    autocast: str | None = None

    def changed_since(self) -> bool:
        """Whether the transformers source this verdict proved has changed since (an install
        from git main, a locally edited release: the version string stays the same)."""
        return bool(self.module) and sources.digest(self.module) != self.source

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
        if self.attention:
            on += f", attn_implementation={self.attention!r}"
        if self.dtype:
            on += f", in float32 and {self.dtype}"
        if self.autocast:
            on += f", and under autocast to {self.autocast}"
        if self.passed:
            return f"{self.substitution}: proven equal to the original on {on}"
        return (
            f"{self.substitution} does not behave like the original on {on}: "
            f"{self.check} differs ({self.detail}). The layer contract changed in a way "
            "this layerswap does not follow; upgrade layerswap, or install a transformers "
            "release it supports (docs/compatibility.md). Where transformers' code was "
            "patched in this process (another library's or your own patch of its modeling "
            "code, not made through layerswap.adopt), the original runs that code: the "
            "proof compared the swap with it"
        )


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


def proving() -> bool:
    """Whether this runs inside :func:`comparing` (a proof's own models, or a comparison
    that is itself the proof): a slot that proves at each swap proves nothing there.

    Example::

        with comparing():
            proving()      # True
    """
    return _PROVING.get()


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
    """A causal LM of ``config`` with the originals in ``sub``'s slot, random from the seed."""
    model = family.causal_lm_class()(config)
    sub.parts.slot.proof_reference(model, sub, config)  # built inside a use(): originals back
    _randomize(model)
    placed: nn.Module = model.to(device=device, dtype=torch.float32)
    return placed.eval()


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


def _tolerance(device: torch.device) -> Tolerance:
    # float32 on both sides: a swap only reorders roundings, and a GPU's kernels reorder more
    return Tolerance.scaled(1e-4 if device.type == "cpu" else 2e-3)


@normal_tensors
def _prove(
    sub: Substitution,
    config: PreTrainedConfig | None,
    device: torch.device,
    dtype: torch.dtype | None = None,
    autocast: torch.dtype | None = None,
) -> Verdict:
    started = time.perf_counter()
    family = sub.parts.family
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
    # and in float32 even inside the caller's torch.autocast (a proof at a forward pass
    # under Trainer's bf16=True): the autocast run is a check of its own, at the end
    with (
        torch.random.fork_rng(devices=[device] if device.type == "cuda" else []),
        torch.device(device),
        without_autocast(device),
        comparing(),
    ):
        torch.manual_seed(0)
        check: str | None
        reference: nn.Module | None
        try:
            reference = _original_model(family, sub, proven, device)
        except Exception as exc:
            _raise_if_another_use_refused(exc, sub)
            # the shrunk config does not build (a size the shrink broke): the family's tiny
            proven, kind = family.tiny_config(), "family"
            reference = None
        try:
            if reference is None:
                reference = _original_model(family, sub, proven, device)
        except Exception as exc:  # nothing can be proven here: refused, with the reason
            _raise_if_another_use_refused(exc, sub)
            check, detail = "building the tiny original model", f"{type(exc).__name__}: {exc}"
        else:
            candidate = sub.parts.slot.proof_candidate(reference, sub, proven)
            batch = _batch(proven, device)
            check, detail = first_difference(
                reference,
                candidate,
                batch,
                _tolerance(device),
                new_tokens=_NEW_TOKENS,
                candidate_context=sub.parts.slot.proof_context(sub),
                to_original=lambda model, grads: gradients_to_original(model, grads, sub),
            )
            if check is None:
                check, detail = _dropout_left_out(sub, proven, batch, device) or (None, detail)
            if check is None and (dtype in LOW_PRECISION or autocast in LOW_PRECISION):
                check, low = _rounding(reference, candidate, batch, dtype, autocast)
                detail = low if check is not None else f"{detail}; {low}"
    return Verdict(
        substitution=sub.name,
        passed=check is None,
        check=check,
        detail=detail,
        seconds=round(time.perf_counter() - started, 3),
        versions=verdicts.versions(),
        config=kind,
        module=original_module(sub),
        source=sources.digest(original_module(sub)),
        attention=getattr(proven, "_attn_implementation", None),
        dtype=dtype_name(dtype) if dtype in LOW_PRECISION else None,
        autocast=dtype_name(autocast) if autocast in LOW_PRECISION else None,
    )


def _raise_if_another_use_refused(exc: Exception, sub: Substitution) -> None:
    """Raise ``exc``, a refusal of layerswap's own, where another substitution's
    :func:`~layerswap.use` is in effect: it refused the proof's tiny model (the mlp slot
    refuses a model whose layers are the decoder slot's), which says nothing of ``sub``,
    and no verdict of ``sub`` may be kept for it."""
    if isinstance(exc, LayerswapError) and any(other.name != sub.name for other in applied()):
        raise exc


def _dropout_left_out(
    sub: Substitution,
    config: PreTrainedConfig,
    batch: dict[str, torch.Tensor],
    device: torch.device,
) -> tuple[str, str] | None:
    """Where ``config`` sets two dropouts or more: each alone (the others at 0), the
    original random in training and the replacement not, as ``(check, detail)``. The
    backward check sees the model as a whole: one dropout the replacement keeps (a
    residual dropout) hides another it leaves out (the attention's)."""
    fields = dropout_fields(config)
    if len(fields) < 2:
        return None
    family, slot = sub.parts.family, sub.parts.slot
    for kept in fields:
        alone = copy.deepcopy(config)
        text = layer_config(alone)
        for field in fields:
            if field != kept:
                setattr(text, field, 0.0)
        torch.manual_seed(0)
        reference = _original_model(family, sub, alone, device)
        candidate = slot.proof_candidate(reference, sub, alone)
        if random_in_training(reference, batch) and not random_in_training(
            candidate, batch, slot.proof_context(sub)
        ):
            return (
                "backward",
                f"with only {kept} set, the original computes at random in training and "
                "the swapped model does not: it leaves that dropout out",
            )
    return None


def _rounding(
    reference: nn.Module,
    candidate: nn.Module,
    batch: dict[str, torch.Tensor],
    dtype: torch.dtype | None,
    autocast: torch.dtype | None,
) -> tuple[str | None, str]:
    """The checks in the model's low-precision ``dtype`` and under its ``autocast`` (after
    the float32 checks, which they end: both models are cast), forward and backward, as
    ``(check, detail)``: the one that differs (``"forward in bfloat16"``), or ``None`` and
    the passes compared."""
    low = dtype if dtype in LOW_PRECISION else None
    cast = autocast if autocast in LOW_PRECISION else None
    where = regime(low, cast)
    try:
        found = rounding_differs(reference, candidate, batch, low, autocast=cast)
    except Exception as exc:
        return f"forward and backward {where}", f"{type(exc).__name__}: {exc}"
    if found.differs is None:
        return None, f"{' and '.join(found.compared)} {where} within its rounding bounds"
    return f"{found.differs[0]} {where}", found.differs[1]


def prove(
    substitution: str | Substitution,
    config: PreTrainedConfig | None = None,
    *,
    force: bool = False,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    autocast: torch.dtype | None = None,
) -> Verdict:
    """The verdict for ``substitution`` and ``config``'s kind: stored, else proven now.

    ``config`` is the user's (its sizes are shrunk); ``None`` proves the family's tiny
    config. ``force`` proves again whatever is stored. ``dtype``, the dtype the user's
    model computes in: bfloat16 or float16 is proven too (:data:`LOW_PRECISION`), after
    float32; ``autocast``, the one ``torch.autocast`` runs it in, likewise. ``device``,
    where it computes: the proof runs there where the substitution runs there (else as
    :func:`ensure_proven` would run it). Example::

        verdict = prove("qwen3.decoder.fused", model.config)
        assert verdict.passed, verdict.message()
    """
    # a name is the registry's to resolve; a substitution holds its parts already
    sub = substitution if isinstance(substitution, Substitution) else get(substitution)
    placement = Placement(dtype, None if device is None else torch.device(device), autocast)
    return _verdict(sub, config, force=force, placement=placement)


def _verdict(
    sub: Substitution,
    config: PreTrainedConfig | None,
    *,
    force: bool,
    placement: Placement | None = None,
) -> Verdict:
    placement = placement or Placement()
    device = proof_device(sub, placement.device)  # the key names it, and the proof runs on it
    dtype = placement.dtype if placement.dtype in LOW_PRECISION else None
    autocast = placement.autocast if placement.autocast in LOW_PRECISION else None
    key = proof_key(sub, config, device, dtype, autocast)
    with _LOCK:
        if not force:
            known = _MEMO.get(key)
            if known is None:
                stored = verdicts.read(key)
                known = Verdict.from_dict(stored) if stored is not None else None
            if known is not None:
                _MEMO[key] = known
                return known
        with zero3.outside_partitioning():  # tiny models stay whole inside zero.Init
            verdict = _prove(sub, config, device, dtype, autocast)
        _MEMO[key] = verdict
        if verdict.config == "family" and config is not None:
            warnings.warn(
                f"{sub.name}: the proof could not build a tiny model from this config's "
                "fields, so it proved the family's tiny config instead (this config's own "
                "fields are not proven)",
                SwapWarning,
                stacklevel=3,
            )
            # stored for what it checked, the family's tiny config: never as this config's
            # verdict, which another process would then take for a proof of it
            verdicts.write(proof_key(sub, None, device, dtype, autocast), verdict.to_dict())
            return verdict
        verdicts.write(key, verdict.to_dict())
        return verdict


def proven_here() -> dict[str, Verdict]:
    """The stored verdicts for the installed versions and transformers source, by
    substitution name (a failed one wins over a passed one for another config kind).

    A verdict whose source has changed since (:meth:`Verdict.changed_since`) is not here:
    it vouches for nothing now (:func:`changed_here`). Example::

        {name: v.passed for name, v in proven_here().items()}   # {"llama.decoder.fused": True}
    """
    return _stored_here(stale=False)


def changed_here() -> dict[str, Verdict]:
    """The verdicts stored for the installed versions whose transformers source has changed
    since they were proven (and that no verdict on the current source replaces), by
    substitution name: proven again at first use. Example::

        changed_here()   # {"llama.decoder.fused": Verdict(...)} after an edit of modeling_llama
    """
    current = _stored_here(stale=False)
    return {
        name: verdict for name, verdict in _stored_here(stale=True).items() if name not in current
    }


def _stored_here(*, stale: bool) -> dict[str, Verdict]:
    current = verdicts.versions()
    found: dict[str, Verdict] = {}
    for data in verdicts.stored():
        verdict = Verdict.from_dict(data)
        if verdict.versions != current or verdict.changed_since() != stale:
            continue
        known = found.get(verdict.substitution)
        if known is None or (known.passed and not verdict.passed):
            found[verdict.substitution] = verdict
    return found


def ensure_proven(
    sub: Substitution, config: PreTrainedConfig | None, placement: Placement | None = None
) -> None:
    """Raise :class:`UpstreamDriftError` unless ``sub`` is proven for ``config``'s kind,
    where the model computes (``placement``: in its dtype too where it is bfloat16 or
    float16, on its device where the substitution runs there);
    :class:`UnsupportedFamilyError` when only ``config`` fails (the family's tiny config
    holds: a field of this config selects structure the family does not describe).

    Decoder-slot substitutions with an upstream check (the head's contract is read off its
    source; ``replace_decoder`` classes get no converted weights to compare). Runs
    the proof at first use on these versions (:func:`prove`); nothing inside a proof.

    Example::

        ensure_proven(layerswap.get("llama.decoder.fused"), model.config)
    """
    if not sub.parts.slot.proves(sub) or sub.upstream is None or _PROVING.get():
        return  # replace_decoder's classes take no converted weights: nothing to compare
    verdict = _verdict(sub, config, force=False, placement=placement)
    if verdict.passed:
        return
    if (
        config is not None
        and verdict.config != "family"
        and _verdict(sub, _family_like(sub, config), force=False, placement=placement).passed
    ):
        # the family's own tiny config holds, run the same way (the same attention
        # implementation): a field of this config is what differs
        raise UnsupportedFamilyError(verdict.config_message())
    raise UpstreamDriftError(verdict.message())


def _family_like(sub: Substitution, config: PreTrainedConfig) -> PreTrainedConfig | None:
    """The family's tiny config, running the code paths ``config`` selects (its attention
    and experts implementations); ``None`` (the family's own) where it sets none."""
    text = layer_config(config)
    chosen = {name: getattr(text, name, None) for name in CODE_PATHS}
    if all(value is None for value in chosen.values()):
        return None
    tiny = sub.parts.family.tiny_config()
    for name, value in chosen.items():
        if value is not None:
            setattr(layer_config(tiny), name, value)
    return tiny
