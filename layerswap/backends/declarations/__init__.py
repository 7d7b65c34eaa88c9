"""What the builtin backends' declarations share: the ``head`` slot (:mod:`.head_slot`).

Each builtin backend's declaration is its package's ``declaration`` module
(:mod:`layerswap.backends.fused.declaration` ...); ``declarations.fused``,
``declarations.liger`` and ``declarations.te`` are those modules under their former names,
and :func:`builtin_modules` lists them as :mod:`layerswap.backends` does.
"""

from __future__ import annotations

from layerswap.backends import builtin_modules

__all__ = ["builtin_modules"]
