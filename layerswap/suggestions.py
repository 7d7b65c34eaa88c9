"""Close names for "did you mean" hints: one matcher for every error that offers them.

Each caller words its hint its own way (a registry name in quotes, a family name bare,
a patch target in backquotes); which names are close is decided here.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable

__all__ = ["close_names"]


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
