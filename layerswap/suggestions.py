"""Close names for "did you mean" hints: one matcher and one wording for every error
that offers them.

Only the quoting differs by where the name was typed: ``'llama.decoder.fused'`` for a
Python name, ```LlamaDecoderLayer``` for a patch target, a bare ``llama`` for a
command-line value.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable

__all__ = ["close_names", "did_you_mean"]


def close_names(name: str, pool: Iterable[object], *, cutoff: float = 0.5, n: int = 3) -> list[str]:
    """Up to ``n`` strings of ``pool`` closest to ``name`` (``difflib`` ratio >= ``cutoff``),
    or the one that differs from it in case only; never ``name`` itself, each once.

    Example::

        >>> close_names("lama", ["llama", "gemma", "qwen3"])
        ['llama']
        >>> close_names("Llama", ["llama"], cutoff=0.9)
        ['llama']
    """
    candidates = list(dict.fromkeys(c for c in pool if isinstance(c, str) and c != name))
    close = difflib.get_close_matches(name, candidates, n=n, cutoff=cutoff)
    if not close:
        lowered = {c.lower(): c for c in candidates}
        close = [lowered[name.lower()]] if name.lower() in lowered else []
    return close


def did_you_mean(
    name: str, pool: Iterable[object], *, quote: str = "'", cutoff: float = 0.5
) -> str:
    """``"did you mean 'a' or 'b'?"`` for the names of ``pool`` close to ``name``, or ``""``.

    Example::

        >>> did_you_mean("lama", ["llama", "gemma"])
        "did you mean 'llama'?"
        >>> did_you_mean("lama", ["llama"], quote="")
        'did you mean llama?'
    """
    close = close_names(name, pool, cutoff=cutoff)
    if not close:
        return ""
    return "did you mean " + " or ".join(f"{quote}{c}{quote}" for c in close) + "?"
