"""Tiny real transformers models of every family, for tests (random weights, fixed seeds).

Norm weights and biases are perturbed away from 1/0 (``Family.build`` does it), so a
layer that drops a bias or ignores a norm weight cannot pass an equality test.

Example::

    from models import FAMILIES, tiny_model, left_padded_batch

    model = tiny_model("qwen3", seed=1, num_hidden_layers=2)
    batch = left_padded_batch(model.config.vocab_size)
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedConfig, PreTrainedModel

from layerswap.family import Family
from layerswap.model import layer_config
from layerswap.registry import families as _registered
from layerswap.registry import get_family
from layerswap.tokens import media_tokens

# every registered family: the hand-written ones and those inferred from transformers
FAMILIES = tuple(sorted(_registered()))


def _features(spec: Family) -> set[tuple[str, Any]]:
    """The structural choices a family declares, each as (field, value)."""
    try:
        config: Any = spec.tiny_config()
    except Exception:  # not in this transformers (kolibri1 before 5.13): declared fields only
        config = None
    return {
        ("qkv_bias", bool(spec.attention.qkv_bias)),
        ("o_bias", bool(spec.attention.o_bias)),
        ("mlp_bias", bool(spec.feed_forward.bias)),
        ("qk_norm", spec.attention.qk_norm),
        ("qk_norm_switch", spec.attention.qk_norm_switch is not None),
        ("norm", spec.normalization.kind),
        ("norm_offset", spec.normalization.offset != 0),
        ("mlp", spec.feed_forward.kind),
        ("qkv_modules", spec.attention.qkv_modules),
        ("norms", spec.normalization.places),
        ("parallel", spec.layer.parallel),
        ("rotary", spec.rope.layout),
        ("rotary_layers", spec.rope.layers),
        ("softcap", getattr(config, "attn_logit_softcapping", None) is not None),
        ("sliding", getattr(config, "sliding_window", None) is not None),
    }


def _representatives() -> tuple[str, ...]:
    """Few families that between them show every structural choice any family makes.

    Llama first (the family the examples use), then greedily the family that shows the
    most choices not yet shown (ties: the first in ``FAMILIES``): the fast lane runs the
    per-family tests on these; ``pytest --full`` (and CI) on every family.
    """
    features = {name: _features(get_family(name)) for name in FAMILIES}
    everything = set().union(*features.values())
    chosen = ["llama"]
    covered = set(features["llama"])
    while covered != everything:
        best = max(FAMILIES, key=lambda name: len(features[name] - covered))
        chosen.append(best)
        covered |= features[best]
    return tuple(sorted(chosen))


def _kept_representatives() -> tuple[str, ...]:
    """:func:`_representatives`, kept in the temporary directory between test runs: reading
    64 configs costs each xdist worker about two seconds. The file's name holds what the
    choice depends on (transformers' version, this file and the families' sources), so a
    change to any of them chooses again."""
    import transformers

    import layerswap

    package = Path(layerswap.__file__).parent
    sources = [Path(__file__), package / "family.py", *sorted((package / "families").glob("*.py"))]
    digest = hashlib.sha256(transformers.__version__.encode())
    for source in sources:
        digest.update(source.read_bytes())
    kept = Path(tempfile.gettempdir()) / f"layerswap-test-representatives-{digest.hexdigest()[:16]}"
    try:
        names = tuple(kept.read_text().split())
    except OSError:
        names = ()
    if "llama" in names and set(names) <= set(FAMILIES):
        return names
    chosen = _representatives()
    partial = kept.with_suffix(f".{os.getpid()}")
    partial.write_text(" ".join(chosen))
    partial.replace(kept)  # whole or absent, whichever worker writes last
    return chosen


#: the families the fast lane runs per-family tests on (the rest are marked ``matrix``)
REPRESENTATIVES = _kept_representatives()


def lane_families(config: Any) -> tuple[str, ...]:
    """The families this run tests one by one: every family with ``--full`` or ``-m``,
    else the representatives (for parameters that cost something to list, in
    ``pytest_generate_tests``; a plain per-family parameter lists :data:`FAMILIES`)."""
    if config.getoption("--full") or config.getoption("-m"):
        return FAMILIES
    return REPRESENTATIVES


def family(name: str) -> Family:
    """The builtin family called ``name``."""
    return get_family(name)


def tiny_config(name: str, **overrides: Any) -> PreTrainedConfig:
    """The family's embedded tiny config with ``overrides`` applied."""
    return family(name).tiny_config(**overrides)


def tiny_model(name: str, seed: int = 0, **overrides: Any) -> PreTrainedModel:
    """A tiny causal LM of family ``name``: float32, eval mode, random from ``seed``."""
    spec = family(name)
    return spec.build(spec.tiny_config(**overrides), seed=seed)


def swapped_layer_count(source: Any) -> int:
    """How many decoder layers a decoder swap of ``source`` (a model or its config)
    replaces, read off the config: all of them but a hybrid's layers of another kind
    (Mllama's ``cross_attention_layers`` stay the original's)."""
    config = layer_config(getattr(source, "config", source))
    return int(config.num_hidden_layers) - len(
        getattr(config, "cross_attention_layers", None) or ()
    )


def text_vocab(source: Any) -> int:
    """How many token ids a test may draw for ``source`` (a model or its config): the text
    vocabulary, up to a wrapper's first media token (the tiny Qwen-VL configs put their
    image and video tokens at its top, and a drawn one would ask for image features)."""
    config = getattr(source, "config", source)
    vocab = int(layer_config(config).vocab_size)
    return min((token for token in media_tokens(config) if token < vocab), default=vocab)


def left_padded_batch(
    vocab_size: int, lengths: tuple[int, ...] = (12, 7), seed: int = 0
) -> dict[str, torch.Tensor]:
    """``input_ids`` and ``attention_mask`` of different lengths, padded on the left."""
    generator = torch.Generator().manual_seed(seed)
    width = max(lengths)
    # token 0 is the pad token; real tokens avoid it
    input_ids = torch.randint(1, vocab_size, (len(lengths), width), generator=generator)
    attention_mask = torch.ones(len(lengths), width, dtype=torch.long)
    for row, length in enumerate(lengths):
        input_ids[row, : width - length] = 0
        attention_mask[row, : width - length] = 0
    return {"input_ids": input_ids, "attention_mask": attention_mask}


def tokens(vocab_size: int, shape: tuple[int, int] = (2, 10), seed: int = 0) -> torch.Tensor:
    """Random token ids (no padding)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(1, vocab_size, shape, generator=generator)


def prompt_logits(model: torch.nn.Module) -> torch.Tensor:
    """``model``'s logits for one fixed prompt, in eval mode, without grad."""
    ids = torch.tensor([[1, 5, 9, 22, 3, 7, 100, 4]])
    model.eval()
    with torch.no_grad():
        return model(ids).logits  # type: ignore[no-any-return]


def swapped_llama(seed: int) -> PreTrainedModel:
    """A two-layer tiny llama from ``seed`` with its decoder layers swapped by the fused
    backend (llama.decoder.fused)."""
    import layerswap

    model = tiny_model("llama", seed=seed, num_hidden_layers=2)
    layerswap.swap(model, "llama.decoder.fused")
    return model
