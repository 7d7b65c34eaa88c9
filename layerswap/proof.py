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
3. forward on one sequence of 64 tokens alone (positions past the batch's 11, and a batch
   of one row: a kernel's path of its own for either),
4. prefill and greedy decoding with a dynamic cache (every step's logits),
5. the same with a static cache,
6. a backward pass (the loss and every parameter's gradient, the replacement's mapped to
   the original's layout), in training mode where the original's training pass is
   deterministic (else in eval mode, once the replacement is seen random in training too,
   each dropout the config sets tried alone),
7. for a model computing in bfloat16 or float16, or run under ``torch.autocast``, the
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

import threading
import warnings
from typing import TYPE_CHECKING

import torch

from layerswap import verdicts, zero3
from layerswap.comparison.first_difference import CHECKS
from layerswap.errors import (
    RequirementError,
    SwapWarning,
    UnsupportedFamilyError,
    UpstreamDriftError,
)
from layerswap.placement import Placement
from layerswap.proof_key import plan, proof_key
from layerswap.proof_run import Verdict, comparing, proving, run
from layerswap.registry import get
from layerswap.shrink import SIZE_FIELDS, family_like, shrunk_config
from layerswap.substitution import Substitution

if TYPE_CHECKING:
    from transformers import PreTrainedConfig

    from layerswap.config_view import ModelConfig

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

_LOCK = threading.RLock()
#: verdicts of this process by key, so an unwritable cache directory costs one proof each
_MEMO: dict[str, Verdict] = {}


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
    config: PreTrainedConfig | ModelConfig | None,
    *,
    force: bool,
    placement: Placement | None = None,
) -> Verdict:
    # worked out once: the keys name the device, and the proof runs on it
    proof = plan(sub, config, placement or Placement())
    with _LOCK:
        if not force:
            known = _MEMO.get(proof.key)
            if known is None:
                stored = verdicts.read(proof.key)
                known = Verdict.from_dict(stored) if stored is not None else None
            if known is not None:
                _MEMO[proof.key] = known
                return known
        with zero3.outside_partitioning():  # tiny models stay whole inside zero.Init
            verdict = run(proof)
        _MEMO[proof.key] = verdict
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
            verdicts.write(proof.family_key, verdict.to_dict())
            return verdict
        verdicts.write(proof.key, verdict.to_dict())
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
    sub: Substitution,
    config: PreTrainedConfig | ModelConfig | None,
    placement: Placement | None = None,
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
    if not sub.parts.slot.proves(sub) or sub.upstream is None or proving():
        return  # replace_decoder's classes take no converted weights: nothing to compare
    device = None if placement is None else placement.device
    if device is not None and device.type not in (*sub.devices, "cpu", "cuda"):
        # a CPU or CUDA model is proven where the substitution runs (moved after, proven
        # again there); on another device (mps, xpu) a verdict of the CPU's would vouch
        # for kernels that never ran in it
        raise RequirementError(
            f"{sub.name} is proven on {' or '.join(sub.devices)}, where its layers run; this "
            f"model computes on {device.type}, where no proof of it runs: swap it on "
            f"{sub.devices[0]}, or keep the original layers"
        )
    verdict = _verdict(sub, config, force=False, placement=placement)
    if verdict.passed:
        return
    if (
        config is not None
        and verdict.config != "family"
        and _verdict(
            sub, family_like(sub.parts.family, config), force=False, placement=placement
        ).passed
    ):
        # the family's own tiny config holds, run the same way (the same attention
        # implementation): a field of this config is what differs
        raise UnsupportedFamilyError(verdict.config_message())
    raise UpstreamDriftError(verdict.message())
