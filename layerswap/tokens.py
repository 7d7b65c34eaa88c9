"""A config's special tokens, and random token ids kept clear of them.

A multimodal wrapper replaces its image (video, audio) tokens with the tower's features:
a random text prompt that happens to hold one asks for features it does not have. Test
and proof prompts therefore draw around every token id the config names.

Example::

    ids = avoid_tokens(torch.randint(1, 512, (2, 16)), media_tokens(config), 512)
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import torch

__all__ = ["avoid_tokens", "media_tokens", "special_tokens"]

_TEXT_TOKENS = frozenset({"pad_token_id", "bos_token_id", "eos_token_id"})


def special_tokens(config: Any) -> set[int]:
    """Every token id ``config`` and its text config name (``*_token_id``, ``*_token_index``)."""
    found = set()
    for source in (config, getattr(config, "text_config", None)):
        for key, value in (source.to_dict() if source is not None else {}).items():
            if key.endswith(("_token_id", "_token_index")) and isinstance(value, int):
                found.add(value)
    return found


def media_tokens(config: Any) -> set[int]:
    """The token ids a multimodal wrapper's config names beside its text tokens (image,
    video, audio placeholders and their delimiters); none for a text-only config."""
    if getattr(config, "text_config", None) is None:
        return set()
    return {
        value
        for key, value in config.to_dict().items()
        if key.endswith(("_token_id", "_token_index"))
        and key not in _TEXT_TOKENS
        and isinstance(value, int)
    }


def avoid_tokens(ids: torch.Tensor, avoid: Collection[int], vocab_size: int) -> torch.Tensor:
    """``ids`` with each id in ``avoid`` moved to the next id (cyclically, below
    ``vocab_size``) that is not; ids already clear are kept, so the draw stays the same
    where the config names no such token."""
    taboo = {token for token in avoid if 0 <= token < vocab_size}
    if not taboo:
        return ids
    if len(taboo) >= vocab_size:
        raise ValueError(f"every id below {vocab_size} is a special token")
    out = ids.clone()
    for token in sorted(taboo):
        replacement = (token + 1) % vocab_size
        while replacement in taboo:
            replacement = (replacement + 1) % vocab_size
        out[ids == token] = replacement
    return out
