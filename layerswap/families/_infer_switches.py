"""The config fields that switch a decoder layer's structure, found by family inference
setting each and building the layer again: biases, the norms' kind, q/k norms, modules a
size adds, the dropout the layer applies."""

from __future__ import annotations

from typing import Any

import torch

from layerswap.errors import UnsupportedFamilyError
from layerswap.families._infer_layer import norm_kind, seeded_layer, training_output
from layerswap.families._infer_tiny import config_with

__all__ = ["bias_flag", "modules_a_size_adds", "norm_switch", "qk_norm_switch", "residual_dropout"]


def bias_flag(build: Any, config: Any, probe: Any) -> bool | str:
    """A bias as the config field that switches it (``"attention_bias"``), else a constant.

    Every boolean config field with "bias" in its name is tried: the first whose value
    decides whether ``probe`` finds the bias is the switch.
    """
    switches = [
        key for key, value in config.to_dict().items() if isinstance(value, bool) and "bias" in key
    ]
    for switch in switches:
        on, off = (probe(build(config_with(config, switch, value))) for value in (True, False))
        if on and not off:
            return str(switch)
    return bool(probe(build(config)))


def norm_switch(
    decoder: Any,
    config: Any,
    layout: tuple[tuple[str, str], ...],
    found: tuple[str, float, bool],
    where: str,
) -> tuple[str, str] | None:
    """``(field, norm)`` where unsetting a ``*norm_eps`` field of the config builds norms of
    another kind (Cohere 2 MoE: ``rms_norm_eps=None``, its default, builds a bias-free
    LayerNorm); ``None`` where no such field changes them (or the layer cannot be built
    or run without it)."""
    fields = sorted(
        key
        for key, value in config.to_dict().items()
        if key.endswith("norm_eps") and isinstance(value, float)
    )
    for field_name in fields:
        try:
            unset = seeded_layer(decoder, config_with(config, field_name, None), 0)
            kinds = {
                norm_kind(unset.get_submodule(n), (config.hidden_size,), f"{where} {n}")
                for _, n in layout
            }
        except Exception:  # the layer needs the field: not a switch
            continue
        if len(kinds) == 1:
            kind, offset, scale = kinds.pop()
            if kind != found[0] and (offset, scale) == found[1:]:
                return field_name, kind
    return None


def qk_norm_switch(build: Any, config: Any) -> str | None:
    """The boolean config field with "norm" in its name that adds ``self_attn.q_norm``."""
    for key, value in config.to_dict().items():
        if isinstance(value, bool) and "norm" in key:
            try:
                on, off = (
                    hasattr(build(config_with(config, key, flag)).self_attn, "q_norm")
                    for flag in (True, False)
                )
            except Exception:  # a field other code ties to other settings: not the switch
                continue
            if on and not off:
                return str(key)
    return None


def modules_a_size_adds(build: Any, config: Any) -> tuple[str, list[str]] | None:
    """``(field, modules)`` where setting a ``*_size`` field the tiny config leaves at 0
    builds modules the declaration never saw (GraniteMoE-Shared's
    ``shared_intermediate_size`` adds ``shared_mlp``), else ``None``."""
    seen = {n for n, _ in build(config).named_modules()}
    for key, value in config.to_dict().items():
        if key.endswith("_size") and value == 0 and not isinstance(value, bool):
            try:
                added = sorted(
                    {n for n, _ in build(config_with(config, key, 16)).named_modules()} - seen
                )
            except Exception:  # a size other code ties to other settings: not a switch
                continue
            if added:  # the outermost ones
                return str(key), [n for n in added if not any(n.startswith(f"{m}.") for m in added)]
    return None


def _dropout_fields(config: Any) -> list[str]:
    """The config's dropout probabilities besides the attention's (SDPA's ``dropout_p``)."""
    return [
        key
        for key, value in config.to_dict().items()
        if ("dropout" in key or key.endswith("pdrop"))
        and key != "attention_dropout"
        and isinstance(value, float)
    ]


def residual_dropout(decoder: Any, config: Any, where: str) -> str | None:
    """The config field of a dropout the layer applies in training (Seed-OSS's
    ``residual_dropout``, Phi-3's ``resid_pdrop``), found by setting each dropout field
    with attention dropout off; ``None`` when none changes the layer's training output.
    Its place (after the output projections) is proven in training by
    :func:`layerswap.inference.prove_inferred`; a second field is refused."""
    quiet = (
        config_with(config, "attention_dropout", 0.0)
        if "attention_dropout" in config.to_dict()
        else config
    )
    fields = _dropout_fields(quiet)
    if not fields:
        return None
    off = quiet
    for field_name in fields:
        off = config_with(off, field_name, 0.0)
    try:
        reference = training_output(seeded_layer(decoder, off, 0), off)
    except Exception:  # the layer cannot run bare here: the behavioural check decides
        return None
    found = []
    for field_name in fields:
        try:
            out = training_output(seeded_layer(decoder, config_with(off, field_name, 0.5), 0), off)
        except Exception:
            continue
        if not torch.equal(out, reference):
            found.append(field_name)
    if len(found) > 1:
        raise UnsupportedFamilyError(
            f"{where}: dropout the fused layer does not apply ({', '.join(found)} each drop "
            "in training; it applies one, after the output projections)"
        )
    return found[0] if found else None
