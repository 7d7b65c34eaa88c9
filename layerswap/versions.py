"""The installed transformers release, read without importing transformers.

Error messages, proofs and caches name the release; reading it from the package's
metadata costs a millisecond, importing transformers about a second. Once transformers
is imported, its own ``__version__`` is what is named (the same release).

Example::

    from layerswap.versions import transformers_version

    transformers_version()   # '5.24.0'
"""

from __future__ import annotations

import importlib.metadata
import sys

__all__ = ["transformers_version"]


def transformers_version() -> str:
    """The installed transformers version, as error messages name it."""
    module = sys.modules.get("transformers")
    version = getattr(module, "__version__", None)
    if version:
        return str(version)
    return importlib.metadata.version("transformers")
