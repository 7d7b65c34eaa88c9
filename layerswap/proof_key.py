"""The key a proof's verdict is stored under: what it vouches for, and where it ran.

A verdict vouches for the versions, the transformers source the original runs, the
substitution's replacement and converter and their code, the device the proof runs on,
the config's kind, and the low-precision dtype and autocast dtype the model computes in;
any of them changed, the key is another and the substitution is proven again.

Example::

    proof_key(layerswap.get("llama.decoder.fused"), model.config)
    # "llama.decoder.fused-3f0c..."
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from typing import TYPE_CHECKING, Any

import torch

from layerswap import sources, verdicts
from layerswap.comparison.placement import dtype_name
from layerswap.hf_internals import attention_function, attention_implementation
from layerswap.model import layer_config
from layerswap.placement import LOW_PRECISION, Placement
from layerswap.shrink import config_kind

if TYPE_CHECKING:
    from transformers import PreTrainedConfig

    from layerswap.substitution import Substitution

__all__ = ["ProofPlan", "original_module", "plan", "proof_device", "proof_key", "proof_keys"]


@dataclasses.dataclass(frozen=True)
class ProofPlan:
    """One proof, worked out once before it runs: what it proves, where, in which
    dtypes, under which keys its verdict is stored, and the source it vouches for."""

    sub: Substitution
    #: the user's config (or its :class:`~layerswap.config_view.ModelConfig`), ``None``:
    #: the family's tiny config
    config: Any
    device: torch.device
    #: the low-precision dtype and autocast dtype proven besides float32, else ``None``
    dtype: torch.dtype | None
    autocast: torch.dtype | None
    #: the verdict's key, and the key of the family's tiny config proven the same way
    key: str
    family_key: str
    #: the transformers module the original lives in, and a digest of its source
    module: str
    source: str


def plan(sub: Substitution, config: Any, placement: Placement) -> ProofPlan:
    """The :class:`ProofPlan` of ``sub`` for ``config``, for a model in ``placement``: on
    its device where the substitution runs there (:func:`proof_device`), in its dtype and
    autocast dtype where they are low-precision."""
    device = proof_device(sub, placement.device)
    dtype = placement.dtype if placement.dtype in LOW_PRECISION else None
    autocast = placement.autocast if placement.autocast in LOW_PRECISION else None
    key, family_key = proof_keys(sub, config, device, dtype, autocast)
    module = original_module(sub)
    return ProofPlan(
        sub, config, device, dtype, autocast, key, family_key, module, sources.digest(module)
    )


def original_module(sub: Substitution) -> str:
    """The transformers module the original of ``sub`` lives in (its source is proven)."""
    return sub.original.partition(":")[0]


def proof_key(
    sub: Substitution,
    config: PreTrainedConfig | None,
    device: torch.device | None = None,
    dtype: torch.dtype | None = None,
    autocast: torch.dtype | None = None,
) -> str:
    """The verdict's key: versions, the transformers source the original runs (its files,
    and what this process binds: a function rebound at run time is other code), the
    substitution, its replacement class and converter and (outside layerswap) their code,
    the device the proof runs on (``device``, else the one it would run on), the config's
    kind (its attention implementation included), and the low-precision ``dtype`` the
    model computes in and the one ``autocast`` runs it in (:data:`LOW_PRECISION`; a
    float32 model's key names none)."""
    return proof_keys(sub, config, device, dtype, autocast)[0]


def proof_keys(
    sub: Substitution,
    config: PreTrainedConfig | None,
    device: torch.device | None = None,
    dtype: torch.dtype | None = None,
    autocast: torch.dtype | None = None,
) -> tuple[str, str]:
    """:func:`proof_key` of ``config``, and of the family's tiny config proven the same way
    (where the proof falls back to it), the code digested once for both."""
    replacement = sub.replacement
    named = replacement if isinstance(replacement, str) else replacement.__qualname__
    module = (
        replacement.partition(":")[0] if isinstance(replacement, str) else replacement.__module__
    )
    converter = sub.converter
    live = _live_replacement(sub)
    # another device runs other kernels (SDPA's, a backend's)
    where = (device or proof_device(sub)).type
    text = None if config is None else layer_config(config)
    kind = "family" if text is None else config_kind(text)
    # the functions transformers dispatches attention to: one registered under "sdpa"
    # (or the config's own implementation) since is other code
    chosen = None if text is None else attention_implementation(text)
    names = ["sdpa", *([chosen] if isinstance(chosen, str) and chosen != "sdpa" else [])]
    dispatched = {name: attention_function(name) for name in names}
    parts = {
        **verdicts.versions(),
        # transformers' code, and a plugin's or the user's own layer's, as it is here
        **sources.vouched_code(original_module(sub), module, live, type(converter)),
        "substitution": sub.name,
        "replacement": named,
        # two converters under one name map the weights two ways
        "converter": _ADDRESS.sub("", repr(converter)),
        "device": where,
        # what the family declares (its rotary layout, norm offset, tiny config...): the
        # replacement is built from it, and the proof's config shrunk by it
        "family": _ADDRESS.sub("", repr(dataclasses.replace(sub.parts.family, description=""))),
        # a variant's options (an FP8 recipe) are other kernels
        "options": None
        if sub.variant is None
        else _ADDRESS.sub("", repr(sorted(sub.variant.options.items()))),
        "attention_functions": {
            name: sources.function_digest(function)
            for name, function in dispatched.items()
            if function is not None
        },
    }
    if dtype in LOW_PRECISION:
        parts["dtype"] = dtype_name(dtype)
    if autocast in LOW_PRECISION:
        parts["autocast"] = dtype_name(autocast)
    safe = sub.name.replace("/", "_")
    keys = []
    for proven_kind in (kind, "family"):
        encoded = json.dumps({**parts, "config": proven_kind}, sort_keys=True).encode()
        keys.append(f"{safe}-{hashlib.sha256(encoded).hexdigest()[:20]}")
    return keys[0], keys[1]


#: an object's address in its ``repr`` (a function's, a plain object's): another each run
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def _live_replacement(sub: Substitution) -> type | None:
    """The replacement class, resolved (as the proof would resolve it: the key is the same
    before and after its first import); ``None`` where it cannot be resolved here (a GPU
    backend's on a CPU machine)."""
    try:
        return sub.replacement_class()
    except Exception:
        return None


def proof_device(sub: Substitution, wanted: torch.device | None = None) -> torch.device:
    """The device the proof runs on: the model's (``wanted``) where the substitution runs
    there (a CUDA model's proof runs the CUDA kernels it will run), else the CPU where the
    substitution runs there, else CUDA where present."""
    usable = wanted is not None and (wanted.type != "cuda" or torch.cuda.is_available())
    if wanted is not None and usable and wanted.type in sub.devices:
        return wanted
    on_cpu = "cpu" in sub.devices
    return torch.device("cpu" if on_cpu or not torch.cuda.is_available() else "cuda")
