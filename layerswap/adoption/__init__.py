"""Adopting other libraries' patch functions: recorded, reversible, proven.

One module per concern: ``snapshot`` (what a patch function could change, copied before it
runs), ``changes`` (what it changed, each change reversible), ``record`` (running it
recorded, on an undo log), ``proving`` (the tiny model, original against patched) and
``adopting`` (the public :func:`adopt` and its :class:`Adoption` handle).
"""

from __future__ import annotations

from layerswap.adoption.adopting import Adoption, adopt

__all__ = ["Adoption", "adopt"]
