"""Adopting other libraries' patch functions: recorded, reversible, proven.

One module per concern: ``snapshot`` (what a patch function could change, copied before it
runs; ``process``: torch's switches and the environment), ``importing`` (the modules it
imports, copied when their import ends), ``changes`` (what it changed, each change
reversible), ``record`` (running it recorded, on an undo log), ``proving`` (the tiny
model, original against patched) and ``adopting`` (the public :func:`adopt` and its
:class:`Adoption` handle), and ``substituting`` (:func:`patch_substitution`: a patch
function as a substitution of the ``patch`` slot, :mod:`layerswap.slots.patch`,
registered like any other).
"""

from __future__ import annotations

from layerswap.adoption.adopting import Adoption, adopt
from layerswap.adoption.substituting import patch_substitution

__all__ = ["Adoption", "adopt", "patch_substitution"]
