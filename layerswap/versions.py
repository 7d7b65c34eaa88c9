"""The installed transformers release and the modules it ships, read without importing
transformers.

Error messages, proofs and caches name the release; reading it from the package's
metadata costs a millisecond, importing transformers about a second. Once transformers
is imported, its own ``__version__`` is what is named (the same release).

Example::

    from layerswap.versions import ships, transformers_version

    transformers_version()   # '5.24.0'
    ships("transformers.models.flint.modeling_flint")   # False before 5.21
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
from pathlib import Path

__all__ = ["__version__", "ships", "transformers_version"]

#: layerswap's own release (``layerswap.__version__``); kept here, below every module
#: that names it, so that naming it imports nothing above
__version__ = "0.1.0"


def transformers_version() -> str:
    """The installed transformers version, as error messages name it."""
    module = sys.modules.get("transformers")
    version = getattr(module, "__version__", None)
    if version:
        return str(version)
    import importlib.metadata  # not at import: `import layerswap` names __version__ from here

    return importlib.metadata.version("transformers")


def ships(module: str) -> bool:
    """Whether the installed package has ``module`` (a dotted name), found on disk without
    importing it: the release a family arrived in decides, and ``layerswap list`` asks it
    without importing transformers. A module file of any suffix Python imports, or a
    directory (a package, namespace packages included), counts."""
    if module in sys.modules:
        return True
    top, *parts = module.split(".")
    spec = importlib.util.find_spec(top)  # a top-level name: found, not imported
    if spec is None:
        return False
    if not parts:
        return True
    suffixes = importlib.machinery.all_suffixes()
    for location in spec.submodule_search_locations or ():
        path = Path(location, *parts)
        if path.is_dir() or any((path.parent / (path.name + s)).is_file() for s in suffixes):
            return True
    return False
